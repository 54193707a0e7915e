"""Streaming sources (issue 21 §5): Hugging Face `datasets` over local jsonl/parquet/arrow/txt
files, native .arrow files, and inputs given as fsspec URLs, all give the bytes of the native
readers on local paths. Byte-range pieces of a jsonl file give exactly its lines."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from lmforge.data.pipeline import run_prepare
from lmforge.data.prepare_config import PrepareConfig, SourceConfig
from lmforge.data.sources import iter_documents

pa = pytest.importorskip("pyarrow")


def _doc(rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(2000)}" for _ in range(80)) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import pyarrow.parquet as pq
    root = tmp_path_factory.mktemp("src")
    rng = random.Random(5)
    docs = [_doc(rng) for _ in range(70)]
    (root / "web.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:30]))
    pq.write_table(pa.table({"text": docs[30:50]}), root / "p.parquet", row_group_size=4)
    t = pa.table({"text": docs[50:65]})
    with pa.ipc.new_stream(str(root / "c.arrow"), t.schema) as w:  # as datasets caches it
        w.write_table(t)
    (root / "books").mkdir()
    for k, d in enumerate(docs[65:]):
        (root / "books" / f"{k:02d}.txt").write_text(d)
    return root


def _cfg(out: Path, paths: dict[str, str], reader: str = "native") -> PrepareConfig:
    return PrepareConfig(sources=[SourceConfig(path=p, name=n, reader=reader)
                                  for n, p in paths.items()],
                         output_dir=str(out), vocab_size=350, val_fraction=0.1,
                         shard_tokens=400, chunk_bytes=2500, dedup_ranges=2).validate()


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "prepare.json"}


def _paths(root) -> dict[str, str]:
    return {"web": f"{root}/web.jsonl", "pq": f"{root}/p.parquet", "arrow": f"{root}/c.arrow",
            "books": f"{root}/books"}


def test_datasets_reader_and_fsspec_urls_give_the_native_bytes(corpus, tmp_path):
    native = run_prepare(_cfg(tmp_path / "native", _paths(corpus)))
    assert native.record["units"] > 4  # web.jsonl by byte range, p.parquet by row groups
    want = _hashes(tmp_path / "native")
    # any fsspec URL: file:// and memory:// (an in-process filesystem)
    import fsspec
    mem = fsspec.filesystem("memory")
    for f in sorted(corpus.rglob("*")):
        if f.is_file():
            mem.pipe_file(f"/corpus/{f.relative_to(corpus)}", f.read_bytes())
    run_prepare(_cfg(tmp_path / "mem", _paths("memory://corpus")))
    assert _hashes(tmp_path / "mem") == want
    run_prepare(_cfg(tmp_path / "file", _paths(f"file://{corpus}")))
    assert _hashes(tmp_path / "file") == want
    pytest.importorskip("datasets")  # (only the datasets source is skipped without it)
    streamed = run_prepare(_cfg(tmp_path / "ds", _paths(corpus), reader="datasets"))
    assert _hashes(tmp_path / "ds") == want
    assert streamed.record["clean"] == native.record["clean"]


def test_jsonl_byte_ranges_partition_the_lines(tmp_path):
    rng = random.Random(1)
    lines = [json.dumps({"text": f"doc {i} " + "x" * rng.randrange(0, 40)}) for i in range(50)]
    f = tmp_path / "a.jsonl"
    f.write_bytes(("\n".join(lines) + "\n").encode())
    want = [json.loads(line)["text"] for line in lines]
    size = f.stat().st_size
    for step in (1, 7, 33, 100, size):
        got = []
        for a in range(0, size, step):
            got += list(iter_documents(f, "jsonl", "text", start=a, end=min(a + step, size)))
        assert got == want, step
