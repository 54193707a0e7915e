"""The step-time model per op kind (lmforge.plan.op_time) against the GPU's measurements.

The measured rows are data (benchmarks/plan_measured_h100.toml: the H100 rows of benchmarks/RESULTS.md,
2026-11-26, with their source); benchmarks/plan_calibration.py derives the constants from the profile
and plans every row. Five constants come from five lines of one profile (GPT-2, compile, compiled
chunk loss, fused QKV) and one from a separate GEMM measurement; the eight rows' tokens/s and the
profile lines no constant was fitted to are checked here."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.plan.flops import estimate_step
from lmforge.plan.hardware import CATALOGUE, H100_CALIBRATION, Calibration, Cluster, load_devices, parse_cluster
from lmforge.plan.layout import Layout
from lmforge.plan.memory import estimate_memory, param_specs
from lmforge.plan.op_time import compiled_block_kernels, op_times

ROOT = Path(__file__).resolve().parents[1]


def _calibration_script():
    spec = importlib.util.spec_from_file_location("plan_calibration", ROOT / "benchmarks" / "plan_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CAL = _calibration_script()
MEASURED = CAL.load_measured()


def test_the_stated_h100_constants_are_what_the_profile_gives():
    """hardware.py states each constant rounded to 3 digits; they must be what the derivation from the
    measured profile gives (no hand tuning), and physically plausible: rates below the spec sheet."""
    derived = CAL.derive(MEASURED)
    for f in dataclasses.fields(Calibration):
        if f.name != "source":
            assert getattr(H100_CALIBRATION, f.name) == pytest.approx(getattr(derived, f.name), rel=5e-3), f.name
    for frac in (derived.matmul_fraction, derived.attention_fraction, derived.elementwise_fraction,
                 derived.optimizer_fraction):
        assert 0.2 < frac < 1.0
    assert 1e-6 < derived.gemm_fixed_s < 50e-6 and 1e-6 < derived.host_launch_s < 100e-6


def test_plan_is_within_10_percent_of_every_measured_h100_row():
    """Every GPU row of 2026-11-26 (GPT-2 124M plain / compile / chunked loss eager and compiled / fused
    QKV, the 1B with and without selective checkpointing): planned tokens/s within 10%."""
    rows = CAL.plan_rows(MEASURED)
    assert len(rows) == 8
    for r in rows:
        assert abs(r["error"]) < 0.10, (r["name"], r["plan"], r["measured"])
    # the settings move the plan the way they moved the measurement
    plan = {r["name"]: r["plan"] for r in rows}
    assert plan["gpt2 plain"] < plan["gpt2 compile"] < plan["gpt2 compile chunk eager"] \
        < plan["gpt2 compile chunk compiled"] < plan["gpt2 compile chunk compiled fused-qkv"]
    assert plan["1b compile chunk eager selective"] < plan["1b compile chunk compiled selective"] \
        < plan["1b compile chunk compiled"]


def test_profile_lines_no_constant_was_fitted_to():
    """The profile lines left out of the fit (the blocks' elementwise kernels and the casts of the
    profiled row, the first run's matmul / attention / eager-loss lines with separate q/k/v, the 1B's
    matmul share) within 15% of the plan."""
    checks = CAL.profile_checks(MEASURED)
    assert len(checks) == 8
    for c in checks:
        assert abs(c["error"]) < 0.15, c


def test_a_constant_off_by_a_quarter_breaks_the_rows():
    """The check can fail: with the elementwise bandwidth or the host time per launch 25% off, some
    measured row leaves the 10% band."""
    for field, factor in (("elementwise_fraction", 0.75), ("host_launch_s", 1.25 ** 4), ("gemm_fixed_s", 4.0)):
        off = dataclasses.replace(H100_CALIBRATION, **{field: getattr(H100_CALIBRATION, field) * factor})
        assert max(abs(r["error"]) for r in CAL.plan_rows(MEASURED, off)) > 0.10, field


def test_other_devices_take_the_same_fractions_of_their_spec_sheets():
    """A100: the H100's fractions of its own dense peak and HBM bandwidth, the same latencies; GPT-2
    plans slower on it by between its bandwidth and its peak ratio to the H100's."""
    h100, a100 = CATALOGUE["H100-SXM"], CATALOGUE["A100-80GB"]
    ra, rh = a100.rates("bf16"), h100.rates("bf16")
    assert ra.matmul_flops == pytest.approx(H100_CALIBRATION.matmul_fraction * 312e12)
    assert ra.elementwise_bps == pytest.approx(H100_CALIBRATION.elementwise_fraction * 2039e9)
    assert ra.host_launch_s == rh.host_launch_s and ra.gemm_fixed_s == rh.gemm_fixed_s
    cfg = load_config("gpt2-124m").model
    lay = Layout(micro_batch=16, grad_accum=4, loss_chunk=4096)
    speed = {d.name: estimate_step(cfg, lay, Cluster(d), 1024).tokens_per_s for d in (h100, a100)}
    assert 3350 / 2039 < speed["H100-SXM"] / speed["A100-80GB"] < 989 / 312
    with pytest.raises(ValueError, match="hbm_gbps"):
        devices = load_devices(None)
        bare = dataclasses.replace(devices["H100-SXM"], hbm_gbps=None)
        bare.rates("bf16")


