"""``lmforge prepare --config FILE.toml [--out DIR]``: corpus -> token shards, with a summary."""

from __future__ import annotations

import argparse
import logging
import sys

from lmforge.data.prepare_config import describe_prepare_config, load_prepare_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmforge prepare",
        description="Clean, deduplicate and tokenize corpora (.txt/.jsonl/.parquet) into "
                    "token shards. Resumes an interrupted run; does nothing when inputs and "
                    "config are unchanged.")
    p.add_argument("--config", required=False, help="TOML file with a [prepare] table")
    p.add_argument("--out", default=None, help="output folder (overrides prepare.output_dir)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizer processes (overrides prepare.workers; 0 = all cores)")
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
    rows.append(("total time", f"{t['total_s']:.1f} s" + (" (earlier run; up to date now)"
                                                          if up_to_date else "")))
    width = max(len(k) for k, _ in rows)
    lines = [f"lmforge prepare -> {out}"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def prepare_main(argv: list[str]) -> int:
    """Entry point of ``lmforge prepare``; returns the process exit code (2 on bad input)."""
    args = _parser().parse_args(argv)
    if args.keys:
        for key, default, doc in describe_prepare_config():
            print(f"{key} = {default}\n    {doc}")
        return 0
    if not args.config:
        print("lmforge prepare: error: --config FILE.toml is required", file=sys.stderr)
        return 2
    from lmforge.data.pipeline import run_prepare

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[prepare] {msg}", file=sys.stderr, flush=True)

    try:
        cfg = load_prepare_config(args.config)
        if args.workers is not None:
            cfg.workers = args.workers
            cfg.validate()
        result = run_prepare(cfg, output_dir=args.out, progress=say)
    except ValueError as e:
        print(f"lmforge prepare: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(result.record, result.up_to_date, str(result.output_dir)))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(prepare_main(sys.argv[1:]))
