"""The spike guard decided on the device (torch's fused AdamW skips on `found_inf`): the same skip
and rollback decisions, events and bit-identical weights as the host check, and no per-step read
of the step's values on the host (issue 32 item 4)."""

from __future__ import annotations

import json

import torch

from lmforge.config import load_config
from lmforge.train.trainer import Trainer

from .test_ckpt import SMALL, NaNTrainer, assert_same, weights


class HostGuard(NaNTrainer):
    """The host check of every step (the behaviour before), for comparison."""

    def guard_can_skip_on_device(self) -> bool:
        return False


class Spiky(NaNTrainer):
    """NaN on `bad_batches`; a finite gradient spike (x 1000) on batch 10; a loss spike on batch 11."""

    bad_batches = {3}

    def forward_backward(self, micro_batches):
        loss = super().forward_backward(micro_batches)
        batch = self.state.batches_drawn - 1
        if batch == 10:
            for p in self.model.parameters():
                p.grad.mul_(1000.0)
        if batch == 11:
            return loss * 50.0
        return loss


class SpikyHost(Spiky):
    def guard_can_skip_on_device(self) -> bool:
        return False


class Rollback(NaNTrainer):
    bad_batches = {5, 6, 7}


class RollbackHost(Rollback):
    def guard_can_skip_on_device(self) -> bool:
        return False


def run(small_data, out, cls, **overrides) -> Trainer:
    trainer = cls(load_config("tiny", {**SMALL, **overrides}), out_dir=out, data=small_data)
    trainer.fit()
    return trainer


def records(out) -> tuple[list, list]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r and "event" not in r]
    keep = ("skipped_update", "rollback", "skipped_batch", "rollback_impossible")
    evs = [{k: v for k, v in r.items() if k not in ("path",)} for r in recs if r.get("event") in keep]
    return steps, evs


def compare(small_data, tmp_path, device_cls, host_cls, **overrides) -> tuple[Trainer, list]:
    dev = run(small_data, tmp_path / "device", device_cls, **overrides)
    host = run(small_data, tmp_path / "host", host_cls, **overrides)
    assert dev._guard_on_device and not host._guard_on_device
    assert records(tmp_path / "device") == records(tmp_path / "host")
    assert_same(weights(dev.model), weights(host.model))
    assert dev.guard.n_skipped == host.guard.n_skipped and dev.state.rollbacks == host.state.rollbacks
    assert dev.guard.state_dict() == host.guard.state_dict()
    return dev, records(tmp_path / "device")[1]


def test_device_verdicts_match_the_host_check_on_nan_and_spikes(small_data, tmp_path):
    dev, evs = compare(small_data, tmp_path, Spiky, SpikyHost,
                       **{"guard.min_history": 4, "train.steps": 14, "checkpoint.every_steps": 0})
    skipped = [(e["step"], e["batch"]) for e in evs if e["event"] == "skipped_update"]
    assert skipped == [(4, 3), (11, 10), (12, 11)]  # NaN, gradient-norm spike, loss spike
    assert dev.state.rollbacks == 0


def test_device_verdicts_roll_back_at_the_same_step(small_data, tmp_path):
    dev, evs = compare(small_data, tmp_path, Rollback, RollbackHost)
    assert [e["skip_batches"] for e in evs if e["event"] == "rollback"] == [[5, 6, 7]]
    assert dev.state.rollbacks == 1 and dev.state.batches_drawn == 15


def test_the_host_does_not_read_a_steps_verdict_inside_it(small_data, tmp_path):
    """Between sync points the verdict of a step stays on the device until the next step books it;
    a NaN step is still skipped (weights unchanged) and booked one step later."""
    trainer = Rollback(load_config("tiny", {**SMALL, "checkpoint.every_steps": 0, "train.log_every": 100}),
                       out_dir=tmp_path / "run", data=small_data)
    trainer.bad_batches = {2}
    trainer.setup()
    assert trainer._guard_on_device
    for _ in range(2):
        trainer.train_step(trainer.next_micro_batches())
        trainer.state.step += 1
    assert trainer._guard_pending is not None and trainer._guard_pending[1] == 2  # step 2: not booked yet
    before = weights(trainer.model)
    trainer.train_step(trainer.next_micro_batches())  # batch 2: NaN -> skipped on the device
    assert_same(weights(trainer.model), before)
    assert trainer.guard.n_skipped == 0  # (not booked yet: no host read inside the step)
    trainer.state.step += 1
    trainer.train_step(trainer.next_micro_batches())
    assert trainer.guard.n_skipped == 1 and trainer.guard.consecutive == 1  # booked in step 4
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
