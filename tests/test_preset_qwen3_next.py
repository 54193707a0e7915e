"""The qwen3-next-80b-a3b preset: Qwen3-Next-80B-A3B's published shape (transformers' Qwen3NextConfig
defaults are that model's), its total and active parameter counts against the published 80B / 3B, counted
three ways without materialising anything; `lmforge presets` lists it and `lmforge plan` says in one line
what it does not count yet for the linear-attention blocks."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import load_config
from lmforge.model.accounting import count_params, flops_per_token, training_flops
from lmforge.plan.params import total_params

PRESET = "qwen3-next-80b-a3b"


def test_the_preset_has_the_published_shape():
    m = load_config(PRESET).model
    assert (m.n_layers, m.dim, m.vocab_size, m.tie_embeddings) == (48, 2048, 151936, False)
    assert [m.is_linear_layer(i) for i in range(8)] == [True, True, True, False] * 2
    assert (m.n_heads, m.kv_heads, m.head_dim, m.attn_gate, m.qk_norm, m.rope_dim) == (16, 2, 256, True, True, 64)
    assert (m.deltanet_shape, m.deltanet.conv_kernel) == ((16, 32, 128, 128), 4)
    e = m.moe
    assert (e.num_experts, e.expert_hidden, e.top_k, e.shared_experts, e.shared_gate, e.renormalize) == \
        (512, 512, 10, 1, True, True)
    assert all(e.is_moe_layer(i) for i in range(48))


def test_the_preset_is_transformers_qwen3_next_config():
    """Its export config is transformers' Qwen3NextConfig() (whose defaults are the 80B model's) in
    every shape key, and that config imports as the preset's model."""
    transformers = pytest.importorskip("transformers")
    from lmforge.interop.hf_qwen3next import model_config_from_qwen3next, qwen3next_hf_config

    m = load_config(PRESET).model
    ours, theirs = qwen3next_hf_config(m).to_dict(), transformers.Qwen3NextConfig().to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
                "shared_expert_intermediate_size", "num_experts_per_tok", "num_experts", "norm_topk_prob",
                "layer_types", "mlp_only_layers", "decoder_sparse_step", "tie_word_embeddings", "rms_norm_eps"):
        assert ours[key] == theirs[key], key
    assert ours["rope_parameters"]["partial_rotary_factor"] == theirs["rope_parameters"]["partial_rotary_factor"]
    assert model_config_from_qwen3next(ours) == m


def test_the_preset_has_the_published_total_and_active_parameters():
    """~80B total and ~3B active (A3B) as published: the config's formula, the planner's parameter specs
    and the model built on the meta device agree exactly; 'active' without the embedding and head (what
    the A3B counts; with them 3.9B) rounds to 3B, and the total to 80B."""
    from lmforge.model.transformer import Transformer

    m = load_config(PRESET).model
    counts = count_params(m)
    with torch.device("meta"):
        model = Transformer(m)
    assert model.num_params() == counts["total"] == total_params(m)
    assert abs(counts["total"] - 80e9) / 80e9 < 0.01, counts["total"]
    active = counts["active"] - counts["embedding"] - counts["lm_head"]
    assert round(active / 1e9) == 3, active


def test_the_shared_expert_gate_is_counted_in_flops_as_in_parameters():
    m = load_config(PRESET).model
    with torch.device("meta"):
        from lmforge.model.transformer import Transformer

        trainable = {n: p.numel() for n, p in Transformer(m).named_parameters()}
    assert training_flops(m, 4096, trainable)["total"] == pytest.approx(flops_per_token(m, 4096), rel=1e-12)


def test_presets_lists_it_and_plan_says_what_it_does_not_count(capsys):
    from lmforge.cli import main
    from lmforge.cli.plan import plan_main

    assert main(["presets"]) == 0
    assert PRESET in capsys.readouterr().out
    assert plan_main(["--model", PRESET, "--gpus", "8x8xH100"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "Gated DeltaNet" in line]
    assert len(notes) == 1 and "36 of the 48 blocks" in notes[0], out
