"""Document masking and best-fit packing on the tiny preset: validation loss at equal training tokens.

    python benchmarks/document_recipes.py [--steps 250] [--mb 3] [--json out.json]

Corpus: the embedded default corpus (Shakespeare + Milton) cut into paragraph documents (speeches and
stanzas of more than 200 characters, as benchmarks/data_throughput.py does; about 100 tokens each),
prepared once with `lmforge prepare` (byte-level BPE of the tiny preset's 4096 tokens, 2% of the
documents held out). Then the tiny preset (4 layers, dim 192, 128-token sequences, 32 per step)
trains four ways, each a real `lmforge train` process with the same seed:

* concat + causal   (lmforge's default: fixed windows, attention across documents)
* concat + document (data.attention = "document")
* best_fit + causal (data.packing = "best_fit")
* best_fit + document

Equal tokens: a best-fit row holds padding, so its runs get steps / (1 - padding fraction) steps
(the fraction measured on the loader's rows before training), i.e. the same number of real target
tokens as the concatenated runs (`--equal steps` compares at equal steps instead). Every run is scored
on the same validation tokens two ways, attending as it trained:

* windows: lmforge's own validation (train.eval_sequences concatenated 128-token windows of the
  held-out documents; most start inside a document and hold the end of one and the start of another);
* documents: every held-out document on its own, from its first token, one per row (a document longer
  than a row in pieces, as best-fit packing splits it), padding ignored: what a prompt is at generation.

Printed: each run's steps, real training tokens, both validation losses, and the padding fraction.
`--reuse` keeps the runs already in `--workdir` and only scores them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = {"concat + causal": {}, "concat + document": {"data.attention": "document"},
        "best_fit + causal": {"data.packing": "best_fit"},
        "best_fit + document": {"data.packing": "best_fit", "data.attention": "document"}}


def padding_of(prepared: Path, seq_len: int, batch: int, seed: int, rows: int = 4096) -> float:
    """Padding fraction of the first `rows` best-fit rows the tiny run would draw."""
    from lmforge.data.loader import PackedLoader, open_tokens

    loader = PackedLoader(open_tokens(prepared / "train"), seq_len, batch, seed=seed, packing="best_fit")
    real = total = 0
    for _ in range(rows // batch):
        _, y = loader.next_batch()
        real += int((y != -100).sum())
        total += y.numel()
    return 1 - real / total


def document_loss(run: Path, prepared: Path, seq_len: int, batch: int = 32) -> float:
    """Mean token NLL of every held-out document alone (module docstring), on the run's final weights."""
    import numpy as np
    import torch

    from lmforge.ckpt.export import load_run
    from lmforge.data.packing import document_spans, padded_batch, split_long
    from lmforge.data.prepare import load_prepared
    from lmforge.data.shards import TokenShards
    from lmforge.eval.perplexity import evaluate_loss
    from lmforge.model.documents import DocumentAttention

    cfg, model = load_run(run, "cpu")
    data = load_prepared(prepared)
    val = TokenShards(data.val_dir)
    eos = data.tokenizer.eos_id
    starts, lengths, _ = split_long(*document_spans(val, eos), seq_len)
    rows = np.full((len(starts), seq_len + 1), eos, dtype=np.int64)
    for i, (a, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        rows[i, :n] = val.read(a, n)
    x, y = padded_batch(rows, lengths)
    batches = [(torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])) for i in range(0, len(x), batch)]
    documents = DocumentAttention(eos) if cfg.data.attention == "document" else None
    return evaluate_loss(model, batches, contextlib.nullcontext, torch.device("cpu"), documents=documents)["loss"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=250, help="steps of the concatenated runs (the tiny preset's)")
    p.add_argument("--mb", type=float, default=3.0, help="MB of paragraph documents")
    p.add_argument("--equal", choices=("tokens", "steps"), default="tokens")
    p.add_argument("--precision", default="fp32", help="train.precision (fp32: the faster on the CPUs measured)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the corpus and runs here")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--reuse", action="store_true", help="score the finished runs in --workdir, train no new ones")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from data_throughput import build_corpus

    from lmforge.config import load_config

    work = args.workdir or Path(tempfile.mkdtemp(prefix="lmf-docs-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus, nbytes = build_corpus(work / "paragraphs.jsonl", args.mb)
    prepared = work / "prepared"
    (work / "prepare.toml").write_text(
        f'[prepare]\noutput_dir = "{prepared}"\nvocab_size = 4096\nval_fraction = 0.02\n'
        f'[[prepare.sources]]\nname = "shakespeare"\npath = "{corpus}"\n')
    subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(work / "prepare.toml")], check=True)
    tiny = load_config("tiny")
    seq, batch = tiny.data.seq_len, tiny.train.global_batch_size
    pad = padding_of(prepared, seq, batch, tiny.train.seed)
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "corpus_mb": round(nbytes / 1e6, 2),
               "best_fit_padding_fraction": round(pad, 4), "runs": {}}
    print(f"best-fit padding fraction: {pad:.1%}", flush=True)
    for name, extra in RUNS.items():
        best_fit = extra.get("data.packing") == "best_fit"
        steps = round(args.steps / (1 - pad)) if best_fit and args.equal == "tokens" else args.steps
        out = work / name.replace(" + ", "-")
        overrides = {"data.corpus": str(prepared), "train.steps": steps, "train.out_dir": str(out),
                     "train.eval_every": 0, "train.sample_tokens": 0, "train.progress": "lines", "train.precision": args.precision,
                     "train.plot": "false", "train.tensorboard": "false", "checkpoint.every_minutes": 0,
                     "checkpoint.resume": "none", **extra}
        t0 = time.time()
        if not (args.reuse and (out / "summary.json").is_file()):
            subprocess.run([sys.executable, "-m", "lmforge", "train",
                            *[a for k, v in overrides.items() for a in (f"--{k}", str(v))]], check=True)
        summary = json.loads((out / "summary.json").read_text())
        real = steps * batch * seq * ((1 - pad) if best_fit else 1)
        whole = document_loss(out, prepared, seq)
        results["runs"][name] = {"steps": summary["steps"], "val_loss_windows": round(summary["val_loss"], 4),
                                 "val_loss_documents": round(whole, 4), "real_target_tokens": round(real),
                                 "seconds": round(time.time() - t0)}
        print(f"{name}: {summary['steps']} steps, {real / 1e6:.2f} M real target tokens, validation loss: windows "
              f"{summary['val_loss']:.4f}, whole documents {whole:.4f}", flush=True)
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
