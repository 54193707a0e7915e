"""The planner's conventions against Megatron-LM's and DeepSpeed's estimators
(benchmarks/plan_conventions.py restates their formulas; the figures here are derived by hand)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.plan.memory import Layout, estimate_memory

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plan_conventions", ROOT / "benchmarks" / "plan_conventions.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_megatron_estimator_restated(bench):
    """GPT-3 175B t8 p8 d8, distributed optimizer, SP + selective: 96 x 12h^2 (+ norms) = 173.95B in
    the blocks; the first stage holds (173.95B/8 + 50304 h)/8 = 2.795B x (6 + 12/8) = 20.96 GB, and
    34 sbh x 96 / 8 + (8sbp + sbhp)/8 = 10.29 GB of activations."""
    cfg = load_config("gpt3-175b").model
    lay = Layout(dp=8, zero=1, tp=8, sp=True, pp=8, grad_accum=192, ac="selective")
    est = bench.megatron_estimate(cfg, lay, 2048, distributed_optimizer=True)
    h = 12288
    block = 96 * (12 * h * h + 4 * h) + 2 * h
    assert est["params_on_shard"] == pytest.approx((block / 8 + 50304 * h) / 8)
    assert est["model_states"] / 1e9 == pytest.approx(20.96, abs=0.01)
    sbh = 2048 * h
    assert est["activations"] == pytest.approx((34 * sbh * 96 + 8 * 2048 * 8 + sbh * 8) / 8)


def test_megatron_convention_agrees_with_megatrons_estimator(bench):
    """Same 18 B/param (6 + 12/d): the planner differs only by what Megatron's parameter formula
    leaves out (linear biases, a learned position table): < 1%."""
    for case in bench.CASES[:2]:
        row = bench.compare(case)
        assert row["megatron_conv_states"] == pytest.approx(row["megatron_estimator_states"], rel=0.01), case.name
        assert row["megatron_conv_states"] / row["zero_paper_states"] == pytest.approx(
            (6 + 12 / 8) / (4 + 12 / 8) if case.distributed_optimizer else 18 / 16, rel=1e-6)


def test_deepspeed_estimators_restated_and_compared(bench):
    """DeepSpeed ZeRO-3 = 18 P/N + 4 x the largest module: the planner's megatron convention with
    DeepSpeed's largest-layer term added is exactly it; ZeRO-2 = 2P + 18P/N is the convention's
    2 + 16/N plus DeepSpeed's sharded 16-bit gradient copy (2/N)."""
    cfg = load_config("llama2-70b").model
    P = estimate_memory(cfg, Layout(), "adamw", 4096).params_total
    largest = bench.largest_module_params(cfg)
    assert largest == 32000 * 8192  # the embedding (and the head)
    z3 = estimate_memory(cfg, Layout(dp=8, zero=3), "adamw", 4096, weights="megatron")
    assert bench.deepspeed_zero3_gpu(P, largest, 8) == pytest.approx(z3.model_states + 4 * largest)
    z2 = estimate_memory(cfg, Layout(dp=64, zero=2), "adamw", 4096, weights="megatron")
    assert bench.deepspeed_zero2_gpu(P, 64) == pytest.approx(z2.model_states + 2 * P / 64)


def test_the_table_prints(bench, capsys, tmp_path):
    assert bench.main(["--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| ") >= 2 * (len(bench.CASES) + 1) and "Megatron's estimator" in out
    assert (tmp_path / "rows.json").stat().st_size > 0
