"""`lmforge merge`: average the model weights of saved checkpoints into a run folder (lmforge.ckpt.merge).

    lmforge merge runs/wsd --last 3 --out runs/wsd-merged                   # the newest 3 checkpoints, equal weights
    lmforge merge runs/wsd --steps 300,350,400 --weights 1,1,2 --out runs/wsd-merged --hf hf/wsd-merged
    lmforge merge A/checkpoints/step_00000400 B/checkpoints/step_00000400 --out merged   # any checkpoint folders

The output is a run folder (config.toml, tokenizer.json, model.safetensors, merge.json) that
`lmforge eval`, `generate`, `export` and `finetune.init_from` read; `--hf DIR` also exports it as a
transformers folder (through lmforge.interop, which is why this command line sits in lmforge.cli,
above both).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from lmforge.cli.options import OptionParser, count, float_in, list_of, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="lmforge merge", description="Average the model weights (not the optimizer "
                                "state) of saved checkpoints, tensor by tensor, into a run folder; checkpoints of any "
                                "layout, of one model.")
    p.add_argument("sources", nargs="+", metavar="RUN_DIR | CHECKPOINT_DIR",
                   help="a run folder (choose its checkpoints with --last or --steps), or checkpoint folders")
    pick = p.add_mutually_exclusive_group()
    pick.add_argument("--last", type=positive_int, help="the run's newest K valid checkpoints")
    pick.add_argument("--steps", type=list_of(count), help="the run's checkpoints of these steps, e.g. "
                      "300,350,400")
    p.add_argument("--weights", type=list_of(float_in(0)), help="one weight per checkpoint, oldest first "
                   "(normalised to sum 1; default: equal)")
    p.add_argument("--ema", action="store_true", help="average the checkpoints' EMA of the weights (train.ema_decay) "
                   "instead of the weights; one checkpoint: its EMA at that step")
    p.add_argument("--out", required=True, help="the run folder to write (new or empty)")
    p.add_argument("--hf", metavar="HF_DIR", help="also export the merged weights as a transformers folder")
    p.add_argument("--force", action="store_true", help="replace files already in --out (and --hf)")
    return p


def merge_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    missing = [s for s in args.sources if not Path(s).is_dir()]
    if missing:  # (before torch is imported: a wrong path answers at once)
        print(f"error: {missing[0]!r} is not a folder (a run folder or a checkpoint folder).", file=sys.stderr)
        return 2
    from lmforge.ckpt.merge import merge_checkpoints, select_checkpoints

    try:
        ckpts = select_checkpoints(args.sources, args.last, args.steps)
        out = merge_checkpoints(ckpts, args.out, args.weights, overwrite=args.force, ema=args.ema,
                                command="lmforge merge " + " ".join(shlex.quote(a) for a in argv))
        print(f"merged steps {', '.join(str(c.step) for c in ckpts)} into {out} (what was merged: {out}/merge.json)")
        if args.hf:
            from lmforge.interop.hf import export_hf

            print(f"wrote {export_hf(out, args.hf, overwrite=args.force)}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
