"""μP learning-rate transfer on the CPU (issue 48 item 1): an LR sweep at several widths, under the
standard parametrization (SP) and under μP (model.parametrization = "mup", base width = the
narrowest), with lmforge's own sweep (`lmforge sweep`: one `lmforge train` per trial).

Under μP the best learning rate of the narrow model is the best of the wide ones (the same grid
point); under SP it moves. Prints a markdown table of the final validation losses (the best of each
row in bold), the best LR per (parametrization, width) and what the wider models lose at the
narrowest one's best LR, and draws the loss-vs-LR curves (--plot, a PNG).

    python benchmarks/mup_transfer.py --out runs/mup-transfer --plot benchmarks/mup_transfer.png

The defaults are what benchmarks/RESULTS.md records: widths 64, 128, 256, 2 layers, 4 heads (so
head_dim grows with the width, as μP's attention scaling assumes), model.init_std 0.06 (about
0.5 / sqrt(64); GPT-2's 0.02 is sized for width 768, and μP carries the base's init to every width),
the default corpus with a 512-token BPE vocabulary, seq 64, batch 16, 200 AdamW steps (cosine, 20
warmup), fp32, LRs 1e-3 .. 3.2e-2 by factors of 2, one thread per trial, two trials at a time. Re-running resumes the sweep (finished trials are
skipped); --report-only re-reads a finished sweep; a grid extended later (more LRs) runs as a sweep of
its own, reported together with the first through --merge.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

LRS = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2)


def sweep_command(args) -> list[str]:
    """The `lmforge sweep` command line of the experiment."""
    grid = [f"model.dim={','.join(str(w) for w in args.widths)}",
            f"model.parametrization={','.join(args.parametrizations)}",
            f"optim.lr={','.join(f'{lr:g}' for lr in args.lrs)}"]
    base = {"model.n_layers": args.layers, "model.n_heads": args.heads, "model.max_seq_len": args.seq,
            "model.mup_base_width": args.widths[0], "data.seq_len": args.seq,
            "model.vocab_size": args.vocab, "data.tokenizer_vocab_size": args.vocab, "model.init_std": args.init_std,
            "train.global_batch_size": args.batch, "train.micro_batch_size": args.batch, "train.steps": args.steps,
            "schedule.warmup_steps": max(1, args.steps // 10), "train.eval_every": 0,
            "train.eval_sequences": args.eval_sequences, "train.sample_tokens": 0, "train.precision": "fp32",
            "train.plot": "false", "train.tensorboard": "false", "train.progress": "lines",
            "train.log_every": max(1, args.steps // 5), "checkpoint.every_minutes": 0, "checkpoint.every_steps": 0,
            "checkpoint.save_final": "false"}
    cmd = [sys.executable, "-m", "lmforge", "sweep", "--out", str(args.out), "--threads", str(args.threads),
           "--parallel", str(args.parallel), "--no-report"]
    for g in grid:
        cmd += ["--grid", g]
    for key, value in base.items():
        cmd += [f"--{key}", str(value)]
    return cmd


def read_results(out: Path) -> dict[tuple[str, int, float], float]:
    """(parametrization, width, lr) -> final validation loss of each finished trial: inf for one that
    finished without a finite loss or failed (diverged); trials not run yet (or interrupted) are left out."""
    rows = json.loads((out / "results.json").read_text())
    got = {}
    for r in rows:
        if r.get("status") not in ("done", "skipped", "failed"):
            continue
        loss = r.get("val_loss")
        ok = r["status"] != "failed" and isinstance(loss, (int, float)) and math.isfinite(loss)
        got[(r["model.parametrization"], int(r["model.dim"]), float(r["optim.lr"]))] = float(loss) if ok else math.inf
    return got


def best_lrs(results: dict[tuple[str, int, float], float]) -> dict[tuple[str, int], float]:
    """(parametrization, width) -> the LR of the lowest validation loss."""
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for (p, w, lr), loss in results.items():
        if (p, w) not in best or loss < best[(p, w)][1]:
            best[(p, w)] = (lr, loss)
    return {k: v[0] for k, v in best.items()}


def table(results: dict[tuple[str, int, float], float]) -> str:
    """Markdown: one row per (parametrization, width), one column per LR, the best in bold."""
    lrs = sorted({lr for _, _, lr in results})
    rows = sorted({(p, w) for p, w, _ in results}, key=lambda k: (k[0] != "sp", k[1]))
    best = best_lrs(results)
    lines = ["| parametrization | width | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |",
             "|---|---|" + "---|" * len(lrs) + "---|"]
    for p, w in rows:
        cells = []
        for lr in lrs:
            loss = results.get((p, w, lr))
            text = "-" if loss is None else ("diverged / failed" if math.isinf(loss) else f"{loss:.4f}")
            cells.append(f"**{text}**" if lr == best[(p, w)] else text)
        lines.append(f"| {p.upper() if p == 'sp' else 'μP'} | {w} | " + " | ".join(cells) + f" | {best[(p, w)]:g} |")
    return "\n".join(lines)


def plot(results: dict[tuple[str, int, float], float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = sorted({p for p, _, _ in results}, key=lambda p: p != "sp")
    fig, axes = plt.subplots(1, len(params), figsize=(5.5 * len(params), 4), sharey=True, squeeze=False)
    for ax, p in zip(axes[0], params):
        for w in sorted({w for q, w, _ in results if q == p}):
            pts = sorted((lr, loss) for (q, v, lr), loss in results.items() if q == p and v == w and math.isfinite(loss))
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=f"width {w}")
            lr, loss = min(pts, key=lambda t: t[1])
            ax.scatter([lr], [loss], s=120, facecolors="none", edgecolors="black")
        ax.set_xscale("log")
        ax.set_xlabel("optim.lr")
        ax.set_title("SP" if p == "sp" else "μP (base width = narrowest)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("final validation loss")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/mup-transfer"), help="sweep folder")
    ap.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128, 256],
                    help="model.dim values, narrowest first (the μP base width)")
    ap.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=list(LRS))
    ap.add_argument("--parametrizations", type=lambda s: s.split(","), default=["sp", "mup"])
    ap.add_argument("--init-std", type=float, default=0.06,
                    help="model.init_std (~0.5/sqrt(base width): GPT-2's 0.02 is sized for width 768)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512, help="BPE vocabulary trained on the default corpus")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-sequences", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="threads per trial")
    ap.add_argument("--parallel", type=int, default=2, help="trials run at once")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of validation loss against LR")
    ap.add_argument("--report-only", action="store_true", help="only read the sweep folder's results")
    ap.add_argument("--merge", type=Path, action="append", default=[],
                    help="also report the trials of this earlier sweep folder (e.g. the grid this sweep extends)")
    args = ap.parse_args(argv)
    if not args.report_only:
        proc = subprocess.run(sweep_command(args), env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if proc.returncode != 0:
            print(f"lmforge sweep exited {proc.returncode}", file=sys.stderr)
            return proc.returncode
    results = {}
    for folder in [*args.merge, args.out]:  # (this sweep's trials last: they win)
        results.update(read_results(folder))
    print(table(results))
    best = best_lrs(results)
    for p in args.parametrizations:
        found = [best.get((p, w)) for w in args.widths if (p, w) in best]
        print(f"{p}: best lr per width {dict((w, best[(p, w)]) for w in args.widths if (p, w) in best)} -> "
              f"{'the same grid point' if len(set(found)) == 1 else 'moves'}")
        base_best = best.get((p, args.widths[0]))
        for w in args.widths[1:]:  # the wide model at the narrow one's best lr: how much it loses
            if (p, w) not in best or (p, w, base_best) not in results:
                continue
            gap = results.get((p, w, base_best), math.inf) - min(v for (q, u, _), v in results.items() if (q, u) == (p, w))
            print(f"{p}: width {w} at width {args.widths[0]}'s best lr {base_best:g} is {gap:.4f} above its own best")
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
