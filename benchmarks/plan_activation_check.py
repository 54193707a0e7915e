"""Check `lmforge plan`'s activation estimate against measured GPU memory.

On a CUDA machine: for the tiny and gpt2-124m presets and each activation-checkpointing mode,
build the model and an AdamW optimizer on the GPU, run one step (so gradients and optimizer state
exist), free the gradients, then run a step the way the trainer does (forward and backward inside
the step's `Precision.step`, which casts each weight to 16 bits once per step, and autocast) and measure

  fwd   = torch.cuda.memory_allocated() after the forward pass (loss computed) - before it
  peak  = torch.cuda.max_memory_allocated() during forward + backward - before the forward

and compare with the estimate (`estimate_memory(..., weights="lmforge")`):

  est_fwd  = activations + the step's 16-bit weight copies (+ RoPE tables for blocks kept)
  est_peak = est_fwd + gradients (fp32, allocated during backward) + the loss's transient
             (`loss_transient`: the plain loss's backward, or one chunk of the chunked loss)

printing both and the ratio measured / estimated. On a machine without CUDA it says so and exits
(status 0); `--cpu-saved` instead compares, on CPU, with the bytes autograd saves plus the 16-bit
copies the step holds (`step_bytes`, what the tests assert exactly).

With `--loss-chunk N` the loss is the model's chunked, fused head + cross-entropy
(train.loss_chunk = N, lmforge.model.loss.linear_cross_entropy_sum), planned with loss_chunk = N.

    python benchmarks/plan_activation_check.py [--batch 8] [--seq 1024] [--loss-chunk 0] [--json out.json] [--cpu-saved]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref

import torch
import torch.nn.functional as F

from lmforge.config import OptimConfig, load_config
from lmforge.model.transformer import build_model
from lmforge.optim.optimizers import build_optimizer
from lmforge.plan.memory import Layout, estimate_memory
from lmforge.parallel.activation_ckpt import apply_activation_checkpointing, saved_activation_bytes
from lmforge.train.precision import make_precision

CASES = [("tiny", None), ("gpt2-124m", None)]
MODES = ("none", "full", "every_k", "selective")


def _estimate(cfg, b: int, s: int, ac: str, loss_chunk: int = 0):
    mem = estimate_memory(cfg.model, Layout(micro_batch=b, ac=ac, loss_chunk=loss_chunk), "adamw", s, weights="lmforge")
    fwd = mem.activations + mem.detail["autocast_weight_copies"]
    if ac != "full":
        fwd += mem.detail.get("rope_tables", 0)
    return mem, fwd


def step_bytes(model, batches, dtype=torch.bfloat16, loss_chunk: int = 0) -> tuple[int, int, int, int]:
    """The trainer's step on CPU: the forwards of `batches` inside the step's `Precision.step` (one
    16-bit copy of each weight for the step) and autocast, each micro-batch's graph kept (as a
    pipeline schedule keeps those in flight), then one backward in the same context. Returns (bytes
    of the unique storages autograd saves or the step's copies hold, bytes of the 16-bit parameter
    copies alive after the forwards, after the backward, and after the step exits). The parameters
    themselves are not counted. `loss_chunk` > 0: the model's chunked, fused head + cross-entropy
    (train.loss_chunk; what it saves is its gradients, grad_hidden and grad_weight)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    casts: list[weakref.ref] = []

    class CastSpy(TorchDispatchMode):  # records the 16-bit copies made of parameters
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in params:
                casts.append(weakref.ref(out))
            return out

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    def alive() -> dict[int, int]:
        return {c().untyped_storage().data_ptr(): c().untyped_storage().nbytes() for c in casts if c() is not None}

    precision = make_precision({torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], torch.device("cpu"))
    with contextlib.ExitStack() as step:
        with CastSpy():
            step.enter_context(precision.step(model))  # (the copies are made here: the spy sees them)
        with precision.autocast():
            with CastSpy(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                in_forward = loss_chunk or getattr(model, "mtp", None) is not None  # (MTP: the trainer's path)
                losses = [model(x, targets=x, loss_chunk=loss_chunk) if in_forward else
                          F.cross_entropy(model(x).float().flatten(0, 1), x.flatten()) for x in batches]
            copies = alive()
            sum(losses).backward()
            after_backward = sum(alive().values())
    return sum((saved | copies).values()), sum(copies.values()), after_backward, sum(alive().values())


def run_cuda(batch: int, seq: int, loss_chunk: int = 0) -> list[dict]:
    rows = []
    dev = torch.device("cuda")
    for preset, _ in CASES:
        cfg = load_config(preset)
        s = min(seq, cfg.model.max_seq_len)
        for ac in MODES:
            torch.cuda.empty_cache()
            model = build_model(cfg.model, dev, seed=0)
            apply_activation_checkpointing(model.blocks, ac)
            opt = build_optimizer(OptimConfig(name="adamw", lr=1e-4, weight_decay=0.1), model)
            x = torch.randint(0, cfg.model.vocab_size, (batch, s), device=dev)

            def loss_fn():
                if loss_chunk:  # the trainer's chunked loss: summed NLL, scaled like the mean
                    return model(x, targets=x, loss_chunk=loss_chunk) / x.numel()
                return F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())

            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            bf16 = make_precision("bf16", dev)
            with bf16.step(model), bf16.autocast():  # as the trainer's step
                loss = loss_fn()
                torch.cuda.synchronize()
                fwd = torch.cuda.memory_allocated() - base
                loss.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            mem, est_fwd = _estimate(cfg, batch, s, ac, loss_chunk)
            est_peak = est_fwd + mem.gradients + mem.detail["loss_transient"]
            rows.append({"preset": preset, "ac": ac, "batch": batch, "seq": s, "loss_chunk": loss_chunk,
                         "measured_fwd": fwd,
                         "estimated_fwd": est_fwd, "ratio_fwd": fwd / est_fwd, "measured_peak": peak,
                         "estimated_peak": est_peak, "ratio_peak": peak / est_peak})
            del model, opt, x, loss
    return rows


