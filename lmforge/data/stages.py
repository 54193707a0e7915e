"""The stages of ``lmforge prepare``: the same code for one process, N local processes,
torchrun ranks and Slurm array tasks.

Work units. The input files (sources in config order, files sorted) are cut into *units* of
about ``chunk_bytes``: small files are packed together, a large uncompressed .jsonl file is
split by byte range (a line belongs to the range its first byte is in) and a .parquet file by
row groups; a unit holds files of one source. The plan depends on the inputs and the config
only, never on the number of workers, and every document has a global position
``(unit, index in unit)`` that is its position in the single-process reading order.

Stages (``P`` units, ``H = dedup_ranges`` hash ranges; "per" = one task each, shared out
over the workers; "one" = a single task):

============  ====  =========================================================================
scan          per   unit: read, normalise, filter (empty / length); write the cleaned
              unit  documents, their blake2b-128 digests, and the records of the dedup stage
                    sectioned by hash range: (digest, position, size) and, with near_dedup,
                    one (band, band hash, digest, position, size) per MinHash band.
dedup         per   hash range h: every unit's section h. *Exact*: sort by digest; all but
              range the first position of each digest are duplicates. *Near* (MinHash LSH
                    buckets): sort by (band, band hash); drop members that are exact
                    duplicates of an earlier member; keep the buckets with >= 2 members.
cluster       one   all multi-member buckets: in global order, a document that shares a bucket
                    with an earlier *kept* document is a near-duplicate, otherwise it is kept
                    and marks its buckets (what one datasketch MinHashLSH does when queried and
                    filled in reading order). Also: the kept bytes, hence the tokenizer
                    sample's hash threshold.
filter        per   unit: apply both removal lists -> keep mask; write the unit's documents
              unit  whose content hash falls below the sample threshold.
tokenizer     one   train the BPE on the sample (round-robin over sources, in global order),
                    or load gpt2 / a file.
tokenize      per   unit: ``[BOS] ids EOS`` per kept document, split train/val.
              unit
assemble      per   output shard: shard k of a stream (train/<source>, val) is tokens
              shard ``[k S, (k+1) S)`` of the stream's units in order; its bytes, sha256 and
                    max id; the token counts of the task's shards (work folder).
merge         one   manifests (lmforge.folders.build_manifest) with each stream's token counts
                    and their entropy (the unigram baseline training reports, read instead of
                    the corpus), mixture.json, prepare.json.
============  ====  =========================================================================

Why the bytes equal a single-process run: every decision is a function of the documents and
their global positions (first occurrence by position; greedy near-dedup in position order; the
sample by content hash; val by content hash; streams concatenated in unit order and cut at fixed
offsets), never of which worker did what or when. Units are assigned to workers statically
(largest first, to the least loaded worker) and each task writes its outputs, then a done
marker; a task with a marker is skipped, so a killed worker is re-run alone and redoes only its
unfinished tasks, overwriting their partial outputs with the same bytes.

Everything goes through :class:`lmforge.data.store.Store`: the work folder
(``<output>/.work/<fingerprint>/``) and the output may be a shared file system or an object
store; no worker reads another's local disk.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmforge.data.clean import Cleaner, CleanStats, lsh_bands, minhash
from lmforge.data.prepare_config import PrepareConfig
from lmforge.data.shards import dtype_for_vocab, unigram_file
from lmforge.data.sources import (BadUtf8, format_of, iter_datasets_documents, iter_documents,
                                  parquet_file, source_files)
from lmforge.data.store import SectionedFile, Store, is_url, pack_sections, unpack_sections
from lmforge.data.tokenizer import Tokenizer, load_gpt2_tokenizer, load_tokenizer, train_bpe
from lmforge.folders import (MANIFEST, MIXTURE, PREPARE_RECORD, SHARD_FORMAT_VERSION, TOKENIZER, UNIGRAM_COUNTS,
                             build_manifest, sha256_bytes, shard_file_name, shard_record)

log = logging.getLogger("lmforge.data")

STAGES = ("scan", "dedup", "cluster", "filter", "tokenizer", "tokenize", "assemble", "merge")
SINGLE = ("cluster", "tokenizer", "merge")  # one task (rank 0 / a one-task job)
WORK_VERSION = 2  # layout of the work folder (bump when it changes)
RECORD_VERSION = 1  # prepare.json / output format
WORK = ".work"
MIXTURE_FORMAT = "lmforge-mixture"

EXACT_DT = np.dtype([("d0", "<u8"), ("d1", "<u8"), ("u", "<u4"), ("i", "<u4"), ("n", "<u4")])
BAND_DT = np.dtype([("b", "<u2"), ("k", "<u8"), ("d0", "<u8"), ("d1", "<u8"), ("u", "<u4"),
                    ("i", "<u4"), ("n", "<u4")])
MEMBER_DT = np.dtype([("g", "<u8"), ("u", "<u4"), ("i", "<u4"), ("n", "<u4")])
PROGRESS_EVERY_S = 30.0  # a worker's progress line on long stages
SCAN_SECTIONS = 3  # scan/<unit>.bin: offsets, texts, digests, then (exact, band) per hash range
_SCAN_STATS = ("documents_read", "bad_utf8", "empty", "too_short", "too_long",
               "control_chars_removed", "bytes_read")


# ---------------------------------------------------------------------------------------
# the job: config, stores, plan, this worker
# ---------------------------------------------------------------------------------------

@dataclass
class Job:
    """One worker's view of a prepare run."""

    cfg: PrepareConfig
    out: Store
    work: Store
    plan: dict
    rank: int = 0
    world: int = 1
    say: Callable[[str], None] = print
    resumed: bool = False
    cache: dict = field(default_factory=dict)  # per-process: open headers, tokenizer, ...

    @property
    def units(self) -> list[dict]:
        return self.plan["units"]

    def tag(self) -> str:
        return f"[{self.rank + 1}/{self.world}]" if self.world > 1 else ""


