"""A WSD run on the CPU: merged stable-phase checkpoints and the EMA of the weights against the last
stable checkpoint and the decayed final weights (issue 47).

    python benchmarks/wsd_merge_ema.py --out /tmp/wsd [--steps 400] [--every 20] [--merge 4] [--ema-decay 0.98] \
        [--precision fp32] [--threads 1]

1. `lmforge train` (the tiny preset on the default corpus) with a warmup-stable-decay schedule
   (schedule.decay_fraction 0.2: the stable phase ends at step S = 0.8 x steps), a checkpoint every
   `--every` steps (all kept), the EMA of the weights (train.ema_decay, from step `--ema-start`) and
   the shipped shakespeare-cloze task scored in the loop. A finished run in --out is reused.
2. Run folders of the candidates, through `lmforge merge`: the last stable checkpoint (step S, one
   checkpoint "merged" with weight 1: its weights), the last `--merge` stable checkpoints averaged
   with equal weights, and the EMA as it was at step S (`--ema`, from the step-S checkpoint); the
   run folder itself holds the decayed final weights and the final EMA (model.ema.safetensors).
3. `lmforge eval` of each on the run's validation shards (disjoint windows of data.seq_len = 128
   tokens, the training context) and on shakespeare-cloze (400 items, 4-way, chance 0.25).

Prints a markdown table (the rows of benchmarks/RESULTS.md) and writes it to --out/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def lmforge(*args: str, log: Path | None = None) -> str:
    """Run `python -m lmforge ARGS`, return its stdout (also written to `log`); stop with its output on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # (eval's threads too)
    proc = subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, env=env)
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"lmforge {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="working folder (the run, the candidates, the table)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=20, help="checkpoint every this many steps")
    p.add_argument("--merge", type=int, default=4, help="stable-phase checkpoints to average (the last ones)")
    p.add_argument("--ema-decay", type=float, default=0.98)
    p.add_argument("--ema-start", type=int, default=100)
    p.add_argument("--threads", type=int, default=1, help="train.threads (0: torch's default, one per core)")
    p.add_argument("--precision", default="fp32", help="train.precision (fp32: the same numbers on every CPU)")
    args = p.parse_args()
    out = Path(args.out)
    run = out / "run"
    stable_end = args.steps - round(0.2 * args.steps)
    if stable_end % args.every:
        sys.exit(f"the stable phase ends at step {stable_end}: choose --every dividing it")
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    lmforge("train", "--schedule.name", "wsd", "--schedule.decay_fraction", "0.2", "--train.steps", str(args.steps),
            "--checkpoint.every_steps", str(args.every), "--checkpoint.keep_every", str(args.every),
            "--checkpoint.every_minutes", "0", "--train.ema_decay", str(args.ema_decay),
            "--train.ema_start_step", str(args.ema_start), "--train.eval_tasks", "shakespeare-cloze",
            "--train.eval_tasks_every", "100", "--train.eval_sequences", "128", "--train.threads", str(args.threads),
            "--train.precision", args.precision, "--train.progress", "lines", "--train.out_dir", str(run),
            log=out / "train.log")
    train_s = time.time() - t0
    merged = [stable_end - i * args.every for i in reversed(range(args.merge))]
    candidates = {  # name -> (run folder, `lmforge eval` flags)
        f"last stable checkpoint (step {stable_end})": (out / "stable", []),
        f"merged stable checkpoints {merged} (equal weights)": (out / "merged", []),
        f"EMA at step {stable_end} (decay {args.ema_decay:g})": (out / "ema-stable", []),
        f"decayed final weights (step {args.steps})": (run, []),
        f"EMA at the end (step {args.steps})": (run, ["--ema"]),
    }
    lmforge("merge", str(run), "--steps", str(stable_end), "--out", str(out / "stable"), "--force")
    lmforge("merge", str(run), "--steps", ",".join(map(str, merged)), "--out", str(out / "merged"), "--force")
    lmforge("merge", str(run), "--steps", str(stable_end), "--ema", "--out", str(out / "ema-stable"), "--force")
    rows = ["| weights | val loss (nats/token) | perplexity | shakespeare-cloze acc | acc_norm |", "|---|---|---|---|---|"]
    for name, (folder, flags) in candidates.items():
        result = out / f"eval-{folder.name}{'-ema' if flags else ''}.json"
        lmforge("eval", "--run", str(folder), *flags, "--window", "128", "--stride", "128", "--samples", "0",
                "--mc", "shakespeare-cloze", "--json", str(result))
        r = json.loads(result.read_text())
        ppl, mc = r["perplexity"], r["multiple_choice"]["shakespeare-cloze"]
        rows.append(f"| {name} | {ppl['loss']:.4f} | {ppl['perplexity']:.1f} | {mc['acc']:.3f} | {mc['acc_norm']:.3f} |")
    summary = json.loads((run / "summary.json").read_text())
    tasks = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_tasks_s" in line]
    steps = [json.loads(line)["window_step_time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "window_step_time_s" in line]
    note = (f"\n{args.steps} steps x {summary['tokens'] // args.steps:,} tokens, training {summary['seconds'] / 60:.1f} "
            f"min ({summary['tokens_per_second']:,.0f} tokens/s, {sum(steps) / len(steps):.2f} s a step; this "
            f"command {train_s / 60:.1f} min), {os.cpu_count()} CPUs; in-loop task evaluations (200 items, 800 "
            f"continuations): {', '.join('%.1f' % r['eval_tasks_s'] for r in tasks)} s; validation: "
            f"{ppl['tokens']:,} tokens in windows of 128; chance on the task 0.250 (400 items).")
    table = "\n".join(rows) + "\n" + note
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
