"""μP's coordinate check (Tensor Programs V, Figure 5): how far each layer's activations move in the
first few optimizer steps, at several widths.

For a model of each width (the same config otherwise, the same seed), a few optimizer steps on one
fixed batch; before each step a forward records, per tracked layer, the mean absolute value of the
change of its output since initialisation, mean |x_t - x_0| per coordinate, on that batch. Tracked:
each block's attention scores (q k^T x the attention scale, before the softmax: where μP's 1/head_dim
scaling shows), attention and MLP outputs (what the block adds to the residual stream), each block's
output (the residual stream) and the logits. Under a parametrization in which the hyperparameters
transfer (μP, model.parametrization = "mup") these changes stay the same size as the width grows;
under the standard one (SP) a fixed learning rate moves the wider models' activations further, and
the changes grow with width (the paper's blow-up). `growth_exponents` fits the slope of
log(change) against log(width) per layer: ~0 means flat.

The loop is the plain one (model, optimizer, cross-entropy, no schedule, no clipping) so the check
sees the parametrization alone; the model and the optimizer (its param groups, μP's multipliers
included) are lmforge's own.

    python -m lmforge.train.coord_check --widths 64,128,256,512

runs it under SP and under μP (a 2-layer GQA / SwiGLU model, base width the narrowest, AdamW) and
prints per layer the mean change at each width and the growth exponents; it exits 1 when μP's are
not flat (|exponent| < 0.5) or SP's logits do not grow (benchmarks/mup_coord_check.py adds the plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence

import torch

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.layers import apply_rope
from lmforge.model.loss import token_nll_sum
from lmforge.model.transformer import build_model
from lmforge.optim.optimizers import build_optimizer


def tracked_modules(model) -> dict[str, torch.nn.Module]:
    """Layer name -> module whose output the check follows (the logits are the model's own output)."""
    out = {}
    for i, block in model.blocks.items():
        out[f"block{i}.attn"] = block.attn
        out[f"block{i}.mlp"] = block.mlp
        out[f"block{i}.out"] = block
    return out


@torch.no_grad()
def attention_scores(attn, x: torch.Tensor, rope) -> torch.Tensor:
    """The pre-softmax attention scores SDPA computes for input `x` (batch, seq, dim): q k^T / sqrt(head_dim),
    q including μP's multiplier, RoPE applied, kv heads repeated for GQA."""
    q, k, _ = attn.project(x)
    if rope is not None:
        cos, sin = rope[0][:x.shape[1]], rope[1][:x.shape[1]]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def activation_changes(cfg: ModelConfig, optim: OptimConfig, steps: int = 6, batch: int = 8, seq: int = 32,
                       seed: int = 0) -> dict[str, list[float]]:
    """Per tracked layer (and "logits"): mean |x_t - x_0| for t = 1 .. `steps` (x_t: the output on the
    fixed batch after t optimizer steps)."""
    torch.manual_seed(seed)
    model = build_model(cfg, seed=seed)
    optimizer = build_optimizer(optim, model)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, out.detach()))
             for name, m in tracked_modules(model).items()]
    hooks += [block.attn.register_forward_pre_hook(
        lambda mod, args, name=f"block{i}.attn_scores": seen.__setitem__(name, attention_scores(mod, *args[:2])))
        for i, block in model.blocks.items()]
    first: dict[str, torch.Tensor] = {}
    changes: dict[str, list[float]] = {}
    try:
        for t in range(steps + 1):
            logits = model(x)
            seen["logits"] = logits.detach()
            if t == 0:
                first = dict(seen)
            else:
                for name, value in seen.items():
                    changes.setdefault(name, []).append((value - first[name]).abs().mean().item())
            if t == steps:
                break
            loss = token_nll_sum(logits, y) / y.numel()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    return changes


def coordinate_check(base: ModelConfig, widths: Sequence[int], optim: OptimConfig, steps: int = 6, batch: int = 8,
                     seq: int = 32, seed: int = 0) -> dict[int, dict[str, list[float]]]:
    """`activation_changes` of `base` at each model.dim of `widths` (everything else as in `base`)."""
    return {w: activation_changes(dataclasses.replace(base, dim=w), optim, steps, batch, seq, seed) for w in widths}


def growth_exponents(result: dict[int, dict[str, list[float]]], step: int | None = None) -> dict[str, float]:
    """Per layer: the least-squares slope of log(change) against log(width), the change at `step`
    (None: its mean over the steps, less noisy): the exponent of its growth with width (0 = flat, 1 =
    proportional to width)."""
    widths = sorted(result)
    xs = [math.log(w) for w in widths]
    mx = sum(xs) / len(xs)
    pick = (lambda v: sum(v) / len(v)) if step is None else (lambda v: v[step])  # noqa: E731
    out = {}
    for name in result[widths[0]]:
        ys = [math.log(max(pick(result[w][name]), 1e-30)) for w in widths]
        my = sum(ys) / len(ys)
        out[name] = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    return out


def compare(widths: Sequence[int], lr: float = 1e-2, steps: int = 6, seed: int = 0
            ) -> dict[str, dict[int, dict[str, list[float]]]]:
    """`coordinate_check` under "sp" and "mup" of the command's model: 2 layers, 4 heads (2 kv heads),
    SwiGLU, fused q/k/v, tied embeddings, vocab 256, μP base width = widths[0]; AdamW at `lr`, no decay."""
    base = ModelConfig(vocab_size=256, dim=widths[0], n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                       mup_base_width=widths[0])
    optim = OptimConfig(name="adamw", lr=lr, weight_decay=0.0)
    return {p: coordinate_check(dataclasses.replace(base, parametrization=p), widths, optim, steps, seed=seed)
            for p in ("sp", "mup")}


def table(results: dict[str, dict[int, dict[str, list[float]]]]) -> str:
    """Markdown: per layer the mean change at each width under each parametrization, and the exponents."""
    widths = sorted(results["sp"])
    exps = {p: growth_exponents(r) for p, r in results.items()}
    lines = ["| layer | " + " | ".join(f"{p} {w}" for p in results for w in widths) + " | SP exponent | μP exponent |",
             "|---|" + "---|" * (len(results) * len(widths) + 2)]
    for name in results["sp"][widths[0]]:
        cells = [f"{sum(v) / len(v):.3g}" for p in results for w in widths for v in [results[p][w][name]]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {exps['sp'][name]:.2f} | {exps['mup'][name]:.2f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lmforge.train.coord_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256, 512],
                    help="model.dim values, narrowest first (the μP base width)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def report(results: dict[str, dict[int, dict[str, list[float]]]]) -> int:
    """Print `table` and the verdict; 0 when μP's exponents are flat (|e| < 0.5) and SP's logits grow (> 0.5)."""
    print(table(results))
    mup_exps, sp_exps = growth_exponents(results["mup"]), growth_exponents(results["sp"])
    flat = all(abs(e) < 0.5 for e in mup_exps.values())
    print(f"μP: {'flat' if flat else 'NOT flat'} (exponents {min(mup_exps.values()):.2f} .. {max(mup_exps.values()):.2f}); "
          f"SP: exponents {min(sp_exps.values()):.2f} .. {max(sp_exps.values()):.2f} (logits {sp_exps['logits']:.2f})")
    return 0 if flat and sp_exps["logits"] > 0.5 else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    return report(compare(args.widths, args.lr, args.steps, args.seed))

if __name__ == "__main__":
    sys.exit(main())
