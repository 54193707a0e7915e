"""The planner's conventions against Megatron-LM's and DeepSpeed's estimators
(benchmarks/plan_conventions.py restates their formulas; the figures here are derived by hand)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.plan.memory import Layout, estimate_memory, stage_specs, tp_shape

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
    """GPT-3 175B t8 p8 d8, distributed optimizer, SP + selective: 96 x 12h^2 in the blocks' matrices,
    96 x 4h + 2h of norms (replicated over TP); the vocabulary padded to a multiple of 128 x 8 =
    51200; the first stage holds (96 x 12h^2 / 8 + 51200 h)/8 + (96 x 4h + 2h)/8 = 2.797B params
    x (6 + 12/8) = 20.98 GB, and 34 sbh x 96 / 8 + (8sbp + sbhp)/8 = 10.29 GB of activations."""
    cfg = load_config("gpt3-175b").model
    lay = Layout(dp=8, zero=1, tp=8, sp=True, pp=8, grad_accum=192, ac="selective")
    est = bench.megatron_estimate(cfg, lay, 2048, distributed_optimizer=True)
    h = 12288
    assert bench.megatron_padded_vocab(cfg, 8) == 51200 and bench.megatron_padded_vocab(cfg, 1) == 50304
    assert est["params_on_shard"] == pytest.approx((96 * 12 * h * h / 8 + 51200 * h) / 8 + (96 * 4 * h + 2 * h) / 8)
    assert est["model_states"] / 1e9 == pytest.approx(20.98, abs=0.01)
    sbh = 2048 * h
    assert est["activations"] == pytest.approx((34 * sbh * 96 + 8 * 2048 * 8 + sbh * 8) / 8)


def _params_megatron_leaves_out(bench, cfg, lay: Layout) -> float:
    """Parameters on the first stage's TP rank that the planner counts and Megatron's formula does
    not (linear biases, a learned position table), less what Megatron counts there and the planner
    does not: its share of the final norm (spread over the stages as 1/p each) and the padded
    vocabulary rows (Megatron pads the vocabulary to a multiple of 128 x t)."""
    specs = stage_specs(cfg, lay.pp, 0)
    local = lambda spec: math.prod(tp_shape(spec, lay.tp))  # noqa: E731
    left_out = sum(local(x) for x in specs
                   if (x.name.endswith(".bias") and "norm" not in x.name) or x.name == "pos_emb.weight")
    norm_vectors = 1 if cfg.norm == "rmsnorm" else 2
    final_norm_share = 0 if lay.pp == 1 else norm_vectors * cfg.dim / lay.pp
    embeddings = 2 if (not cfg.tie_embeddings and lay.pp == 1) else 1
    padding = embeddings * (bench.megatron_padded_vocab(cfg, lay.tp) - cfg.vocab_size) * cfg.dim / lay.tp
    return left_out - final_norm_share - padding


def test_megatron_convention_agrees_with_megatrons_estimator(bench):
    """Model states: the same 18 B/param (6 + 12/d); the planner counts the model's own tensors, so
    it differs from Megatron's formula by exactly the parameters `_params_megatron_leaves_out`
    (GPT-3 t8 p8: +24.2M on the rank, +0.9%; Llama-2-70B t8 p4: -0.79M, the padded vocabulary;
    Mistral-7B: none). Activations: equal on the layouts Megatron's report models (SP + selective
    recompute)."""
    for case in bench.CASES:
        lay = Layout.parse(case.layout)
        if lay.zero > 1:
            continue  # Megatron has no ZeRO-2/3 (next test for their activations)
        row = bench.compare(case)
        cfg = load_config(case.preset).model
        assert estimate_memory(cfg, lay, "adamw", case.seq_len, weights="megatron").stage == 0
        per_param = 6 + 12 / lay.dp if case.distributed_optimizer else 18
        gap = _params_megatron_leaves_out(bench, cfg, lay)
        assert row["params_on_rank"] - row["megatron_params_on_rank"] == pytest.approx(gap, abs=1e-3), case.name
        assert row["megatron_conv_states"] - row["megatron_estimator_states"] == pytest.approx(
            per_param * gap, abs=1e-2), case.name
        assert row["megatron_conv_states"] == pytest.approx(row["megatron_estimator_states"], rel=0.01), case.name
        assert row["megatron_conv_states"] / row["zero_paper_states"] == pytest.approx(
            (6 + 12 / lay.dp) / (4 + 12 / lay.dp) if case.distributed_optimizer else 18 / 16, rel=1e-6)
        if lay.sp and lay.ac == "selective":
            assert row["megatron_conv_activations"] == pytest.approx(row["megatron_estimator_activations"],
                                                                     rel=1e-12), case.name
    llama = bench.compare(bench.CASES[1])  # 11.9 GB before (SwiGLU, GQA), Megatron's 10.8 now
    assert llama["megatron_conv_activations"] / 1e9 == pytest.approx(10.754, abs=1e-3)
    assert llama["zero_paper_activations"] / 1e9 == pytest.approx(11.929, abs=1e-3)


def test_full_recompute_keeps_the_layer_inputs_where_megatrons_estimator_counts_every_layer(bench):
    """Megatron's report does not model full recompute: outside SP + selective recompute it counts
    sbh(10 + 24/t) x 1.05 per layer whatever the recompute mode. The convention keeps the layer
    input, 2sbh, for a recomputed layer (Korthikanti et al.), and the rest as the report does: on
    the full-recompute rows it is lower by exactly L x (10 + 24/t - 2) x sbh x 1.05 (Llama-2-70B:
    96.2 -> 6.0 GB)."""
    for case in bench.CASES:
        lay = Layout.parse(case.layout)
        if lay.ac != "full":
            continue
        assert lay.pp == 1 and not lay.sp
        cfg = load_config(case.preset).model
        row = bench.compare(case)
        sbh = case.seq_len * lay.micro_batch * cfg.dim
        gap = 1.05 * cfg.n_layers * (10 + 24 / lay.tp - 2) * sbh
        assert row["megatron_estimator_activations"] - row["megatron_conv_activations"] == pytest.approx(
            gap, rel=1e-12), case.name
    llama = bench.compare(bench.CASES[2])
    assert (llama["megatron_estimator_activations"] / 1e9, llama["megatron_conv_activations"] / 1e9) == (
        pytest.approx(96.212, abs=1e-3), pytest.approx(6.018, abs=1e-3))


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