def listing(cfg: PrepareConfig) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(source name, [(file, format), ...]), ...] in config order."""
    out = []
    for src in cfg.sources:
        files = source_files(src, cfg.s3_endpoint)
        fl = []
        for f in files:
            fmt = format_of(f) if src.format == "auto" else src.format
            if fmt is None:
                raise ValueError(f"source {src.name!r}: cannot tell the format of {f} from its "
                                 f"extension; set format = \"txt\" | \"jsonl\" | \"parquet\"")
            fl.append((f, fmt))
        out.append((src.name, fl))
    return out


def _identity(path: str, cfg: PrepareConfig) -> list:
    """[path, size, version] of an input file (local: mtime; object stores: ETag)."""
    if not is_url(path):
        st = os.stat(path)
        return [os.path.realpath(path), st.st_size, st.st_mtime_ns]
    from lmforge.data.store import filesystem
    fs, p = filesystem(path, cfg.s3_endpoint)
    info = fs.info(p)
    return [path, int(info.get("size") or 0),
            str(info.get("ETag") or info.get("mtime") or info.get("LastModified") or "")]


EXECUTION_KEYS = ("workers", "parallelism", "output_dir", "scratch_dir", "s3_endpoint")


def fingerprint(cfg: PrepareConfig, files, identities: dict[str, list]) -> str:
    """Hash of the config (less how it is executed) and of the input files' identities."""
    conf = cfg.to_dict()
    for k in EXECUTION_KEYS:
        conf.pop(k)
    rows = [[name, *identities[f], fmt] for name, fl in files for f, fmt in fl]
    blob = json.dumps({"v": WORK_VERSION, "shard_format": SHARD_FORMAT_VERSION, "config": conf,
                       "files": rows}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def make_plan(cfg: PrepareConfig, files, identities: dict[str, list], fp: str) -> dict:
    """Work units: consecutive pieces of one source's files, about ``chunk_bytes`` each."""
    C = cfg.chunk_bytes
    units: list[dict] = []
    for s, (src, (name, fl)) in enumerate(zip(cfg.sources, files)):
        cur: list = []
        size = 0
        for f, fmt in fl:
            total = identities[f][1]
            for piece in _pieces(cfg, src.reader, f, fmt, total):
                if cur and size + piece[4] > C:
                    units.append({"source": s, "pieces": cur, "bytes": size})
                    cur, size = [], 0
                cur.append(piece)
                size += piece[4]
        if cur:
            units.append({"source": s, "pieces": cur, "bytes": size})
    return {"fingerprint": fp, "version": WORK_VERSION, "sources": [s.name for s in cfg.sources],
            "files": sum(len(fl) for _, fl in files), "units": units,
            "input_bytes": sum(u["bytes"] for u in units)}


def _pieces(cfg: PrepareConfig, reader: str, f: str, fmt: str, total: int) -> Iterator[list]:
    """[file, format, start, end (None = to the end), bytes] pieces of one file."""
    C = cfg.chunk_bytes
    if reader == "native" and fmt == "jsonl" and not f.lower().endswith(".gz") and total > C:
        for a in range(0, total, C):
            yield [f, fmt, a, min(a + C, total), min(a + C, total) - a]
        return
    if reader == "native" and fmt == "parquet":
        md = parquet_file(f, cfg.s3_endpoint).metadata
        sizes = [md.row_group(g).total_byte_size for g in range(md.num_row_groups)]
        if len(sizes) > 1 and sum(sizes) > C:
            first, acc = 0, 0
            for g, n in enumerate(sizes):
                if g > first and acc + n > C:
                    yield [f, fmt, first, g, acc]
                    first, acc = g, 0
                acc += n
            yield [f, fmt, first, len(sizes), acc]
            return
    yield [f, fmt, 0, None, total]


def assignment(weights: list[int], world: int) -> list[int]:
    """Owner rank of each task: largest first, to the least loaded rank (ties: lowest rank)."""
    load = [0] * world
    owner = [0] * len(weights)
    for t in sorted(range(len(weights)), key=lambda t: (-weights[t], t)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[t] = r
        load[r] += max(int(weights[t]), 1)
    return owner


# ---------------------------------------------------------------------------------------
# markers and progress
# ---------------------------------------------------------------------------------------

def _marker(stage: str, key: str) -> str:
    return f"done/{stage}/{key}.json"


def _unit_key(u: int) -> str:
    return f"{u:06d}"


def done_keys(job: Job, stage: str) -> set[str]:
    return {n[:-5] for n in job.work.list(f"done/{stage}") if n.endswith(".json")}


def markers(job: Job, stage: str) -> dict[str, dict]:
    """key -> marker of every finished task of ``stage``."""
    out = {}
    for key in sorted(done_keys(job, stage)):
        m = job.work.read_json(_marker(stage, key))
        if m is not None:
            out[key] = m
    return out


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _removed_text(d: dict, keys=("bad_utf8", "empty", "too_short", "too_long", "duplicates",
                                 "near_duplicates")) -> str:
    return ", ".join(f"{k} {d.get(k, 0):,}" for k in keys if k in d)


# ---------------------------------------------------------------------------------------
# stage 1: scan
# ---------------------------------------------------------------------------------------

def read_unit(cfg: PrepareConfig, unit: dict, on_bad) -> Iterator[str]:
    """The raw documents of a unit, in order."""
    src = cfg.sources[unit["source"]]
    for f, fmt, start, end, _ in unit["pieces"]:
        if src.reader == "datasets":
            yield from iter_datasets_documents(f, fmt, src.text_field)
        else:
            yield from iter_documents(f, fmt, src.text_field, on_bad, start, end,
                                      cfg.s3_endpoint)


def scan_unit(job: Job, u: int) -> dict:
    cfg, unit = job.cfg, job.units[u]
    name = cfg.sources[unit["source"]].name
    cleaner = Cleaner(dataclasses.replace(cfg, dedup=False, near_dedup=False))

    def on_bad(e: BadUtf8) -> None:
        log.warning("skipping document: %s", e.where)
        cleaner.count_bad_utf8(name)

    texts = [t.encode("utf-8") for raw in read_unit(cfg, unit,
                                                     on_bad if cfg.on_bad_utf8 == "skip" else None)
             if (t := cleaner.filter(raw, name)) is not None]
    n = len(texts)
    offsets = np.zeros(n + 1, dtype="<i8")
    np.cumsum([len(t) for t in texts], out=offsets[1:])
    digests = np.frombuffer(b"".join(hashlib.blake2b(t, digest_size=16).digest() for t in texts),
                            dtype="<u8").reshape(n, 2)
    H = cfg.dedup_ranges
    ex = np.zeros(n, dtype=EXACT_DT)
    ex["d0"], ex["d1"] = digests[:, 0], digests[:, 1]
    ex["u"], ex["i"], ex["n"] = u, np.arange(n), np.diff(offsets)
    sections: list[np.ndarray] = []
    bands = _band_records(cfg, texts, ex) if cfg.near_dedup else np.zeros(0, dtype=BAND_DT)
    ex_h, band_h = ex["d0"] % H, bands["k"] % H
    for h in range(H):
        sections += [ex[ex_h == h], bands[band_h == h]]
    job.work.write(f"scan/{_unit_key(u)}.bin",
                   pack_sections([offsets, b"".join(texts), digests, *sections]))
    st = cleaner.stats.to_dict()
    return {"source": name, "passed": n, "bytes_passed": int(offsets[-1]),
            **{k: st[k] for k in _SCAN_STATS}}


def _band_records(cfg: PrepareConfig, texts: list[bytes], ex: np.ndarray) -> np.ndarray:
    b, r = lsh_bands(cfg.near_dedup_threshold, cfg.near_dedup_num_perm)
    out = np.zeros(len(texts) * b, dtype=BAND_DT)
    keys = []
    for t in texts:
        hv = minhash(t.decode("utf-8"), cfg.near_dedup_ngram, cfg.near_dedup_num_perm).hashvalues
        keys += [hashlib.blake2b(hv[j * r:(j + 1) * r].tobytes(), digest_size=8).digest()
                 for j in range(b)]
    out["k"] = np.frombuffer(b"".join(keys), dtype="<u8") if keys else 0
    out["b"] = np.tile(np.arange(b), len(texts))
    for f in ("d0", "d1", "u", "i", "n"):
        out[f] = np.repeat(ex[f], b)
    return out


# ---------------------------------------------------------------------------------------
# stage 2: dedup (per hash range)
# ---------------------------------------------------------------------------------------

def dedup_range(job: Job, h: int) -> dict:
    P, H = len(job.units), job.cfg.dedup_ranges
    ex_parts, band_parts = [], []
    for u in range(P):
        sf = SectionedFile(job.work, f"scan/{_unit_key(u)}.bin", SCAN_SECTIONS + 2 * H)
        k = SCAN_SECTIONS + 2 * h
        lo, mid, hi = int(sf.offsets[k]), int(sf.offsets[k + 1]), int(sf.offsets[k + 2])
        data = job.work.read_range(sf.rel, sf.data_start + lo, sf.data_start + hi)
        ex_parts.append(np.frombuffer(data[:mid - lo], dtype=EXACT_DT))
        band_parts.append(np.frombuffer(data[mid - lo:], dtype=BAND_DT))
    # exact: the first position of each digest survives
    E = np.concatenate(ex_parts)
    E = E[np.lexsort((E["i"], E["u"], E["d1"], E["d0"]))]
    first = np.ones(len(E), dtype=bool)
    first[1:] = (E["d0"][1:] != E["d0"][:-1]) | (E["d1"][1:] != E["d1"][:-1])
    removed = E[~first]
    removed = removed[np.lexsort((removed["i"], removed["u"]))]
    cuts = np.searchsorted(removed["u"], np.arange(P + 1))
    job.work.write(f"dedup/{h:04d}.exact",
                   pack_sections([removed["i"][cuts[p]:cuts[p + 1]] for p in range(P)]))
    # near: buckets (band, band hash) with >= 2 members that are not copies of each other
    B = np.concatenate(band_parts)
    B = B[np.lexsort((B["i"], B["u"], B["d1"], B["d0"], B["k"], B["b"]))]
    if len(B):
        new_text = np.ones(len(B), dtype=bool)
        new_text[1:] = ((B["b"][1:] != B["b"][:-1]) | (B["k"][1:] != B["k"][:-1])
                        | (B["d0"][1:] != B["d0"][:-1]) | (B["d1"][1:] != B["d1"][:-1]))
        B = B[new_text]
    start = np.ones(len(B), dtype=bool)
    start[1:] = (B["b"][1:] != B["b"][:-1]) | (B["k"][1:] != B["k"][:-1])
    gid = np.cumsum(start) - 1
    size = np.bincount(gid, minlength=int(gid[-1]) + 1 if len(gid) else 0)
    multi = size[gid] >= 2
    kept_g = np.unique(gid[multi])
    M = np.zeros(int(multi.sum()), dtype=MEMBER_DT)
    M["g"] = np.searchsorted(kept_g, gid[multi])
    for f in ("u", "i", "n"):
        M[f] = B[f][multi]
    job.work.write(f"dedup/{h:04d}.buckets", M.tobytes())
    return {"exact_removed": int(len(removed)), "surviving_bytes": int(E["n"][first].sum()),
            "buckets": int(len(kept_g)), "members": int(len(M)), "records": int(len(E) + len(B))}


# ---------------------------------------------------------------------------------------
# stage 3: cluster (one task)
# ---------------------------------------------------------------------------------------

def cluster(job: Job) -> dict:
    cfg, P, H = job.cfg, len(job.units), job.cfg.dedup_ranges
    dd = markers(job, "dedup")
    parts, base = [], 0
    for h in range(H):
        M = np.frombuffer(job.work.read(f"dedup/{h:04d}.buckets"), dtype=MEMBER_DT).copy()
        M["g"] += base
        base += dd[f"{h:04d}"]["buckets"]
        parts.append(M)
    M = np.concatenate(parts) if parts else np.zeros(0, dtype=MEMBER_DT)
    M = M[np.lexsort((M["g"], M["i"], M["u"]))]
    marked = bytearray(base)
    removed: list[int] = []  # indices into M of each removed document's first row
    key = (M["u"].astype(np.uint64) << np.uint64(32)) | M["i"].astype(np.uint64)
    bounds = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True]) if len(M) else np.zeros(1, int)
    g = M["g"].tolist()
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):  # documents in global order
        gs = g[a:b]
        if any(marked[x] for x in gs):
            removed.append(a)
        else:
            for x in gs:
                marked[x] = 1
    R = M[np.array(removed, dtype=np.int64)] if removed else np.zeros(0, dtype=MEMBER_DT)
    cuts = np.searchsorted(R["u"], np.arange(P + 1))
    job.work.write("dedup/near.rm",
                   pack_sections([R["i"][cuts[p]:cuts[p + 1]] for p in range(P)]))
    kept_bytes = sum(m["surviving_bytes"] for m in dd.values()) - int(R["n"].sum())
    thr = 2**64 if kept_bytes <= cfg.sample_bytes else cfg.sample_bytes * 2**64 // kept_bytes
    return {"near_removed": len(removed), "kept_bytes": kept_bytes, "sample_threshold": thr,
            "candidates": int(len(bounds) - 1), "memberships": int(len(M))}


