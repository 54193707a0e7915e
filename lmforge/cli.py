"""`lmforge` command line: one entry point, one sub-command per job.

    lmforge train    [--config PRESET|FILE] [--section.key value ...]
    lmforge generate --ckpt RUN_DIR --prompt "..." [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]
    lmforge config   [--config PRESET|FILE] [--section.key value ...] [--docs]
    lmforge presets
    lmforge prepare  --config PREPARE.toml         (lmforge/data/cli_prepare.py)
    lmforge plan     --model PRESET --gpus 8xH100  (lmforge/plan/cli_plan.py)
    lmforge report   RUN_DIR [RUN_DIR ...]         (lmforge/report/cli.py)
    lmforge sweep    --base tiny --grid optim.lr=1e-3,3e-4  (lmforge/sweep/cli.py)
    lmforge eval     --ckpt RUN_DIR [--text F] [--bleu F] [--mc F] (lmforge/eval/cli_eval.py)
    lmforge export   --run RUN_DIR --out HF_DIR    (lmforge/interop/cli.py)
    lmforge import   --hf HF_DIR --out RUN_DIR     (lmforge/interop/cli.py)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from lmforge.config import ConfigError, available_presets, describe, load_config, parse_cli_overrides, to_toml
from lmforge.folders import TOKENIZER


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    cfg = load_config(args.config, parse_cli_overrides(rest))  # validate before the heavy imports
    from lmforge.train.trainer import Trainer

    try:
        result = Trainer(cfg).fit()
    except Exception as exc:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # name the rank (e.g. a collective timeout)
            print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        raise
    if os.environ.get("RANK", "0") != "0":
        return 0  # only rank 0 reports
    print(f"\nvalidation loss {result.val_loss:.4f} (perplexity {result.val_perplexity:.1f}); "
          f"unigram entropy of the corpus {result.unigram_entropy:.3f}")
    if result.sample:
        print(f"\n--- sample ---\n{cfg.train.sample_prompt}{result.sample}\n--------------")
    print(f"run folder: {result.out_dir}")
    return 0


def cmd_generate(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError(f"unexpected arguments {rest}.")
    from pathlib import Path

    from lmforge.ckpt.export import load_run
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.eval.generate import stream_text

    cfg, model = load_run(args.ckpt)
    tok_path = Path(args.ckpt) / TOKENIZER
    if not tok_path.is_file():
        raise ValueError(f"{str(tok_path)!r} is missing: generate needs the run's tokenizer (a run imported from "
                         f"a transformers folder without a tokenizer has none); copy the tokenizer.json the "
                         f"model was trained with into {str(args.ckpt)!r}.")
    tokenizer = Tokenizer.load(tok_path)
    print(args.prompt, end="", flush=True)
    for piece in stream_text(model, tokenizer, args.prompt, args.max_tokens, stop=[args.stop] if args.stop else None,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        print(piece, end="", flush=True)  # stream as tokens arrive
    print()
    return 0


def cmd_config(args: argparse.Namespace, rest: list[str]) -> int:
    if args.docs:
        for key, default, doc in describe():
            print(f"{key:34s} {default:>18s}  {doc}")
        return 0
    print(to_toml(load_config(args.config, parse_cli_overrides(rest))), end="")
    return 0


def cmd_presets(args: argparse.Namespace, rest: list[str]) -> int:
    for name in available_presets():
        cfg = load_config(name, validate=False)
        print(f"{name:16s} {cfg.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description="Train and use decoder-only language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (default: the tiny preset on the embedded corpus)")
    p.add_argument("--config", default="tiny", help="preset name or path to a TOML file (default: tiny)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("generate", help="sample text from a trained run folder")
    p.add_argument("--ckpt", "--run", dest="ckpt", required=True, help="run folder written by `lmforge train`")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", default=None, help="stop when this string appears")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("config", help="print the resolved config, or --docs for every key")
    p.add_argument("--config", default="tiny")
    p.add_argument("--docs", action="store_true")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("presets", help="list the presets")
    p.set_defaults(func=cmd_presets)
    for name, (_, _, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


# Sub-commands that own their argument parsing, each in its concern's folder: name -> (module, function).
DELEGATED = {
    "prepare": ("lmforge.data.cli_prepare", "prepare_main", "turn raw text files into token shards"),
    "plan": ("lmforge.plan.cli_plan", "plan_main", "memory, time and cost of a model on a cluster; best layout"),
    "report": ("lmforge.report.cli", "report_main", "plots and an HTML summary of one or more runs"),
    "sweep": ("lmforge.sweep.cli", "sweep_main", "grid or random hyperparameter search"),
    "eval": ("lmforge.eval.cli_eval", "eval_main", "perplexity, BLEU/chrF, multiple-choice accuracy, fluency"),
    "export": ("lmforge.interop.cli", "export_main", "write a run as a Hugging Face transformers folder"),
    "import": ("lmforge.interop.cli", "import_main", "turn a transformers Llama/GPT-2 folder into a run folder"),
}


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        import importlib

        module, func, _ = DELEGATED[argv[0]]
        return getattr(importlib.import_module(module), func)(argv[1:])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        return args.func(args, rest)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
