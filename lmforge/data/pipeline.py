"""``lmforge prepare`` at corpus scale: sources -> cleaned chunks -> tokenizer -> token shards.

Output folder::

    prepare.json            fingerprint of the inputs + config, statistics, per-split summary
    tokenizer.json
    train/mixture.json      the train sources with their (normalised) mixture weights
    train/<source>/         one token-shard set per source (manifest.json + shard_*.bin)
    val/                    one token-shard set with the validation documents of all sources
    .work/                  only while running: state.json, cleaned chunks, carry buffers

Stages, each recorded in ``.work/state.json`` so that a killed run resumes where it stopped:

1. *clean*: read every source in order (sorted files), clean/filter/dedup (see
   :mod:`lmforge.data.clean`) and write the kept documents into chunks of about
   ``chunk_bytes`` (one source per chunk). Dedup is global, so this stage is redone as a whole
   if it was interrupted; it is cheap next to tokenization.
2. *tokenizer*: train a byte-level BPE on a sample (documents taken round-robin over sources
   until ``sample_bytes``), or load ``gpt2`` / a tokenizer.json.
3. *tokenize*: chunks are tokenized in parallel and consumed in order; each document becomes
   ``[BOS] ids EOS``. Its split is chosen by content hash (``val_split="documents"``) or its
   last ``val_fraction`` of tokens go to val (``"tail"``). Tokens stream into fixed-size shards
   written straight into the final folders; after every chunk the position, the finished shards
   (with sha256) and the not-yet-full tail buffer are recorded. A resumed run verifies the
   recorded shards' checksums, skips finished chunks and never rewrites finished shards; its
   output is byte-identical to an uninterrupted run.

Re-running with unchanged inputs (same files by path, size and mtime; same config except
``workers``/``parallelism``) finds ``prepare.json`` up to date and does nothing.

Mixtures: the weights are not applied here; every kept train token is written once per source
and :class:`lmforge.data.loader.PackedLoader` draws windows from the sources in the weighted
proportions (a small source is repeated, i.e. up-sampled, a large one sub-sampled).

Parallelism (measured by ``benchmarks/data_throughput.py`` on the shared 2-core CPU; see
benchmarks/RESULTS.md). About 90% of the tokenize stage is the Rust ``encode_batch`` call,
which releases the GIL and already uses every core through tokenizers' thread pool; the rest is
Python (ids -> numpy, split, shard files). The default ``threads`` mode therefore encodes in
this process and overlaps the next chunk's encoding with the Python work of the previous one
(a 2-deep thread prefetch). ``processes`` (spawn context, never fork, since tokenizers' Rust
threads do not survive a fork; workers single-threaded and reading their chunk themselves) pays
a spawn + import per worker and pickles every result back: on 2 cores it reached ~0.79x the
batch-encode ceiling against ~0.94x for ``threads`` and used more CPU per MB. It remains
available for many-core machines where the Python share would serialise on one core.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.clean import Cleaner, CleanStats
from lmforge.data.prepare_config import PrepareConfig
from lmforge.data.shards import TokenShards, dtype_for_vocab
from lmforge.folders import (MANIFEST, MIXTURE, PREPARE_RECORD, SHARD_FORMAT_VERSION, TOKENIZER, atomic_write,
                             atomic_write_json, build_manifest, sha256_bytes, shard_record)
from lmforge.data.sources import BadUtf8, expand_source, format_of, iter_documents
from lmforge.data.tokenizer import Tokenizer, load_gpt2_tokenizer, load_tokenizer, train_bpe

log = logging.getLogger("lmforge.data")

PIPELINE_VERSION = 1
MIXTURE_FILE = MIXTURE
MIXTURE_FORMAT = "lmforge-mixture"
RECORD = PREPARE_RECORD
WORK = ".work"


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------

def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _files_of(cfg: PrepareConfig) -> list[tuple[str, list[tuple[Path, str]]]]:
    """[(source name, [(file, format), ...]), ...] in config order."""
    out = []
    for src in cfg.sources:
        files = expand_source(src)
        out.append((src.name, [(f, format_of(f) if src.format == "auto" else src.format)
                               for f in files]))
    return out


def _fingerprint(cfg: PrepareConfig, files) -> str:
    conf = cfg.to_dict()
    for k in ("workers", "parallelism", "output_dir"):
        conf.pop(k)
    listing = []
    for name, fl in files:
        for f, fmt in fl:
            st = f.stat()
            listing.append([name, str(f.resolve()), fmt, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"v": PIPELINE_VERSION, "shard_format": SHARD_FORMAT_VERSION, "config": conf,
                       "files": listing}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# stage 1: clean into chunks
# ---------------------------------------------------------------------------------------

class _ChunkWriter:
    """Kept documents -> ``chunk_NNNNN.bin`` (UTF-8 text concatenated) + ``.idx`` offsets."""

    def __init__(self, root: Path, chunk_bytes: int) -> None:
        self.root, self.chunk_bytes = root, chunk_bytes
        self.chunks: list[dict] = []
        self._buf: list[bytes] = []
        self._size = 0
        self._source = ""

    def add(self, source: str, text: str) -> None:
        if source != self._source:
            self.flush()
            self._source = source
        data = text.encode("utf-8")
        self._buf.append(data)
        self._size += len(data)
        if self._size >= self.chunk_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        name = f"chunk_{len(self.chunks):05d}"
        offsets = np.zeros(len(self._buf) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in self._buf], out=offsets[1:])
        atomic_write(self.root / f"{name}.bin", b"".join(self._buf))
        atomic_write(self.root / f"{name}.idx", offsets.tobytes())
        self.chunks.append({"name": name, "source": self._source, "documents": len(self._buf),
                            "bytes": int(offsets[-1])})
        self._buf, self._size = [], 0


def read_chunk(root: Path, name: str) -> list[str]:
    """The documents of a cleaned chunk."""
    data = (root / f"{name}.bin").read_bytes()
    offsets = np.frombuffer((root / f"{name}.idx").read_bytes(), dtype=np.int64)
    return [data[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]


def _clean_stage(cfg: PrepareConfig, files, chunk_dir: Path,
                 progress: Callable[[str], None]) -> tuple[CleanStats, list[dict]]:
    if chunk_dir.exists():
        shutil.rmtree(chunk_dir)
    chunk_dir.mkdir(parents=True)
    cleaner = Cleaner(cfg)
    writer = _ChunkWriter(chunk_dir, cfg.chunk_bytes)
    for name, fl in files:
        def on_bad(e: BadUtf8, name=name) -> None:
            log.warning("skipping document: %s", e)
            cleaner.count_bad_utf8(name)
        for f, fmt in fl:
            for raw in iter_documents(f, fmt, _text_field(cfg, name),
                                      on_bad if cfg.on_bad_utf8 == "skip" else None):
                text = cleaner(raw, name)
                if text is not None:
                    writer.add(name, text)
                if cleaner.stats.documents_read % 200_000 == 0:
                    st = cleaner.stats
                    say_docs = f"{st.documents_read:,} documents read, {st.kept:,} kept"
                    progress(f"cleaning: {say_docs} ({st.bytes_read / 1e6:,.0f} MB)")
        progress(f"cleaned source {name!r}: {cleaner.stats.per_source.get(name, {})}")
    writer.flush()
    st = cleaner.stats
    if st.kept == 0:
        raise ValueError(f"empty corpus: {st.documents_read} documents read, none kept "
                         f"({_removed_text(st)})")
    for name, _ in files:
        if cleaner.stats.per_source.get(name, {}).get("kept", 0) == 0:
            raise ValueError(f"source {name!r} is empty after cleaning "
                             f"({cleaner.stats.per_source.get(name, {'read': 0})['read']} "
                             f"documents read); remove it or relax the filters")
    return st, writer.chunks


def _text_field(cfg: PrepareConfig, name: str) -> str:
    return next(s.text_field for s in cfg.sources if s.name == name)


def _removed_text(st: CleanStats) -> str:
    return ", ".join(f"{k} {getattr(st, k)}" for k in
                     ("bad_utf8", "empty", "too_short", "too_long", "duplicates",
                      "near_duplicates"))


# ---------------------------------------------------------------------------------------
# stage 2: tokenizer
# ---------------------------------------------------------------------------------------

def _sample_texts(cfg: PrepareConfig, chunk_dir: Path, chunks: list[dict]) -> Iterator[str]:
    """Documents round-robin over sources until ``sample_bytes`` UTF-8 bytes."""
    per_source: dict[str, list[str]] = {}
    for c in chunks:
        per_source.setdefault(c["source"], []).append(c["name"])

    def docs(names: list[str]) -> Iterator[str]:
        for n in names:
            yield from read_chunk(chunk_dir, n)

    iters = [docs(v) for v in per_source.values()]
    budget = cfg.sample_bytes
    while iters and budget > 0:
        for it in list(iters):
            doc = next(it, None)
            if doc is None:
                iters.remove(it)
                continue
            budget -= len(doc.encode("utf-8"))
            yield doc
            if budget <= 0:
                return


def _tokenizer_stage(cfg: PrepareConfig, chunk_dir: Path, chunks: list[dict]) -> Tokenizer:
    bos = cfg.bos_token or None
    if cfg.tokenizer == "bpe":
        return train_bpe(_sample_texts(cfg, chunk_dir, chunks), cfg.vocab_size,
                         special_tokens=cfg.special_tokens, eos_token=cfg.eos_token,
                         bos_token=bos, pad_token=cfg.pad_token or None)
    if cfg.tokenizer == "gpt2":
        tok = load_gpt2_tokenizer()
        if bos and tok.backend.token_to_id(bos) is None:
            raise ValueError(f"prepare.bos_token = {bos!r} is not in the GPT-2 vocabulary; "
                             f"set bos_token = \"\"")
        return tok
    path = Path(cfg.tokenizer)
    tok = load_tokenizer(path)  # a tokenizer.json, or a folder (tokenizer.json / GPT-2 files)
    eos = tok.backend.token_to_id(cfg.eos_token)
    return Tokenizer(tok.backend, source=str(path),
                     eos_token=cfg.eos_token if eos is not None else None, bos_token=bos)


# ---------------------------------------------------------------------------------------
# stage 3: tokenize (worker side)
# ---------------------------------------------------------------------------------------

_W: dict[str, Any] = {}


def _worker_init(tokenizer_json: str, single_thread: bool) -> None:
    if single_thread:  # one Rust thread per worker process: the pool provides parallelism
        os.environ["RAYON_NUM_THREADS"] = "1"
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers
    tk = tokenizers.Tokenizer.from_str(tokenizer_json)
    tk.encode_special_tokens = True
    _W["tk"] = tk


def _val_choice(text: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h < val_fraction * 2.0**64


def _tokenize_chunk(job: tuple) -> dict:
    """Tokenize one cleaned chunk; return train/val token arrays and counts.

    Every document becomes ``[BOS] ids EOS``; the ids of the whole chunk are converted and
    range-checked in one vectorised pass.
    """
    chunk_dir, name, eos, bos, dtype, vocab, val_fraction, val_split = job
    docs = read_chunk(Path(chunk_dir), name)
    encs = _W["tk"].encode_batch_fast(docs, add_special_tokens=False)
    ids = [e.ids for e in encs]
    dt = np.dtype(dtype)
    lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    total = int(lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    if total and (int(flat.max()) >= vocab or int(flat.min()) < 0):
        raise ValueError(f"chunk {name}: token id {int(flat.max())} is outside the "
                         f"vocabulary [0, {vocab})")
    head = 1 if bos is not None else 0
    if val_split == "tail":  # per document: train = [BOS] head EOS, val = tail EOS
        n_val_tok = np.rint(lens * val_fraction).astype(np.int64)
        return _tail_split(name, docs, flat, lens, n_val_tok, eos, bos, dt)
    doc_len = lens + head + 1
    ends = np.cumsum(doc_len)
    starts = ends - doc_len
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dt)
    out[ends - 1] = eos
    if head:
        out[starts] = bos
    tok_starts = np.cumsum(lens) - lens
    out[np.repeat(starts + head - tok_starts, lens) + np.arange(total)] = flat
    if val_fraction > 0:
        is_val = np.fromiter((_val_choice(d, val_fraction) for d in docs), dtype=bool,
                             count=len(docs))
    else:
        is_val = np.zeros(len(docs), dtype=bool)
    mask = np.repeat(is_val, doc_len)
    return {"name": name, "train": out[~mask], "val": out[mask],
            "train_docs": int((~is_val).sum()), "val_docs": int(is_val.sum()),
            "bytes": sum(len(d.encode("utf-8")) for d in docs)}


def _tail_split(name, docs, flat, lens, n_val_tok, eos, bos, dt) -> dict:
    train, val = [], []
    eos_a = np.array([eos], dtype=dt)
    bos_a = np.array([bos] if bos is not None else [], dtype=dt)
    pos = 0
    for n, nv in zip(lens.tolist(), n_val_tok.tolist()):
        ids = flat[pos:pos + n].astype(dt)
        pos += n
        cut = n - nv
        train += [bos_a, ids[:cut], eos_a]
        if nv:
            val += [ids[cut:], eos_a]
    cat = (lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=dt))
    return {"name": name, "train": cat(train), "val": cat(val), "train_docs": len(docs),
            "val_docs": int((n_val_tok > 0).sum()),
            "bytes": sum(len(d.encode("utf-8")) for d in docs)}


# ---------------------------------------------------------------------------------------
# stage 3: shard writing (parent side)
# ---------------------------------------------------------------------------------------

class _ShardWriter:
    """Fixed-size shards written straight into ``dir``; state is a JSON-able dict + carry."""

    def __init__(self, dir: Path, shard_tokens: int, dtype: np.dtype, rec: dict | None = None,
                 carry: np.ndarray | None = None) -> None:
        self.dir, self.shard_tokens, self.dtype = dir, shard_tokens, dtype
        dir.mkdir(parents=True, exist_ok=True)
        self.rec = rec or {"shards": [], "tokens": 0, "documents": 0}
        self.carry = carry if carry is not None else np.zeros(0, dtype=dtype)

    def add(self, arr: np.ndarray, documents: int) -> None:
        self.rec["tokens"] += int(arr.size)
        self.rec["documents"] += documents
        buf = np.concatenate([self.carry, arr]) if self.carry.size else arr
        pos = 0
        while buf.size - pos >= self.shard_tokens:
            self._write(buf[pos:pos + self.shard_tokens])
            pos += self.shard_tokens
        self.carry = buf[pos:].copy()

    def _write(self, tokens: np.ndarray) -> None:
        data = tokens.astype(self.dtype, copy=False).tobytes()
        rec = shard_record(len(self.rec["shards"]), data, tokens.size, int(tokens.max()))
        atomic_write(self.dir / rec["file"], data)
        self.rec["shards"].append(rec)

    def finish(self, vocab_size: int, meta: dict) -> dict:
        if self.carry.size:
            self._write(self.carry)
            self.carry = self.carry[:0]
        manifest = build_manifest(self.dtype.name, vocab_size, self.shard_tokens, self.rec["shards"],
                                  {**meta, "documents": self.rec["documents"]})
        assert manifest["total_tokens"] == self.rec["tokens"], (manifest["total_tokens"], self.rec["tokens"])
        atomic_write_json(self.dir / MANIFEST, manifest)
        return manifest


def _verify_recorded(dir: Path, rec: dict) -> bool:
    for s in rec["shards"]:
        f = dir / s["file"]
        if not f.is_file() or sha256_bytes(f.read_bytes()) != s["sha256"]:
            log.warning("data: recorded shard %s is missing or corrupted; re-tokenizing", f)
            return False
    return True


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------

@dataclass
class PrepareResult:
    """Summary of a prepare run (``up_to_date``: nothing had to be done)."""

    output_dir: Path
    record: dict
    up_to_date: bool


def run_prepare(cfg: PrepareConfig, output_dir: str | Path | None = None,
                progress: Callable[[str], None] | None = None) -> PrepareResult:
    """Run (or resume, or skip if up to date) the whole prepare pipeline."""
    t_start = time.perf_counter()
    cfg.validate()
    say = progress or (lambda msg: log.info("prepare: %s", msg))
    out = Path(output_dir or cfg.output_dir)
    files = _files_of(cfg)
    fp = _fingerprint(cfg, files)
    record = _read_json(out / RECORD)
    if record and record.get("fingerprint") == fp and _outputs_ok(out, record):
        say(f"{out} is up to date (inputs and config unchanged); nothing to do")
        return PrepareResult(out, record, True)

    work = out / WORK
    if out.is_dir() and any(out.iterdir()) and not (out / RECORD).exists() and \
            not work.exists():
        raise ValueError(f"output_dir {out} exists, is not empty and is not an lmforge prepare "
                         f"output; choose an empty or new folder")
    state = _read_json(work / "state.json")
    if not state or state.get("fingerprint") != fp:
        if state or record:
            say("inputs or config changed: starting over")
        for p in (work, out / "train", out / "val"):
            shutil.rmtree(p, ignore_errors=True)
        for p in (out / RECORD, out / TOKENIZER):
            p.unlink(missing_ok=True)
        work.mkdir(parents=True)
        state = {"fingerprint": fp}
        atomic_write_json(work / "state.json", state)
    else:
        say("resuming an interrupted run")
        for stale in out.rglob(".*.tmp*"):  # half-written files of the killed run
            stale.unlink(missing_ok=True)
    chunk_dir = work / "clean"

    # 1. clean
    t0 = time.perf_counter()
    if "clean" not in state:
        stats, chunks = _clean_stage(cfg, files, chunk_dir, say)
        state["clean"] = {"stats": stats.to_dict(), "chunks": chunks,
                          "seconds": time.perf_counter() - t0}
        atomic_write_json(work / "state.json", state)
    stats = CleanStats.from_dict(state["clean"]["stats"])
    chunks = state["clean"]["chunks"]

    # 2. tokenizer
    tok_path = out / TOKENIZER
    t1 = time.perf_counter()
    if "tokenizer" in state and tok_path.is_file() and \
            sha256_bytes(tok_path.read_bytes()) == state["tokenizer"]["file_sha256"]:
        tok = Tokenizer.load(tok_path, eos_token=state["tokenizer"]["eos_token"])
    else:
        tok = _tokenizer_stage(cfg, chunk_dir, chunks)
        tok.save(tok_path)
        eos_tok = tok.backend.id_to_token(tok.eos_id)
        state["tokenizer"] = {"file_sha256": sha256_bytes(tok_path.read_bytes()),
                              "eos_token": eos_tok, "seconds": time.perf_counter() - t1}
        state.pop("tokenize", None)
        atomic_write_json(work / "state.json", state)
        say(f"tokenizer ready: vocab {tok.vocab_size} ({time.perf_counter() - t1:.1f} s)")
    bos_id = tok.backend.token_to_id(cfg.bos_token) if cfg.bos_token else None

    # 3. tokenize
    cpu0 = _cpu_seconds()
    tstate = _tokenize_stage(cfg, out, work, state, chunk_dir, chunks, tok, bos_id, say)
    tok_cpu = _cpu_seconds() - cpu0  # this process + its finished worker processes
    tok_seconds = tstate["seconds"]
    clean_bytes = sum(c["bytes"] for c in chunks)

    # manifests, mixture, record
    dtype = dtype_for_vocab(tok.vocab_size)
    meta = {"tokenizer_sha256": tok.sha256, "eos_id": tok.eos_id, "bos_id": bos_id,
            "pad_id": tok.pad_id}
    writers = tstate["writers"]
    splits: dict[str, Any] = {"train": {}, "val": None}
    weights = {s.name: s.weight for s in cfg.sources}
    total_w = sum(weights.values())
    for key, rec in writers.items():
        split, _, source = key.partition("/")
        d = out / key
        if rec["tokens"] == 0:
            if split == "val":
                if cfg.val_fraction > 0:
                    raise ValueError(
                        f"val_fraction = {cfg.val_fraction} selected no validation documents "
                        f"out of {stats.kept}; raise val_fraction or use val_split = \"tail\"")
                continue
            raise ValueError(f"source {source!r}: every document went to validation; lower "
                             f"val_fraction")
        carry = _load_carry(work, rec, dtype)
        w = _ShardWriter(d, cfg.shard_tokens, dtype, rec, carry)
        m = w.finish(tok.vocab_size, {**meta, "split": split, "source": source or None})
        summary = {"dir": key, "tokens": m["total_tokens"], "documents": m["meta"]["documents"],
                   "shards": len(m["shards"])}
        if split == "train":
            splits["train"][source] = {**summary, "weight": weights[source] / total_w}
        else:
            splits["val"] = summary
    atomic_write_json(out / "train" / MIXTURE_FILE, {
        "format": MIXTURE_FORMAT, "version": 1,
        "sources": [{"name": n, "dir": n, "weight": v["weight"]}
                    for n, v in splits["train"].items()]})
    record = {"format": "lmforge-prepared", "version": PIPELINE_VERSION, "fingerprint": fp,
              "config": cfg.to_dict(), "tokenizer": {
                  "file": TOKENIZER, "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                  "eos_id": tok.eos_id, "bos_id": bos_id, "pad_id": tok.pad_id,
                  "eos_token": state["tokenizer"]["eos_token"],
                  "bos_token": cfg.bos_token if bos_id is not None else None,
                  "pad_token": (tok.backend.id_to_token(tok.pad_id)
                                if tok.pad_id is not None else None)},
              "dtype": dtype.name, "clean": stats.to_dict(), "splits": splits,
              "timing": {"clean_s": round(state["clean"]["seconds"], 3),
                         "tokenizer_s": round(state["tokenizer"]["seconds"], 3),
                         "tokenize_s": round(tok_seconds, 3),
                         "tokenize_cpu_s_this_run": round(tok_cpu, 3),
                         "tokenize_mb_per_s": round(clean_bytes / 1e6 / max(tok_seconds, 1e-9),
                                                    2),
                         "total_s": round(time.perf_counter() - t_start, 3)},
              "files": sum(len(fl) for _, fl in files)}
    atomic_write_json(out / RECORD, record)
    shutil.rmtree(work, ignore_errors=True)
    return PrepareResult(out, record, False)


def _cpu_seconds() -> float:
    """User+system CPU seconds of this process and its reaped children (e.g. pool workers)."""
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _carry_file(work: Path, key: str, chunks_done: int) -> Path:
    return work / f"carry_{key.replace('/', '__')}_{chunks_done:05d}.bin"


def _load_carry(work: Path, rec: dict, dtype: np.dtype) -> np.ndarray:
    if not rec.get("carry_file"):
        return np.zeros(0, dtype=dtype)
    data = (work / rec["carry_file"]).read_bytes()
    if sha256_bytes(data) != rec["carry_sha256"]:
        raise ValueError(f"{work / rec['carry_file']} is corrupted; delete {work.parent} "
                         f"and re-run prepare")
    return np.frombuffer(data, dtype=dtype).copy()


def _tokenize_stage(cfg, out: Path, work: Path, state: dict, chunk_dir: Path,
                    chunks: list[dict], tok: Tokenizer, bos_id, say) -> dict:
    dtype = dtype_for_vocab(tok.vocab_size)
    keys = [f"train/{s.name}" for s in cfg.sources] + ["val"]
    tstate = state.get("tokenize")
    if tstate and not all(_verify_recorded(out / k, tstate["writers"][k]) for k in keys):
        tstate = None
    if not tstate:
        for k in keys:
            shutil.rmtree(out / k, ignore_errors=True)
        tstate = {"chunks_done": 0, "writers": {k: {"shards": [], "tokens": 0, "documents": 0}
                                                for k in keys}, "seconds": 0.0}
    else:
        say(f"resuming tokenization after {tstate['chunks_done']} of {len(chunks)} chunks")
    writers = {k: _ShardWriter(out / k, cfg.shard_tokens, dtype, tstate["writers"][k],
                               _load_carry(work, tstate["writers"][k], dtype)) for k in keys}
    todo = chunks[tstate["chunks_done"]:]
    jobs = [(str(chunk_dir), c["name"], tok.eos_id, bos_id, dtype.str, tok.vocab_size,
             cfg.val_fraction, cfg.val_split) for c in todo]
    t0 = time.perf_counter()
    source_of = {c["name"]: c["source"] for c in chunks}
    workers = cfg.workers or os.cpu_count() or 1
    base = tstate.get("seconds", 0.0)
    for res in _run_jobs(jobs, tok, cfg.parallelism, workers):
        writers[f"train/{source_of[res['name']]}"].add(res["train"], res["train_docs"])
        writers["val"].add(res["val"], res["val_docs"])
        done = tstate["chunks_done"] + 1
        for k, w in writers.items():  # persist carries first, then the state that names them
            if w.carry.size:
                data = w.carry.tobytes()
                f = _carry_file(work, k, done)
                atomic_write(f, data)
                w.rec["carry_file"], w.rec["carry_sha256"] = f.name, sha256_bytes(data)
            else:
                w.rec["carry_file"] = w.rec["carry_sha256"] = None
        tstate["chunks_done"] = done
        tstate["seconds"] = base + time.perf_counter() - t0
        state["tokenize"] = tstate
        atomic_write_json(work / "state.json", state)
        named = {r.get("carry_file") for r in tstate["writers"].values()}
        for f in work.glob("carry_*.bin"):  # drop carries the state no longer names
            if f.name not in named:
                f.unlink(missing_ok=True)
        if done % 16 == 0 or done == len(chunks):
            say(f"tokenized {done}/{len(chunks)} chunks")
    tstate.setdefault("seconds", base)
    return tstate


def _run_jobs(jobs: list[tuple], tok: Tokenizer, mode: str, workers: int) -> Iterator[dict]:
    if not jobs:
        return
    tk_json = tok.backend.to_str()
    if mode == "threads" or workers == 1:
        # One process: tokenizers' Rust pool encodes on all cores and releases the GIL, so a
        # second chunk is encoded while this thread converts/writes the previous one.
        _worker_init(tk_json, single_thread=False)
        with ThreadPoolExecutor(2) as ex:
            pending: deque = deque()
            for job in jobs:
                pending.append(ex.submit(_tokenize_chunk, job))
                if len(pending) >= 2:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        return
    ctx = mp.get_context("spawn")  # safe with tokenizers' Rust threads (no fork)
    with ctx.Pool(min(workers, len(jobs)), initializer=_worker_init,
                  initargs=(tk_json, True)) as pool:
        yield from pool.imap(_tokenize_chunk, jobs, chunksize=1)


def _outputs_ok(out: Path, record: dict) -> bool:
    """All shard sets of a finished run open (files present with the recorded sizes)."""
    try:
        for v in record["splits"]["train"].values():
            TokenShards(out / v["dir"])
        if record["splits"]["val"]:
            TokenShards(out / record["splits"]["val"]["dir"])
        return (out / TOKENIZER).is_file()
    except (ValueError, KeyError, TypeError):
        return False


__all__ = ["run_prepare", "PrepareResult", "read_chunk", "MIXTURE_FILE"]
