"""The EMA of the weights (train.ema_decay, lmforge.train.ema) in one process: exact against a reference
computed from the weights after every step, swapped in and out of the model bit for bit, resumed
bit for bit, exported, and planned (`lmforge plan`'s `ema` term). Every layout's EMA against one
process's: the parity tests (tests/test_parallel_dp.py, test_parallel_mp.py, test_parallel_ep.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lmforge.config import ConfigError, load_config
from lmforge.train.trainer import Trainer
from tests.test_ckpt import SMALL

EMA = {"train.ema_decay": 0.8, "train.ema_start_step": 3, "train.ema_every": 2}


def trainer(small_data, out, **overrides) -> Trainer:
    t = Trainer(load_config("tiny", {**SMALL, **EMA, **overrides}), out_dir=out, data=small_data)
    t.setup()
    return t


def test_ema_equals_the_reference_of_the_weights_after_each_step(small_data, tmp_path):
    """Steps 1-2 are before train.ema_start_step = 3: no EMA yet; the first update (step 4, the first
    multiple of ema_every = 2 from step 3) copies the weights; steps 6 and 8 fold them in with
    torch.lerp. The EMA (exact, bit for bit) and what `swapped_in` puts into the model; the live
    weights come back bit for bit."""
    t = trainer(small_data, tmp_path / "run")
    try:
        ref: dict[str, torch.Tensor] | None = None
        for step in range(1, 9):
            t.update(t.forward_backward(t.next_micro_batches()))
            t.state.step = step
            live = {n: p.detach().clone() for n, p in t.model.named_parameters()}
            if step >= 3 and step % 2 == 0:
                ref = dict(live) if ref is None else {n: torch.lerp(ref[n], live[n], 1 - 0.8) for n in ref}
            assert t.ema.updates == (0 if ref is None else (step - 2) // 2), step
        ema = dict(zip(t.ema.names, t.ema.shadow))
        assert ema.keys() == ref.keys()
        for name in ref:
            assert torch.equal(ema[name], ref[name]), name
        with t.ema.swapped_in():
            for name, p in t.model.named_parameters():
                assert torch.equal(p, ref[name]), name
        for name, p in t.model.named_parameters():
            assert torch.equal(p, live[name]), name
        for name, e in zip(t.ema.names, t.ema.shadow):  # (and the EMA is the EMA again)
            assert torch.equal(e, ref[name]), name
        assert t.ema.local_bytes() == 4 * sum(p.numel() for p in t.model.parameters())
    finally:
        t.close()


def run(small_data, out, **overrides) -> Trainer:
    t = Trainer(load_config("tiny", {**SMALL, **EMA, **overrides}), out_dir=out, data=small_data)
    t.fit()
    return t


def test_ema_resumes_bit_for_bit_and_is_validated_and_exported(small_data, tmp_path):
    """12 steps straight (checkpoints at 4, 8, 12) vs resumed from the step-8 checkpoint: the same
    model.ema.safetensors, byte for byte, and the same val_loss_ema; `lmforge merge --ema` of the
    last checkpoint gives that file too; a checkpoint without an EMA resumes with a fresh one."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(small_data, straight)
    shutil.copytree(straight / "checkpoints" / "step_00000008", resumed / "checkpoints" / "step_00000008")
    t = run(small_data, resumed)
    assert t.resumed_from.name == "step_00000008"
    assert (straight / "model.ema.safetensors").read_bytes() == (resumed / "model.ema.safetensors").read_bytes()
    ema_val = [json.loads(line).get("val_loss_ema") for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [v for v in ema_val if v is not None] == [json.loads((straight / "summary.json").read_text())["val_loss_ema"]]
    assert json.loads((resumed / "summary.json").read_text())["val_loss_ema"] == \
        json.loads((straight / "summary.json").read_text())["val_loss_ema"]
    ema, live = load_file(str(straight / "model.ema.safetensors")), load_file(str(straight / "model.safetensors"))
    assert ema.keys() == live.keys() and not all(torch.equal(ema[k], live[k]) for k in ema)

    from lmforge.ckpt.merge import merge_checkpoints, select_checkpoints

    merged = merge_checkpoints(select_checkpoints([straight], last=1), tmp_path / "m", ema=True)
    assert load_file(str(merged / "model.safetensors")).keys() == ema.keys()
    assert all(torch.equal(load_file(str(merged / "model.safetensors"))[k], ema[k]) for k in ema)

    plain = tmp_path / "plain"  # a checkpoint written without an EMA: resumed with one, it starts afresh
    run(small_data, plain, **{"train.ema_decay": 0.0, "train.steps": 8})
    t = run(small_data, plain, **{"train.ema_start_step": 9})
    assert t.state.step == 12 and t.ema.updates == 2  # steps 10 and 12


def test_ema_config_is_checked():
    for bad, message in [({"train.ema_decay": 1.0}, "train.ema_decay = 1.0 must be in"),
                         ({"train.ema_every": 0}, "train.ema_every = 0 must be >= 1"),
                         ({"train.ema_decay": 0.9, "parallel.async_sgd": True, "parallel.dp_replicate": 2,
                           "train.global_batch_size": 64, "train.micro_batch_size": 16}, "not supported with "
                                                                                          "parallel.async_sgd")]:
        with pytest.raises(ConfigError, match=message):
            load_config("tiny", bad)


# ---------------------------------------------------------------------------------------------
# the planner's `ema` term
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp,zero,tp", [(1, 0, 1), (4, 1, 1), (4, 3, 1), (4, 2, 2), (2, 0, 2)])
def test_plan_counts_the_ema_like_the_weights(dp, zero, tp):
    """4 bytes per parameter of the rank's share: the fp32 weights' own bytes, in every layout (an FSDP2
    shard, a TP split, the whole model where the weights are replicated, ZeRO-1 too); 0 without;
    bf16-pure alike (its fp32 weights are the masters). The literature conventions: 4 B/param, sharded by ZeRO-3."""
    from lmforge.plan.memory import Layout, estimate_memory

    cfg = load_config("gpt2-124m").model
    for precision, per_weight_byte in (("bf16", 1), ("bf16-pure", 1)):
        with_ema = estimate_memory(cfg, Layout(dp=dp, zero=zero, tp=tp, ema=True, precision=precision), "adamw", 64)
        without = estimate_memory(cfg, Layout(dp=dp, zero=zero, tp=tp, precision=precision), "adamw", 64)
        assert without.ema == 0 and with_ema.ema == per_weight_byte * with_ema.weights > 0
        assert with_ema.model_states - without.model_states == with_ema.ema
        assert with_ema.phases["validation"] - without.phases["validation"] == pytest.approx(with_ema.ema)
    zp = estimate_memory(cfg, Layout(dp=dp, zero=zero, tp=tp, ema=True), "adamw", 64, weights="zero-paper")
    assert zp.ema == pytest.approx(4 * zp.params_per_rank / (dp if zero == 3 else 1))


def test_plan_ema_of_the_tiny_model_equals_the_real_ema():
    """One process, the tiny preset: the planned bytes are the EMA's real tensors (a tied head once)."""
    from lmforge.model.transformer import build_model
    from lmforge.plan.memory import Layout, estimate_memory
    from lmforge.plan.micro_batch import layout_for_config
    from lmforge.train.ema import WeightEMA

    cfg = load_config("tiny", {"train.ema_decay": 0.99})
    layout = layout_for_config(cfg, "fp32", "cpu", 8)
    assert layout.ema and "ema=1" in layout.short() and Layout.parse("ema=1").ema
    real = WeightEMA(build_model(cfg.model, "cpu"), 0.99).local_bytes()
    assert estimate_memory(cfg.model, layout, "adamw", 128).ema == real