# ---------------------------------------------------------------------------------------
# stage 4: filter (per unit)
# ---------------------------------------------------------------------------------------

def _sectioned(job: Job, rel: str, n: int) -> SectionedFile:
    cache = job.cache.setdefault("sectioned", {})
    if rel not in cache:
        cache[rel] = SectionedFile(job.work, rel, n)
    return cache[rel]


def keep_mask(job: Job, u: int, n: int) -> tuple[np.ndarray, int, int]:
    """(keep mask, exact duplicates, near duplicates) of unit ``u``'s ``n`` documents."""
    P = len(job.units)
    keep = np.ones(n, dtype=bool)
    exact = 0
    for h in range(job.cfg.dedup_ranges):
        idx = _sectioned(job, f"dedup/{h:04d}.exact", P).read(u, "<u4")
        keep[idx] = False
        exact += len(idx)
    near = _sectioned(job, "dedup/near.rm", P).read(u, "<u4")
    keep[near] = False
    return keep, exact, len(near)


def filter_unit(job: Job, u: int) -> dict:
    cfg = job.cfg
    docs = SectionedFile(job.work, f"scan/{_unit_key(u)}.bin",
                         SCAN_SECTIONS + 2 * cfg.dedup_ranges)
    offsets = docs.read(0, "<i8")
    n = len(offsets) - 1
    keep, exact, near = keep_mask(job, u, n)
    sizes = np.diff(offsets)
    thr = job.cache["cluster"]["sample_threshold"]
    sel = keep.copy()
    if cfg.tokenizer != "bpe" or thr >= 2**64:
        sel[:] = False  # (everything is the sample: the tokenizer stage reads the kept documents)
    else:
        sel &= docs.read(2, "<u8").reshape(n, 2)[:, 1] < np.uint64(thr)
    if sel.any():
        blob = docs.read(1).tobytes()
        picked = [blob[offsets[i]:offsets[i + 1]] for i in np.flatnonzero(sel)]
        offs = np.zeros(len(picked) + 1, dtype="<i8")
        np.cumsum([len(p) for p in picked], out=offs[1:])
        job.work.write(f"filter/{_unit_key(u)}.sample", pack_sections([offs, b"".join(picked)]))
    return {"duplicates": exact, "near_duplicates": near, "kept": int(keep.sum()),
            "bytes_kept": int(sizes[keep].sum()), "sample_docs": int(sel.sum()), "docs": n,
            "keep": base64.b64encode(np.packbits(keep).tobytes()).decode("ascii")}


