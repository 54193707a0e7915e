"""`lmforge prepare` output plugs into `lmforge train` via data.corpus (a two-source mixture)."""

import json
import subprocess
import sys

from tests import warm_start
from tests.conftest import make_corpus


def test_train_on_a_prepared_mixture_through_the_cli(tmp_path):
    web = make_corpus(tmp_path / "raw" / "web", n_docs=20, words_per_doc=400, seed=1)
    books = tmp_path / "raw" / "books.jsonl"
    books.write_text("\n".join(json.dumps({"body": p.read_text()}) for p in
                               make_corpus(tmp_path / "raw" / "b", n_docs=20, words_per_doc=400, seed=2)))
    out = tmp_path / "prepared"
    (tmp_path / "prep.toml").write_text(
        f'[prepare]\noutput_dir = "{out}"\nvocab_size = 300\nval_fraction = 0.1\n'
        f'[[prepare.sources]]\npath = "raw/web/*.txt"\nweight = 0.7\n'
        f'[[prepare.sources]]\npath = "raw/books.jsonl"\ntext_field = "body"\nweight = 0.3\n')
    prep = subprocess.run([*warm_start.shared().interpreter(), "-m", "lmforge", "prepare", "--config", str(tmp_path / "prep.toml")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert prep.returncode == 0, prep.stdout + prep.stderr

    run = tmp_path / "run"
    train = subprocess.run(
        [*warm_start.shared().interpreter(), "-m", "lmforge", "train", "--data.corpus", str(out), "--model.vocab_size", "320",
         "--model.dim", "64", "--model.n_heads", "4", "--data.seq_len", "32", "--data.tokenizer_vocab_size", "300",
         "--train.steps", "30", "--train.eval_every", "0", "--train.global_batch_size", "8",
         "--train.micro_batch_size", "8", "--schedule.warmup_steps", "3", "--data.mask_doc_boundaries", "true",
         "--train.out_dir", str(run), "--train.sample_tokens", "5"],
        capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_loss"] < summary["initial_val_loss"] - 1.0


def test_bad_corpus_folder_is_named(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "--data.corpus", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not a folder written by `lmforge prepare`" in proc.stderr or "neither 'default' nor" in proc.stderr
