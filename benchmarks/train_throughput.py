"""Training throughput: lmforge's real `Trainer` against a plain PyTorch loop, side by side.

    python benchmarks/train_throughput.py --preset tiny [--set key=value ...] [--json out.json]
    python benchmarks/train_throughput.py --quick            # CPU smoke run (1 thread), < 60 s on the tiny preset
    torchrun --nproc-per-node 8 benchmarks/train_throughput.py --preset gpt2-124m --set parallel.dp_replicate=8

What is timed (per optimizer step, same process, arms interleaved):

* lmforge: `Trainer.setup()` once, then per step `trainer.next_micro_batches()` (the real loader:
  memmap gather + host->device copy) and `trainer.train_step(batches)` (forward/backward per
  micro-batch with the step-normalised loss, unscale, global-norm clip, spike guard, optimizer
  step, zero_grad, LR schedule). Nothing is copied from the trainer: it is the class `lmforge
  train` runs.
* reference: the minimal loop every peer starts from, given the same torch options as lmforge:
  the same model class built the same way (`build_model(cfg.model, device, seed)`, plus the same
  activation checkpointing and per-block torch.compile when the config asks for them), the same
  micro-batch shapes and accumulation, torch AdamW with the same kernel as lmforge's optimizer
  (fused when lmforge's is fused, foreach when it is foreach: one flag any loop can set; same
  lr/betas/eps/weight decay, decay on >= 2-D tensors), the same precision (autocast dtype;
  GradScaler for fp16) and per micro-batch: forward -> logits -> cross-entropy (mean) /
  accumulation -> backward; then clip_grad_norm_ -> step -> zero_grad. Its batches are made once,
  up front, on the device: the reference pays nothing for data, lmforge pays its loader. So a
  ratio above 1 is what lmforge itself adds (train.loss_chunk: the cross-entropy fused with the
  output projection, chunk by chunk), not torch flags.
* optionally (`--guard-arm`) lmforge again with the spike guard switched off for the block
  (`trainer.guard = None`): the guard's cost is its host sync per step (a no-op on CPU; on CUDA
  it waits for the step's kernels) plus a few microseconds of Python.

Each repetition runs `--block` steps of each arm, in alternating order (A B, then B A, ...);
the machine is shared, so we report median and best step times, the median of the *paired*
ratios (reference step time / lmforge step time of the same repetition = lmforge tokens/s over
the reference's), and CPU-seconds per step (`time.process_time`, less sensitive to other jobs).
The load average is recorded.

MFU = tokens/s x flops_per_token / peak, flops_per_token = the trainer's own count
(`lmforge.model.accounting.flops_per_token`: 6N + 12*L*d*s when every weight trains, N = matmul
weights incl. the output projection, L layers, d model width, s sequence length; fewer where
weights are frozen). Peak: the one the run uses, as the trainer picks it
(`lmforge.train.profiler.device_peak`): on CUDA the catalogue's dense peak for the run's
precision; on CPU no spec sheet applies, so the best n^3 matmul rate is measured in fp32 (and in
the run's 16-bit dtype when it runs one, the faster kept), before and after the timed steps, the
better of the two kept. No MFU is given against a peak the run did not use.

Peak memory: CUDA `max_memory_allocated` over each arm's steps (both models are resident, so
each arm's figure includes the other's weights and optimizer state; `resident_gb` says how much
that is); CPU: the process's peak RSS.

Data: synthetic uniform random tokens in `model.vocab_size` written as real token shards (the
loader path is the production one); throughput does not depend on the token values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from lmforge.config import Config, load_config, parse_override_value  # noqa: E402
from lmforge.config.rules import compute_precision, resolve_loss_chunk  # noqa: E402
from lmforge.parallel.parallelize import compile_choice, compile_mode  # noqa: E402
from lmforge.data.prepare import PreparedData  # noqa: E402
from lmforge.data.shards import write_token_shards  # noqa: E402
from lmforge.data.tokenizer import train_bpe  # noqa: E402

QUICK_OVERRIDES = {  # --quick: tiny preset, fp32, a few steps
    "train.precision": "fp32",
}
BENCH_OVERRIDES = {  # never part of what is measured: no files, no evaluation, no resume
    "train.tensorboard": False, "train.wandb": False, "train.plot": False, "train.progress": "none",
    "train.steps": 1_000_000, "train.eval_every": 0, "train.sample_tokens": 0, "train.profile_steps": "",
    "checkpoint.resume": "none", "checkpoint.every_steps": 0, "checkpoint.every_minutes": 0.0,
}


# ----------------------------------------------------------------------------------------------
# setup
# ----------------------------------------------------------------------------------------------


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: use key=value, e.g. --set train.micro_batch_size=8")
        key, value = item.split("=", 1)
        out[key.strip()] = parse_override_value(value.strip())
    return out


def synthetic_tokens(vocab_size: int, tokens_per_step: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The benchmark's uniform random tokens, train and val: the same for a given vocabulary, step and
    seed (the GPU suite's peer rows train on these too, benchmarks/gpu/peers.py)."""
    rng = np.random.default_rng(seed)
    n_tokens = max(1 << 20, 4 * tokens_per_step + 1)
    return {split: rng.integers(0, vocab_size, n, dtype=np.int64)
            for split, n in (("train", n_tokens), ("val", max(n_tokens // 50, 4096)))}


def synthetic_data(root: Path, vocab_size: int, tokens_per_step: int, seed: int = 0) -> PreparedData:
    """synthetic_tokens as token shards (train + val) and a small byte-level BPE (eos id for the loader)."""
    tok = train_bpe(["lmforge benchmark text " * 20], vocab_size=min(vocab_size, 300))
    tok.save(root / "tokenizer.json")
    for split, tokens in synthetic_tokens(vocab_size, tokens_per_step, seed).items():
        write_token_shards([tokens], root / split, 1 << 24, vocab_size, {"split": split, "synthetic": True})
    return PreparedData(train_dir=root / "train", val_dir=root / "val", tokenizer_path=root / "tokenizer.json",
                        tokenizer=tok)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Reference:
    """The plain loop: forward + cross-entropy + backward + clip + step, nothing else."""

    def __init__(self, cfg: Config, device: torch.device, precision: str, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 fast_path: str):
        from lmforge.model.transformer import build_model
        from lmforge.parallel.activation_ckpt import apply_activation_checkpointing

        t, o = cfg.train, cfg.optim
        self.model = build_model(cfg.model, device, seed=t.seed)
        apply_activation_checkpointing(self.model.blocks, t.activation_checkpoint, t.ac_every)
        compiled = compile_choice(cfg, device)[0]  # (as lmforge's arm: train.compile resolved)
        mode = compile_mode(cfg)
        if compiled == "blocks":
            for block in self.model.blocks.values():
                block.compile(mode=mode)
        params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        extra = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(fast_path, {})  # lmforge's kernel
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **extra)
        # bf16-pure: the reference is the plain loop under bf16 autocast (what bf16-pure gains over it)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute_precision(precision))
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.clip = o.grad_clip if o.grad_clip > 0 else math.inf
        self.batches = batches
        self.loss = self.forward_loss
        if compiled == "model":  # the whole forward and its cross-entropy as one graph, as lmforge's arm
            self.loss = torch.compile(self.forward_loss, mode=mode, fullgraph=True, dynamic=False)

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=self.dtype) if self.dtype else contextlib.nullcontext():
            logits = self.model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)

    def step(self) -> torch.Tensor:
        accum = len(self.batches)
        for x, y in self.batches:
            loss = self.loss(x, y) / accum
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return loss


def measure_peaks(device: torch.device, precision: str) -> dict:
    """The MFU denominator the run uses: the catalogue peak on GPUs; on CPU the measured fp32
    matmul rate, or the run's 16-bit one where that is faster (as `device_peak` picks it)."""
    from lmforge.train import profiler

    if device.type == "cuda":
        peak = profiler.device_peak(device, precision)
        return {"run": peak.flops, "run_label": precision, "source": peak.source, "device_name": peak.device_name}
    out = {"device_name": profiler.cpu_name(), "source": f"measured best n^3 matmul on {torch.get_num_threads()} threads"}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    precision = compute_precision(precision)
    for name in dict.fromkeys(("fp32", precision)):
        profiler._MEASURED.pop((str(device), dtypes[name], torch.get_num_threads()), None)  # re-measure each call
        out[name] = profiler.measure_matmul_flops(device, dtypes[name], n=1024, reps=5, budget_s=1.0)
    out["run_label"] = max(dict.fromkeys(("fp32", precision)), key=lambda k: out[k])
    out["run"] = out[out["run_label"]]
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def apply_threads(args: argparse.Namespace) -> None:
    """--threads / --interop-threads (torch.set_num_interop_threads: before any inter-op work starts)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.interop_threads:
        torch.set_num_interop_threads(args.interop_threads)


def run(args: argparse.Namespace) -> dict:
    apply_threads(args)
    overrides = {**(QUICK_OVERRIDES if args.quick else {}), **parse_sets(args.set), **BENCH_OVERRIDES}
    if args.threads:
        overrides["train.threads"] = args.threads
    cfg = load_config(args.preset, overrides)

    from lmforge.train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="lmf-train-bench-"))
    t, m = cfg.train, cfg.model
    tokens_per_step = cfg.tokens_per_step // cfg.parallel.dp  # this rank's share
    data = synthetic_data(tmp / "data", m.vocab_size, tokens_per_step, seed=t.seed)
    trainer = Trainer(cfg, out_dir=tmp / "run", data=data)
    trainer.setup()
    device, precision = trainer.device, trainer.precision.name
    distributed = trainer.dist.distributed
    rank0 = not distributed or trainer.dist.rank == 0
    say = print if rank0 else (lambda *a, **k: None)
    say(f"lmforge train throughput: preset {cfg.preset}, {trainer.n_params:,} params, {device}, {precision}, "
        f"{torch.get_num_threads()} threads, layout {trainer.layout.name}; {tokens_per_step:,} tokens/step/rank "
        f"({t.micro_batch_size} x {cfg.data.seq_len} x {cfg.grad_accum_steps} micro-batches)", flush=True)

    arms = {"lmforge": None}
    reference = None
    if not args.no_reference and not distributed:
        batches = [tuple(tt.to(device) for tt in trainer.loader.next_batch()) for _ in range(cfg.grad_accum_steps)]
        reference = Reference(cfg, device, precision, batches, _fast_path(trainer.optimizer))
        arms["reference"] = None
    guard = trainer.guard
    if args.guard_arm and guard is not None:
        arms["lmforge_no_guard"] = None

    data_s: list[float] = []

    def lmforge_step() -> None:
        d0 = time.perf_counter()
        batches = trainer.next_micro_batches()
        data_s.append(time.perf_counter() - d0)
        trainer.train_step(batches)

    def lmforge_no_guard_step() -> None:
        trainer.guard = None
        try:
            trainer.train_step(trainer.next_micro_batches())
        finally:
            trainer.guard = guard

    fns = {"lmforge": lmforge_step, "reference": reference.step if reference else None,
           "lmforge_no_guard": lmforge_no_guard_step}
    peaks_before = measure_peaks(device, precision)

    t0 = time.perf_counter()
    for name in arms:  # warm-up (allocator, compile, optimizer state)
        for _ in range(args.warmup):
            fns[name]()
        sync(device)
    say(f"warm-up: {args.warmup} steps per arm in {time.perf_counter() - t0:.1f} s", flush=True)

    wall: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    mem: dict[str, float] = {a: 0.0 for a in arms}
    order = list(arms)
    for rep in range(args.reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.block):
                fns[name]()
            sync(device)
            wall[name].append((time.perf_counter() - w0) / args.block)
            cpu[name].append((time.process_time() - c0) / args.block)
            if device.type == "cuda":
                mem[name] = max(mem[name], torch.cuda.max_memory_allocated(device) / 1e9)
        say(f"[rep {rep + 1}/{args.reps}] " + ", ".join(f"{a} {wall[a][-1] * 1e3:.1f} ms" for a in arms), flush=True)

    moe_path = experts_path(lmforge_step) if cfg.model.moe.num_experts > 0 else None
    if moe_path:
        say(f"MoE experts took {moe_path['path']}: {moe_path['grouped_mm_calls']} grouped_mm and "
            f"{moe_path['bmm_calls']} bmm calls in one step", flush=True)
    if args.profile:  # after the timed steps, so the profiler's own cost never enters a timing
        profile_steps(lmforge_step, device, args.profile, steps=2, step_s=statistics.median(wall["lmforge"]))
        say(f"profile of 2 lmforge steps: {args.profile}", flush=True)

    peaks_after = measure_peaks(device, precision)
    peaks = dict(peaks_after)
    for key in ("fp32", "bf16", "fp16"):
        if key in peaks_before:
            peaks[key] = max(peaks_before[key], peaks_after[key])
    if device.type == "cpu":  # the better of before/after, in the dtype the run's peak comes from
        labels = ("fp32", compute_precision(precision))
        peaks["run_label"] = max((k for k in labels if k in peaks), key=lambda k: peaks[k])
        peaks["run"] = peaks[peaks["run_label"]]

    fpt = trainer.flops_per_token
    world = cfg.parallel.world_size if distributed else 1
    results: dict = {
        "schema": "lmforge.train_throughput/2",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "git_commit": git_commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "device": str(device), "device_name": peaks.get("device_name", str(device)),
                    "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "interop_threads": torch.get_num_interop_threads(),
                    "load_average": [round(v, 2) for v in os.getloadavg()]},
        "config": {"preset": cfg.preset, "overrides": {k: v for k, v in overrides.items() if k not in BENCH_OVERRIDES},
                   "n_params": trainer.n_params, "flops_per_token": fpt,
                   "flops_formula": "6N + 12*L*d*s (N = matmul weights incl. output projection; LoRA / frozen "
                                    "weights: their weight gradients not counted, lmforge.model.accounting)",
                   "precision": precision, "layout": trainer.layout.name, "world_size": world,
                   "tokens_per_step_per_rank": tokens_per_step, "micro_batch_size": t.micro_batch_size,
                   "seq_len": cfg.data.seq_len, "grad_accum_steps": cfg.grad_accum_steps,
                   "activation_checkpoint": t.activation_checkpoint, "compile": compile_choice(cfg, device)[0],
                   "compile_setting": t.compile,
                   "loss_chunk": resolve_loss_chunk(cfg, device.type, precision), "loss_chunk_setting": t.loss_chunk,
                   "optimizer": type(trainer.optimizer).__name__, "optimizer_fast_path": _fast_path(trainer.optimizer),
                   "reference_optimizer_fast_path": _fast_path(reference.opt) if reference else None,
                   "guard": guard is not None},
        "protocol": {"warmup_steps": args.warmup, "reps": args.reps, "steps_per_block": args.block,
                     "order": "alternating (A B, B A, ...)"},
        "peak_flops": {k: v for k, v in peaks.items() if k in ("fp32", "bf16", "fp16", "run")},
        "peak_used": peaks["run_label"],
        "peak_source": peaks.get("source", ""),
        "arms": {},
    }
    for name in arms:
        med = statistics.median(wall[name])
        tok_s = tokens_per_step / med
        arm = {"step_time_s_median": med, "step_time_s_best": min(wall[name]),
               "tokens_per_s_median": tok_s, "tokens_per_s_best": tokens_per_step / min(wall[name]),
               "cpu_s_per_step_median": statistics.median(cpu[name]),
               "mfu": tok_s * fpt / peaks["run"] if peaks.get("run") else None,
               "peak_mem_gb": mem[name] if device.type == "cuda" else _rss_gb(),
               "step_times_s": wall[name]}
        results["arms"][name] = arm
    if moe_path:
        results["moe_path"] = moe_path
    if data_s:  # lmforge's loader on the critical path: memmap gather + host->device copy per step
        d = statistics.median(data_s[args.warmup:] or data_s)
        results["arms"]["lmforge"]["data_s_per_step_median"] = d
        results["arms"]["lmforge"]["data_share"] = d / results["arms"]["lmforge"]["step_time_s_median"]
    if device.type == "cuda":
        results["resident_gb"] = torch.cuda.memory_allocated(device) / 1e9
    ratios = {}
    if "reference" in arms:
        for name in arms:
            if name != "reference":
                ratios[f"{name}/reference"] = statistics.median(r / a for a, r in zip(wall[name], wall["reference"]))
                ratios[f"{name}/reference_cpu_s"] = statistics.median(
                    r / a for a, r in zip(cpu[name], cpu["reference"]))
    if "lmforge_no_guard" in arms:
        ratios["lmforge/lmforge_no_guard"] = statistics.median(
            g / a for a, g in zip(wall["lmforge"], wall["lmforge_no_guard"]))
    results["paired_ratios"] = ratios
    if distributed:
        results["note"] = "under torchrun: per-rank numbers of rank 0; the single-process reference is not run"
    trainer.end_together()
    trainer.close()  # (the prefetch thread, the checkpoint writer, the process groups)
    return results


# kernel-name patterns -> where the time goes (first match wins); the rest is "other"
KERNEL_GROUPS = [
    ("compiled (Triton)", ("triton_",)),  # (first: Inductor's names contain "fused", "copy", ...)
    ("matmul (GEMM)", ("gemm", "matmul", "cutlass", "nvjet", "sm90_xmma", "cublas", "_mm_", "addmm")),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl", "allreduce", "all_gather", "reduce_scatter")),
    ("softmax / loss", ("softmax", "log_softmax", "nll", "cross_entropy", "exp_kernel", "scatter", "gather")),
    ("copy / cast", ("copy", "memcpy", "memset", "cast", "to_copy")),
]


def profile_steps(step, device: torch.device, path: Path, steps: int, step_s: float) -> None:
    """Where the step's time goes: `steps` lmforge steps under torch.profiler, written to `path` as
    device time per kernel group (KERNEL_GROUPS), its share of the wall time (what is left over is
    time the device waited on the host), and the profiler's own top-30 table by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    w0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall = (time.perf_counter() - w0) / steps
    events = prof.key_averages()

    def dev_us(e) -> float:  # self device time (the attribute's name changed across torch releases)
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(e, name):
                return float(getattr(e, name))
        return 0.0

    # Count device-side events only (kernels, memcpy): an aten op's own "self device time" is the
    # time of the kernels it launched, which appear again as events of their own.
    device_events = [e for e in events if str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1"))]
    if not device_events:  # an older profiler without device_type on averages: kernels have no "::"
        device_events = [e for e in events if "::" not in e.key]
    groups: dict[str, float] = {}
    for e in device_events:
        us = dev_us(e)
        if us <= 0:
            continue
        key = e.key.lower()
        group = next((g for g, pats in KERNEL_GROUPS if any(p in key for p in pats)), "other")
        groups[group] = groups.get(group, 0.0) + us
    busy = sum(groups.values()) / 1e6 / steps
    lines = [f"# profile: {steps} steps, wall {wall * 1e3:.1f} ms/step under the profiler "
             f"(timed median {step_s * 1e3:.1f} ms/step); device busy {busy * 1e3:.1f} ms/step "
             f"= {100 * busy / wall:.1f}% of the profiled wall time", "",
             "| kernel group | device ms/step | share of device time |", "|---|---|---|"]
    for g, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {g} | {us / 1e3 / steps:.2f} | {100 * us / max(sum(groups.values()), 1e-9):.1f}% |")
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        table = events.table(sort_by=sort, row_limit=30, max_name_column_width=90)
    except (KeyError, AttributeError, ValueError):
        table = events.table(sort_by="self_cuda_time_total" if device.type == "cuda" else sort, row_limit=30)
    Path(path).write_text("\n".join(lines) + "\n\n" + table + "\n")


def experts_path(step) -> dict:
    """Which matmul the MoE experts ran, as the ops of one lmforge step show (torch.profiler, host side
    only): torch._grouped_mm (lmforge.model.moe.grouped_matmul's grouped path) or the padded batched
    matmul it falls back to."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    calls = {e.key: e.count for e in prof.key_averages()}
    grouped = sum(n for k, n in calls.items() if "grouped_mm" in k and k.startswith("aten::"))
    bmm = calls.get("aten::bmm", 0)
    return {"path": "grouped_mm" if grouped else ("padded bmm" if bmm else "neither"), "grouped_mm_calls": grouped,
            "bmm_calls": bmm}


def _fast_path(opt: torch.optim.Optimizer) -> str:
    d = getattr(opt, "defaults", {})
    return "fused" if d.get("fused") else ("foreach" if d.get("foreach") else "for-loop")


def _rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def format_table(res: dict) -> str:
    used = res.get("peak_used", "run")
    head = f"| arm | tokens/s (median) | tokens/s (best) | step ms (median) | CPU-s/step | MFU vs {used} peak | peak mem GB |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, a in res["arms"].items():
        mfu = f"{100 * a['mfu']:.1f}%" if a["mfu"] is not None else "-"
        lines.append(f"| {name} | {a['tokens_per_s_median']:,.0f} | {a['tokens_per_s_best']:,.0f} | "
                     f"{a['step_time_s_median'] * 1e3:.1f} | {a['cpu_s_per_step_median']:.3f} | {mfu} | "
                     f"{a['peak_mem_gb']:.2f} |")
    pk = res["peak_flops"]
    c = res["config"]
    lines.append("")
    lines.append(f"peak used for MFU: {used} {pk['run'] / 1e9:,.1f} GFLOP/s ({res['peak_source']}); FLOPs/token "
                 f"{c['flops_per_token'] / 1e6:.1f} M ({c['flops_formula']})")
    lines.append(f"lmforge: optimizer {c['optimizer']} ({c['optimizer_fast_path']}), loss_chunk {c['loss_chunk']} "
                 f"({c['loss_chunk_setting']}), compile {c['compile']} "
                 f"({c['compile_setting']}); reference: AdamW "
                 f"({c['reference_optimizer_fast_path']}), plain cross-entropy, compile {c['compile']}")
    lm = res["arms"]["lmforge"]
    if "data_share" in lm:
        lines.append(f"lmforge data fetch (next_micro_batches): {lm['data_s_per_step_median'] * 1e3:.3f} ms/step "
                     f"= {100 * lm['data_share']:.3f}% of the step")
    for k, v in res["paired_ratios"].items():
        lines.append(f"median paired ratio {k}: {v:.3f}")
    if "note" in res:
        lines.append(res["note"])
    lines.append(f"load average: {res['machine']['load_average']}; threads {res['machine']['threads']}; "
                 f"commit {res['git_commit']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="preset name or TOML path (default tiny)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, repeatable: --set train.micro_batch_size=8 --set train.compile=true")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm (default 3; quick 1)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per arm (default 6; quick 3)")
    p.add_argument("--block", type=int, default=None, help="steps per arm per repetition (default 2; quick 1)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    p.add_argument("--interop-threads", type=int, default=0, help="torch.set_num_interop_threads (0 = default)")
    p.add_argument("--guard-arm", action="store_true", help="also time lmforge with the spike guard off")
    p.add_argument("--no-reference", action="store_true", help="lmforge only (e.g. to save GPU memory)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke mode: fp32, 1 thread (unless --threads), 1 warm-up, 3 reps of 1 step")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--profile", type=Path, default=None,
                   help="after the timed steps, profile 2 lmforge steps and write where the time goes here")
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 6)
    args.block = args.block if args.block is not None else (1 if args.quick else 2)
    if args.quick and not args.threads:
        args.threads = 1  # CI boxes are shared: 2 OpenMP threads on 2 busy cores ran 7 s steps vs 1.5 s on 1
    res = run(args)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        print(format_table(res))
        if args.json:
            args.json.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
