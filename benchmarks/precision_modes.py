"""Step time of lmforge's `Trainer` in each precision mode, side by side in one process.

    python benchmarks/precision_modes.py [--preset tiny] [--modes fp32,bf16,bf16-pure] [--set key=value ...]
                                         [--threads N] [--reps 8] [--block 2] [--json out.json]

One `Trainer` per mode (train.precision), each set up on the same synthetic token shards
(benchmarks/train_throughput.py's `synthetic_data`) and the same config otherwise; per repetition
every mode runs `--block` real training steps (`next_micro_batches` + `train_step`: forward,
backward, clip, guard, optimizer), in rotating order, after `--warmup` steps each. Reported per
mode: median and best wall time per step, median CPU time per step (`time.process_time`: less
sensitive to other jobs on a shared machine) and tokens/s at the median; and each mode's median
paired ratio against the first mode (that mode's step time / this mode's, same repetition). This
is what `train.precision = auto`'s CPU rule is measured by (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lmforge.config import load_config  # noqa: E402
from train_throughput import BENCH_OVERRIDES, parse_sets, synthetic_data  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    from lmforge.train.trainer import Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    base = {**parse_sets(args.set), **BENCH_OVERRIDES}
    tmp = Path(tempfile.mkdtemp(prefix="lmf-precision-bench-"))
    cfg0 = load_config(args.preset, {**base, "train.precision": "fp32"})
    data = synthetic_data(tmp / "data", cfg0.model.vocab_size, cfg0.tokens_per_step, seed=cfg0.train.seed)
    trainers = {}
    for mode in modes:
        trainer = Trainer(load_config(args.preset, {**base, "train.precision": mode}), out_dir=tmp / mode, data=data)
        trainer.setup()
        trainers[mode] = trainer
    tokens = cfg0.tokens_per_step
    print(f"precision modes: preset {cfg0.preset}, {trainers[modes[0]].n_params:,} params, {tokens:,} tokens/step "
          f"({cfg0.train.micro_batch_size} x {cfg0.data.seq_len} x {cfg0.grad_accum_steps}), "
          f"{torch.get_num_threads()} threads", flush=True)

    def step(mode: str) -> None:
        t = trainers[mode]
        t.train_step(t.next_micro_batches())

    for mode in modes:
        for _ in range(args.warmup):
            step(mode)
    wall = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    for rep in range(args.reps):
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]
        for mode in order:
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.block):
                step(mode)
            wall[mode].append((time.perf_counter() - w0) / args.block)
            cpu[mode].append((time.process_time() - c0) / args.block)
        print(f"[rep {rep + 1}/{args.reps}] " + ", ".join(f"{m} {wall[m][-1] * 1e3:.0f} ms" for m in modes), flush=True)
    first = modes[0]
    out = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                       "torch": torch.__version__, "load_avg": os.getloadavg()},
           "tokens_per_step": tokens, "modes": {}}
    for mode in modes:
        med = statistics.median(wall[mode])
        out["modes"][mode] = {
            "median_ms": med * 1e3, "best_ms": min(wall[mode]) * 1e3, "cpu_ms": statistics.median(cpu[mode]) * 1e3,
            "tokens_per_s": tokens / med,
            f"speedup_vs_{first}": statistics.median(a / b for a, b in zip(wall[first], wall[mode]))}
        r = out["modes"][mode]
        print(f"{mode:>10}: median {r['median_ms']:.0f} ms (best {r['best_ms']:.0f}), cpu {r['cpu_ms']:.0f} ms, "
              f"{r['tokens_per_s']:,.0f} tokens/s, {r[f'speedup_vs_{first}']:.2f}x {first}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--modes", default="fp32,bf16,bf16-pure", help="train.precision values, comma-separated")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
