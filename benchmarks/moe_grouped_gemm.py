"""Speed of the MoE experts' compute, forward + backward of the SwiGLU experts over the same
expert-sorted rows, three ways (lmforge.model.moe):

- grouped_mm: `GroupedExperts.sorted_rows` with model.moe.grouped_mm = on: the rows laid out on the
  device in groups aligned to 16 bytes of rows, one `torch._grouped_mm` per projection with int32
  offsets, the outputs gathered back (layout and gather included in the time);
- padded_bmm: the same with grouped_mm = off: one host read of the offsets, then one padded
  `torch.bmm` per projection (the fallback);
- loop: a Python loop over experts (`experts_loop`, the reference): 3 matmuls per expert forward.

    python benchmarks/moe_grouped_gemm.py [--device cpu|cuda] [--dtype fp32|bf16] [--tokens 4096]
        [--experts 8 64] [--dim 192] [--hidden 256] [--top-k 2] [--reps 10] [--json OUT]

Rows per expert follow a random top-k routing (softmax of Gaussian logits), as a router at
initialisation gives. The weights are leaves in --dtype (what `Precision.step` hands the experts in
bf16). Prints median milliseconds over --reps repetitions (after 2 warm-ups; CUDA synchronised
around each), tokens/s (input tokens, each sent to top-k experts) and the loop / grouped_mm ratio,
measured in one process one after another, so the ratios are what to compare on a shared machine;
`auto path` is what model.moe.grouped_mm = auto takes for these rows here. --json OUT writes the
same numbers (and the machine) as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lmforge.model.moe import GroupedExperts, experts_loop

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PATHS = ("grouped_mm", "padded_bmm", "loop")
SCHEMA = "lmforge.moe_grouped_gemm/1"  # --json: these keys, one "results" entry per --experts value


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def timed(run, rows: torch.Tensor, params: list[torch.Tensor], reps: int, device: torch.device) -> float:
    """Median milliseconds of run(x) forward + backward (fresh gradients each time)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(reps + 2):
        for p in params:
            p.grad = None
        x = rows.detach().requires_grad_()
        sync()
        t0 = time.perf_counter()
        out = run(x)
        out.backward(torch.ones_like(out))
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(experts_n: int, args, device: torch.device, dtype: torch.dtype) -> dict:
    logits = torch.randn(args.tokens, experts_n)
    chosen = logits.softmax(-1).topk(args.top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(chosen, minlength=experts_n).to(device)
    rows = torch.randn(int(counts.sum()), args.dim, device=device, dtype=dtype)
    modules = {mode: GroupedExperts(experts_n, args.dim, args.hidden, mode) for mode in ("on", "off", "auto")}
    weights = [torch.randn(experts_n, args.dim, args.hidden) * 0.02, torch.randn(experts_n, args.dim, args.hidden) * 0.02,
               torch.randn(experts_n, args.hidden, args.dim) * 0.02]
    with torch.no_grad():
        for module in modules.values():
            module.to(device, dtype)
            for p, w in zip((module.w_gate, module.w_up, module.w_down), weights):
                p.copy_(w)
    on = modules["on"]
    params = list(on.parameters())
    ms = {"grouped_mm": timed(lambda x: on.sorted_rows(x, counts), rows, params, args.reps, device),
          "padded_bmm": timed(lambda x: modules["off"].sorted_rows(x, counts), rows, list(modules["off"].parameters()),
                              args.reps, device),
          "loop": timed(lambda x: experts_loop(x, counts, on.w_gate, on.w_up, on.w_down), rows, params, args.reps, device)}
    auto = "grouped_mm" if modules["auto"].uses_grouped_mm(rows) else "padded_bmm"
    return {"experts": experts_n, "auto_path": auto, "ms": ms,
            "tokens_per_s": {path: args.tokens / (t / 1000) for path, t in ms.items()},
            "loop_over_grouped_mm": ms["loop"] / ms["grouped_mm"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    machine = device_name(device)
    print(f"torch {torch.__version__}, {machine}, {torch.get_num_threads()} threads; {args.dtype}; forward + backward "
          f"of the SwiGLU experts; {args.tokens} tokens x top-{args.top_k}, dim {args.dim}, expert hidden {args.hidden}")
    print("| experts | grouped_mm (ms) | padded bmm (ms) | per-expert loop (ms) | loop / grouped_mm | auto path |")
    print("|---|---|---|---|---|---|")
    results = []
    for experts_n in args.experts:
        r = measure(experts_n, args, device, dtype)
        results.append(r)
        ms = r["ms"]
        print(f"| {experts_n} | {ms['grouped_mm']:.1f} | {ms['padded_bmm']:.1f} | {ms['loop']:.1f} | "
              f"{r['loop_over_grouped_mm']:.2f} | {r['auto_path']} |")
    report = {"schema": SCHEMA, "device": args.device, "machine": machine, "dtype": args.dtype,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "tokens": args.tokens,
              "top_k": args.top_k, "dim": args.dim, "hidden": args.hidden, "reps": args.reps, "paths": list(PATHS),
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
