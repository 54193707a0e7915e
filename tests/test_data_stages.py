"""Mixture stages (data.stages) and validation per source in real `lmforge train` processes, on a
prepared mixture of two sources (web: short documents, books: longer ones).

The two-stage recipe: the prepared mix, then from step 8 an anneal stage on the books alone that starts
the WSD schedule's decay; with document masking on best-fit packed rows. The run is SIGKILLed in the
first stage (one process), resumed at another world size (2 pipeline stages under torchrun: the
workers are killed, then the agent's group), killed again in the anneal stage, and finished in one
process: its final weights equal the uninterrupted one-process run's bit for bit, and so does every
step's loss (optim.grad_clip = 0: pipeline stages compute each weight's gradient as one process does,
and with no clipping the gradient norm, whose reduction order differs, does not touch the update).
Every validation scores each source's held-out documents on their own (val_loss/web,
val_loss/books) beside the mix's. A resumed run may add a stage after its checkpoint, never change
one that has begun.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_corpus
from tests.test_ckpt_fault import (assert_bitwise, final_weights, finish, kill_launch, launch, newest_step,
                                   wait_for_checkpoint)
from tests.test_parallel_dp import losses, metric, prepare

pytestmark = pytest.mark.slow

ANNEAL = '[{start_step = 8, weights = {books = 1.0}, lr_decay = true, name = "anneal"}]'
STAGED = {"data.stages": ANNEAL, "schedule.name": "wsd", "schedule.warmup_steps": 2, "optim.grad_clip": 0,
          "data.attention": "document", "data.packing": "best_fit", "data.packing_buffer": 16,
          "model.tie_embeddings": "false", "train.eval_every": 8, "train.sample_tokens": 0}


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stages")
    make_corpus(root / "web", n_docs=200, words_per_doc=60, min_words=3, seed=0)
    make_corpus(root / "books", n_docs=40, words_per_doc=400, min_words=100, seed=7)
    return prepare(root, '[[prepare.sources]]\nname = "web"\npath = "web/*.txt"\nweight = 0.7\n'
                         '[[prepare.sources]]\nname = "books"\npath = "books/*.txt"\nweight = 0.3\n', val_fraction=0.2)


@pytest.fixture(scope="module")
def reference(mix, tmp_path_factory) -> Path:
    """The uninterrupted run, one process."""
    out = tmp_path_factory.mktemp("staged") / "reference"
    finish(launch(mix, out, **STAGED), out)
    return out


def test_two_stage_run_killed_in_each_stage_and_resumed_at_another_world_size_is_bit_identical(mix, reference,
                                                                                                  tmp_path):
    out = tmp_path / "run"
    first = launch(mix, out, **STAGED)
    assert wait_for_checkpoint(first, out, 4)
    kill_launch(first)
    assert 4 <= newest_step(out) < 8  # killed in the first stage
    pp = {**STAGED, "parallel.pp": 2}
    second = launch(mix, out, nproc=2, **pp)
    assert wait_for_checkpoint(second, out, 10)
    kill_launch(second)
    assert 10 <= newest_step(out) < 16  # killed in the anneal stage, at world size 2
    finish(launch(mix, out, **STAGED), out)
    log = (tmp_path / "run.log").read_text()
    assert log.count("resumed from") == 2, log[-3000:]
    assert_bitwise(final_weights(out), final_weights(reference))
    assert losses(out) == losses(reference)
    # the header's plan: the anneal draws the books alone; the decay starts with it
    assert "data: anneal, steps 8-15:" in log and "books 2,048 (100%)" in log, log[:4000]
    lr = metric(reference, "lr")
    assert lr[9] == lr[8] == max(lr.values()) and lr[16] < lr[10] < lr[9]  # (metrics step s: lr of step s - 1)


def test_every_validation_scores_each_source_beside_the_mix(reference, tmp_path):
    recs = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 8, 16]
    for r in val:
        assert {"val_loss/web", "val_loss/books"} <= r.keys() and r["val_loss/web"] != r["val_loss/books"]
        # the mix's: the sources' losses weighted by the prepared mixture (web 0.7, books 0.3)
        assert abs(r["val_loss"] - (0.7 * r["val_loss/web"] + 0.3 * r["val_loss/books"])) < 1e-9
    summary = json.loads((reference / "summary.json").read_text())
    assert set(summary["val_loss_per_source"]) == {"web", "books"}
    # the anneal trains on the books alone: their loss falls further than the web's over it
    assert val[2]["val_loss/books"] - val[1]["val_loss/books"] < val[2]["val_loss/web"] - val[1]["val_loss/web"]
    # TensorBoard tags each source's loss beside the mix's; the report plots them
    from lmforge.report.plots import plot_runs
    from lmforge.train.metrics import _scalars

    assert _scalars(val[1]).keys() >= {"val/loss", "val/loss/web", "val/loss/books"}
    assert plot_runs([reference], tmp_path / "report")["val_sources"].stat().st_size > 10_000


def test_a_stage_that_ran_cannot_change_a_later_one_may_be_added(mix, reference, tmp_path):
    from tests.test_parallel_dp import overrides

    def resume(out: Path, stages: str) -> subprocess.CompletedProcess:
        args = overrides(mix, out, **{**STAGED, "data.stages": stages, "train.steps": 20, "checkpoint.every_steps": 0,
                                      "checkpoint.resume": str(reference / "checkpoints" / "step_00000016")})
        return subprocess.run([sys.executable, "-m", "lmforge", "train", *args], capture_output=True, text=True,
                              timeout=300)

    changed = resume(tmp_path / "changed", '[{start_step = 8, weights = {books = 0.5, web = 0.5}, lr_decay = true}]')
    assert changed.returncode != 0 and "A stage that has run cannot change" in changed.stderr, changed.stderr[-2000:]
    added = resume(tmp_path / "added", ANNEAL[:-1] + ', {start_step = 18, weights = {web = 1.0}}]')
    assert added.returncode == 0, added.stderr[-3000:]
    assert sorted(losses(tmp_path / "added")) == [17, 18, 19, 20]