def run_cpu_saved(batch: int, seq: int, micro_batches: int = 1) -> list[dict]:
    rows = []
    for preset, _ in CASES:
        cfg = load_config(preset, {"model.n_layers": 2})
        s = min(seq, cfg.model.max_seq_len)
        for ac in ("none", "full", "every_k"):
            model = build_model(cfg.model, "cpu", seed=0)
            apply_activation_checkpointing(model.blocks, ac)
            xs = [torch.randint(0, cfg.model.vocab_size, (batch, s)) for _ in range(micro_batches)]
            measured = step_bytes(model, xs)[0]
            mem, est = _estimate(cfg, batch, s, ac)
            est += (micro_batches - 1) * mem.activations
            rows.append({"preset": f"{preset} (2 layers)", "ac": ac, "batch": batch, "seq": s,
                         "micro_batches": micro_batches, "measured_saved": measured, "estimated": est,
                         "ratio": measured / est})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-saved", action="store_true",
                    help="compare with autograd's saved tensors + autocast's cached copies on CPU instead")
    ap.add_argument("--micro-batches", type=int, default=1, help="--cpu-saved: forwards kept in flight in one step")
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="CUDA: the chunked fused loss over N-token chunks (train.loss_chunk = N); 0 = plain logits")
    args = ap.parse_args(argv)
    if args.cpu_saved:
        rows = run_cpu_saved(min(args.batch, 2), min(args.seq, 64), args.micro_batches)
        for r in rows:
            print(f"{r['preset']:<22} ac={r['ac']:<9} b={r['batch']} s={r['seq']} m={r['micro_batches']}: "
                  f"saved {r['measured_saved'] / 1e6:9.3f} MB "
                  f"estimated {r['estimated'] / 1e6:9.3f} MB ratio {r['ratio']:.4f}")
    else:
        if not torch.cuda.is_available():
            print("plan_activation_check: no CUDA device on this machine; the GPU comparison needs one "
                  "(run it in a GPU session; --cpu-saved compares with autograd's saved tensors on CPU).")
            return 0
        rows = run_cuda(args.batch, args.seq, args.loss_chunk)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        for r in rows:
            print(f"{r['preset']:<10} ac={r['ac']:<9} b={r['batch']} s={r['seq']} loss_chunk={r['loss_chunk']}: "
                  f"fwd measured {r['measured_fwd'] / 1e9:7.3f} GB est {r['estimated_fwd'] / 1e9:7.3f} GB ratio {r['ratio_fwd']:.3f} | "
                  f"peak measured {r['measured_peak'] / 1e9:7.3f} GB est {r['estimated_peak'] / 1e9:7.3f} GB ratio {r['ratio_peak']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
