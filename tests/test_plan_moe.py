"""The planner on Mixture-of-Experts models: the presets' parameter counts against the published
figures, expert weights held under expert parallelism, FLOPs from the active parameters (and the
MFU that uses them), the all-to-all traffic in the step time, and EP degrees in the layout search."""

from __future__ import annotations

import pytest

from lmforge.config import load_config
from lmforge.model.accounting import count_params, flops_per_token
from lmforge.plan.flops import ep_comm, estimate_step
from lmforge.plan.hardware import parse_cluster
from lmforge.plan.memory import Layout, estimate_memory, total_params
from lmforge.plan.search import enumerate_layouts

# (total, active) parameters as published: Mixtral of Experts (Jiang et al. 2024): 46.7B / 12.9B;
# Qwen3-30B-A3B (Qwen3 technical report): 30.5B / 3.3B; DeepSeek-V3 (arXiv 2412.19437): 671B / 37B,
# the main model without its multi-token prediction module (count_params' "main" / "main_active").
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9), "qwen3-30b-a3b": (30.5e9, 3.3e9), "deepseek-v3-671b": (671e9, 37e9)}
# Tolerance 2% relative: the published figures are rounded to 2-3 significant digits (3.3B is 3.35B
# counted from the Hugging Face config, 1.6% above; DeepSeek-V3's 37B is 37.55B).
TOL = 0.02


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_moe_presets_have_the_published_total_and_active_parameters(preset):
    cfg = load_config(preset).model
    total, active = PUBLISHED[preset]
    counts = count_params(cfg)
    assert counts["total"] == total_params(cfg)  # the planner's tensors: every expert of every layer
    assert abs(counts["main"] - total) / total < TOL, counts["main"]
    assert abs(counts["main_active"] - active) / active < TOL, counts["main_active"]


def test_deepseek_v3_counts_are_those_of_its_released_config():
    """Exact counts of DeepSeek-V3's config.json (multi-head latent attention, 256 + 1 experts from
    block 3, one MTP module): the main model 671.03B (the published 671B), 37.55B active (37B); the MTP
    module 11.61B of its own, and its Hugging Face checkpoint, which also stores the MTP layer's copies
    of the embedding and head, 684.49B (the model card's 685B)."""
    import torch

    from lmforge.model.transformer import Transformer

    cfg = load_config("deepseek-v3-671b").model
    counts = count_params(cfg)
    assert (counts["main"], counts["main_active"]) == (671_026_404_352, 37_552_282_624)
    assert (counts["mtp"], counts["total"]) == (11_610_067_968, 682_636_472_320)
    assert counts["total"] + 2 * cfg.vocab_size * cfg.dim == 684_489_830_400
    layer_attention = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert layer_attention == 187_107_328  # DeepSeek-V3's MLA per layer
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_params() == counts["total"]
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp.")) == counts["mtp"]
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.3.attn.")) == layer_attention


def test_expert_weights_are_held_as_the_layout_splits_them():
    cfg = load_config("mixtral-8x7b").model
    experts = count_params(cfg)["experts"]
    dense = count_params(cfg)["total"] - experts
    for ep in (1, 2, 8):  # replicated data parallelism (no ZeRO): each rank holds E / ep experts, all else
        mem = estimate_memory(cfg, Layout(dp=8, ep=ep, ac="full"), seq_len=4096)
        assert mem.weights == pytest.approx(4 * (dense + experts / ep))  # lmforge: fp32 weights
    sharded = estimate_memory(cfg, Layout(dp=8, zero=3, ep=8, ac="full"), seq_len=4096)
    assert sharded.weights == pytest.approx(4 * (dense / 8 + experts / 8), rel=1e-3)  # FSDP over dp / ep = 1
    with pytest.raises(ValueError, match="ep = 3"):
        Layout(dp=8, ep=3).validate()
    with pytest.raises(ValueError, match="routed experts"):
        Layout(dp=8, ep=2).validate(load_config("llama-1b").model)


def test_flops_count_active_parameters_and_mfu_uses_them():
    cfg = load_config("mixtral-8x7b").model
    counts = count_params(cfg)
    # 6 x (active parameters in matmuls: not the input embedding) + 12 L d s (attention)
    expected = 6 * (counts["active"] - counts["embedding"]) + 12 * cfg.n_layers * cfg.dim * 4096
    assert flops_per_token(cfg, 4096) == pytest.approx(expected)
    est = estimate_step(cfg, Layout(dp=8, zero=3, ep=8, micro_batch=1, grad_accum=4, ac="full"),
                        parse_cluster("8xH100"), 4096)
    assert est.flops_per_token == pytest.approx(expected)
    peak = est.model_flops_per_step / (est.mfu * est.step_s * est.n_gpus)
    assert est.model_flops_per_step == pytest.approx(est.tokens_per_step * expected)
    assert peak == pytest.approx(989e12, rel=0.01)


def test_step_time_includes_the_all_to_all_traffic():
    cfg = load_config("mixtral-8x7b").model
    cluster = parse_cluster("8xH100")
    base = Layout(dp=8, zero=3, micro_batch=1, grad_accum=4, ac="none")
    with_ep = Layout(dp=8, zero=3, ep=8, micro_batch=1, grad_accum=4, ac="none")
    assert "ep" not in estimate_step(cfg, base, cluster, 4096).comm_s
    est = estimate_step(cfg, with_ep, cluster, 4096)
    traffic = ep_comm(cfg, with_ep, 4096)
    # per layer and micro-batch: dispatch + combine forward and backward, 4096 tokens x top-2 rows of
    # 4096 bf16 values, 7/8 of them leaving the rank
    assert traffic["calls"] == 4 * 32 * 4
    assert traffic["wire_bytes"] == pytest.approx(traffic["calls"] * 4096 * 2 * 4096 * 2 * 7 / 8)
    assert est.comm_s["ep"] > traffic["wire_bytes"] / (cluster.device.intra_node_gbps * 1e9)
    assert est.exposed_comm_s >= est.comm_s["ep"] * (1 - 1e-12)  # (not overlapped)


def test_search_tries_expert_parallel_degrees():
    moe = load_config("mixtral-8x7b").model
    cluster = parse_cluster("2x8xH100")
    eps = {layout.ep for layout in enumerate_layouts(moe, cluster, 64, seq_len=4096, ac_modes=("full",))}
    assert eps == {1, 2, 4, 8}  # powers of two dividing dp and the 8 experts
    dense = load_config("llama-1b").model
    assert {layout.ep for layout in enumerate_layouts(dense, cluster, 64, seq_len=2048, ac_modes=("full",))} == {1}
