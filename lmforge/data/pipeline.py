"""``lmforge prepare``: sources -> cleaned, deduplicated -> tokenizer -> token shards, on one
process, N local processes, torchrun ranks or a Slurm array, with the same output bytes.

Output folder (a local path or a URL such as ``s3://bucket/prepared``)::

    prepare.json            fingerprint of the inputs + config, statistics, per-split summary
    tokenizer.json
    train/mixture.json      the train sources with their (normalised) mixture weights
    train/<source>/         one token-shard set per source (manifest.json + shard_*.bin)
    val/                    one token-shard set with the validation documents of all sources
    .work/<fingerprint>/    only while running: the plan, each stage's outputs and done markers

The stages and why any number of workers writes the same bytes: :mod:`lmforge.data.stages`.

Engines (no scheduler of our own: each worker computes its share from its rank):

* one process (default, ``parallelism = "threads"``): every stage in this process;
  tokenizers' Rust pool encodes on all cores.
* ``parallelism = "processes"``, ``workers = N``: N local spawn-context processes take their
  share of each stage; the one-task stages (cluster, tokenizer, merge) run in this process.
* torchrun: ``torchrun --nnodes M --nproc-per-node K -m lmforge prepare --config C``: every
  rank runs every stage on its share, with a gloo barrier between stages; rank 0 runs the
  one-task stages. No extra dependency (torch is one).
* a Slurm array (or any launcher): one job per stage, ``lmforge prepare --config C --stage S``
  with the rank and worker count from ``SLURM_ARRAY_TASK_ID`` / ``SLURM_ARRAY_TASK_COUNT``
  (or ``--rank`` / ``--world``); stages chained with ``--dependency=afterok``
  (``examples/slurm_prepare.sh``).

Resuming: every task writes its outputs, then a done marker; finished tasks are skipped, so a
re-run (of everything, or of one dead worker alone) redoes only what is missing. Re-running with
unchanged inputs (same files by path, size and mtime / ETag; same config except how it is
executed) finds ``prepare.json`` up to date and does nothing.

Mixtures: the weights are not applied here; every kept train token is written once per source
and :class:`lmforge.data.loader.PackedLoader` draws windows from the sources in the weighted
proportions (a small source is repeated, i.e. up-sampled, a large one sub-sampled).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from lmforge.data.prepare_config import PrepareConfig
from lmforge.data.shards import TokenShards
from lmforge.data.stages import (SINGLE, STAGES, WORK, Job, _identity, finish, fingerprint,
                                 listing, make_plan, progress_lines, run_tasks, stage_walls,
                                 tokenize_docs, val_choice)
from lmforge.data.store import Store, is_url
from lmforge.folders import MANIFEST, MIXTURE, PREPARE_RECORD, TOKENIZER

log = logging.getLogger("lmforge.data")

MIXTURE_FILE = MIXTURE
RECORD = PREPARE_RECORD
_val_choice = val_choice  # (the name earlier versions exported)


@dataclass
class PrepareResult:
    """Summary of a prepare run (``up_to_date``: nothing had to be done)."""

    output_dir: Path | str
    record: dict
    up_to_date: bool


def _out_name(root: str) -> Path | str:
    return root if is_url(root) else Path(root)


def _use_scratch(path: str) -> None:
    """Node-local temporary files go to ``path`` (tempfile, the datasets cache)."""
    os.makedirs(path, exist_ok=True)
    tempfile.tempdir = path
    os.environ["TMPDIR"] = path
    os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(path, "hf_datasets"))


def open_job(cfg: PrepareConfig, output_dir: str | Path | None = None, rank: int = 0,
             world: int = 1, say: Callable[[str], None] | None = None
             ) -> tuple[Job | None, PrepareResult | None]:
    """(this worker's Job, None), or (None, result) when the output is already up to date."""
    cfg.validate()
    say = say or (lambda msg: log.info("prepare: %s", msg))
    if not 0 <= rank < world:
        raise ValueError(f"worker rank {rank} must be in [0, {world}) (--rank / --world)")
    if cfg.scratch_dir:
        _use_scratch(cfg.scratch_dir)
    root = str(output_dir or cfg.output_dir)
    out = Store(root, cfg.s3_endpoint)
    out.check()
    for src in cfg.sources:
        if is_url(src.path):
            Store(src.path.split("*", 1)[0].rsplit("/", 1)[0], cfg.s3_endpoint).check()
    files = listing(cfg)
    ids = {f: _identity(f, cfg) for _, fl in files for f, _ in fl}
    fp = fingerprint(cfg, files, ids)
    record = out.read_json(RECORD)
    if record and record.get("fingerprint") == fp and outputs_ok(out, record):
        return None, PrepareResult(_out_name(root), record, True)
    if record is None and not out.is_empty() and not out.exists(WORK):
        raise ValueError(f"output_dir {root} exists, is not empty and is not an lmforge prepare "
                         f"output; choose an empty or new folder")
    if record is not None:
        say("inputs or config changed: starting over")
        out.remove(RECORD)
    work = out.sub(f"{WORK}/{fp[:16]}")
    plan = work.read_json("plan.json")
    resumed = bool(plan and plan.get("fingerprint") == fp)
    if not resumed:
        plan = make_plan(cfg, files, ids, fp)
        work.write_json("plan.json", plan)  # (every worker computes the same bytes)
    return Job(cfg, out, work, plan, rank, world, say, resumed), None


def outputs_ok(out: Store, record: dict) -> bool:
    """All shard sets of a finished run are there (local: they open with the recorded sizes)."""
    try:
        dirs = [v["dir"] for v in record["splits"]["train"].values()]
        if record["splits"]["val"]:
            dirs.append(record["splits"]["val"]["dir"])
        for d in dirs:
            if out.local:
                TokenShards(Path(out.url(d)))
            elif not out.exists(f"{d}/{MANIFEST}"):
                return False
        return out.exists(TOKENIZER)
    except (ValueError, KeyError, TypeError):
        return False


def run_stage(cfg: PrepareConfig, stage: str, rank: int = 0, world: int = 1,
              output_dir: str | Path | None = None,
              progress: Callable[[str], None] | None = None) -> PrepareResult | None:
    """Run worker ``rank`` of ``world``'s share of one stage (a Slurm array task, say).
    The one-task stages run on rank 0 only. Returns the result after ``merge``."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    say = progress or (lambda msg: log.info("prepare: %s", msg))
    job, done = open_job(cfg, output_dir, rank, world, say)
    if done is not None:
        say(f"{done.output_dir} is up to date (inputs and config unchanged); nothing to do")
        return done
    if stage in SINGLE and rank != 0:
        say(f"stage {stage} is a single task, run by rank 0; nothing to do on rank {rank}")
        return None
    if stage == "merge":
        return PrepareResult(_out_name(job.out.root), finish(job), False)
    run_tasks(job, stage)
    return None


def _stage_line(job: Job, stage: str) -> str:
    line = progress_lines(job)[STAGES.index(stage)]
    return "overall: " + line


def run_prepare(cfg: PrepareConfig, output_dir: str | Path | None = None,
                progress: Callable[[str], None] | None = None) -> PrepareResult:
    """Run (or resume, or skip if up to date) the whole pipeline on this machine."""
    t_start = time.perf_counter()
    say = progress or (lambda msg: log.info("prepare: %s", msg))
    job, done = open_job(cfg, output_dir, 0, 1, say)
    if done is not None:
        say(f"{done.output_dir} is up to date (inputs and config unchanged); nothing to do")
        return done
    if job.resumed:
        say("resuming an interrupted run")
    workers = (cfg.workers or os.cpu_count() or 1) if cfg.parallelism == "processes" else 1
    root = job.out.root
    pool = None
    if workers > 1:
        pool = mp.get_context("spawn").Pool(workers, initializer=_pool_init)
    try:
        for stage in STAGES[:-1]:
            if pool is None or stage in SINGLE:
                run_tasks(job, stage)
            else:
                for line in pool.starmap(_pool_stage, [(cfg, root, stage, r, workers)
                                                       for r in range(workers)]):
                    if line:
                        say(line)
            say(_stage_line(job, stage))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    record = finish(job, total_s=time.perf_counter() - t_start)
    return PrepareResult(_out_name(root), record, False)


def _pool_init() -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # one Rust thread per worker process
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _pool_stage(cfg: PrepareConfig, root: str, stage: str, rank: int, world: int) -> str:
    lines: list[str] = []
    job, _ = open_job(cfg, root, rank, world, lines.append)
    run_tasks(job, stage)
    return "\n".join(lines)


def run_distributed(cfg: PrepareConfig, output_dir: str | Path | None = None,
                    progress: Callable[[str], None] | None = None) -> PrepareResult:
    """Every stage on this torchrun rank's share, a gloo barrier between stages (rank 0 runs
    the one-task stages). Inputs and outputs must be reachable by every rank (a shared file
    system or an object store)."""
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    say = progress or (lambda msg: log.info("prepare: %s", msg))
    dist.init_process_group("gloo", timeout=timedelta(days=7))  # stages can take hours
    try:
        job, done = open_job(cfg, output_dir, rank, world, say)
        if done is not None:
            if rank == 0:
                say(f"{done.output_dir} is up to date (inputs and config unchanged)")
            return done
        for stage in STAGES[:-1]:
            if stage not in SINGLE or rank == 0:
                run_tasks(job, stage)
            dist.barrier()
            if rank == 0:
                say(_stage_line(job, stage))
        record = finish(job) if rank == 0 else None
        dist.barrier()
        if record is None:
            record = job.out.read_json(RECORD) or {}
        return PrepareResult(_out_name(job.out.root), record, False)
    finally:
        dist.destroy_process_group()


def worker_from_env(slurm_array: bool = True) -> tuple[int, int] | None:
    """(rank, world) from torchrun (RANK, WORLD_SIZE, MASTER_ADDR) or, with ``slurm_array``,
    a Slurm array (SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT), else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if slurm_array and "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        # array indices are the ranks (0..N-1); a re-run of one index passes --world N
        return int(env["SLURM_ARRAY_TASK_ID"]), int(env["SLURM_ARRAY_TASK_COUNT"])
    return None


def status(cfg: PrepareConfig, output_dir: str | Path | None = None) -> list[str]:
    """Progress of a run (finished or not): tasks per stage, MB/s, what each filter removed."""
    job, done = open_job(cfg, output_dir, 0, 1, lambda m: None)
    if done is not None:
        t = done.record.get("timing", {})
        return [f"{done.output_dir}: finished and up to date "
                f"({t.get('total_s', 0):.1f} s, {t.get('mb_per_s', 0):.2f} MB/s)"]
    lines = progress_lines(job)
    walls = stage_walls(job)
    for stage, w in walls.items():
        for r, pw in sorted(w["per_worker"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"  {stage} worker {r}: {pw['tasks']} task(s), {pw['mb']:.2f} MB, "
                         f"{pw['mb_per_s']:.2f} MB/s")
    return lines


__all__ = ["run_prepare", "run_stage", "run_distributed", "status", "worker_from_env",
           "PrepareResult", "MIXTURE_FILE", "tokenize_docs", "STAGES"]
