"""Fused QKV (model.fused_qkv: one `attn.wqkv` matmul) against the separate wq/wk/wv: tokens/s of one
forward + backward of the q/k/v projection alone (`Attention.project`: the three matmuls or the one,
QK-norm and the head split) and of the whole attention layer (+ RoPE, SDPA, the output projection).

    python benchmarks/fused_qkv.py                                    # CPU: GPT-2 124M and a GQA shape
    python benchmarks/fused_qkv.py --device cuda --tokens 16384 --precision bf16

Both arms hold the same weights (the fused one is the separate ones' rows, lmforge.model.layers.
fuse_qkv) and see the same input; they alternate step by step in one process (one warm-up step
each), so a loaded machine slows both alike, and the table gives each arm's median step and the
median of the per-round ratios (fused / separate tokens/s; > 1: fused is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from lmforge.config import ModelConfig
from lmforge.model.layers import Attention, fuse_qkv, rope_tables

SHAPES = {  # name: ModelConfig keys of the attention
    "gpt2-124m (dim 768, 12 heads, MHA)": dict(dim=768, n_heads=12, bias=True),
    "gqa (dim 1024, 16 heads, 4 kv heads, qk-norm)": dict(dim=1024, n_heads=16, n_kv_heads=4, qk_norm=True),
}


def layers(shape: dict, max_seq: int) -> tuple[Attention, Attention]:
    cfg = ModelConfig(vocab_size=64, n_layers=1, max_seq_len=max_seq, fused_qkv=False, **shape)
    sep, fused = Attention(cfg), Attention(replace(cfg, fused_qkv=True))
    state = sep.state_dict()
    with torch.no_grad():
        for kind in ("weight", "bias"):
            if f"wq.{kind}" in state:
                getattr(fused.wqkv, kind).copy_(fuse_qkv(cfg, *(state[f"{w}.{kind}"] for w in ("wq", "wk", "wv"))))
        for k, v in state.items():
            if not k.startswith(("wq.", "wk.", "wv.")):
                fused.state_dict()[k].copy_(v)
    return sep, fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--tokens", type=int, default=2048, help="batch x seq per step")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"{args.device}, {args.precision}, {args.tokens} tokens ({args.tokens // args.seq} x {args.seq}) per step, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} alternating rounds")
    print("| shape | part | separate tok/s | fused tok/s | fused / separate (median paired) |")
    print("|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        sep, fused = (m.to(dev) for m in layers(shape, args.seq))
        cfg = ModelConfig(vocab_size=64, n_layers=1, max_seq_len=args.seq, **shape)
        rope = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=dev, cfg=cfg)
        x = torch.randn(args.tokens // args.seq, args.seq, cfg.dim, device=dev, requires_grad=True)

        def project(m: Attention) -> torch.Tensor:
            q, k, v = m.project(x)
            return q.float().square().sum() + k.float().square().sum() + v.float().square().sum()

        def layer(m: Attention) -> torch.Tensor:
            return m(x, rope).float().square().sum()

        for part, fn in (("q/k/v projection", project), ("attention layer", layer)):
            times: dict[str, list[float]] = {"separate": [], "fused": []}
            for r in range(args.rounds + 1):  # round 0: warm-up
                for arm, m in (("separate", sep), ("fused", fused)):
                    m.zero_grad(set_to_none=True)
                    x.grad = None
                    sync()
                    t0 = time.perf_counter()
                    with autocast:
                        loss = fn(m)
                    loss.backward()
                    sync()
                    if r:
                        times[arm].append(time.perf_counter() - t0)
            ratio = statistics.median(s / f for s, f in zip(times["separate"], times["fused"]))
            tps = {arm: args.tokens / statistics.median(ts) for arm, ts in times.items()}
            print(f"| {name} | {part} | {tps['separate']:,.0f} | {tps['fused']:,.0f} | **{ratio:.2f}** |")


if __name__ == "__main__":
    main()
