"""Every optimizer through the real training loop on the tiny preset's architecture; 8-bit Adam vs
fp32 AdamW over 200 steps; batch-size ramp-up inside the trainer."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import load_config
from lmforge.optim.optimizers import measured_state_bytes
from lmforge.train.trainer import Trainer

# The tiny preset's model (d=192, 4 layers, 6 heads, vocab 4096), with short sequences and small
# batches so 200 steps take seconds on 2 cores.
FAST = {"data.seq_len": 32, "data.tokenizer_vocab_size": 320, "train.global_batch_size": 8,
        "train.micro_batch_size": 8, "train.eval_every": 0, "train.eval_sequences": 32, "train.sample_tokens": 0,
        "train.precision": "fp32", "schedule.warmup_steps": 5}

LRS = {"sgd": 0.5, "momentum": 0.05, "adam": 2e-3, "adamw": 2e-3, "lion": 2e-4, "adafactor": 1e-2,
       "lamb": 5e-3, "muon": 2e-3, "adam8bit": 2e-3}


def trainer_for(small_data, tmp_path, **overrides) -> Trainer:
    cfg = load_config("tiny", {**FAST, **overrides})
    t = Trainer(cfg, out_dir=tmp_path / "run", data=small_data)
    t.setup()
    return t


# the fast tier trains AdamW (the default); each other optimizer's steps run in the full suite. 20 steps:
# each optimizer's validation loss fell by 1.3 (lamb) to 6.1 (muon) nats there, over twice the
# 0.5 asked for (measured on the CPU, torch 2.13); at lr 0 the test fails
OPTIMIZER_STEPS = 20


@pytest.mark.parametrize("name", [n if n == "adamw" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(LRS)])
def test_each_optimizer_lowers_validation_loss(small_data, tmp_path, name):
    t = trainer_for(small_data, tmp_path, **{"optim.name": name, "optim.lr": LRS[name], "train.steps": OPTIMIZER_STEPS})
    start = t.evaluate()["loss"]
    for _ in range(OPTIMIZER_STEPS):
        t.train_step(t.next_micro_batches())
    end = t.evaluate()["loss"]
    assert end < start - 0.5, (name, start, end)


@pytest.mark.slow
def test_adam8bit_tracks_fp32_adamw_for_200_steps(small_data, tmp_path):
    """Same data, same init: 8-bit state (block-wise, 256) vs fp32 state. Stated tolerance: the
    per-step training losses differ by < 0.1 nats (mean < 0.03) and the final validation losses by
    < 2%; the state takes ~2 bytes/param (< 2.2, norms and small tensors stay fp32)."""
    runs = {}
    for name in ("adamw", "adam8bit"):
        t = trainer_for(small_data, tmp_path / name, **{"optim.name": name, "optim.lr": 2e-3, "train.steps": 200})
        losses = [float(t.train_step(t.next_micro_batches())[0]) for _ in range(200)]
        runs[name] = (losses, t.evaluate()["loss"], measured_state_bytes(t.optimizer) / t.n_params)
    (l32, v32, b32), (l8, v8, b8) = runs["adamw"], runs["adam8bit"]
    diffs = [abs(a - b) for a, b in zip(l32, l8)]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.03, (max(diffs), sum(diffs) / len(diffs))
    assert abs(v8 - v32) / v32 < 0.02, (v32, v8)
    assert l32[-1] < l32[0] - 2.0
    assert b32 == pytest.approx(8.0, rel=1e-4)  # + one 4-byte step counter per tensor
    assert 1.9 < b8 < 2.2, b8


def test_batch_rampup_grows_accumulation_in_the_trainer(small_data, tmp_path):
    t = trainer_for(small_data, tmp_path, **{
        "train.global_batch_size": 32, "train.micro_batch_size": 4, "train.steps": 12,
        "schedule.batch_rampup_start": 8, "schedule.batch_rampup_tokens": 32 * 32 * 4,
        "schedule.batch_rampup_increment": 8})
    sizes = []
    for _ in range(12):
        batches = t.next_micro_batches()
        sizes.append(sum(x.shape[0] for x, _ in batches))
        t.update(t.forward_backward(batches))
        t.state.tokens_seen += sizes[-1] * 32
    assert sizes[0] == 8 and sizes[-1] == 32
    assert sizes == sorted(sizes) and len(set(sizes)) == 4  # 8, 16, 24, 32
    expected = [t.rampup.batch_at(sum(sizes[:i]) * 32) for i in range(12)]
    assert sizes == expected


def test_rampup_config_errors():
    from lmforge.config import ConfigError

    with pytest.raises(ConfigError, match="must be multiples of train.micro_batch_size x dp = 32"):
        load_config("tiny", {"schedule.batch_rampup_start": 8, "schedule.batch_rampup_tokens": 100})
    with pytest.raises(ConfigError, match="batch_rampup_tokens must be >= 1"):
        load_config("tiny", {"schedule.batch_rampup_start": 32})


def test_gpt3_preset_ramps_from_32k_tokens():
    from lmforge.optim.schedules import BatchRampup

    cfg = load_config("gpt3-175b")
    s = cfg.schedule
    ramp = BatchRampup(s.batch_rampup_start, cfg.train.global_batch_size, s.batch_rampup_tokens,
                       s.batch_rampup_increment, cfg.data.seq_len)
    assert ramp.batch_at(0) * 2048 == 32768
    assert ramp.batch_at(12_000_000_000) == 1536
