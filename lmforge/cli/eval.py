"""`lmforge eval`: perplexity, BLEU/chrF, multiple-choice accuracy and a fluency report of a run.

    lmforge eval --run RUN_DIR                       # perplexity on the run's validation shards + samples
    lmforge eval --run RUN_DIR --ema --mc shakespeare-cloze   # the EMA of the weights (train.ema_decay)
    lmforge eval --run RUN_DIR --text book.txt --window 256 --stride 128
    lmforge eval --run RUN_DIR --data prepared/val --bleu pairs.jsonl --mc hellaswag.jsonl --mc piqa.jsonl \\
                 --json results.json

Perplexity is exp(mean NLL per scored token) over a sliding window (`--window` tokens, default the
model's context; a new window every `--stride` tokens, default half a window, so every token
after the first window sees at least window - stride tokens of context).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.folders import TOKENIZER, check_run_folder
from lmforge.cli.options import OptionParser, count, float_in, positive_int, seed


@dataclass
class EvalOptions:
    """What `lmforge eval` computes; see `build_parser` for the meaning of each field."""

    ckpt: str
    ema: bool = False
    text: str | None = None
    data: str | None = None
    perplexity: bool = True
    window: int = 0
    stride: int = 0
    max_tokens: int = 0
    bleu: str | None = None
    max_new_tokens: int = 64
    stop: str = "\n"
    mc: list[str] = field(default_factory=list)
    samples: int = 4
    sample_tokens: int = 100
    prompt: str | None = None
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0
    batch_size: int = 8
    device: str = "cpu"


def _stream_tokens(opts: EvalOptions, cfg, tokenizer) -> tuple[str, Any]:
    """(description, token ids) of the perplexity data: a text file, a shard folder, or the run's
    own validation shards."""
    import numpy as np

    from lmforge.data.shards import MANIFEST, TokenShards

    if opts.text and opts.data:
        raise ValueError("give either --text or --data, not both.")
    if opts.text:
        path = Path(opts.text)
        if not path.is_file():
            raise ValueError(f"--text {path}: file not found.")
        if tokenizer is None:
            raise ValueError(f"--text needs the run's tokenizer, but {Path(opts.ckpt) / TOKENIZER} is missing.")
        return str(path), np.asarray(tokenizer.encode(path.read_text(encoding="utf-8")), dtype=np.int64)
    if opts.data:
        folder = Path(opts.data)
        if not (folder / MANIFEST).is_file() and (folder / "val" / MANIFEST).is_file():
            folder = folder / "val"  # a prepared dataset folder: its validation split
    else:
        from lmforge.train.components import prepare_data

        try:
            folder = prepare_data(cfg).val_dir
        except Exception as exc:  # noqa: BLE001 (a missing cache, no network, a deleted folder ...)
            raise ValueError(f"could not open the run's validation data ({exc}); pass --data SHARD_DIR or "
                             f"--text FILE.") from exc
    shards = TokenShards(folder)
    n = len(shards) if not opts.max_tokens else min(len(shards), opts.max_tokens)
    return str(folder), shards.read(0, n)


def run_documents(cfg, tokenizer):
    """The document masking a run trained with (data.attention = "document"; lmforge.model.documents), or
    None: its perplexity windows attend as it trained."""
    from lmforge.model.documents import DocumentAttention

    if cfg.data.attention != "document" or tokenizer is None or tokenizer.eos_id is None:
        return None
    return DocumentAttention(tokenizer.eos_id, cfg.data.document_positions == "restart")


def run_eval(opts: EvalOptions) -> dict[str, Any]:
    """Load the run, compute what `opts` asks for, and return the results as a dict."""
    check_run_folder(opts.ckpt)  # the folder and the files named, before torch is imported
    from lmforge.folders import BUILTIN_TASKS

    for flag, path in [("--text", opts.text), ("--data", opts.data), ("--bleu", opts.bleu)] + [
            ("--mc", m) for m in opts.mc if m not in BUILTIN_TASKS]:
        if path and not Path(path).exists():
            raise ValueError(f"{flag} {path!r} does not exist.")
    from lmforge.ckpt.export import load_run
    from lmforge.config.rules import auto_loss_chunk
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.eval.bleu import bleu_chrf, hypothesis, load_bleu_items
    from lmforge.eval.fluency import fluency_report
    from lmforge.eval.generate import generate_text
    from lmforge.eval.perplexity import perplexity_report, sliding_window_nll
    from lmforge.eval.tasks import evaluate_mc, load_mc_items, resolve_task

    cfg, model = load_run(opts.ckpt, opts.device, ema=opts.ema)
    tok_path = Path(opts.ckpt) / TOKENIZER
    tokenizer = Tokenizer.load(tok_path) if tok_path.is_file() else None
    needs_text = opts.bleu or opts.mc or opts.samples
    if needs_text and tokenizer is None:
        raise ValueError(f"{tok_path} is missing: BLEU, multiple-choice and samples need the run's tokenizer "
                         f"(use --samples 0 and only perplexity on --data).")
    results: dict[str, Any] = {"run": str(opts.ckpt) + (" (EMA of the weights)" if opts.ema else "")}
    if opts.perplexity:
        source, tokens = _stream_tokens(opts, cfg, tokenizer)
        if tokens.size and int(tokens.max()) >= cfg.model.vocab_size:
            raise ValueError(f"{source} holds token id {int(tokens.max())} >= model.vocab_size = "
                             f"{cfg.model.vocab_size}: it was tokenized with another tokenizer.")
        window = opts.window or cfg.model.max_seq_len
        stride = opts.stride or max(1, window // 2)
        # the whole model in fp32 in one process: the chunked loss as train.loss_chunk = "auto" picks it
        # there (vocabularies of 8192 and more), so a large vocabulary's logits are never held whole
        nll, count = sliding_window_nll(model, tokens, window, stride, opts.batch_size, opts.device,
                                        loss_chunk=auto_loss_chunk(cfg.model.vocab_size),
                                        documents=run_documents(cfg, tokenizer))
        results["perplexity"] = {"source": source, **perplexity_report(nll, count), "window": window,
                                 "stride": stride}
    if opts.bleu:
        prompts, refs = load_bleu_items(opts.bleu)
        hyps = [hypothesis(generate_text(model, tokenizer, p, opts.max_new_tokens, temperature=0.0), opts.stop)
                for p in prompts]
        results["bleu"] = {"file": opts.bleu, **bleu_chrf(hyps, refs)}
        results["bleu_hypotheses"] = hyps
    if opts.mc:
        results["multiple_choice"] = {f: evaluate_mc(model, tokenizer, load_mc_items(resolve_task(f)), opts.batch_size)
                                      for f in opts.mc}
    if opts.samples:
        prompt = opts.prompt if opts.prompt is not None else cfg.train.sample_prompt
        samples = [generate_text(model, tokenizer, prompt, opts.sample_tokens, temperature=opts.temperature,
                                 top_k=opts.top_k, seed=opts.seed + i) for i in range(opts.samples)]
        results["fluency"] = {"prompt": prompt, **fluency_report(samples)}
        results["samples"] = samples
    return results


def format_table(results: dict[str, Any]) -> str:
    """The results as aligned `metric  value` lines, one section per evaluation."""
    sections = []  # (title, [(label, value), ...])
    if "perplexity" in results:
        p = results["perplexity"]
        sections.append((f"perplexity ({p['source']}, window {p['window']}, stride {p['stride']})",
                         [("loss (nats/token)", p["loss"]), ("perplexity", p["perplexity"]),
                          ("tokens scored", p["tokens"])]))
    if "bleu" in results:
        b = results["bleu"]
        sections.append((f"generation vs references ({b['file']}, greedy)",
                         [("BLEU", b["bleu"]), ("chrF", b["chrf"]), ("items", b["n"])]))
    for f, r in results.get("multiple_choice", {}).items():
        sections.append((f"multiple choice ({f})", [("acc", r["acc"]), ("acc_norm", r["acc_norm"]), ("items", r["n"])]))
    if "fluency" in results:
        fl = results["fluency"]
        sections.append((f"fluency of {fl['samples']} samples (prompt {fl['prompt']!r})",
                         [(k, v) for k, v in fl.items() if k not in ("prompt", "samples")]))
    lines = [f"run: {results['run']}"]
    for title, rows in sections:
        lines.append(title)
        for name, value in rows:
            text = f"{value:.4f}" if isinstance(value, float) else str(value)
            lines.append(f"  {name:28s} {text:>12s}")
    lines += ["  sample: " + " ".join(s.split())[:100] for s in results.get("samples", [])[:2]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="lmforge eval", description="Evaluate a run folder: perplexity, BLEU/chrF, "
                                "multiple-choice accuracy, fluency of samples.")
    p.add_argument("--run", "--ckpt", dest="ckpt", metavar="RUN_DIR", required=True,
                   help="run folder (config.toml + model.safetensors); --ckpt: its old name")
    p.add_argument("--ema", action="store_true", help="evaluate the EMA of the weights (model.ema.safetensors of a "
                   "run trained with train.ema_decay)")
    g = p.add_argument_group("perplexity (default: the run's validation shards)")
    g.add_argument("--text", help="a UTF-8 text file, tokenized with the run's tokenizer")
    g.add_argument("--data", help="a token-shard folder (manifest.json) or a prepared dataset folder (uses val/)")
    g.add_argument("--no-perplexity", dest="perplexity", action="store_false", help="skip perplexity")
    g.add_argument("--window", type=count, default=0, help="tokens per window (default: model.max_seq_len)")
    g.add_argument("--stride", type=count, default=0, help="tokens between window starts (default: window // 2)")
    g.add_argument("--max-tokens", type=count, default=0, help="score only the first N tokens of --data (0 = all)")
    g = p.add_argument_group("BLEU / chrF")
    g.add_argument("--bleu", help='jsonl of {"prompt": ..., "reference": ...}; prompts are continued greedily')
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--stop", default="\n", help="cut each generation at this string, after its leading whitespace "
                   "(default: newline, so the first line of text; '' = none)")
    g = p.add_argument_group("multiple choice")
    g.add_argument("--mc", action="append", default=[], help='jsonl of {"context", "choices", "label"}, or a task shipped '
                   'with lmforge: shakespeare-cloze (repeatable)')
    g = p.add_argument_group("samples and fluency")
    g.add_argument("--samples", type=count, default=4, help="sampled continuations for the fluency report (0 = none)")
    g.add_argument("--sample-tokens", type=positive_int, default=100)
    g.add_argument("--prompt", default=None, help="prompt of the samples (default: the run's train.sample_prompt)")
    g.add_argument("--temperature", type=float_in(0), default=0.8)
    g.add_argument("--top-k", type=count, default=50)
    g.add_argument("--seed", type=seed, default=0)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def eval_main(argv: list[str]) -> int:
    args = vars(build_parser().parse_args(argv))
    out = args.pop("json")
    try:
        results = run_eval(EvalOptions(**args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if out:
        Path(out).write_text(json.dumps(results, indent=2))
        print(f"wrote {out}")
    return 0