def clean_stats(job: Job) -> CleanStats:
    """The run's cleaning counts: scan + filter markers, summed in unit order."""
    scan, filt = markers(job, "scan"), markers(job, "filter")
    st = CleanStats()
    for u in range(len(job.units)):
        s, f = scan[_unit_key(u)], filt.get(_unit_key(u), {})
        for k in _SCAN_STATS:
            setattr(st, k, getattr(st, k) + s[k])
        for k in ("duplicates", "near_duplicates", "kept", "bytes_kept"):
            setattr(st, k, getattr(st, k) + f.get(k, 0))
        ps = st.per_source.setdefault(s["source"], {"read": 0, "kept": 0})
        ps["read"] += s["documents_read"]
        ps["kept"] += f.get("kept", 0)
    st.per_source = {n: st.per_source[n] for n in job.plan["sources"] if n in st.per_source}
    return st


# ---------------------------------------------------------------------------------------
# stage 5: tokenizer (one task)
# ---------------------------------------------------------------------------------------

def sample_texts(job: Job) -> Iterator[str]:
    """The sample, round-robin over sources (each in global order), until sample_bytes."""
    filt = markers(job, "filter")
    everything = job.work.read_json(_marker("cluster", "all"))["sample_threshold"] >= 2**64
    per_source: dict[int, list[int]] = {}
    for u, unit in enumerate(job.units):
        if filt[_unit_key(u)]["sample_docs"] or (everything and filt[_unit_key(u)]["kept"]):
            per_source.setdefault(unit["source"], []).append(u)

    def docs(units: list[int]) -> Iterator[str]:
        for u in units:
            if everything:
                yield from kept_documents(job, u, filt[_unit_key(u)])
                continue
            offs, blob = unpack_sections(job.work.read(f"filter/{_unit_key(u)}.sample"))
            o = np.frombuffer(offs, dtype="<i8")
            for i in range(len(o) - 1):
                yield blob[o[i]:o[i + 1]].decode("utf-8")

    iters = [docs(v) for _, v in sorted(per_source.items())]
    budget = job.cfg.sample_bytes
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


def check_kept(job: Job, st: CleanStats) -> None:
    """The errors of an empty corpus or an empty source, before any tokenizer work."""
    if st.kept == 0:
        raise ValueError(f"empty corpus: {st.documents_read} documents read, none kept "
                         f"({_removed_text(st.to_dict())})")
    for name in job.plan["sources"]:
        ps = st.per_source.get(name, {"read": 0, "kept": 0})
        if ps["kept"] == 0:
            raise ValueError(f"source {name!r} is empty after cleaning ({ps['read']} documents "
                             f"read); remove it or relax the filters")


