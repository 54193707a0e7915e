"""No host sync inside a training step that does not log (issue 55 item 4, the CPU part).

A host read of a device value (`.item()`, `.tolist()`, `.cpu()`, `float(t)`, `if t:`, printing a
tensor, ...) inside a step makes the host wait for the device: the GPU's queue drains, and a CUDA
graph of the step cannot be captured. The loop keeps the step's loss and grad norm as tensors
(`StepLog.pending`) and reads them once per log line (`StepLog.write`, one sync for the window);
the non-finite loss check is made there too. Here every Tensor method that reads a value on the
host raises from `step_begin` to `step_end` of each step where the loop does not sync anyway
(`StepEvents.syncs`: a log line, an evaluation, a checkpoint by count, the last step), and whole
runs go through.

The CUDA-shaped path: on the CPU the trainer takes the same branches as on a GPU (fused AdamW,
whose kernel honours `found_inf`, so the spike guard decides on the device: `StepGuard.verdict_on_device`),
except three device-type branches that need CUDA: the guard's copy of a step's (loss, grad norm)
to pinned host memory with an event (on the CPU the pending values are the step's tensor itself),
the phase clock's CUDA events (lmforge.train.stragglers), and `StepLog.write`'s synchronize (a log
step, not checked here). Not caught by patching Python methods: syncs inside C++ kernels
(`nonzero`, boolean-mask indexing, `.to("cpu")`: on the CPU a no-op); `torch.cuda.set_sync_debug_mode`
finds those on a GPU.

What stays, by design (`test_what_the_host_paths_cost` counts it per step): the guard's booking of
the *previous* step's verdict (it keeps the accepted history the sigma rule reads, and rolls back
at the same step as the host check; on CUDA it reads values copied to pinned memory a step earlier:
the host waits at most for that step's clip, never for the current step's work); the host guard of
every optimizer that cannot skip on the device, fp16 included (two reads per step); fp16 with
foreach kernels (torch's GradScaler reads found_inf to skip an overflow on the host); and the
Mixture-of-Experts padded-bmm fallback (one read of the group ends per MoE layer and forward).
A first step under train.compile = model also reads values while torch.compile traces (once).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter

import pytest
import torch

from lmforge.config import load_config
from lmforge.train.events import Handler
from lmforge.train.step_log import StepEvents
from lmforge.train.trainer import Trainer

from .test_ckpt import SMALL

# the Tensor methods that read a value on the host (CUDA: a device -> host copy the host waits for)
READS = ("item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__float__", "__int__", "__index__",
         "__complex__", "__format__", "__repr__")

# 8 steps, a log line every 4: steps 1-3 and 5-7 run armed; no checkpoint by count, no evaluation
RUN = {**SMALL, "train.steps": 8, "train.log_every": 4, "checkpoint.every_steps": 0}


class HostSync(AssertionError):
    pass


class NoHostSync(Handler):
    """Armed from `step_begin` to `step_end` of the steps where the loop does not sync anyway. `count`
    False: a read raises HostSync; True: reads are counted (`reads`) and let through. The guard's
    booking of the previous step (`tolist` of `guard.pending`'s values, which on CUDA are a pinned
    host copy) is allowed unless `allow_guard_booking` is False."""

    def __init__(self, count: bool = False, allow_guard_booking: bool = True):
        self.count, self.allow_guard_booking = count, allow_guard_booking
        self.armed = False
        self.booked = None  # the previous step's values, as the guard holds them for its booking
        self.armed_steps = 0
        self.reads: Counter = Counter()

    def step_begin(self, trainer, step: int) -> None:
        self.armed = not StepEvents.at(trainer.cfg, step).syncs
        pending = trainer._guard_pending if self.allow_guard_booking else None
        self.booked = pending[0] if pending is not None else None
        self.armed_steps += self.armed

    def step_end(self, trainer, step: int) -> None:
        self.armed = False

    def close(self, trainer, error) -> None:
        self.armed = False

    def read(self, name: str, tensor: torch.Tensor) -> None:
        if not self.armed or (name == "tolist" and tensor is self.booked):
            return
        if self.count:
            self.reads[name] += 1
            return
        self.armed = False  # (the message's formatting may read tensors itself)
        raise HostSync(f"Tensor.{name} inside a step that does not log: a host sync")


@contextlib.contextmanager
def watched(handler: NoHostSync):
    """READS patched on torch.Tensor (Parameters inherit them) to tell `handler`, then restored."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in READS}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            handler.read(name, self)
            return original(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield handler
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def train(small_data, out, handler: Handler, *extra: Handler, **overrides) -> Trainer:
    trainer = Trainer(load_config("tiny", {**RUN, **overrides}), out_dir=out, data=small_data,
                      handlers=[handler, *extra])
    with watched(handler):
        trainer.fit()
    return trainer


def logged(out) -> list[tuple]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r and "event" not in r]


