"""Check `lmforge plan`'s activation estimate against measured GPU memory.

On a CUDA machine: for the tiny and gpt2-124m presets and each activation-checkpointing mode,
build the model and an AdamW optimizer on the GPU, run one step (so gradients and optimizer state
exist), free the gradients, then measure

  fwd   = torch.cuda.memory_allocated() after the forward pass (loss computed) - before it
  peak  = torch.cuda.max_memory_allocated() during forward + backward - before the forward

and compare with the estimate (`estimate_memory(..., weights="lmforge")`):

  est_fwd  = activations + autocast 16-bit weight copies (+ RoPE tables for blocks kept)
  est_peak = est_fwd + gradients (fp32, allocated during backward)

printing both and the ratio measured / estimated. On a machine without CUDA it says so and exits
(status 0); `--cpu-saved` instead compares with the bytes autograd saves on CPU (what the tests
assert exactly).

    python benchmarks/plan_activation_check.py [--batch 8] [--seq 1024] [--json out.json] [--cpu-saved]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from lmforge.config import OptimConfig, load_config
from lmforge.model.transformer import build_model
from lmforge.optim.optimizers import build_optimizer
from lmforge.plan.memory import Layout, estimate_memory
from lmforge.parallel.activation_ckpt import apply_activation_checkpointing, saved_activation_bytes

CASES = [("tiny", None), ("gpt2-124m", None)]
MODES = ("none", "full", "every_k", "selective")


def _estimate(cfg, b: int, s: int, ac: str):
    mem = estimate_memory(cfg.model, Layout(micro_batch=b, ac=ac), "adamw", s, weights="lmforge")
    fwd = mem.activations + mem.detail["autocast_weight_copies"]
    if ac != "full":
        fwd += mem.detail.get("rope_tables", 0)
    return mem, fwd


def run_cuda(batch: int, seq: int) -> list[dict]:
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
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                return F.cross_entropy(logits.float().flatten(0, 1), x.flatten())

            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = loss_fn()
            torch.cuda.synchronize()
            fwd = torch.cuda.memory_allocated() - base
            loss.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            mem, est_fwd = _estimate(cfg, batch, s, ac)
            est_peak = est_fwd + mem.gradients
            rows.append({"preset": preset, "ac": ac, "batch": batch, "seq": s, "measured_fwd": fwd,
                         "estimated_fwd": est_fwd, "ratio_fwd": fwd / est_fwd, "measured_peak": peak,
                         "estimated_peak": est_peak, "ratio_peak": peak / est_peak})
            del model, opt, x, loss
    return rows


def run_cpu_saved(batch: int, seq: int) -> list[dict]:
    rows = []
    for preset, _ in CASES:
        cfg = load_config(preset, {"model.n_layers": 2})
        s = min(seq, cfg.model.max_seq_len)
        for ac in ("none", "full", "every_k"):
            model = build_model(cfg.model, "cpu", seed=0)
            apply_activation_checkpointing(model.blocks, ac)
            x = torch.randint(0, cfg.model.vocab_size, (batch, s))

            def fn():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x)
                return F.cross_entropy(logits.float().flatten(0, 1), x.flatten())

            measured = saved_activation_bytes(fn, exclude=list(model.parameters()))
            _, est = _estimate(cfg, batch, s, ac)
            rows.append({"preset": f"{preset} (2 layers)", "ac": ac, "batch": batch, "seq": s,
                         "measured_saved": measured, "estimated": est, "ratio": measured / est})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-saved", action="store_true", help="compare with autograd's saved tensors on CPU instead")
    args = ap.parse_args(argv)
    if args.cpu_saved:
        rows = run_cpu_saved(min(args.batch, 2), min(args.seq, 64))
        for r in rows:
            print(f"{r['preset']:<22} ac={r['ac']:<9} b={r['batch']} s={r['seq']}: saved {r['measured_saved'] / 1e6:9.3f} MB "
                  f"estimated {r['estimated'] / 1e6:9.3f} MB ratio {r['ratio']:.4f}")
    else:
        if not torch.cuda.is_available():
            print("plan_activation_check: no CUDA device on this machine; the GPU comparison needs one "
                  "(run it in a GPU session; --cpu-saved compares with autograd's saved tensors on CPU).")
            return 0
        rows = run_cuda(args.batch, args.seq)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        for r in rows:
            print(f"{r['preset']:<10} ac={r['ac']:<9} b={r['batch']} s={r['seq']}: "
                  f"fwd measured {r['measured_fwd'] / 1e9:7.3f} GB est {r['estimated_fwd'] / 1e9:7.3f} GB ratio {r['ratio_fwd']:.3f} | "
                  f"peak measured {r['measured_peak'] / 1e9:7.3f} GB est {r['estimated_peak'] / 1e9:7.3f} GB ratio {r['ratio_peak']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