def build_tokenizer(job: Job) -> Tokenizer:
    cfg = job.cfg
    bos = cfg.bos_token or None
    if cfg.tokenizer == "bpe":
        return train_bpe(sample_texts(job), cfg.vocab_size, special_tokens=cfg.special_tokens,
                         eos_token=cfg.eos_token, bos_token=bos, pad_token=cfg.pad_token or None)
    if cfg.tokenizer == "gpt2":
        tok = load_gpt2_tokenizer()
        if bos and tok.backend.token_to_id(bos) is None:
            raise ValueError(f"prepare.bos_token = {bos!r} is not in the GPT-2 vocabulary; "
                             f"set bos_token = \"\"")
        return tok
    # a tokenizer.json, or a folder of tokenizer files (a Hugging Face model folder or an imported run:
    # its tokenizer_config.json names the model's own EOS, used when prepare.eos_token is not in the vocabulary)
    tok = load_tokenizer(cfg.tokenizer)
    eos = cfg.eos_token if tok.backend.token_to_id(cfg.eos_token) is not None else tok.backend.id_to_token(tok.eos_id)
    return Tokenizer(tok.backend, source=str(cfg.tokenizer), eos_token=eos, bos_token=bos)


def tokenizer_stage(job: Job) -> dict:
    check_kept(job, clean_stats(job))
    tok = build_tokenizer(job)
    text = tok.to_json()
    job.out.write(TOKENIZER, text)
    return {"file_sha256": sha256_bytes(text.encode("utf-8")),
            "eos_token": tok.backend.id_to_token(tok.eos_id), "vocab_size": tok.vocab_size}


def load_job_tokenizer(job: Job) -> Tokenizer:
    """The tokenizer the tokenizer stage wrote (checked against its record; cached)."""
    if "tokenizer" not in job.cache:
        job.cache["tokenizer"] = _load_job_tokenizer(job)
    return job.cache["tokenizer"]


def _load_job_tokenizer(job: Job) -> Tokenizer:
    m = job.work.read_json(_marker("tokenizer", "all"))
    data = job.out.read(TOKENIZER)
    if m is None or sha256_bytes(data) != m["file_sha256"]:
        raise ValueError(f"{job.out.url(TOKENIZER)} does not match the tokenizer stage's record; "
                         f"re-run the tokenizer stage")
    import tokenizers
    return Tokenizer(tokenizers.Tokenizer.from_str(data.decode("utf-8")),
                     source=job.out.url(TOKENIZER), eos_token=m["eos_token"],
                     bos_token=job.cfg.bos_token or None)


# ---------------------------------------------------------------------------------------
# stage 6: tokenize (per unit)
# ---------------------------------------------------------------------------------------

def val_choice(text: str, val_fraction: float) -> bool:
    """Whether a document goes to validation (``val_split = "documents"``): by content hash."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h < val_fraction * 2.0**64


def tokenize_docs(tk, docs: list[str], name: str, eos: int, bos: int | None, dtype: str,
                  vocab: int, val_fraction: float, val_split: str) -> dict:
    """``[BOS] ids EOS`` per document, split train/val; ids converted and range-checked in
    one vectorised pass. ``tk``: a ``tokenizers.Tokenizer``."""
    encs = tk.encode_batch_fast(docs, add_special_tokens=False)
    ids = [e.ids for e in encs]
    dt = np.dtype(dtype)
    lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    total = int(lens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    if total and (int(flat.max()) >= vocab or int(flat.min()) < 0):
        raise ValueError(f"unit {name}: token id {int(flat.max())} is outside the "
                         f"vocabulary [0, {vocab})")
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    head = 1 if bos is not None else 0
    if val_split == "tail":  # per document: train = [BOS] head EOS, val = tail EOS
        n_val_tok = np.rint(lens * val_fraction).astype(np.int64)
        return {**_tail_split(flat, lens, n_val_tok, eos, bos, dt), "bytes": nbytes}
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
        is_val = np.fromiter((val_choice(d, val_fraction) for d in docs), dtype=bool,
                             count=len(docs))
    else:
        is_val = np.zeros(len(docs), dtype=bool)
    mask = np.repeat(is_val, doc_len)
    return {"train": out[~mask], "val": out[mask], "train_docs": int((~is_val).sum()),
            "val_docs": int(is_val.sum()), "bytes": nbytes}


def _tail_split(flat, lens, n_val_tok, eos, bos, dt) -> dict:
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
    return {"train": cat(train), "val": cat(val), "train_docs": len(lens),
            "val_docs": int((n_val_tok > 0).sum())}


def kept_documents(job: Job, u: int, filter_marker: dict | None = None) -> list[str]:
    """The documents of unit ``u`` that survived every filter and dedup, in order."""
    m = filter_marker or job.work.read_json(_marker("filter", _unit_key(u)))
    sf = SectionedFile(job.work, f"scan/{_unit_key(u)}.bin",
                       SCAN_SECTIONS + 2 * job.cfg.dedup_ranges)
    o = sf.read(0, "<i8")
    blob = sf.read(1).tobytes()
    keep = np.unpackbits(np.frombuffer(base64.b64decode(m["keep"]), dtype=np.uint8),
                         count=len(o) - 1).astype(bool)
    return [blob[o[i]:o[i + 1]].decode("utf-8") for i in np.flatnonzero(keep)]


def tokenize_unit(job: Job, u: int) -> dict:
    tok = job.cache["tok"]
    cfg = job.cfg
    bos = tok.backend.token_to_id(cfg.bos_token) if cfg.bos_token else None
    res = tokenize_docs(tok.backend, kept_documents(job, u), _unit_key(u), tok.eos_id, bos,
                        dtype_for_vocab(tok.vocab_size).str, tok.vocab_size, cfg.val_fraction,
                        cfg.val_split)
    job.work.write(f"tok/{_unit_key(u)}.bin", pack_sections([res["train"], res["val"]]))
    return {"train_tokens": int(res["train"].size), "val_tokens": int(res["val"].size),
            "train_docs": res["train_docs"], "val_docs": res["val_docs"],
            "bytes_kept": res["bytes"]}


# ---------------------------------------------------------------------------------------
# stages 7-8: assemble (per shard) and merge (one task)
# ---------------------------------------------------------------------------------------

def streams(job: Job) -> list[dict]:
    """The output token streams: train/<source> (its units) and val (all units), in order,
    with per-unit token counts; raises the errors of a split that came out empty."""
    cfg = job.cfg
    tm = markers(job, "tokenize")
    out = []
    for s, name in enumerate(job.plan["sources"]):
        us = [u for u, unit in enumerate(job.units) if unit["source"] == s]
        out.append({"dir": f"train/{name}", "split": "train", "source": name, "section": 0,
                    "units": us, "tokens": [tm[_unit_key(u)]["train_tokens"] for u in us],
                    "documents": sum(tm[_unit_key(u)]["train_docs"] for u in us)})
    us = list(range(len(job.units)))
    val = {"dir": "val", "split": "val", "source": None, "section": 1, "units": us,
           "tokens": [tm[_unit_key(u)]["val_tokens"] for u in us],
           "documents": sum(tm[_unit_key(u)]["val_docs"] for u in us)}
    for st in out:
        if sum(st["tokens"]) == 0:
            raise ValueError(f"source {st['source']!r}: every document went to validation; "
                             f"lower val_fraction")
    if sum(val["tokens"]) == 0:
        if cfg.val_fraction > 0:
            kept = sum(m["train_docs"] + m["val_docs"] for m in tm.values())
            raise ValueError(f"val_fraction = {cfg.val_fraction} selected no validation "
                             f"documents out of {kept}; raise val_fraction or use "
                             f"val_split = \"tail\"")
    else:
        out.append(val)
    S = cfg.shard_tokens
    for st in out:
        st["total"] = sum(st["tokens"])
        st["starts"] = np.concatenate([[0], np.cumsum(st["tokens"])]).tolist()
        st["shards"] = math.ceil(st["total"] / S)
    return out


ASSEMBLE_TASK_BYTES = 4_000_000  # small shards are assembled several to a task (fewer markers)


def shard_tasks(job: Job) -> list[tuple[int, int, int]]:
    """(stream, first shard, shards) per assemble task."""
    job.cache["streams"] = st = streams(job)
    per = max(1, ASSEMBLE_TASK_BYTES // (job.cfg.shard_tokens * 2))
    return [(i, k, min(per, s["shards"] - k)) for i, s in enumerate(st)
            for k in range(0, s["shards"], per)]


def assemble_shards(job: Job, task: tuple[int, int, int]) -> dict:
    si, k0, n = task
    counts = np.zeros(job.cache["vocab"], dtype=np.int64)
    recs = [assemble_shard(job, si, k, counts) for k in range(k0, k0 + n)]
    job.work.write(_counts_file(task_key("assemble", task)), counts.astype("<i8").tobytes())
    return {"records": recs, "tokens": sum(r["tokens"] for r in recs)}


def _counts_file(key: str) -> str:
    """The work-folder file of one assemble task's token counts (vocab little-endian int64)."""
    return f"unigram/{key}.bin"


