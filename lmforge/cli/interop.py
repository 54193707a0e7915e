"""`lmforge export` and `lmforge import`: run folders to and from Hugging Face transformers folders.

    lmforge export --run RUN_DIR --out HF_DIR     # config.json + model.safetensors + tokenizer files
    lmforge export --run RUN_DIR --out HF_DIR --ema   # the EMA of the weights (train.ema_decay)
    lmforge export --run RUN_DIR --out HF_DIR --dtype bf16   # the weights rounded once to bf16
    lmforge import --hf HF_DIR --out RUN_DIR      # config.toml + model.safetensors + tokenizer.json
"""

from __future__ import annotations

import sys

from lmforge.cli.options import OptionParser


EXPORT = dict(prog="lmforge export", description="Write a run as a transformers folder (Llama, Qwen2, Qwen3, "
              "Mistral, Mixtral, Qwen3-MoE, DeepSeek-V3, Qwen3-Next, Qwen3.5 (dense or MoE), Gemma 3 (text), OLMo 2, OLMo 3 or GPT-2) that AutoModelForCausalLM.from_pretrained loads offline.",
              source="run", source_help="lmforge run folder (config.toml + model.safetensors)", export=True)
IMPORT = dict(prog="lmforge import", description="Turn a local transformers Llama, Qwen2, Qwen3, Mistral, Mixtral, "
              "Qwen3-MoE, DeepSeek-V3, Qwen3-Next, Qwen3.5 (dense or MoE), Gemma 3 (text), OLMo 2, OLMo 3 or GPT-2 folder into an lmforge run folder (for generate, eval and "
              "fine-tuning); its weights must be exactly those config.json describes (a missing or extra tensor "
              "is refused, named).",
              source="hf", source_help="transformers folder (config.json + safetensors or pytorch_model.bin)")


def build_parser(prog: str, description: str, source: str, source_help: str, export: bool = False) -> OptionParser:
    """`--<source> PATH --out DIR` (and export's `--ema` / `--dtype` where `export`)."""
    p = OptionParser(prog=prog, description=description)
    p.add_argument(f"--{source}", *(("--ckpt",) if source == "run" else ()), dest=source, required=True,
                   metavar="RUN_DIR" if source == "run" else "HF_DIR", help=source_help)
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--force", action="store_true", help="replace files already in --out")
    if export:
        p.add_argument("--ema", action="store_true", help="export the EMA of the weights (a run trained with "
                       "train.ema_decay: model.ema.safetensors, or its newest checkpoint's) instead of the weights")
        p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                       help="dtype of the exported floating-point weights (default: as the run's model.safetensors)")
    return p


def _run(argv: list[str], spec: dict, convert) -> int:
    """Parse the command line of `spec`, run `convert(path, out, ...)`, print the result or the error."""
    args = build_parser(**spec).parse_args(argv)
    source, export = spec["source"], spec.get("export", False)
    try:
        extra = {"ema": args.ema, "dtype": args.dtype} if export else {}
        out = convert(getattr(args, source), args.out, overwrite=args.force, **extra)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def export_main(argv: list[str]) -> int:
    def export(run, out, overwrite, ema, dtype):
        from lmforge.folders import CHECKPOINTS, check_run_folder

        check_run_folder(run, has_checkpoint=lambda d: (d / CHECKPOINTS).is_dir())  # before torch; verified later
        from lmforge.interop.hf import export_hf

        return export_hf(run, out, overwrite=overwrite, ema=ema, dtype=dtype)

    return _run(argv, EXPORT, export)


def import_main(argv: list[str]) -> int:
    from lmforge.interop.hf import import_hf_run

    return _run(argv, IMPORT, import_hf_run)