def test_host_gaps_vanish_where_kernels_are_long():
    """Kernels longer than the host's time per launch hide it: Llama-2-70B's per-rank step has no host
    gap to speak of, GPT-2's short kernels leave ~6% of its step."""
    big = estimate_step(load_config("llama2-70b").model, Layout(dp=8, zero=3, micro_batch=1, grad_accum=16, ac="full"),
                        parse_cluster("8xH100"), 4096)
    assert big.time_by_kind["host"] < 1e-3 * big.compute_s
    small = estimate_step(load_config("gpt2-124m").model, Layout(micro_batch=16, grad_accum=4, loss_chunk=4096),
                          parse_cluster("H100"), 1024)
    assert 0.03 < small.time_by_kind["host"] / small.compute_s < 0.1


def test_bf16_pure_is_planned_for_memory_and_time():
    """precision = "bf16-pure" as lmforge runs it (lmforge.train.precision): the fp32 parameters are the
    master weights, fp32 gradients, Adam's states, and the step's bf16 copy of every parameter but the
    embeddings' (a buffer; the tied head's once): Megatron's 18 bytes per parameter (4 + 4 + 8 + 2, +
    AdamW's 4-byte step per tensor); a bf16 residual stream; and faster: the elementwise kernels move
    fewer bytes (no fp32 residual, no casts of activations)."""
    cfg = load_config("gpt2-124m").model
    mixed = Layout(micro_batch=16, grad_accum=4, loss_chunk=4096)
    pure = Layout.parse("mb=16,ga=4,loss_chunk=4096,precision=bf16-pure")
    assert pure.precision == "bf16-pure"
    m_mixed, m_pure = (estimate_memory(cfg, lay, "adamw", 1024) for lay in (mixed, pure))
    n = m_pure.params_total
    assert m_pure.weights == 4 * n and m_pure.gradients == 4 * n and m_pure.master_weights == 0
    assert m_pure.model_states == m_mixed.model_states == 16 * n + 4 * len(param_specs(cfg))
    embeddings = sum(math.prod(s.shape) for s in param_specs(cfg) if s.is_embedding)  # (token + positions)
    tied_head = cfg.vocab_size * cfg.dim
    assert m_pure.detail["bf16_pure_weight_copies"] == 2 * (n - embeddings + tied_head)
    assert "autocast_weight_copies" in m_mixed.detail and "autocast_weight_copies" not in m_pure.detail
    assert m_pure.activations < m_mixed.activations
    assert estimate_memory(cfg, pure, "adamw", 1024, weights="megatron").model_states == \
        estimate_memory(cfg, mixed, "adamw", 1024, weights="megatron").model_states
    h100 = CATALOGUE["H100-SXM"]
    t_mixed, t_pure = (op_times(cfg, lay, 1024, h100).by_kind() for lay in (mixed, pure))
    assert t_pure["matmul"] == pytest.approx(t_mixed["matmul"]) and t_pure["attention"] == t_mixed["attention"]
    assert t_pure["elementwise"] < 0.75 * t_mixed["elementwise"] and t_pure["casts"] < t_mixed["casts"]
    names = {g.name for g in op_times(cfg, pure, 1024, h100).groups}
    assert "16-bit weight copies" in names and "residual grad cast" not in names  # (the step's one copy)
    fast = [estimate_step(cfg, lay, Cluster(h100), 1024).tokens_per_s for lay in (mixed, pure)]
    assert fast[1] > 1.05 * fast[0]


def test_compiled_block_bytes_follow_the_stated_counts():
    """The compiled block's elementwise bytes are the module docstring's counts: GPT-2 under autocast
    (r = 4, a = 2, F = 4h, fused q/k/v): forward 5r + 4a + 2Fa = 44h, backward 72h bytes per token."""
    from lmforge.plan.op_time import _widths

    cfg = load_config("gpt2-124m", {"model.fused_qkv": True}).model
    fwd, bwd = compiled_block_kernels(cfg, _widths(cfg, Layout()))
    h = cfg.dim
    assert sum(b for _, b in fwd) == 44 * h and sum(b for _, b in bwd) == 72 * h