def assemble_shard(job: Job, si: int, k: int, counts: np.ndarray) -> dict:
    st = job.cache["streams"][si]
    dtype = dtype_for_vocab(job.cache["vocab"])
    S = job.cfg.shard_tokens
    lo, hi = k * S, min((k + 1) * S, st["total"])
    parts = []
    starts = st["starts"]
    j = int(np.searchsorted(starts, lo, side="right")) - 1
    while lo < hi:
        u = st["units"][j]
        a = lo - starts[j]
        take = min(hi - lo, starts[j + 1] - lo)
        if take > 0:
            sf = _sectioned(job, f"tok/{_unit_key(u)}.bin", 2)
            parts.append(sf.read(st["section"], dtype, first=a, count=take))
            lo += take
        j += 1
    tokens = np.concatenate(parts)
    counts += np.bincount(tokens, minlength=len(counts))
    data = tokens.tobytes()
    rec = shard_record(k, data, tokens.size, int(tokens.max()))
    job.out.write(f"{st['dir']}/{rec['file']}", data)
    return rec


def merge(job: Job, timing: dict) -> dict:
    cfg = job.cfg
    tok = load_job_tokenizer(job)
    tm = job.work.read_json(_marker("tokenizer", "all"))
    bos_id = tok.backend.token_to_id(cfg.bos_token) if cfg.bos_token else None
    dtype = dtype_for_vocab(tok.vocab_size)
    meta = {"tokenizer_sha256": tok.sha256, "eos_id": tok.eos_id, "bos_id": bos_id,
            "pad_id": tok.pad_id}
    asm = markers(job, "assemble")
    weights = {s.name: s.weight for s in cfg.sources}
    total_w = sum(weights.values())
    splits: dict[str, Any] = {"train": {}, "val": None}
    keep_files = {TOKENIZER, f"train/{MIXTURE}"}
    for i, st in enumerate(streams(job)):
        keys = [key for key in sorted(asm) if key.startswith(f"{i:03d}-")]
        recs = [r for key in keys for r in asm[key]["records"]]
        if [r["file"] for r in recs] != [shard_file_name(k) for k in range(st["shards"])]:
            raise ValueError(f"{st['dir']}: the assemble stage's records do not cover its "
                             f"{st['shards']} shards; re-run the assemble stage")
        counts = np.zeros(tok.vocab_size, dtype=np.int64)
        for key in keys:  # (one vocabulary-sized vector per assemble task, added one at a time)
            counts += np.frombuffer(job.work.read(_counts_file(key)), dtype="<i8")
        data, unigram = unigram_file(counts)
        job.out.write(f"{st['dir']}/{UNIGRAM_COUNTS}", data)
        sources = {} if st["split"] == "train" else {"sources": val_sources(job, st)}
        m = build_manifest(dtype.name, tok.vocab_size, cfg.shard_tokens, recs,
                           {**meta, "split": st["split"], "source": st["source"],
                            "documents": st["documents"], **sources}, unigram)
        job.out.write_json(f"{st['dir']}/{MANIFEST}", m)
        keep_files |= ({f"{st['dir']}/{MANIFEST}", f"{st['dir']}/{UNIGRAM_COUNTS}"}
                       | {f"{st['dir']}/{r['file']}" for r in recs})
        summary = {"dir": st["dir"], "tokens": m["total_tokens"], "documents": st["documents"],
                   "shards": len(recs), "unigram_entropy": unigram["entropy"]}
        if st["split"] == "train":
            splits["train"][st["source"]] = {**summary, "weight": weights[st["source"]] / total_w}
        else:
            splits["val"] = {**summary, "sources": sources["sources"]}
    job.out.write_json(f"train/{MIXTURE}", {
        "format": MIXTURE_FORMAT, "version": 1,
        "sources": [{"name": n, "dir": n, "weight": v["weight"]}
                    for n, v in splits["train"].items()]})
    for f in job.out.find("train") + job.out.find("val"):  # shards of an earlier, other run
        if f not in keep_files:
            job.out.remove(f)
    record = {"format": "lmforge-prepared", "version": RECORD_VERSION,
              "fingerprint": job.plan["fingerprint"], "config": cfg.to_dict(), "tokenizer": {
                  "file": TOKENIZER, "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                  "eos_id": tok.eos_id, "bos_id": bos_id, "pad_id": tok.pad_id,
                  "eos_token": tm["eos_token"],
                  "bos_token": cfg.bos_token if bos_id is not None else None,
                  "pad_token": (tok.backend.id_to_token(tok.pad_id)
                                if tok.pad_id is not None else None)},
              "dtype": dtype.name, "clean": clean_stats(job).to_dict(), "splits": splits,
              "timing": timing, "files": job.plan["files"], "units": len(job.units),
              "tokenizer_sample": sample_summary(job)}
    return record


