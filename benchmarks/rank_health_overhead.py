"""What naming slow and stuck ranks costs a training step (issue 49): the straggler report's phase
clock and the hang watchdog's per-step calls, and the report's per-log-window exchange on gloo,
against the tiny preset's own step time.

    python benchmarks/rank_health_overhead.py --steps 30 --reps 2000

1. per step: the calls the loop makes each step (watchdog step_begin / step_end, the phase clock's
   data add and its compute / optimizer / sync contexts), `--reps` times, mean microseconds;
2. per log window: `StragglerMonitor.window` (one all-gather of five floats per rank on the gloo
   host group) on 2 processes, mean milliseconds over `--reps` / 10 windows;
3. the tiny preset's step: `lmforge train` for `--steps` steps on this machine, the median of its
   window step times (metrics.jsonl), 1 thread.
Prints one JSON object with the per-step overhead as a fraction of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lmforge.train.stragglers import PhaseClock, StragglerMonitor  # noqa: E402
from lmforge.train.watchdog import HangWatchdog  # noqa: E402


def per_step_us(reps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        clock = PhaseClock(torch.device("cpu"))
        dog = HangWatchdog(Path(d), 0, factor=10, min_s=120, action="wait").start()
        t0 = time.perf_counter()
        for step in range(reps):
            dog.step_begin(step)
            clock.add("data", 1e-6)
            with clock("compute"):
                pass
            with clock("optimizer"):
                pass
            with clock("sync"):
                pass
            dog.step_end()
        dt = time.perf_counter() - t0
        dog.stop()
    return 1e6 * dt / reps


def window_worker(windows: int) -> None:
    """(one of 2 gloo ranks, under torchrun) the per-window exchange, timed."""
    torch.distributed.init_process_group("gloo")
    m = StragglerMonitor(1.2, 3, None, True)
    clock = PhaseClock(torch.device("cpu"))
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(windows):
        m.window(clock.take())
    dt = time.perf_counter() - t0
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"window_ms": 1e3 * dt / windows}))
    torch.distributed.destroy_process_group()


def per_window_ms(windows: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), __file__, "--worker", str(windows)], capture_output=True, text=True, env=env,
                          timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["window_ms"]


def tiny_step_ms(steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "lmforge", "train", "--train.out_dir", d, "--train.steps", str(steps),
                        "--train.log_every", "5", "--train.eval_every", "0", "--train.sample_tokens", "0",
                        "--train.plot", "false", "--train.tensorboard", "false", "--train.progress", "none",
                        "--train.threads", "1", "--checkpoint.save_final", "false",
                        "--schedule.warmup_steps", "2"], env=env, check=True, capture_output=True, timeout=1200)
        recs = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in recs if "window_tokens_per_s" in r and "tokens" in r]
        tok = [r["window_tokens_per_s"] for r in train][5:]  # (past warm-up)
        tokens = train[-1]["tokens"] / train[-1]["step"]
    return 1e3 * statistics.median(tokens / t for t in tok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        window_worker(args.worker)
        return
    step_us = per_step_us(args.reps)
    window_ms = per_window_ms(max(args.reps // 10, 10))
    tiny_ms = tiny_step_ms(args.steps)
    print(json.dumps({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "load_average": os.getloadavg(), "per_step_us": round(step_us, 2),
                      "per_window_ms": round(window_ms, 3), "tiny_step_ms": round(tiny_ms, 1),
                      "per_step_fraction": step_us / 1e3 / tiny_ms,
                      "per_window_fraction_at_log_every_10": window_ms / (10 * tiny_ms)}, indent=1))


if __name__ == "__main__":
    main()
