"""Resume parity on a device: N straight steps against N/2 steps + resume from their checkpoint + N/2
more, in one process, and the largest difference between the two runs' final weights.

    python benchmarks/resume_parity.py --device cuda --precision bf16 --steps 40 [--json out.json]
    python benchmarks/resume_parity.py --device cpu --precision fp32 --steps 8 --small   # CPU smoke

Both runs are the real `Trainer` (`lmforge train`'s class) on the tiny preset and the default corpus,
with compile off and checkpoints every N/2 steps (async saves: on CUDA the pinned staging path of
lmforge.ckpt.manager.device_stager). The straight run's step-N/2 checkpoint is copied into a fresh run
folder, which resumes from it. Kernels are asked to be deterministic
(`torch.use_deterministic_algorithms(True, warn_only=True)`, CUBLAS_WORKSPACE_CONFIG set before CUDA
starts), so the runs are expected to agree bit for bit. Where they do not, the report says which
weights differ and by how much, the first step whose training loss differs, and every op torch warned
has no deterministic kernel (the likely cause). Exit status 1 when the weights differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (cuBLAS reads it when CUDA starts)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from lmforge.ckpt.manager import step_name  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.train.trainer import Trainer  # noqa: E402

SMALL = {"train.global_batch_size": 8, "train.micro_batch_size": 4, "data.seq_len": 32}  # --small: the CPU smoke


def overrides(args: argparse.Namespace) -> dict:
    half = args.steps // 2
    return {"train.steps": args.steps, "train.device": args.device, "train.precision": args.precision,
            "train.compile": False, "train.eval_every": 0, "train.eval_sequences": 32, "train.sample_tokens": 0,
            "train.log_every": 1, "train.plot": False, "train.progress": "none", "train.tensorboard": False,
            "checkpoint.every_steps": half, "checkpoint.keep_last": 2, "checkpoint.every_minutes": 0.0,
            **(SMALL if args.small else {})}


def train(cfg_overrides: dict, out: Path) -> tuple[dict[str, torch.Tensor], dict[int, float], Trainer]:
    trainer = Trainer(load_config("tiny", cfg_overrides), out_dir=out)
    trainer.fit()
    weights = {k: v.detach().float().cpu() for k, v in trainer.model.state_dict().items()}
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "event" not in rec:
            losses[rec["step"]] = rec["loss"]
    return weights, losses, trainer


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    diffs = {k: float((a[k] - b[k]).abs().max()) if a[k].numel() else 0.0 for k in a}
    differing = {k: d for k, d in diffs.items() if d > 0 or not torch.equal(a[k], b[k])}
    worst = max(diffs, key=diffs.get)
    return {"tensors": len(diffs), "differing": len(differing), "max_abs_diff": diffs[worst],
            "worst_tensor": worst if differing else None,
            "differing_tensors": dict(sorted(differing.items(), key=lambda kv: -kv[1])[:10])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=40, help="N, even: N straight vs N/2 + resume + N/2")
    ap.add_argument("--small", action="store_true", help="8 x 32-token batches (the CPU smoke run)")
    ap.add_argument("--dir", default="", help="where the two runs go (default: a temp folder, removed)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        ap.error(f"--steps {args.steps}: an even number >= 2 (the resume is at N/2)")
    root = Path(args.dir or tempfile.mkdtemp(prefix="lmforge-resume-parity-"))
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = overrides(args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        straight, straight_losses, _ = train(cfg, root / "straight")
        half = root / "resumed" / "checkpoints" / step_name(args.steps // 2)
        shutil.copytree(root / "straight" / "checkpoints" / step_name(args.steps // 2), half)
        resumed, resumed_losses, trainer = train(cfg, root / "resumed")
    nondeterministic = sorted({str(w.message).split(" does not have a deterministic")[0]
                               for w in caught if "deterministic" in str(w.message)})
    assert trainer.resumed_from is not None and trainer.resumed_from.name == half.name, trainer.resumed_from
    res = compare(straight, resumed)
    first = next((s for s in sorted(resumed_losses) if resumed_losses[s] != straight_losses.get(s)), None)
    res.update({"device": args.device, "precision": args.precision, "steps": args.steps,
                "resumed_from_step": args.steps // 2, "identical": res["differing"] == 0,
                "first_step_loss_differs": first, "nondeterministic_ops": nondeterministic,
                "final_loss": {"straight": straight_losses.get(args.steps), "resumed": resumed_losses.get(args.steps)},
                "torch": torch.__version__,
                "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"})
    if res["identical"]:
        print(f"resume parity: {args.steps} straight steps == {args.steps // 2} + resume + {args.steps // 2} "
              f"bit for bit ({res['tensors']} tensors, {args.device}, {args.precision})")
    else:
        print(f"resume parity: the weights DIFFER: {res['differing']} of {res['tensors']} tensors, max |diff| "
              f"{res['max_abs_diff']:.3g} in {res['worst_tensor']}; first step whose loss differs: {first}; ops "
              f"torch has no deterministic kernel for: {', '.join(nondeterministic) or 'none reported'}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
