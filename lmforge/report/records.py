"""The records of a run's metrics.jsonl by kind (train, val, tasks, event), as lmforge.train.metrics
writes them (its docstring lists the fields) and lmforge.report reads them.

Standard library only, and here, below lmforge.train, so that the trainer may plot through
lmforge.report at the end of a run while lmforge.report reads records without importing the trainer.
"""

from __future__ import annotations

from typing import Any

TASK_PREFIX = "task/"  # task records' keys: task/<name>/<metric> (lmforge.train.eval_tasks)


def record_kind(record: dict[str, Any]) -> str:
    """'train', 'val', 'tasks' or 'event'."""
    if "event" in record:
        return "event"
    if "val_loss" in record:
        return "val"
    if any(key.startswith(TASK_PREFIX) for key in record):
        return "tasks"
    return "train"


def task_metrics(records: list[dict[str, Any]]) -> list[dict]:
    """The task records (train.eval_tasks), by step; a step logged twice (a resume): the later wins."""
    by_step = {rec["step"]: rec for rec in records if record_kind(rec) == "tasks"}
    return [by_step[k] for k in sorted(by_step)]


def split_metrics(records: list[dict[str, Any]]) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, val, event) records (task records: `task_metrics`). A resumed run may log a step twice:
    the later record wins."""
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    events = []
    for rec in records:
        kind = record_kind(rec)
        if kind == "train":
            train[rec["step"]] = rec
        elif kind == "val":
            val[rec["step"]] = rec
        elif kind == "event":
            events.append(rec)
    return [train[k] for k in sorted(train)], [val[k] for k in sorted(val)], events
