"""Multiple-choice tasks scored inside training (train.eval_tasks, lmforge.train.eval_tasks): the same
scores as `lmforge eval --mc` on the same weights, in metrics.jsonl, TensorBoard, summary.json and
the report, at the set interval, with their cost printed and bounded; and the shipped
shakespeare-cloze task, rebuilt from the default corpus's held-out text. On the sharded model of every
parallel layout, against one process: tests/test_parallel_dp.py's `assert_extras_match`."""

from __future__ import annotations

import json
import logging

import pytest

from lmforge.config import load_config
from lmforge.eval.tasks import load_mc_items, resolve_task
from lmforge.train.trainer import Trainer
from tests.conftest import make_tasks
from tests.test_ckpt import SMALL


def test_tasks_are_scored_in_the_loop_and_reported(small_data, tmp_path, caplog):
    """train.eval_every 4 of 8 steps: scored before step 1, after step 4 and at the end (step 8), 10 of
    the file's 12 items (eval_tasks_max_examples); each evaluation's cost on one line; the end's
    scores equal `lmforge eval --mc` of the final weights (the first 10 items)."""
    task = make_tasks(tmp_path / "kings.jsonl")
    out = tmp_path / "run"
    cfg = load_config("tiny", {**SMALL, "train.steps": 8, "train.eval_every": 4, "train.eval_tasks": str(task),
                               "train.eval_tasks_max_examples": 10, "train.tensorboard": True, "train.plot": True})
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        Trainer(cfg, out_dir=out, data=small_data).fit()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "task/kings/acc" in r]
    assert [r["step"] for r in scored] == [0, 4, 8]
    assert all(r["task/kings/n"] == 10 and r["task/kings/chance"] == pytest.approx(1 / 3) and r["eval_tasks_s"] > 0
               for r in scored)
    assert sum(f"{n} items, {3 * n} continuations" in m for m in caplog.messages for n in [10]) == 3
    assert "kings (10 items, chance 0.333); 8 forwards of <= 4 rows per evaluation" in caplog.text

    from lmforge.ckpt.export import load_run
    from lmforge.data.tokenizer import Tokenizer
    from lmforge.eval.tasks import evaluate_mc

    _, model = load_run(out)
    offline = evaluate_mc(model, Tokenizer.load(out / "tokenizer.json"), load_mc_items(task)[:10], batch_size=8)
    final = json.loads((out / "summary.json").read_text())["eval_tasks"]["kings"]
    assert final == {**offline, "chance": pytest.approx(1 / 3)}
    assert {k: scored[-1][f"task/kings/{k}"] for k in ("acc", "acc_norm")} == {k: offline[k] for k in ("acc", "acc_norm")}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("tasks/kings/acc_norm")] == [0, 4, 8]
    html = (out / "report").glob("*.png")
    assert "tasks.png" in {p.name for p in html}

    from lmforge.report.html import build_report

    page = build_report([out], tmp_path / "report").read_text()
    assert "Downstream tasks" in page and "kings acc_norm" in page


def test_a_wrong_task_stops_the_run_before_it_starts(small_data, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "x", "choices": ["only one"], "label": 0}\n')
    for spec, message in [(str(tmp_path / "missing.jsonl"), "is neither a file nor a task shipped with lmforge"),
                          (str(bad), "item 1: 'choices' must be a list of at least 2 strings")]:
        cfg = load_config("tiny", {**SMALL, "train.eval_tasks": spec})
        with pytest.raises(ValueError, match=f"train.eval_tasks: .*{message}"):
            Trainer(cfg, out_dir=tmp_path / "run", data=small_data).fit()
        assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_the_shipped_cloze_task_is_rebuilt_from_held_out_text():
    """lmforge/data/tasks/shakespeare_cloze.jsonl is what `python -m lmforge.data.cloze` writes from the
    default dataset (the tiny preset's), item for item; every item's line lies in the held-out tail of a
    document and nowhere in the training text; 4 choices, the right one at every position alike."""
    from lmforge.data.cloze import cloze_items, default_split_texts, held_out_lines

    path = resolve_task("shakespeare-cloze")
    shipped = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    val_docs, train_text = default_split_texts()
    assert cloze_items(held_out_lines(val_docs, train_text), 400, 0) == shipped
    held_out = {" ".join(line.split()) for doc in val_docs for line in doc.splitlines()}
    train_text = " ".join(train_text.split())  # (whitespace made single spaces, as the items' text)
    for item in shipped:
        line = item["context"].split("\n")[1] + item["choices"][item["label"]]
        assert line in held_out and line not in train_text, line
    items = load_mc_items(path)
    assert len(items) == 400 and all(len(i.choices) == 4 for i in items)
    assert all(60 <= sum(i.label == k for i in items) <= 140 for k in range(4))
