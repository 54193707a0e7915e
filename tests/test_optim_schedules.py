"""LR schedules against their closed forms, build_scheduler against lr_at, and BatchRampup."""

from __future__ import annotations

import io
import math

import pytest
import torch

from lmforge.config import ConfigError, ScheduleConfig, load_config
from lmforge.optim.schedules import BatchRampup, build_scheduler, lr_at

PEAK, WARMUP, TOTAL, RATIO = 3e-4, 10, 110, 0.1
MIN = PEAK * RATIO
# Closed forms are evaluated in float64 with the same operations in a different order:
# agreement to ~1e-16 relative, so rel_tol 1e-12.
REL = 1e-12


def _lr(step: int, schedule: str, **kw) -> float:
    return lr_at(step, schedule=schedule, peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL,
                 min_lr_ratio=RATIO, **kw)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_from_first_step(schedule: str) -> None:
    assert math.isclose(_lr(0, schedule), PEAK / WARMUP, rel_tol=REL)
    assert math.isclose(_lr(4, schedule), PEAK * 5 / WARMUP, rel_tol=REL)
    assert math.isclose(_lr(WARMUP - 1, schedule), PEAK, rel_tol=REL)
    assert math.isclose(_lr(WARMUP, schedule), PEAK, rel_tol=REL)


def test_cosine_closed_form() -> None:
    def closed(step: int) -> float:
        p = (step - WARMUP) / (TOTAL - WARMUP)
        return MIN + 0.5 * (PEAK - MIN) * (1 + math.cos(math.pi * p))

    for step in (WARMUP, 35, 60, 85, TOTAL - 1):
        assert math.isclose(_lr(step, "cosine"), closed(step), rel_tol=REL)
    assert math.isclose(_lr(60, "cosine"), (PEAK + MIN) / 2, rel_tol=REL)  # middle of the decay
    assert math.isclose(_lr(TOTAL, "cosine"), MIN, rel_tol=REL)
    assert math.isclose(_lr(10 * TOTAL, "cosine"), MIN, rel_tol=REL)  # flat beyond the end


def test_linear_and_constant_closed_form() -> None:
    for step in (WARMUP, 60, TOTAL - 1):
        expected = PEAK - (PEAK - MIN) * (step - WARMUP) / (TOTAL - WARMUP)
        assert math.isclose(_lr(step, "linear"), expected, rel_tol=REL)
        assert _lr(step, "constant") == PEAK
    assert math.isclose(_lr(TOTAL + 5, "linear"), MIN, rel_tol=REL)
    assert _lr(TOTAL + 5, "constant") == PEAK


@pytest.mark.parametrize("decay", ["linear", "cosine", "sqrt"])
def test_wsd_closed_form(decay: str) -> None:
    frac = 0.2
    start = TOTAL - round(frac * TOTAL)  # decay over the last 22 steps: 88 .. 110
    shape = {
        "linear": lambda q: q, "cosine": lambda q: (1 - math.cos(math.pi * q)) / 2, "sqrt": math.sqrt,
    }[decay]
    for step in (WARMUP, 50, start - 1):
        assert _lr(step, "wsd", decay_fraction=frac, wsd_decay=decay) == PEAK  # stable phase
    for step in (start, start + 11, TOTAL - 1):
        q = (step - start) / (TOTAL - start)
        expected = PEAK - (PEAK - MIN) * shape(q)
        assert math.isclose(_lr(step, "wsd", decay_fraction=frac, wsd_decay=decay), expected, rel_tol=REL)
    assert math.isclose(_lr(TOTAL, "wsd", wsd_decay=decay), MIN, rel_tol=REL)
    assert math.isclose(_lr(TOTAL + 100, "wsd", wsd_decay=decay), MIN, rel_tol=REL)


@pytest.mark.parametrize(("kwargs", "bad"), [
    ({"warmup_steps": TOTAL}, "warmup_steps"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"total_steps": 0, "warmup_steps": 0}, "total_steps"),
    ({"peak_lr": 0.0}, "peak_lr"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ({"schedule": "cosin"}, "schedule"),
    ({"schedule": "wsd", "decay_fraction": 0.0}, "decay_fraction"),
    ({"schedule": "wsd", "decay_fraction": 0.95}, "decay_fraction"),  # decay would overlap warmup
    ({"schedule": "wsd", "wsd_decay": "exp"}, "wsd_decay"),
    ({"step": -1}, "step"),
])
def test_bad_arguments_name_the_argument(kwargs: dict, bad: str) -> None:
    args = {"step": 0, "schedule": "cosine", "peak_lr": PEAK, "warmup_steps": WARMUP, "total_steps": TOTAL}
    args.update(kwargs)
    step = args.pop("step")
    with pytest.raises(ValueError, match=bad):
        lr_at(step, **args)


