"""DiLoCo against per-step gradient averaging at the same tokens (issue 58): two torchft replica groups of
one process each, on the default corpus, with a real lighthouse, in three modes (the gradients averaged
every step, as DDP over the groups; DiLoCo syncing every H steps; streaming DiLoCo, one of F fragments
every H / F steps); each group's final validation loss, and each rank's cross-group traffic per step as
`lmforge plan` counts it (lmforge.plan.cross_group).

    python benchmarks/diloco_vs_ddp.py [--steps 60] [--sync-every 10] [--fragments 2] [--out DIR]

Prints a markdown table (benchmarks/RESULTS.md keeps one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(out: Path, steps: int, extra: list[str]) -> tuple[list[float], float]:
    """Two groups to the end; their final validation losses and the wall clock."""
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    port = free_port()
    lighthouse = subprocess.Popen([binary, "--min_replicas", "2", "--bind", f"[::]:{port}", "--join_timeout_ms", "1000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    common = ["--train.steps", str(steps), "--train.progress", "lines", "--train.plot", "false",
              "--train.eval_every", "0", "--guard.enabled", "false", "--fault_tolerance.enabled", "true",
              "--fault_tolerance.replica_groups", "2", "--fault_tolerance.min_replicas", "2",
              "--fault_tolerance.lighthouse", f"http://localhost:{port}", *extra]
    t0 = time.time()
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "lmforge", "train", *common, "--fault_tolerance.replica_id",
                                   str(g), "--train.out_dir", str(out / f"group{g}")],
                                  stdout=open(out / f"group{g}.log", "w"), stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}) for g in range(2)]
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    if any(codes):
        raise SystemExit(f"a group failed ({codes}): see {out}")
    losses = [json.loads((out / f"group{g}" / "summary.json").read_text())["val_loss"] for g in range(2)]
    return losses, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from lmforge.config import load_config
    from lmforge.plan.cross_group import cross_group_traffic
    from lmforge.plan.params import total_params

    root = args.out or Path(tempfile.mkdtemp(prefix="diloco-vs-ddp-"))
    params = total_params(load_config("tiny").model)
    modes = {"gradients averaged every step (DDP over the groups)": ([], 0, 1),
             f"DiLoCo, H = {args.sync_every}": (["--fault_tolerance.diloco_sync_every", str(args.sync_every)],
                                                args.sync_every, 1),
             f"streaming DiLoCo, H = {args.sync_every}, F = {args.fragments}":
                 (["--fault_tolerance.diloco_sync_every", str(args.sync_every), "--fault_tolerance.diloco_fragments",
                   str(args.fragments)], args.sync_every, args.fragments)}
    print(f"tiny ({params:,} parameters), 2 groups x {args.steps} steps of 4,096 tokens each; fp32 master weights")
    print("| mode | val loss, group 0 / 1 | cross-group MB per rank per step (per sync) | wall clock |")
    print("|---|---|---|---|")
    for i, (name, (extra, h, f)) in enumerate(modes.items()):
        out = root / f"mode{i}"
        out.mkdir(parents=True, exist_ok=True)
        losses, wall = run_mode(out, args.steps, extra)
        t = cross_group_traffic(params, 4, 2, h, f)
        print(f"| {name} | {losses[0]:.4f} / {losses[1]:.4f} | {t.per_step_bytes / 1e6:,.2f} "
              f"({t.burst_bytes / 1e6:,.2f} every {t.sync_every}) | {wall:.0f} s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