def val_sources(job: Job, st: dict) -> list[list]:
    """[name, tokens, documents] of each source's part of the validation stream, in stream order: its
    units come source by source (make_plan), so each source's held-out tokens are one range (training
    validates each source on its own: lmforge.train.validation)."""
    tm = markers(job, "tokenize")
    order = [job.units[u]["source"] for u in st["units"]]
    assert order == sorted(order), "the units come source by source"
    out = []
    for s, name in enumerate(job.plan["sources"]):
        units = [u for u in st["units"] if job.units[u]["source"] == s]
        out.append([name, sum(tm[_unit_key(u)]["val_tokens"] for u in units),
                    sum(tm[_unit_key(u)]["val_docs"] for u in units)])
    return out


def sample_summary(job: Job) -> dict | None:
    """What trained the BPE: the content-hash fraction of the kept documents, per source."""
    if job.cfg.tokenizer != "bpe":
        return None
    thr = job.work.read_json(_marker("cluster", "all"))["sample_threshold"]
    filt = markers(job, "filter")
    docs = {n: 0 for n in job.plan["sources"]}
    for u, unit in enumerate(job.units):
        m = filt[_unit_key(u)]
        docs[job.plan["sources"][unit["source"]]] += m["kept"] if thr >= 2**64 else m["sample_docs"]
    return {"fraction": min(1.0, thr / 2**64), "documents": docs,
            "cap_bytes": job.cfg.sample_bytes}


# ---------------------------------------------------------------------------------------
# running a stage: this worker's tasks, skipping finished ones
# ---------------------------------------------------------------------------------------

def tasks_of(job: Job, stage: str) -> list:
    """All tasks of a stage, in order (the same list on every worker)."""
    if stage in ("scan", "filter", "tokenize"):
        return list(range(len(job.units)))
    if stage == "dedup":
        return list(range(job.cfg.dedup_ranges))
    if stage == "assemble":
        return shard_tasks(job)
    return ["all"]


def task_key(stage: str, t) -> str:
    if stage == "assemble":
        return f"{t[0]:03d}-{t[1]:06d}"  # (stream, first shard)
    if stage == "dedup":
        return f"{t:04d}"
    return _unit_key(t) if isinstance(t, int) else str(t)


def task_weights(job: Job, stage: str, tasks: list) -> list[int]:
    if stage in ("scan", "filter", "tokenize"):
        return [job.units[u]["bytes"] for u in tasks]
    if stage == "assemble":
        return [n for _, _, n in tasks]
    return [1] * len(tasks)


PREVIOUS = {s: STAGES[i - 1] for i, s in enumerate(STAGES) if i}


def finish(job: Job, total_s: float | None = None) -> dict:
    """The merge stage (one task): manifests, mixture, prepare.json; then the work folder is
    removed. ``total_s``: the run's wall time if the caller measured it (one process), else
    first worker start to now."""
    require_previous(job, "merge")
    t0, c0 = time.time(), _cpu()
    walls = stage_walls(job)
    starts = [w["start"] for w in (job.work.read_json(f"workers/{s}/{n}") for s in STAGES
                                   for n in job.work.list(f"workers/{s}")) if w]
    w = lambda s, k="wall_s": walls.get(s, {}).get(k, 0.0)  # noqa: E731
    tok_s = w("tokenize")
    timing = {"clean_s": w("scan"), "dedup_s": round(w("dedup") + w("cluster") + w("filter"), 3),
              "tokenizer_s": w("tokenizer"), "tokenize_s": tok_s,
              "tokenize_cpu_s_this_run": w("tokenize", "cpu_s"),
              "tokenize_mb_per_s": w("tokenize", "mb_per_s"), "assemble_s": w("assemble"),
              "stages": walls}
    record = merge(job, timing)
    total = total_s if total_s is not None else time.time() - min(starts, default=t0)
    record["timing"]["merge_s"] = round(time.time() - t0, 3)
    record["timing"]["merge_cpu_s"] = round(_cpu() - c0, 3)
    record["timing"]["total_s"] = round(total, 3)
    mb = record["clean"]["bytes_read"] / 1e6
    record["timing"]["mb_per_s"] = round(mb / max(total, 1e-9), 3)
    job.out.write_json(PREPARE_RECORD, record)
    job.out.remove_tree(WORK)
    return record


def require_previous(job: Job, stage: str) -> None:
    """ValueError naming the missing tasks (and their workers) of the stage before."""
    prev = PREVIOUS.get(stage)
    if prev is None:
        return
    tasks = tasks_of(job, prev)
    have = done_keys(job, prev)
    missing = [t for t in tasks if task_key(prev, t) not in have]
    if missing:
        owner = assignment(task_weights(job, prev, tasks), job.world)
        ranks = sorted({owner[tasks.index(t)] for t in missing}) if job.world > 1 else []
        who = f" (workers {', '.join(map(str, ranks))} of {job.world})" if ranks else ""
        raise ValueError(f"stage {stage!r} needs stage {prev!r} to be finished: "
                         f"{len(missing)} of {len(tasks)} tasks missing{who}. Fix: re-run "
                         f"`lmforge prepare --stage {prev}` for them (finished tasks are "
                         f"skipped)")


