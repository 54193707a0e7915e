"""lmforge.plan.flops: FLOPs, time, cost, bubble, communication; published figures."""

from __future__ import annotations

import pytest

from lmforge.config import load_config
from lmforge.plan.flops import (SECONDS_PER_YEAR, estimate_step, flops_per_token, pipeline_bubble,
                                simple_training_estimate)
from lmforge.plan.hardware import CATALOGUE, parse_cluster
from lmforge.plan.memory import Layout


def test_gpt3_on_one_v100_takes_about_288_years():
    # Narayanan et al. 2021: GPT-3 175B (300B tokens) on one V100 would take ~288 years.
    # 6ND = 3.15e23 FLOPs at 27.7% MFU of the V100's 125 TFLOP/s fp16 (34.6 TFLOP/s sustained).
    est = simple_training_estimate(175e9, 300e9, CATALOGUE["V100"], n_gpus=1, mfu=0.277, precision="fp16")
    assert est["flops"] == pytest.approx(3.15e23)
    assert est["years"] == pytest.approx(288, rel=0.01)
    # Same answer from the preset (its N is 174.6B) through the 6N convention.
    cfg = load_config("gpt3-175b").model
    years = 300e9 * flops_per_token(cfg, 2048, "6N") / (125e12 * 0.277) / SECONDS_PER_YEAR
    assert years == pytest.approx(288, rel=0.01)


def test_flops_per_token_matches_the_model():
    from lmforge.model.transformer import flops_per_token as model_fpt

    for preset in ("tiny", "gpt2-124m", "llama2-70b", "gpt3-175b"):
        cfg = load_config(preset)
        assert flops_per_token(cfg.model, cfg.data.seq_len) == model_fpt(cfg.model, cfg.data.seq_len)


def test_pipeline_bubble():
    assert pipeline_bubble(1, 8) == 0
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble(4, 8, virtual_stages=3) == pytest.approx(1 / 9)
    with pytest.raises(ValueError):
        pipeline_bubble(0, 8)


def test_step_time_cost_and_bubble():
    cfg = load_config("gpt2-124m").model
    cluster = parse_cluster("8xH100")
    lay = Layout(dp=8, micro_batch=8, grad_accum=8)
    est = estimate_step(cfg, lay, cluster, 1024, mfu=0.4, train_tokens=1e10, price_per_gpu_hour=2.0,
                        use_shape_efficiency=False)
    fpt = flops_per_token(cfg, 1024)
    assert est.tokens_per_step == 8 * 8 * 8 * 1024
    assert est.compute_s == pytest.approx(est.tokens_per_step * fpt / (8 * 989e12 * 0.4))
    assert est.step_s >= est.compute_s and est.mfu <= 0.4 + 1e-12
    assert est.gpu_hours == pytest.approx(est.train_s * 8 / 3600)
    assert est.cost == pytest.approx(est.gpu_hours * 2.0)
    piped = estimate_step(load_config("llama2-70b").model, Layout(dp=1, tp=8, pp=4, grad_accum=8),
                          parse_cluster("4x8xH100"), 4096)
    assert piped.bubble_fraction == pytest.approx(3 / 11)
    assert set(piped.comm_s) == {"tp", "pp"}
    with pytest.raises(ValueError, match="GPUs"):
        estimate_step(cfg, Layout(dp=16), cluster, 1024)


def test_comm_crosses_nodes_only_when_the_group_does():
    cfg = load_config("gpt3-175b").model  # 96 heads: tp = 16 is legal
    one = estimate_step(cfg, Layout(dp=1, tp=8, grad_accum=4), parse_cluster("8xH100"), 2048)
    two = estimate_step(cfg, Layout(dp=1, tp=16, grad_accum=4), parse_cluster("16xH100"), 2048)
    spread = estimate_step(cfg, Layout(dp=1, tp=16, grad_accum=4), parse_cluster("2x8xH100"), 2048)
    assert spread.comm_s["tp"] > 5 * two.comm_s["tp"]
    assert one.comm_s["tp"] > 0
