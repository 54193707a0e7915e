"""The trainer's extension points and its resolved, frozen config (issue 53 items 1 and 3): handlers hear
the loop's events in the documented order; a registered handler joins every trainer; every "auto" is
resolved once, written beside the config the user gave and printed in the header; after that the
config cannot change."""

from __future__ import annotations

import copy
import logging
import tomllib

import pytest
import torch

from lmforge.config import load_config
from lmforge.config.freeze import FrozenConfigError, freeze, is_frozen
from lmforge.folders import CONFIG, RESOLVED
from lmforge.train import events
from lmforge.train.events import EVENTS, Handler, register_handler
from lmforge.train.trainer import Trainer

from .test_ckpt import SMALL

RUN = {**SMALL, "train.steps": 6, "train.log_every": 3, "train.eval_every": 3, "checkpoint.every_steps": 3,
       "train.micro_batch_size": "auto", "train.precision": "auto"}


class Recorder(Handler):
    """Writes down every event it hears, with what the trainer holds at that moment."""

    def __init__(self, calls: list):
        self.calls = calls

    def states(self, trainer):
        self.calls.append(("states", trainer.resumed_from is not None))
        return {}

    def run_start(self, trainer):
        self.calls.append(("run_start", trainer.state.step))

    def step_begin(self, trainer, step):
        self.calls.append(("step_begin", step))

    def backward_end(self, trainer, loss):
        grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
        self.calls.append(("backward_end", trainer.state.step + 1, bool(grads)))

    def update_end(self, trainer, step):
        self.calls.append(("update_end", step, trainer.state.step))

    def log_window(self, trainer):
        self.calls.append(("log_window", trainer.state.step))
        return {"recorder_field": trainer.state.step}

    def paused(self, trainer):
        self.calls.append(("paused", trainer.state.step))
        return super().paused(trainer)

    def step_end(self, trainer, step):
        self.calls.append(("step_end", step))

    def run_end(self, trainer):
        self.calls.append(("run_end", trainer.state.step))

    def close(self, trainer, error):
        self.calls.append(("close", error))


