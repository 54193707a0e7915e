"""bf16-pure against bf16 autocast: loss curves and final validation loss over real training runs.

    python benchmarks/bf16_pure_numerics.py [--steps 300] [--models tiny,gpt2-style] [--out DIR] [--json out.json]

Per model, three `lmforge train` runs on the default corpus (one process, 1 thread each): bf16
autocast with train.seed S, bf16 autocast with seed S + 1, and bf16-pure with seed S. The two
autocast runs give the noise floor: how far two runs of the same precision drift apart when only
the seed (initial weights and data order) changes. bf16-pure is then compared with the autocast run
of its own seed. Reported for each pair: the largest relative difference of the per-step training
loss over the steps, of its 20-step moving average (the curve without the batch-to-batch noise),
and of the final validation loss (train.eval_sequences sequences of the validation split).

Models: "tiny" is the tiny preset (Llama-style: RMSNorm, RoPE, SwiGLU, 2.6M parameters);
"gpt2-style" is GPT-2's architecture (learned positions, LayerNorm, GELU, biases, tied embeddings)
at the tiny preset's width (dim 192, 4 layers, 6 heads, the corpus' 4096-token BPE vocabulary), so
300 steps fit a CPU. Results: benchmarks/RESULTS.md, "bf16-pure numerics".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": {},
    "gpt2-style": {"model.pos_emb": "learned", "model.norm": "layernorm", "model.activation": "gelu",
                   "model.bias": "true"},
}
COMMON = {"train.eval_every": 100, "train.sample_tokens": 0, "train.log_every": 1, "train.threads": 1,
          "train.progress": "none", "train.tensorboard": "false", "train.plot": "false",
          "checkpoint.resume": "none", "checkpoint.save_final": "false", "checkpoint.every_minutes": 0}


def run(out: Path, steps: int, overrides: dict, reuse: bool = False) -> Path:
    """One `lmforge train` run into `out` (with `reuse`: a run already finished there is read instead)."""
    if reuse and (out / "metrics.jsonl").is_file() and len(records(out)[0]) == steps:
        print(f"  {out.name}: reused", flush=True)
        return out
    args = {**COMMON, "train.steps": steps, "train.out_dir": str(out), **overrides}
    cmd = [sys.executable, "-m", "lmforge", "train", "--config", "tiny"] + [a for k, v in args.items()
                                                                           for a in (f"--{k}", str(v))]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    print(f"  {out.name}: {time.time() - t0:.0f} s", flush=True)
    return out


def records(run_dir: Path) -> tuple[dict[int, float], float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r and "step" in r}
    return losses, [r["val_loss"] for r in recs if "val_loss" in r][-1]


def moving(losses: dict[int, float], window: int = 20) -> dict[int, float]:
    steps = sorted(losses)
    return {s: sum(losses[t] for t in steps[i - window + 1:i + 1]) / window
            for i, s in enumerate(steps) if i >= window - 1}


def compare(a: Path, b: Path) -> dict:
    (la, va), (lb, vb) = records(a), records(b)
    ma, mb = moving(la), moving(lb)
    rel = lambda x, y: abs(x - y) / abs(y)  # noqa: E731
    return {"loss_max_rel": max(rel(la[s], lb[s]) for s in la.keys() & lb.keys()),
            "loss_ma20_max_rel": max(rel(ma[s], mb[s]) for s in ma.keys() & mb.keys()),
            "final_val_loss": [va, vb], "val_loss_rel": rel(va, vb)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--models", default="tiny,gpt2-style")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bf16-pure-numerics")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--reuse", action="store_true", help="read runs already finished in --out instead of training them")
    args = p.parse_args()
    results = {"command": " ".join(sys.argv), "steps": args.steps, "models": {}}
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        root, model, s = args.out / name, MODELS[name], args.seed
        auto_a = run(root / "bf16-a", args.steps, {**model, "train.precision": "bf16", "train.seed": s}, args.reuse)
        auto_b = run(root / "bf16-b", args.steps, {**model, "train.precision": "bf16", "train.seed": s + 1}, args.reuse)
        pure = run(root / "bf16-pure-a", args.steps, {**model, "train.precision": "bf16-pure", "train.seed": s},
                   args.reuse)
        results["models"][name] = {"autocast seed vs seed (noise floor)": compare(auto_b, auto_a),
                                   "bf16-pure vs autocast, same seed": compare(pure, auto_a)}
        for what, r in results["models"][name].items():
            print(f"  {what}: per-step loss max rel {r['loss_max_rel']:.4f}, 20-step average {r['loss_ma20_max_rel']:.4f}, "
                  f"final val loss {r['final_val_loss'][0]:.4f} vs {r['final_val_loss'][1]:.4f} "
                  f"({100 * r['val_loss_rel']:.2f}%)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
