"""lmforge.plan.search: layouts that fit, ranked, with reasons."""

from __future__ import annotations

import pytest

from lmforge.config import load_config
from lmforge.plan.hardware import parse_cluster
from lmforge.plan.search import enumerate_layouts, explain_winner, search_layouts


def test_70b_on_64_nodes_of_8_h100():
    cfg = load_config("llama2-70b").model
    cluster = parse_cluster("64x8xH100")
    cands = search_layouts(cfg, cluster, global_batch=1024, seq_len=4096, top=20)
    assert cands and all(c.fits for c in cands)
    rates = [c.step.tokens_per_s for c in cands]
    assert rates == sorted(rates, reverse=True)
    for c in cands:
        L = c.layout
        assert L.world_size == 512 and L.tp <= 8  # TP stays inside a node
        assert L.micro_batch * L.grad_accum * L.dp == 1024
        assert c.memory.total <= 0.9 * 80e9
        assert c.reason and f"DP={L.dp}" in c.reason
    best = cands[0].layout
    assert best.tp > 1 and best.zero >= 1  # a 70B model needs TP or sharding to fit at all
    assert "TP stays inside a node" in explain_winner(cands)
    # 70B does not fit replicated (DDP, no TP/PP) on an 80 GB GPU: no such candidate anywhere.
    everything = search_layouts(cfg, cluster, 1024, 4096, top=None)
    assert not any(c.layout.tp == 1 and c.layout.pp == 1 and c.layout.zero == 0 for c in everything)


def test_tp_across_nodes_is_never_proposed():
    cfg = load_config("gpt3-175b").model
    layouts = enumerate_layouts(cfg, parse_cluster("4x8xH100"), 64)
    assert layouts and max(lay.tp for lay in layouts) == 8


def test_small_model_prefers_plain_data_parallel():
    cfg = load_config("gpt2-124m").model
    cands = search_layouts(cfg, parse_cluster("8xH100"), global_batch=480 // 60 * 64, seq_len=1024, top=5)
    best = cands[0].layout
    assert best.tp == 1 and best.pp == 1 and best.dp == 8


def test_unfit_and_bad_batch():
    cfg = load_config("llama2-70b").model
    cands = search_layouts(cfg, parse_cluster("1xA100-40GB"), 8, 4096, include_unfit=False)
    assert cands == []
    assert "No layout fits" in explain_winner(cands)
    with pytest.raises(ValueError, match="global batch"):
        # gpt2: 12 heads, so tp <= 4 on 8 GPUs, and one sequence cannot feed dp >= 2 or a pipeline
        search_layouts(load_config("gpt2-124m").model, parse_cluster("8xH100"), 1, 1024)
