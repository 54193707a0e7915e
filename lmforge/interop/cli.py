"""`lmforge export` and `lmforge import`: run folders to and from Hugging Face transformers folders.

    lmforge export --run RUN_DIR --out HF_DIR     # config.json + model.safetensors + tokenizer files
    lmforge import --hf HF_DIR --out RUN_DIR      # config.toml + model.safetensors + tokenizer.json
"""

from __future__ import annotations

import argparse
import sys


def export_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge export", description="Write a run as a transformers folder "
                                "(LlamaForCausalLM or GPT2LMHeadModel) that from_pretrained loads offline.")
    p.add_argument("--run", required=True, help="lmforge run folder (config.toml + model.safetensors)")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    from lmforge.interop.hf import export_hf

    try:
        out = export_hf(args.run, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def import_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge import", description="Turn a local transformers Llama or GPT-2 "
                                "folder into an lmforge run folder (for generate, eval and fine-tuning).")
    p.add_argument("--hf", required=True, help="transformers folder (config.json + safetensors or pytorch_model.bin)")
    p.add_argument("--out", required=True, help="output run folder")
    args = p.parse_args(argv)
    from lmforge.interop.hf import import_hf_run

    try:
        out = import_hf_run(args.hf, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (try: lmforge generate --ckpt {out})")
    return 0
