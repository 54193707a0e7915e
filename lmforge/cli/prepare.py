"""``lmforge prepare --config FILE.toml [--out DIR|URL]``: corpus -> token shards, with a summary.

    lmforge prepare --config C                        # this machine (all stages)
    torchrun --nnodes M --nproc-per-node K -m lmforge prepare --config C   # M x K workers
    lmforge prepare --config C --stage scan [--rank R --world N]          # one stage, one worker
    lmforge prepare --config C --status               # progress of a run, per stage and worker
"""

from __future__ import annotations

import argparse
import logging
import sys

from lmforge.data.prepare_config import describe_prepare_config, load_prepare_config
from lmforge.cli.options import OptionParser, count, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(
        prog="lmforge prepare",
        description="Clean, deduplicate and tokenize corpora (.txt/.jsonl/.parquet) into "
                    "token shards. Resumes an interrupted run; does nothing when inputs and "
                    "config are unchanged.")
    p.add_argument("--config", required=False, help="TOML file with a [prepare] table")
    p.add_argument("--out", default=None,
                   help="output folder or URL, e.g. s3://bucket/data (overrides "
                        "prepare.output_dir)")
    p.add_argument("--workers", type=count, default=None,
                   help="local worker processes (overrides prepare.workers and sets "
                        "prepare.parallelism = processes; 0 = all cores)")
    from lmforge.data.stages import STAGES
    p.add_argument("--stage", choices=STAGES, default=None,
                   help="run only this worker's share of one stage (a Slurm array task); "
                        "rank and worker count from --rank/--world, torchrun's RANK/WORLD_SIZE "
                        "or SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT")
    p.add_argument("--rank", type=count, default=None, help="this worker's rank (with --stage)")
    p.add_argument("--world", type=positive_int, default=None, help="number of workers (with --stage)")
    p.add_argument("--scratch", default=None,
                   help="node-local folder for temporary files (overrides prepare.scratch_dir)")
    p.add_argument("--status", action="store_true",
                   help="print the progress of a run (tasks, MB/s, removals) and exit")
    p.add_argument("--keys", action="store_true", help="list every config key and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return p


def format_summary(record: dict, up_to_date: bool, out: str) -> str:
    """The human-readable table printed at the end of a run."""
    c = record["clean"]
    rows: list[tuple[str, str]] = [
        ("input files", f"{record['files']:,}"),
        ("documents read", f"{c['documents_read']:,}"),
        ("  removed: bad UTF-8", f"{c['bad_utf8']:,}"),
        ("  removed: empty", f"{c['empty']:,}"),
        ("  removed: too short", f"{c['too_short']:,}"),
        ("  removed: too long", f"{c['too_long']:,}"),
        ("  removed: duplicates", f"{c['duplicates']:,}"),
        ("  removed: near-duplicates", f"{c['near_duplicates']:,}"),
        ("documents kept", f"{c['kept']:,}"),
        ("control characters removed", f"{c['control_chars_removed']:,}"),
        ("tokenizer", f"vocab {record['tokenizer']['vocab_size']:,}, "
                      f"sha256 {record['tokenizer']['sha256'][:12]}, {record['dtype']}"),
    ]
    for name, v in record["splits"]["train"].items():
        rows.append((f"train/{name}", f"{v['tokens']:,} tokens, {v['documents']:,} docs, "
                                      f"{v['shards']} shards, weight {v['weight']:.3f}"))
    val = record["splits"]["val"]
    if val:
        rows.append(("val", f"{val['tokens']:,} tokens, {val['documents']:,} docs, "
                            f"{val['shards']} shards"))
    t = record["timing"]
    rows.append(("tokenize throughput", f"{t['tokenize_mb_per_s']:.2f} MB/s "
                                        f"({t['tokenize_s']:.1f} s)"))
    if "mb_per_s" in t:
        workers = max((v.get("workers", 1) for v in t.get("stages", {}).values()), default=1)
        rows.append(("overall throughput", f"{t['mb_per_s']:.2f} MB/s of input text, "
                                           f"{workers} worker(s)"))
    rows.append(("total time", f"{t['total_s']:.1f} s" + (" (earlier run; up to date now)"
                                                          if up_to_date else "")))
    width = max(len(k) for k, _ in rows)
    lines = [f"lmforge prepare -> {out}"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def prepare_main(argv: list[str]) -> int:
    """Entry point of ``lmforge prepare``; returns the process exit code (2 on bad input)."""
    args = build_parser().parse_args(argv)
    if args.keys:
        for key, default, doc in describe_prepare_config():
            print(f"{key} = {default}\n    {doc}")
        return 0
    if not args.config:
        print("lmforge prepare: error: --config FILE.toml is required", file=sys.stderr)
        return 2
    from lmforge.data import pipeline

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[prepare] {msg}", file=sys.stderr, flush=True)

    try:
        cfg = load_prepare_config(args.config)
        if args.workers is not None:
            cfg.workers = args.workers
            cfg.parallelism = "processes" if args.workers != 1 else cfg.parallelism
        if args.scratch is not None:
            cfg.scratch_dir = args.scratch
        cfg.validate()
        if args.status:
            print("\n".join(pipeline.status(cfg, args.out)))
            return 0
        # all stages: torchrun ranks only (a plain run inside a Slurm array job stays local)
        env = pipeline.worker_from_env(slurm_array=args.stage is not None)
        if args.stage is not None:
            rank, world = env or (0, 1)
            rank = args.rank if args.rank is not None else rank
            world = args.world if args.world is not None else world
            result = pipeline.run_stage(cfg, args.stage, rank, world, args.out, say)
            if result is None:
                return 0
        elif args.rank is not None or args.world is not None:
            print("lmforge prepare: error: --rank/--world need --stage (one stage per job); "
                  "for all stages on many workers use torchrun", file=sys.stderr)
            return 2
        elif env is not None and env[1] > 1:
            result = pipeline.run_distributed(cfg, args.out, say)
            if env[0] != 0:
                return 0
        else:
            result = pipeline.run_prepare(cfg, output_dir=args.out, progress=say)
    except ValueError as e:
        print(f"lmforge prepare: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(result.record, result.up_to_date, str(result.output_dir)))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(prepare_main(sys.argv[1:]))