def _optimizer() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a], "lr": PEAK}, {"params": [b], "lr": 0.02}], lr=PEAK)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_build_scheduler_follows_lr_at_for_every_group(schedule: str) -> None:
    opt = _optimizer()
    sched = build_scheduler(ScheduleConfig(name=schedule, warmup_steps=WARMUP, min_lr_ratio=RATIO), opt, PEAK, TOTAL)
    for step in range(TOTAL + 5):
        expected = _lr(step, schedule)
        # base * (lr_at / peak): equal to lr_at up to one rounding of the division, rel 1e-12.
        assert math.isclose(opt.param_groups[0]["lr"], expected, rel_tol=REL)
        assert math.isclose(opt.param_groups[1]["lr"], 0.02 * expected / PEAK, rel_tol=REL)  # scales together
        opt.step()
        sched.step()


def test_scheduler_state_dict_roundtrip() -> None:
    opt = _optimizer()
    sched = build_scheduler(ScheduleConfig(name="wsd", warmup_steps=WARMUP), opt, PEAK, TOTAL)
    for _ in range(95):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    opt2 = _optimizer()
    sched2 = build_scheduler(ScheduleConfig(name="constant", warmup_steps=WARMUP), opt2, PEAK, TOTAL)  # overwritten by the load
    sched2.load_state_dict(torch.load(buf, weights_only=False))
    for _ in range(3):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    assert opt2.param_groups[0]["lr"] < PEAK  # in the WSD decay, so the schedule itself was restored


def test_batch_rampup_endpoints_monotone_and_on_grid() -> None:
    ramp = BatchRampup(start_batch=32, target_batch=512, ramp_tokens=1_000_000, increment=32, seq_len=1024)
    assert ramp.batch_at(0) == 32
    assert ramp.batch_at(1_000_000) == 512 and ramp.batch_at(5_000_000) == 512
    assert ramp.batch_at(999_999) == 480  # last increment before the end of the ramp
    assert ramp.batch_at(500_000) == 32 + 32 * 7  # 15 increments * 0.5 = 7.5, rounded down
    batches = [ramp.batch_at(t) for t in range(0, 1_200_000, 7_919)]
    assert batches == sorted(batches)
    assert all(32 <= b <= 512 and (b - 32) % 32 == 0 for b in batches)
    assert ramp.tokens_in_batch(0) == 32 * 1024
    assert ramp.equivalent_step(3 * 512 * 1024 + 5) == 3
    assert ramp.lr_scale_for_batch(256) == 1.0  # linear scaling is off by default
    scaled = BatchRampup(32, 512, 1_000_000, 32, 1024, linear_lr_scaling=True)
    assert scaled.lr_scale_for_batch(256) == 0.5


def test_batch_rampup_validation() -> None:
    with pytest.raises(ValueError, match="increment"):
        BatchRampup(start_batch=32, target_batch=500, ramp_tokens=10, increment=32, seq_len=8)
    with pytest.raises(ValueError, match="target_batch"):
        BatchRampup(start_batch=64, target_batch=32, ramp_tokens=10, increment=32, seq_len=8)
    with pytest.raises(ValueError, match="tokens_seen"):
        BatchRampup(32, 64, 10, 32, 8).batch_at(-1)
    assert BatchRampup(32, 64, 0, 32, 8).batch_at(0) == 64  # no ramp: target from the start


@pytest.mark.parametrize("decay", ["linear", "cosine", "sqrt"])
def test_schedule_wsd_decay_config_key_shapes_the_run_schedule(decay: str) -> None:
    """schedule.wsd_decay reaches the scheduler the trainer builds from the config."""
    cfg = load_config("tiny", {"schedule.name": "wsd", "schedule.wsd_decay": decay, "train.steps": 100,
                               "schedule.warmup_steps": 10, "schedule.decay_fraction": 0.5})
    opt = _optimizer()
    sched = build_scheduler(cfg.schedule, opt, cfg.optim.lr, cfg.train.steps)
    for _ in range(70):
        opt.step()
        sched.step()
    want = lr_at(70, schedule="wsd", peak_lr=cfg.optim.lr, warmup_steps=10, total_steps=100, min_lr_ratio=0.1,
                 decay_fraction=0.5, wsd_decay=decay)
    assert math.isclose(opt.param_groups[0]["lr"] * cfg.optim.lr / PEAK, want, rel_tol=REL)
    others = {d: lr_at(70, schedule="wsd", peak_lr=1.0, warmup_steps=10, total_steps=100, decay_fraction=0.5,
                       wsd_decay=d) for d in ("linear", "cosine", "sqrt")}
    assert len(set(others.values())) == 3  # the three shapes really differ at this step
    with pytest.raises(ConfigError, match="schedule.wsd_decay = 'cubic' is not one of"):
        load_config("tiny", {"schedule.wsd_decay": "cubic"})