def run_tasks(job: Job, stage: str) -> dict:
    """Run this worker's unfinished tasks of ``stage``; returns this worker's stage summary."""
    require_previous(job, stage)
    t0, c0 = time.time(), _cpu()
    if stage == "filter":
        job.cache["cluster"] = job.work.read_json(_marker("cluster", "all"))
    if stage == "tokenize":
        job.cache["tok"] = load_job_tokenizer(job)
    if stage == "assemble":
        job.cache["vocab"] = job.work.read_json(_marker("tokenizer", "all"))["vocab_size"]
    tasks = tasks_of(job, stage)
    if stage in SINGLE:
        mine = tasks if job.rank == 0 else []
    else:
        owner = assignment(task_weights(job, stage, tasks), job.world)
        mine = [t for t, r in zip(tasks, owner) if r == job.rank]
    have = done_keys(job, stage)
    todo = [t for t in mine if task_key(stage, t) not in have]
    if len(todo) < len(mine):
        job.say(f"{job.tag()} {stage}: {len(mine) - len(todo)} of my {len(mine)} tasks already "
                f"done; skipping them".strip())
    fn = {"scan": scan_unit, "dedup": dedup_range, "cluster": lambda j, t: cluster(j),
          "filter": filter_unit, "tokenizer": lambda j, t: tokenizer_stage(j),
          "tokenize": tokenize_unit, "assemble": assemble_shards}[stage]
    summary = {"rank": job.rank, "world": job.world, "tasks": 0, "bytes": 0, "start": t0}
    removed: dict[str, int] = {}

    lock = threading.Lock()
    live = {"done": 0, "bytes": 0, "said": time.time()}

    def one(t) -> dict:
        s0 = time.time()
        m = fn(job, t)
        m = {**m, "seconds": round(time.time() - s0, 4), "rank": job.rank}
        job.work.write_json(_marker(stage, task_key(stage, t)), m)
        with lock:  # a progress line every PROGRESS_EVERY_S seconds on long stages
            live["done"] += 1
            live["bytes"] += _task_bytes(stage, m)
            now = time.time()
            if now - live["said"] >= PROGRESS_EVERY_S and live["done"] < len(todo):
                live["said"] = now
                job.say(f"{job.tag()} {stage}: {live['done']}/{len(todo)} task(s), "
                        f"{live['bytes'] / 1e6:.1f} MB, "
                        f"{live['bytes'] / 1e6 / max(now - t0, 1e-9):.2f} MB/s".strip())
        return m

    if stage == "tokenize" and job.cfg.parallelism == "threads" and len(todo) > 1:
        with ThreadPoolExecutor(2) as ex:  # encode one unit while the other is converted
            results = list(ex.map(one, todo))
    else:
        results = [one(t) for t in todo]
    for t, m in zip(todo, results):
        summary["tasks"] += 1
        summary["bytes"] += _task_bytes(stage, m)
        for k in ("bad_utf8", "empty", "too_short", "too_long", "duplicates", "near_duplicates"):
            if k in m:
                removed[k] = removed.get(k, 0) + m[k]
    summary.update(end=time.time(), cpu_s=round(_cpu() - c0, 3), removed=removed)
    if todo:
        secs = max(summary["end"] - t0, 1e-9)
        job.say((f"{job.tag()} {stage}: {len(todo)} task(s), {summary['bytes'] / 1e6:.2f} MB in "
                 f"{secs:.2f} s = {summary['bytes'] / 1e6 / secs:.2f} MB/s"
                 + (f"; removed: {_removed_text(removed)}" if removed else "")).strip())
        job.work.write_json(f"workers/{stage}/{job.rank:05d}-of-{job.world:05d}.json", summary)
    return summary


def _task_bytes(stage: str, m: dict) -> int:
    if stage == "scan":
        return m["bytes_read"]
    if stage in ("tokenize", "filter"):
        return m["bytes_kept"]
    if stage == "assemble":
        return 2 * m["tokens"]  # (approximately: uint16)
    return 0


def stage_walls(job: Job) -> dict:
    """Per stage: wall seconds (first start to last end over workers), MB, MB/s, workers."""
    out = {}
    for stage in STAGES:
        ws = [job.work.read_json(f"workers/{stage}/{n}") for n in job.work.list(f"workers/{stage}")]
        ws = [w for w in ws if w]
        if not ws:
            continue
        wall = max(w["end"] for w in ws) - min(w["start"] for w in ws)
        mb = sum(w["bytes"] for w in ws) / 1e6
        out[stage] = {"wall_s": round(wall, 3), "mb": round(mb, 3),
                      "mb_per_s": round(mb / max(wall, 1e-9), 3),
                      "cpu_s": round(sum(w["cpu_s"] for w in ws), 3),
                      "workers": len({w["rank"] for w in ws}),
                      "per_worker": {str(w["rank"]): {
                          "tasks": w["tasks"], "mb": round(w["bytes"] / 1e6, 3),
                          "mb_per_s": round(w["bytes"] / 1e6 / max(w["end"] - w["start"], 1e-9), 3)}
                          for w in ws}}
    return out


def progress_lines(job: Job) -> list[str]:
    """Overall progress: tasks done per stage, MB/s, what each filter removed so far."""
    lines = []
    walls = stage_walls(job)
    st = {k: 0 for k in ("bad_utf8", "empty", "too_short", "too_long", "duplicates",
                         "near_duplicates")}
    for stage in STAGES:
        have = done_keys(job, stage)
        try:
            total: Any = len(tasks_of(job, stage))
        except (ValueError, KeyError, TypeError):
            total = "?"
        line = f"{stage:<10} {len(have)}/{total} tasks"
        if stage in walls:
            w = walls[stage]
            line += (f", {w['mb']:.2f} MB in {w['wall_s']:.2f} s wall = {w['mb_per_s']:.2f} MB/s"
                     f" over {w['workers']} worker(s)")
        if stage in ("scan", "filter") and have:
            for m in markers(job, stage).values():
                for k in st:
                    st[k] += m.get(k, 0)
            line += f"; removed so far: {_removed_text(st)}"
        lines.append(line)
    return lines


__all__ = ["STAGES", "SINGLE", "Job", "listing", "fingerprint", "make_plan", "assignment",
           "run_tasks", "finish", "merge", "stage_walls", "progress_lines", "tokenize_docs", "val_choice",
           "clean_stats", "markers", "done_keys", "tasks_of", "task_key"]
