"""Checkpoint save cost: time the training loop blocks vs. total time to a validated checkpoint, and size.

    python benchmarks/checkpoint_save.py --preset tiny gpt2-124m --reps 3

For each preset: the model + AdamW state after one optimizer step (so the optimizer state exists),
saved through the same path the trainer uses (`lmforge.ckpt.checkpointer.save_states` of the model +
optimizer and RNG states -> CheckpointManager): async (a staging copy into host buffers, then a background
write) and sync. With `--device cuda` (the default where CUDA exists) the model lives on the GPU and
there are two async arms: `async` (DCP staging into pinned host buffers allocated at the first save and
reused: `lmforge.ckpt.manager.device_stager`) and `async-per-save` (DCP's own staging into fresh pageable
memory at every save: the behaviour before). Reported per save:
  blocking_s  time the caller was blocked (building the state dicts, then, async, staging them into host
              memory)
  total_s     until the checkpoint is written, fsynced, checksummed, renamed and validated
              (re-hash + test load of every tensor)
  size        bytes on disk

Every save must succeed: after each one the manager must report no failure, its last save must be
this step, and the step's folder must hold a validated checkpoint of that step (the manager validates
each save: re-hash + test load). Otherwise the script lists what failed and exits 1: a failed save
never reads as a fast one (the "blocking" of a save that failed at staging is near zero).
`--staging dcp` sends host tensors through DCP's staging with the run's stager too (the path CUDA
tensors take), so it can be checked on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmforge.ckpt.checkpointer import save_states
from lmforge.ckpt.manager import CheckpointFailure, CheckpointManager, read_meta, step_name
from lmforge.ckpt.state import ModelOptimizerState, RNGState
from lmforge.config import OptimConfig, load_config
from lmforge.model.transformer import build_model
from lmforge.optim.optimizers import build_optimizer


def modes(device: str) -> list[str]:
    return ["async", "async-per-save", "sync"] if device == "cuda" else ["async", "sync"]


def check_save(mgr: CheckpointManager, step: int, failures_before: int) -> list[str]:
    """What is wrong with save `step` once it is finished ([] when it was written and validated)."""
    if mgr.failures != failures_before:
        return [f"save {step} FAILED: {mgr.last_error}"]
    if mgr.last_save.get("step") != step:
        return [f"save {step}: the manager's last good save is step {mgr.last_save.get('step')}"]
    folder = mgr.root / step_name(step)
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as e:
        return [f"save {step}: no readable checkpoint in {folder} ({e})"]
    return [] if meta.get("step") == step else [f"save {step}: {folder} holds step {meta.get('step')}"]


def one_preset(preset: str, reps: int, root: Path, device: str = "cpu", modes_: list[str] | None = None,
               staging: str = "auto") -> tuple[list[dict], list[str]]:
    """The saves' rows, and what went wrong (empty when every save was written and validated)."""
    cfg = load_config(preset)
    model = build_model(cfg.model, device, seed=0)
    opt = build_optimizer(OptimConfig(name="adamw", lr=1e-4, weight_decay=0.1), model)
    for p in model.parameters():  # one step on random gradients: the optimizer state exists
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows, problems = [], []
    for mode in modes_ or modes(device):
        # one manager per mode, saving again and again like a run does (keep_last = 1): the first
        # async save allocates the host staging buffers, later ones reuse them
        folder = root / f"{preset}-{mode}"
        mgr = CheckpointManager(folder, async_save=mode != "sync", validate=True, keep_last=1,
                                staging="dcp-per-save" if mode == "async-per-save" else staging)
        states = {"model": ModelOptimizerState(model, opt), "rng": RNGState(0)}
        for rep in range(reps):
            failures = mgr.failures
            t0 = time.perf_counter()
            try:
                save_states(mgr, rep + 1, states, {"optimizer": "adamw"})
            except CheckpointFailure as e:  # (checkpoint.max_failed_saves in a row: the manager stops)
                problems.append(f"{preset} {mode}: save {rep + 1} refused: {e}")
                break
            blocking = time.perf_counter() - t0
            mgr.wait()
            total = time.perf_counter() - t0
            wrong = [f"{preset} {mode}: {p}" for p in check_save(mgr, rep + 1, failures)]
            problems += wrong
            rows.append({"preset": preset, "mode": mode, "rep": rep, "device": device, "staging": mgr.staging,
                         "params": sum(p.numel() for p in model.parameters()), "ok": not wrong,
                         "blocking_s": blocking, "total_s": total, "bytes": mgr.last_save.get("bytes", 0),
                         "write_s": mgr.last_save.get("write_s", 0.0)})
        mgr.close()
        shutil.rmtree(folder, ignore_errors=True)
    return rows, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", nargs="+", default=["tiny", "gpt2-124m"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="", help="where to write (default: a temp folder on the local disk)")
    ap.add_argument("--json", default="")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model and optimizer state live (default: cuda where it exists)")
    ap.add_argument("--modes", default="", help="comma-separated, of async, async-per-save (cuda), sync "
                                                 "(default: all of the device's)")
    ap.add_argument("--staging", choices=["auto", "dcp"], default="auto",
                    help="async saves of host tensors: auto = the manager's host copy; dcp = DCP's staging with "
                         "the run's stager, as for CUDA tensors")
    args = ap.parse_args(argv)
    chosen = [m for m in args.modes.split(",") if m] or modes(args.device)
    unknown = sorted(set(chosen) - set(modes(args.device)))
    if unknown:
        ap.error(f"--modes {args.modes}: no {', '.join(unknown)} on {args.device}; choose from "
                 f"{', '.join(modes(args.device))}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="lmforge-ckpt-bench-"))
    rows, problems = [], []
    for preset in args.preset:
        got, wrong = one_preset(preset, args.reps, root, args.device, chosen, args.staging)
        rows += got
        problems += wrong
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, commit {commit}, "
          f"load average {os.getloadavg()[0]:.1f}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    print(f"{'preset':<12} {'mode':<14} {'params':>12} {'size MB':>9} {'blocking s':>11} {'total s':>8} "
          f"(median of saves 2..{args.reps}; first save in the JSON)")
    for preset in args.preset:
        for mode in chosen:
            sel = [r for r in rows if r["preset"] == preset and r["mode"] == mode and (r["rep"] > 0 or args.reps == 1)]
            med = lambda k: statistics.median(r[k] for r in sel)  # noqa: E731
            print(f"{preset:<12} {mode:<14} {sel[0]['params']:>12,} {sel[0]['bytes'] / 1e6:>9.1f} "
                  f"{med('blocking_s'):>11.3f} {med('total_s'):>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    if problems:
        print(f"{len(problems)} of {len(rows)} saves FAILED or were not validated:", *problems, sep="\n  ",
              file=sys.stderr)
        return 1
    print(f"all {len(rows)} saves written and validated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