@pytest.mark.parametrize("overrides", [
    {},  # the default: guard on, decided on the device (fused AdamW)
    {"guard.enabled": False},
    {"guard.enabled": False, "train.precision": "fp16"},  # the GradScaler hands found_inf to the fused kernel
    {"train.ema_decay": 0.9, "train.micro_batch_size": 2},  # EMA of the weights; 4 micro-batches a step
    {"model.moe.num_experts": 4},  # routed experts through torch._grouped_mm (CPU: fp32; CUDA: bf16 on sm90/100)
], ids=["guard-on-device", "no-guard", "fp16-fused", "ema-accumulation", "moe-grouped-mm"])
def test_a_step_that_does_not_log_reads_nothing_on_the_host(small_data, tmp_path, overrides):
    handler = NoHostSync()
    trainer = train(small_data, tmp_path / "run", handler, **overrides)
    assert handler.armed_steps == 6 and trainer.state.step == 8
    assert trainer._guard_on_device == trainer.cfg.guard.enabled  # (the CUDA-shaped guard path)
    # every step is still logged, with the values read once per log line
    records = logged(tmp_path / "run")
    assert [s for s, *_ in records] == list(range(1, 9))
    assert all(math.isfinite(v) for _, *values in records for v in values)


class ReadsTheLoss(Handler):
    """A planted host read inside the step, as an added `float(loss)` in the trainer would be."""

    def backward_end(self, trainer, loss) -> None:
        float(loss)


def test_a_host_read_inside_the_step_fails_the_check(small_data, tmp_path):
    """The check is not vacuous: one `float(loss)` inside a step that does not log raises (an `.item()`
    added to `Trainer.update` fails test_a_step_that_does_not_log_reads_nothing_on_the_host alike);
    so does the guard's booking of the previous step when it is not allowed for."""
    with pytest.raises(HostSync, match="__float__"):
        train(small_data, tmp_path / "planted", NoHostSync(), ReadsTheLoss())
    with pytest.raises(HostSync, match="tolist"):
        train(small_data, tmp_path / "booking", NoHostSync(allow_guard_booking=False))


@pytest.mark.parametrize("overrides, reads", [
    # the default path, the guard's booking counted too: step N books step N-1's verdict unless step N-1
    # was a sync point (which booked it): steps 2, 3, 6 and 7 of the armed 1-3, 5-7
    ({}, {"tolist": 4}),
    # the host guard (every optimizer but fused Adam/AdamW, and fp16, whose GradScaler drives found_inf):
    # float(loss) and float(grad_norm) for StepGuard.allows, one wait for the step's update
    ({"optim.name": "sgd", "optim.lr": 0.1}, {"__float__": 2 * 6}),
    ({"train.precision": "fp16"}, {"__float__": 2 * 6}),
    # fp16 without the guard, foreach kernels: torch's GradScaler reads found_inf (`.item()`) to skip an
    # overflowed step on the host (fused kernels take found_inf on the device: no read, tested above).
    # (SGD: foreach Adam's CPU step counters would count too, host tensors on CUDA as well)
    ({"optim.name": "sgd", "optim.lr": 0.1, "optim.fused": "off", "train.precision": "fp16",
      "guard.enabled": False}, {"item": 6}),
    # Mixture-of-Experts without the grouped GEMM (model.moe.grouped_mm = off; "auto" on CUDA without bf16
    # on sm90 / sm100): the padded batched matmul reads each MoE layer's group ends, per forward (2 layers x
    # 2 micro-batches a step)
    ({"model.moe.num_experts": 4, "model.moe.grouped_mm": "off", "guard.enabled": False}, {"tolist": 4 * 6}),
], ids=["guard-booking", "host-guard", "fp16-guard", "fp16-foreach", "moe-padded-bmm"])
def test_what_the_host_paths_cost(small_data, tmp_path, overrides, reads):
    """The paths that keep a host read inside the step, and what each costs over the 6 armed steps."""
    handler = NoHostSync(count=True, allow_guard_booking=False)
    train(small_data, tmp_path / "run", handler, **overrides)
    assert handler.armed_steps == 6
    assert dict(handler.reads) == reads
