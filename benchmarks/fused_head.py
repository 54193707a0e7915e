"""The output head + cross-entropy, plain against fused and chunked (train.loss_chunk): tokens/s of
one forward + backward and its peak memory, at a GPT-2 head (vocab 50,304 x dim 768) by default.

    python benchmarks/fused_head.py                                   # CPU, fp32 and bf16 autocast
    python benchmarks/fused_head.py --device cuda --precision bf16 --tokens 16384 --json head.json

plain: logits = h @ W.T (the compute dtype) -> lmforge.model.loss.token_nll_sum (fp32 copy,
log-softmax, its gradient), the path of train.loss_chunk = 0. fused: lmforge.model.loss.
linear_cross_entropy_sum, `--chunk` tokens at a time (the path of loss_chunk = N or "auto"). Both
take d loss / d h and d loss / d W (fp32 master weight, bf16 autocast as the trainer runs it).

Each arm runs in a fresh process (a warm-up step, then `--steps` timed ones; arms alternate,
`--rounds` times, and the median step counts): on the CPU the peak is the process's peak resident
memory above what it held before the first step; on CUDA torch.cuda.max_memory_allocated above the
inputs. The table, and with --json the numbers, say which arm is faster: the benchmarks/gpu/suite.py
row `head-loss` runs this on the GPU and checks that train.loss_chunk = "auto" picked the faster arm.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    """This process's current resident memory (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_arm(args: argparse.Namespace) -> dict:
    """One arm in this process: warm-up, timed steps, peak memory. Printed as a JSON line."""
    import torch

    from lmforge.model.loss import linear_cross_entropy_sum, token_nll_sum

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = torch.randn(args.tokens, args.dim, generator=g).to(dev).requires_grad_()
    w = (0.02 * torch.randn(args.vocab, args.dim, generator=g)).to(dev).requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step() -> float:
        h.grad = w.grad = None
        with autocast:
            if args.arm == "fused":
                loss = linear_cross_entropy_sum(h, w, y, args.chunk)
            else:
                loss = token_nll_sum(h @ w.t(), y)
        loss.backward()
        return float(loss)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base = rss_bytes()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = step()
    times = []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"arm": args.arm, "loss": loss, "times": times, "peak_bytes": peak,
            "grad_norm_h": float(h.grad.norm()), "grad_norm_w": float(w.grad.norm())}


def measure(args: argparse.Namespace, precision: str) -> dict:
    """Both arms, alternating in fresh processes; medians and the verdict."""
    arms: dict[str, dict] = {"plain": {"times": [], "peaks": []}, "fused": {"times": [], "peaks": []}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for _ in range(args.rounds):
        for arm in ("plain", "fused"):
            cmd = [sys.executable, __file__, "--arm", arm, "--device", args.device, "--precision", precision,
                   "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--dim", str(args.dim),
                   "--chunk", str(args.chunk), "--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            a = arms[arm]
            a["times"] += r["times"]
            a["peaks"].append(r["peak_bytes"])
            a.update(loss=r["loss"], grad_norm_h=r["grad_norm_h"], grad_norm_w=r["grad_norm_w"])
    for a in arms.values():
        a["step_s_median"] = statistics.median(a["times"])
        a["tokens_per_s"] = args.tokens / a["step_s_median"]
        a["peak_gb"] = max(a["peaks"]) / 1e9
    ratio = arms["fused"]["tokens_per_s"] / arms["plain"]["tokens_per_s"]
    return {"precision": precision, "arms": arms, "fused_over_plain": ratio, "faster": "fused" if ratio >= 1 else "plain",
            "logits_fp32_gb": args.tokens * args.vocab * 4 / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", default="", help="fp32 or bf16 (autocast); default: both on the CPU, bf16 on CUDA")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the micro-batch (batch x seq)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--chunk", type=int, default=4096, help="tokens per chunk of the fused arm (train.loss_chunk)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (after one warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="processes per arm, alternating")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--arm", default="", help=argparse.SUPPRESS)  # internal: run one arm in this process
    args = p.parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(args)))
        return 0
    precisions = [args.precision] if args.precision else (["bf16"] if args.device == "cuda" else ["fp32", "bf16"])
    print(f"head + cross-entropy, forward + backward: {args.tokens} tokens x vocab {args.vocab} x dim {args.dim}, "
          f"{args.device}, fused chunk {args.chunk}")
    print("| precision | arm | tokens/s | step s (median) | peak GB | loss |")
    print("|---|---|---|---|---|---|", flush=True)
    results = []
    for prec in precisions:  # (each precision's rows as soon as they are measured)
        r = measure(args, prec)
        results.append(r)
        for name, a in r["arms"].items():
            print(f"| {r['precision']} | {name} | {a['tokens_per_s']:,.0f} | {a['step_s_median']:.3f} | "
                  f"{a['peak_gb']:.2f} | {a['loss']:.4f} |")
        print(f"| {r['precision']} | fused / plain | {r['fused_over_plain']:.3f} | | | |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "tokens": args.tokens, "vocab": args.vocab,
                                               "dim": args.dim, "chunk": args.chunk, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
