"""`lmforge` command line: one entry point, one sub-command per job.

    lmforge train    [--config PRESET|FILE] [--section.key value ...]
    lmforge generate --run RUN_DIR --prompt "..." [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]
    lmforge config   [--config PRESET|FILE] [--section.key value ...] [--docs]
    lmforge presets
    lmforge prepare  --config PREPARE.toml         (lmforge/cli/prepare.py)
    lmforge plan     --model PRESET --gpus 8xH100  (lmforge/cli/plan.py)
    lmforge report   --run RUN_DIR [...]           (lmforge/cli/report.py)
    lmforge sweep    --base tiny --grid optim.lr=1e-3,3e-4  (lmforge/cli/sweep.py)
    lmforge scale    sweep --models 64x2,128x4 --budgets 1e12,1e13 | fit RUNS...  (lmforge/cli/scale.py)
    lmforge eval     --run RUN_DIR [--text F] [--bleu F] [--mc F] (lmforge/cli/eval.py)
    lmforge export   --run RUN_DIR --out HF_DIR    (lmforge/cli/interop.py)
    lmforge merge    RUN_DIR --last K --out DIR    (lmforge/cli/merge.py)
    lmforge compare  RUN_A RUN_B --band loss=1e-3,grad_norm=1e-2 | --reference RUN ...  (lmforge/cli/compare.py)
    lmforge import   --hf HF_DIR --out RUN_DIR     (lmforge/cli/interop.py)
    lmforge launch   [torchrun options] train ...  (lmforge/launch.py: torchrun, exit statuses mapped)
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from lmforge import __version__
from lmforge.cli.options import OptionError, OptionParser, count, float_in, fraction, positive_int, seed
from lmforge.config import ConfigError, available_presets, describe, load_config, parse_cli_overrides, to_toml
from lmforge.config.launch import current_launch
from lmforge.folders import CONFIG, TOKENIZER, check_run_folder, check_writable


TRAIN_ARGS_ENV = "LMFORGE_TRAIN_ARGS"  # overrides appended to every `lmforge train` command line


class _StdoutHandler(logging.StreamHandler):
    """A handler that writes to whatever `sys.stdout` is when a line is logged, not to the stream that
    was stdout when logging was set up: a caller that runs `main()` in-process with stdout redirected
    (a notebook cell, a test's capture) and then restores it would otherwise leave every later log line
    (e.g. an async checkpoint's, from its thread) writing to a closed stream ('--- Logging error ---')."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # (logging.StreamHandler.__init__ assigns it)
        pass


def _setup_logging() -> None:
    """Log lines to stdout. Under torchrun rank 0 alone prints the run's lines (distributed, config,
    data, model, progress, final, ...); another rank prints only its warnings and errors, which are
    about itself, prefixed with its rank."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[_StdoutHandler()], force=True)
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        for handler in logging.getLogger().handlers:
            handler.setLevel(logging.WARNING)
            handler.setFormatter(logging.Formatter(f"rank {rank}: %(message)s"))


def report_on_one_rank(message: str, code: int = 2) -> int:
    """Report an error that every rank of a torchrun job hits alike (a config error: every rank
    parses the same command line) once instead of once per rank, and keep torchrun's
    failure summary to one entry: rank 0 prints `message`, local rank 0 (on every node) returns
    `code` once its sibling workers have ended; under torchrun the others end first, silently and with status 0, so the
    agent lists local rank 0 alone (no SIGTERM entries for the ranks it would otherwise kill).
    torchrun still exits non-zero: local rank 0 failed on every node. Without torchrun's agent
    (TORCHELASTIC_RUN_ID unset) every rank returns `code`; only rank 0 prints."""
    local_rank = os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))
    under_agent = "TORCHELASTIC_RUN_ID" in os.environ
    if local_rank != "0":
        return 0 if under_agent else code
    if under_agent:
        _wait_for_sibling_workers()
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    return code


def _wait_for_sibling_workers(timeout_s: float = 5.0) -> None:
    """Wait (at most `timeout_s`) until the agent has reaped the other workers it started with
    this process's command line (Linux /proc; elsewhere a fixed 1 s grace)."""
    import time

    def siblings() -> set[int]:
        parent, me = os.getppid(), os.getpid()
        own = Path(f"/proc/{me}/cmdline").read_bytes()
        pids: set[int] = set()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                pids.update(int(p) for p in children.read_text().split())
            except OSError:
                continue
        found = set()
        for pid in pids - {me}:
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == own:
                    found.add(pid)
            except OSError:
                continue
        return found

    if not Path(f"/proc/{os.getppid()}/task").is_dir():
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout_s
    while siblings() and time.monotonic() < deadline:
        time.sleep(0.05)


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    extra = shlex.split(os.environ.get(TRAIN_ARGS_ENV, ""))  # (the README test runs examples briefly)
    try:  # validate before the heavy imports; under torchrun every rank reads the same config
        typed = parse_cli_overrides(rest)
        source = train_config_source(args.config, typed)
        if args.run is not None:  # that run's own config, in that folder
            source, typed = continued_run(args.run, args.config, typed)
        cfg = load_config(source, {**typed, **parse_cli_overrides(extra)}, launch=current_launch())
        check_writable(cfg.train.out_dir.format(preset=cfg.preset), "train.out_dir")
    except ValueError as exc:  # (ConfigError included)
        return report_on_one_rank(f"config error: {exc}")
    # what the user typed names the auto run folder (not LMFORGE_TRAIN_ARGS, a test's shortening)
    cfg.named_by = tuple(typed.items())
    cfg.command = train_command(args.config, rest)
    if os.environ.get("RANK", "0") == "0":  # a folder in use is refused before the heavy imports
        from lmforge.train.run_folder import check_folder_free, run_folder

        try:
            check_folder_free(run_folder(cfg, say=False))
        except ValueError as exc:  # (rank 0 alone: under torchrun its exit ends the others)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
    from lmforge.ckpt.manager import EXIT_CHECKPOINT_FAILED, CheckpointFailure
    from lmforge.train import trainer_for
    from lmforge.train.preempt import PREEMPTED_EXIT_CODE, Preempted

    try:
        result = trainer_for(cfg).fit()
    except Preempted:  # (rank 0 logged the one line: step, checkpoint, exit code)
        return PREEMPTED_EXIT_CODE
    except CheckpointFailure as exc:  # (every rank alike) one line, the exit status says it
        if os.environ.get("RANK", "0") == "0":
            print(f"checkpoint error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CHECKPOINT_FAILED
    except ConfigError as exc:  # every rank checks the same config against the same launch: say it once
        return report_on_one_rank(f"config error: {exc}")
    except Exception as exc:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # name the rank (e.g. a collective timeout)
            where = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}"
            if isinstance(exc, ValueError):  # a user error (it may be one rank's): one line, no traceback
                print(f"{where}: error: {exc}", file=sys.stderr, flush=True)
                return 2
            print(f"{where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise
    if os.environ.get("RANK", "0") != "0":
        return 0  # only rank 0 reports
    baseline = "" if result.unigram_entropy != result.unigram_entropy else (  # (NaN for fine-tuning)
        f"; unigram entropy of the corpus {result.unigram_entropy:.3f}")
    print(f"\nvalidation loss {result.val_loss:.4f} (perplexity {result.val_perplexity:.1f}){baseline}")
    if result.sample:
        print(f"\n--- sample ---\n{cfg.train.sample_prompt}{result.sample}\n--------------")
    print(f"run folder: {result.out_dir}")
    return 0


def train_config_source(config: str | None, overrides: dict) -> str:
    """--config; without one, the config.toml of the run folder that finetune.init_from names (an
    imported run's holds its model and data settings, the rest adapting as a preset's; a trained
    run's, that run's whole config), else the tiny preset."""
    if config is not None:
        return config
    init_from = overrides.get("finetune.init_from")
    if init_from and (Path(init_from) / CONFIG).is_file():
        return str(Path(init_from) / CONFIG)
    return "tiny"


def continued_run(run: str, config: str | None, typed: dict) -> tuple[str, dict]:
    """`lmforge train --run RUN_DIR`: the config source (RUN_DIR's config.toml) and the overrides
    (RUN_DIR as train.out_dir). Checked before torch is imported."""
    if config is not None:
        raise ConfigError(f"--run {run} continues that run with its own config.toml; drop --config {config} (or "
                          f"start a new run with --config and --train.out_dir).")
    if "train.out_dir" in typed and Path(typed["train.out_dir"]) != Path(run):
        raise ConfigError(f"--run {run} trains in that folder; drop --train.out_dir {typed['train.out_dir']}.")
    folder = Path(run)
    if not (folder / CONFIG).is_file():
        check_run_folder(folder, has_checkpoint=lambda d: True)  # names what the path is instead
    return str(folder / CONFIG), {**typed, "train.out_dir": str(folder)}


def train_command(config: str | None, rest: list[str]) -> str:
    """The `lmforge train` command line as typed (under torchrun: its launcher, one node)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    head = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)} -m lmforge train" if world > 1 \
        else "lmforge train"
    return " ".join([head] + ([f"--config {shlex.quote(config)}"] if config not in (None, "tiny") else []) + [shlex.quote(a) for a in rest])


def cmd_generate(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError(f"unexpected arguments {rest}.")
    check_run_folder(args.run)  # before torch is imported: a wrong path answers at once
    tok_path = Path(args.run) / TOKENIZER
    if not tok_path.is_file():
        raise ValueError(f"{str(tok_path)!r} is missing: generate needs the run's tokenizer (a run imported from "
                         f"a transformers folder without a tokenizer has none); copy the tokenizer.json the "
                         f"model was trained with into {str(args.run)!r}.")
    from lmforge.ckpt.export import load_run
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.eval.generate import stream_text

    cfg, model = load_run(args.run)
    tokenizer = Tokenizer.load(tok_path)
    print(args.prompt, end="", flush=True)
    for piece in stream_text(model, tokenizer, args.prompt, args.max_tokens, stop=[args.stop] if args.stop else None,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed):
        print(piece, end="", flush=True)  # stream as tokens arrive
    print()
    return 0


def config_docs(preset: str | None = None, overrides: dict | None = None) -> list[str]:
    """The lines of `lmforge config --docs`: every key, a value and its meaning. Without a preset
    the value column holds the built-in defaults (what a TOML file that sets no `inherit` gets for a
    key it leaves out), and the header says where they differ from the tiny preset's; with a preset
    (and overrides) it holds that config's resolved values, `*` marking those that differ from
    the built-in default."""
    from lmforge.cli.sweep import flatten_keys

    rows = describe()
    if preset is None and not overrides:
        tiny = flatten_keys(load_config("tiny", validate=False).to_dict())
        differs = [key for key, default, _ in rows if key in tiny and repr(tiny[key]) != default
                   and key not in ("description", "preset")]
        header = [f"# value column: the built-in defaults, what a config file without `inherit` gets for a key "
                  f"it leaves out (not the tiny preset, which `lmforge train` uses by default: it differs in "
                  f"{', '.join(differs) or 'nothing'}); `lmforge config --docs --config PRESET` shows a "
                  f"preset's values."]
        return header + [f"{key:34s} {default:>18s}  {doc}" for key, default, doc in rows]
    cfg = load_config(preset or "tiny", overrides or {})
    values = flatten_keys(cfg.to_dict())
    name = preset or "tiny"
    header = [f"# value column: the resolved config of {name!r}" + (" with the given overrides" if overrides else "")
              + "; * = differs from the built-in default (`lmforge config --docs` lists those)."]
    lines = []
    for key, default, doc in rows:
        value = repr(values[key]) if key in values else default
        mark = "*" if value != default else " "
        lines.append(f"{key:34s} {value:>18s}{mark} {doc}")
    return header + lines


def cmd_config(args: argparse.Namespace, rest: list[str]) -> int:
    overrides = parse_cli_overrides(rest)
    if args.docs:
        print("\n".join(config_docs(args.config, overrides)))
        return 0
    print(to_toml(load_config(args.config or "tiny", overrides)), end="")
    return 0


def cmd_presets(args: argparse.Namespace, rest: list[str]) -> int:
    for name in available_presets():
        cfg = load_config(name, validate=False)
        print(f"{name:16s} {cfg.description}")
    return 0


OVERRIDES_HELP = """\
config overrides (lmforge train, config and sweep):
  --section.key value   set any config key, e.g. --optim.lr 3e-4 --train.steps 100 --model.n_layers 6
                        (also --section.key=value); values are TOML: numbers, true/false, strings
  lmforge config --docs               every key with its default and meaning
  lmforge config --config PRESET ...  the resolved config (preset + overrides) as TOML
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(prog="lmforge", description="Train and use decoder-only language models.",
                                     epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (default: the tiny preset on the embedded corpus)",
                       description="Train a model: a preset or TOML file, plus any config key set on the command "
                       "line.", epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="preset name or path to a TOML file (default: tiny, or with "
                   "--finetune.init_from RUN_FOLDER that run's config.toml; `lmforge presets` lists the presets)")
    p.add_argument("--run", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR (after a crash or a "
                   "preemption: from its newest valid checkpoint) with its own config.toml; overrides still apply")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("generate", help="sample text from a trained run folder")
    p.add_argument("--run", "--ckpt", dest="run", metavar="RUN_DIR", required=True,
                   help="run folder written by `lmforge train` (--ckpt: its old name)")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--max-tokens", type=positive_int, default=200)
    p.add_argument("--temperature", type=float_in(0), default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=count, default=50, help="0 = off")
    p.add_argument("--top-p", type=fraction, default=1.0)
    p.add_argument("--seed", type=seed, default=None)
    p.add_argument("--stop", default=None, help="stop when this string appears")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("config", help="print the resolved config, or --docs for every key",
                       description="Print the resolved config as TOML, or with --docs every key with its value "
                       "and meaning.", epilog=OVERRIDES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="preset name or path to a TOML file (default: tiny; with "
                   "--docs: the built-in defaults)")
    p.add_argument("--docs", action="store_true", help="every config key with its value and meaning")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("presets", help="list the presets")
    p.set_defaults(func=cmd_presets)
    sub.add_parser("launch", help="torchrun with exit statuses a scheduler can act on (lmforge launch --help)",
                   add_help=False)
    for name, (_, _, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


# Sub-commands that own their argument parsing, each a module of this package, imported only when that
# sub-command runs: name -> (module, function, help).
DELEGATED = {
    "prepare": ("lmforge.cli.prepare", "prepare_main", "turn raw text files into token shards"),
    "plan": ("lmforge.cli.plan", "plan_main", "memory, time and cost of a model on a cluster; best layout"),
    "report": ("lmforge.cli.report", "report_main", "plots and an HTML summary of one or more runs"),
    "sweep": ("lmforge.cli.sweep", "sweep_main", "grid or random hyperparameter search"),
    "scale": ("lmforge.cli.scale", "scale_main", "IsoFLOP grids of runs; scaling-law fits (FIT.json)"),
    "eval": ("lmforge.cli.eval", "eval_main", "perplexity, BLEU/chrF, multiple-choice accuracy, fluency"),
    "export": ("lmforge.cli.interop", "export_main", "write a run as a Hugging Face transformers folder"),
    "import": ("lmforge.cli.interop", "import_main", "turn a transformers Llama/Qwen/Mixtral/GPT-2 folder into a run"),
    "merge": ("lmforge.cli.merge", "merge_main", "average the weights of saved checkpoints into a run folder"),
    "compare": ("lmforge.cli.compare", "compare_main", "two runs' loss and grad norm per step, within a band"),
}


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "launch":  # torchrun as the engine, exit statuses mapped (lmforge/launch.py)
        from lmforge.launch import launch_main

        try:
            return launch_main(argv[1:], set(DELEGATED) | {"train", "generate", "config", "presets"})
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if argv and argv[0] in DELEGATED:
        import importlib

        module, func, _ = DELEGATED[argv[0]]
        try:
            return getattr(importlib.import_module(module), func)(argv[1:])
        except OptionError as exc:  # a numeric option out of range, found while parsing (lmforge/cli/options.py)
            print(f"error: {exc}", file=sys.stderr)
            return 2
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        return args.func(args, rest)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a training loop's handlers (imports, set-up of other commands)
        if os.environ.get("RANK", "0") == "0":
            print("interrupted", file=sys.stderr, flush=True)
        return 130


def exit_now(code: int | None) -> None:
    """End the process with `code` as the interpreter's own exit would (the non-daemon threads joined,
    the atexit handlers run, the streams flushed), less its teardown of the loaded modules: with torch
    and torch.distributed loaded that teardown deallocates tens of thousands of objects nobody uses
    again, ~0.7 s of a 2-core machine at the end of every command and of every rank. Files are
    closed by their owners before this (the trainer's, the checkpointer's), and the kernel closes
    the descriptors. Python gives no public call for this order; where `threading._shutdown` is
    missing (another interpreter), the plain `sys.exit`."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None or not hasattr(atexit, "_run_exitfuncs"):
        sys.exit(code)
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # (a closed or absent stream)
            pass
    os._exit(0 if code is None else code)


def run() -> None:
    """The `lmforge` console script: `main()`, then `exit_now`."""
    exit_now(main())


if __name__ == "__main__":
    run()
