"""Downstream multiple-choice tasks scored inside training (train.eval_tasks), on the sharded model.

    tasks = TaskEvaluator.for_run(cfg, tokenizer, precision.autocast)   # None without train.eval_tasks
    if tasks.due(step):
        results = tasks.run(step, layout.inference_model(), metrics, say)

The tasks are `lmforge eval --mc`'s (lmforge.eval.tasks: zero-shot, each choice scored by the
log-likelihood of its tokens after the context; `acc` the highest sum, `acc_norm` the highest per
UTF-8 byte): local jsonl files, or a task shipped with lmforge by name. They are read and tokenized
once, at setup (a missing or malformed file stops the run before it starts); at most
train.eval_tasks_max_examples items of each are scored (the first ones), which bounds the cost: a
few forward passes of micro_batch_size short rows (one row per choice, as long as its context and
choice). Each evaluation's items, rows and seconds are printed with its accuracies.

The model is `layout.inference_model()`: the training model itself (one process, DDP, FSDP2: each
block gathered and freed again) or, for tensor / pipeline parallelism, the rank's part driven by
lmforge.parallel.inference; no rank builds a whole model. Every rank scores the same items (the
forwards are collectives of the layout), as validation does, under the run's autocast.

Records (metrics.jsonl, lmforge.train.metrics: kind "tasks"; TensorBoard `tasks/<name>/<metric>`):
    {"step": 100, "task/<name>/acc": .., "task/<name>/acc_norm": .., "task/<name>/n": items,
     "task/<name>/chance": mean of 1 / choices, "eval_tasks_s": seconds of the evaluation}
The last evaluation (at the end of training) goes into summary.json as `eval_tasks`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from lmforge.eval.tasks import MCItem, continuation_logprobs, load_mc_items, mc_requests, resolve_task, score_mc

log = logging.getLogger("lmforge.train")

PREFIX = "task/"  # metrics keys of a task's results: task/<name>/<metric>


@dataclass
class Task:
    name: str  # as logged: the shipped task's name, or the file's stem
    path: Path
    items: list[MCItem]
    requests: list[tuple[list[int], list[int]]]  # (context, choice) token ids of every choice, in order

    @property
    def chance(self) -> float:
        """Expected accuracy of a uniform guess."""
        return sum(1 / len(item.choices) for item in self.items) / len(self.items)


def load_tasks(spec: str, tokenizer, max_examples: int) -> list[Task]:
    """The tasks of train.eval_tasks (comma-separated names or files), each cut to its first
    `max_examples` items and tokenized; ValueError names the key and the task that is wrong."""
    tasks: list[Task] = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        try:
            path = resolve_task(entry)
            items = load_mc_items(path)[:max_examples]
        except ValueError as e:
            raise ValueError(f"train.eval_tasks: {e}") from None
        if not items:
            raise ValueError(f"train.eval_tasks: {path} holds no items.")
        name = entry if not Path(entry).suffix else path.stem
        if name in {t.name for t in tasks}:
            raise ValueError(f"train.eval_tasks names {name!r} twice.")
        tasks.append(Task(name, path, items, mc_requests(tokenizer, items)))
    return tasks


class TaskEvaluator:
    """Scores the run's tasks (module docstring)."""

    def __init__(self, tasks: list[Task], every: int, steps: int, batch_size: int, autocast):
        self.tasks, self.every, self.steps = tasks, every, steps
        self.batch_size, self.autocast = batch_size, autocast
        self.last: dict[str, dict[str, float]] = {}  # the latest results, by task

    @classmethod
    def for_run(cls, cfg, tokenizer, autocast) -> "TaskEvaluator | None":
        """The evaluator of train.eval_tasks, or None when it names no task."""
        t = cfg.train
        if not t.eval_tasks.strip():
            return None
        tasks = load_tasks(t.eval_tasks, tokenizer, t.eval_tasks_max_examples)
        every = t.eval_tasks_every or t.eval_every
        log.info("eval tasks: %s; %d forwards of <= %d rows per evaluation, before the first step, %sat the end",
                 ", ".join(f"{task.name} ({len(task.items)} items, chance {task.chance:.3f})" for task in tasks),
                 sum(-(-len(task.requests) // t.micro_batch_size) for task in tasks), t.micro_batch_size,
                 f"every {every} steps and " if every else "")
        return cls(tasks, every, t.steps, t.micro_batch_size, autocast)

    def due(self, step: int) -> bool:
        """Are the tasks scored after step `step` (inside the loop; the last step's are `finish`'s)?"""
        return bool(self.every) and step % self.every == 0 and 0 < step < self.steps

    def run(self, step: int, model, metrics, say=log.info) -> dict[str, dict[str, float]]:
        """Score every task on `model` (every rank), write one metrics record, `say` one line a task."""
        t0 = time.perf_counter()
        record: dict[str, float] = {}
        for task in self.tasks:
            t1 = time.perf_counter()
            scores = [lp for lp, _ in continuation_logprobs(model, task.requests, self.batch_size, self.autocast)]
            res = {**score_mc(task.items, scores), "chance": task.chance}
            self.last[task.name] = res
            record.update({f"{PREFIX}{task.name}/{k}": v for k, v in res.items()})
            say(f"step {step}: {task.name} acc {res['acc']:.3f}, acc_norm {res['acc_norm']:.3f} (chance "
                f"{res['chance']:.3f}; {res['n']} items, {len(task.requests)} continuations, "
                f"{time.perf_counter() - t1:.1f} s)")
        record["eval_tasks_s"] = time.perf_counter() - t0
        metrics.write({"step": step, **record})
        metrics.flush()
        return dict(self.last)