def test_handlers_hear_the_events_in_order_and_add_log_fields(small_data, tmp_path):
    calls: list = []
    later: list = []
    trainer = Trainer(load_config("tiny", RUN), out_dir=tmp_path / "run", data=small_data, handlers=[Recorder(calls)])
    trainer.add_handler(Recorder(later))
    trainer.fit()
    assert calls == later  # (the same events, the one added later after the one passed)
    names = [c[0] for c in calls]
    assert set(names) == set(EVENTS)
    assert names[:2] == ["states", "run_start"] and names[-2:] == ["run_end", "close"] and calls[-1] == ("close", None)
    for step in range(1, 7):
        begin = calls.index(("step_begin", step))
        end = calls.index(("step_end", step))
        within = names[begin:end + 1]
        assert within[:3] == ["step_begin", "backward_end", "update_end"], within
        assert calls[begin + 1] == ("backward_end", step, True)  # gradients there, the step not counted yet
        assert calls[begin + 2] == ("update_end", step, step)  # counted
        assert ("log_window" in within) == (step % 3 == 0)
        assert within.count("paused") == (2 if step == 3 else 0)  # validation + checkpoint at step 3
    records = [r for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"recorder_field"' in r]
    assert len(records) == 6  # every step's record, through the log_window fields


def test_a_registered_handler_joins_every_trainer_built_after(small_data, tmp_path, monkeypatch):
    monkeypatch.setattr(events, "_REGISTERED", [])
    calls: list = []
    register_handler(lambda: Recorder(calls))
    Trainer(load_config("tiny", {**RUN, "train.steps": 3, "schedule.warmup_steps": 1}), out_dir=tmp_path / "run", data=small_data).fit()
    assert [c for c in calls if c[0] == "step_begin"] == [("step_begin", 1), ("step_begin", 2), ("step_begin", 3)]


def test_close_hears_the_error_that_ended_the_run(small_data, tmp_path):
    calls: list = []

    class Boom(Handler):
        def step_begin(self, trainer, step):
            if step == 2:
                raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        Trainer(load_config("tiny", RUN), out_dir=tmp_path / "run", data=small_data,
                handlers=[Recorder(calls), Boom()]).fit()
    assert calls[-1][0] == "close" and str(calls[-1][1]) == "planted"


def test_every_auto_is_resolved_once_written_printed_and_frozen(small_data, tmp_path, caplog):
    cfg = load_config("tiny", RUN)
    trainer = Trainer(cfg, out_dir=tmp_path / "run", data=small_data)
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        trainer.fit()
    # the caller's config is left as it was; the run's own copy is resolved and frozen
    assert cfg.train.micro_batch_size == "auto" and not is_frozen(cfg)
    assert is_frozen(trainer.cfg) and isinstance(trainer.cfg.train.micro_batch_size, int)
    with pytest.raises(FrozenConfigError, match=r"^train.steps: the run's config is frozen"):
        trainer.cfg.train.steps = 7
    with pytest.raises(FrozenConfigError, match=r"^model.moe.top_k: "):
        trainer.cfg.model.moe.top_k = 1
    resolved = tomllib.loads((tmp_path / "run" / RESOLVED).read_text())
    assert resolved["train.precision"] == trainer.precision.name
    assert resolved["train.micro_batch_size"] == trainer.cfg.train.micro_batch_size
    assert {"train.device", "train.compile", "train.loss_chunk", "checkpoint.resume"} <= set(resolved)
    assert (tmp_path / "run" / CONFIG).is_file()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resolved: ")]
    assert any(s.startswith("resolved: train.micro_batch_size = 'auto' -> ") for s in said), said
    assert any(s.startswith("resolved: train.precision = 'auto' -> ") for s in said), said


def test_a_frozen_config_still_copies_compares_and_pickles():
    import pickle

    cfg = load_config("tiny", SMALL)
    frozen = copy.deepcopy(cfg)
    freeze(frozen)
    assert frozen == cfg and cfg == frozen and frozen.model == cfg.model
    assert repr(frozen.model.moe).startswith("MoEConfig(")
    again = pickle.loads(pickle.dumps(frozen))
    assert again == cfg and is_frozen(again)
    with pytest.raises(FrozenConfigError):
        again.optim.lr = 1.0
    editable = copy.deepcopy(cfg)
    editable.optim.lr = 1.0  # (a copy of the unfrozen config stays editable)
    assert editable.optim.lr == 1.0


def test_a_handlers_states_are_checkpointed_and_restored_with_the_run(small_data, tmp_path):
    """`states`: a handler's own part of the checkpoint (here a counter of its updates and a tensor)
    is saved with the run's and restored, before run_start, on resume."""

    class Counted(Handler):
        def __init__(self):
            self.count, self.seen_at_start = 0, None
            self.vector = torch.zeros(3)

        def states(self, trainer):
            return {"counted": self}

        def state_dict(self):
            return {"count": self.count, "vector": self.vector}

        def load_state_dict(self, sd):
            self.count, self.vector = sd["count"], sd["vector"].clone()

        def run_start(self, trainer):
            self.seen_at_start = (self.count, self.vector.tolist())

        def update_end(self, trainer, step):
            self.count += 1
            self.vector += step

    cfg = load_config("tiny", {**RUN, "train.steps": 4, "checkpoint.every_steps": 2, "schedule.warmup_steps": 1})
    first = Counted()
    Trainer(cfg, out_dir=tmp_path / "run", data=small_data, handlers=[first]).fit()
    assert first.count == 4 and first.vector.tolist() == [10.0] * 3
    import shutil

    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")  # resume from step 2
    (tmp_path / "run" / "summary.json").unlink()
    again = Counted()
    Trainer(cfg, out_dir=tmp_path / "run", data=small_data, handlers=[again]).fit()
    assert again.seen_at_start == (2, [3.0] * 3)  # restored before run_start
    assert again.count == 4 and again.vector.tolist() == [10.0] * 3
