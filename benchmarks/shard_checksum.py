"""What `data.verify_checksums` costs: sha256 verification of token shards vs. reading them, and
the time it adds to a run's start-up on the default corpus.

    python benchmarks/shard_checksum.py --mb 256 --reps 3

1. Synthetic shards (`--mb` MB of uint16 ids in 64 MB shards, written by `write_token_shards`, in a
   temporary folder; page cache warm: each measurement follows a read of the same bytes, so this is
   the CPU cost, not the disk's):
   - read      every shard's bytes read (`np.fromfile`): the floor of any full pass;
   - sha256    `lmforge.folders.sha256_file` of every shard: what verification adds per byte;
   - always    `TokenShards(dir, "always")`: open + hash + largest-id check of every shard;
   - first_open  the first batch of a `PackedLoader` over `TokenShards(dir, "first_open")` minus the
     same with "never": what the first read of a shard pays (it hashes that whole shard once).
   Wall MB/s (best and median of `--reps`) and MB per CPU-second (less sensitive to other jobs).
2. The default corpus (`lmforge train` with no config): its train + val shards, prepared with the
   tiny preset's tokenizer settings, verified as "always" (every shard) would at start-up: seconds
   added, best of `--reps`. "first_open" pays the same, spread over the first read of each shard.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import lmforge.data.shards as shards_mod
from lmforge.config import load_config
from lmforge.data.loader import PackedLoader
from lmforge.data.shards import TokenShards, write_token_shards
from lmforge.folders import sha256_file


def timed(fn, reps: int) -> dict:
    walls, cpus = [], []
    for _ in range(reps):
        shards_mod._VERIFIED.clear()  # (each repetition hashes again, as a fresh process would)
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"best_s": min(walls), "median_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def rates(t: dict, mb: float) -> dict:
    return {**{k: round(v, 4) for k, v in t.items()}, "best_mb_s": round(mb / t["best_s"], 1),
            "median_mb_s": round(mb / t["median_s"], 1), "mb_per_cpu_s": round(mb / max(t["cpu_s"], 1e-9), 1)}


def synthetic(mb: int, reps: int, root: Path) -> dict:
    tokens = mb * (1 << 20) // 2
    rng = np.random.default_rng(0)
    arrays = (rng.integers(0, 50257, size=1 << 22, dtype=np.uint16) for _ in range(-(-tokens // (1 << 22))))
    folder = root / "shards"
    write_token_shards(arrays, folder, shard_tokens=1 << 25, vocab_size=50257, meta={})  # 64 MB shards
    files = sorted(folder.glob("shard_*.bin"))
    size_mb = sum(f.stat().st_size for f in files) / 1e6

    def read_all():
        for f in files:
            np.fromfile(f, dtype="<u2")

    def first_batch(mode: str):
        loader = PackedLoader(TokenShards(folder, verify_checksums=mode), 1024, 8, seed=0)
        loader.next_batch()

    read_all()  # warm the page cache
    out = {"shard_files": len(files), "mb": round(size_mb, 1)}
    out["read"] = rates(timed(read_all, reps), size_mb)
    read_all()
    out["sha256"] = rates(timed(lambda: [sha256_file(f) for f in files], reps), size_mb)
    read_all()
    out["always"] = rates(timed(lambda: TokenShards(folder, verify_checksums="always"), reps), size_mb)
    never = timed(lambda: first_batch("never"), reps)
    first = timed(lambda: first_batch("first_open"), reps)
    out["first_open_first_batch_s"] = {"never": round(never["best_s"], 4), "first_open": round(first["best_s"], 4),
                                       "shards_hashed": "those the batch's 8 windows touch"}
    return out


def default_corpus(reps: int) -> dict:
    from lmforge.train.components import prepare_data

    cfg = load_config("tiny")
    data = prepare_data(cfg)  # (cached after the first run, as for `lmforge train`)
    dirs = [data.train_dir, data.val_dir]
    files = [f for d in dirs for f in sorted(Path(d).glob("shard_*.bin"))]
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    [sha256_file(f) for f in files]  # warm
    never = timed(lambda: [TokenShards(d, verify_checksums="never") for d in dirs], reps)
    always = timed(lambda: [TokenShards(d, verify_checksums="always") for d in dirs], reps)
    return {"shard_files": len(files), "mb": round(size_mb, 2),
            "tokens": sum(len(TokenShards(d)) for d in dirs),
            "open_never_s": round(never["best_s"], 4), "open_always_s": round(always["best_s"], 4),
            "added_s": round(always["best_s"] - never["best_s"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="MB of synthetic shards")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
                  "load_average": os.getloadavg(), "synthetic": synthetic(args.mb, args.reps, Path(tmp)),
                  "default_corpus": default_corpus(args.reps)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
