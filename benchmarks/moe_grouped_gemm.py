"""Speed of the MoE experts' compute on this machine: one grouped GEMM per projection
(`torch._grouped_mm`, lmforge.model.moe.grouped_matmul), the padded batched-matmul fallback, and a
Python loop over experts (lmforge.model.moe.experts_loop, the reference), forward + backward of the
SwiGLU experts over the same expert-sorted rows.

    python benchmarks/moe_grouped_gemm.py [--tokens 4096] [--experts 8 64] [--dim 192] [--hidden 256] [--top-k 2]

Rows per expert follow a random top-k routing (softmax of Gaussian logits), as a router at
initialisation gives. Prints median milliseconds over --reps repetitions (after 2 warm-ups) and the
loop / grouped ratio, measured in one process one after another, so the ratio is what to compare on
a machine shared with other jobs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lmforge.model.moe import experts_loop, grouped_matmul


def swiglu(mode: str):
    def run(x, counts, w_gate, w_up, w_down):
        h = F.silu(grouped_matmul(x, w_gate, counts, mode)) * grouped_matmul(x, w_up, counts, mode)
        return grouped_matmul(h, w_down, counts, mode)
    return run


def timed(fn, args, reps: int) -> float:
    times = []
    for i in range(reps + 2):
        params = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
        t0 = time.perf_counter()
        out = fn(*params)
        out.backward(torch.ones_like(out))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; fp32; forward + backward of the SwiGLU "
          f"experts; {args.tokens} tokens x top-{args.top_k}, dim {args.dim}, expert hidden {args.hidden}")
    print("| experts | grouped_mm (ms) | padded bmm (ms) | per-expert loop (ms) | loop / grouped_mm |")
    print("|---|---|---|---|---|")
    for experts in args.experts:
        logits = torch.randn(args.tokens, experts)
        chosen = logits.softmax(-1).topk(args.top_k, dim=-1).indices.reshape(-1)
        counts = torch.bincount(chosen, minlength=experts)
        x = torch.randn(int(counts.sum()), args.dim)
        ws = [torch.randn(experts, args.dim, args.hidden) * 0.02, torch.randn(experts, args.dim, args.hidden) * 0.02,
              torch.randn(experts, args.hidden, args.dim) * 0.02]
        grouped = timed(lambda x, *w: swiglu("on")(x, counts, *w), [x, *ws], args.reps)
        padded = timed(lambda x, *w: swiglu("off")(x, counts, *w), [x, *ws], args.reps)
        loop = timed(lambda x, *w: experts_loop(x, counts, *w), [x, *ws], args.reps)
        print(f"| {experts} | {grouped:.1f} | {padded:.1f} | {loop:.1f} | {loop / grouped:.2f} |")


if __name__ == "__main__":
    main()
