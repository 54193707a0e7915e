"""The planner's model of multi-head latent attention and multi-token prediction (lmforge.plan.params,
lmforge.plan.activations): the parameter tensors equal the model's, and a bf16 training step on the
CPU saves exactly the planned activations + the step's 16-bit weight copies (+ the RoPE tables that
blocks without recompute keep: under full recompute the MTP blocks, which are never recomputed, still
keep them), as tests/test_plan_memory.py checks for multi-head attention."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import load_config
from lmforge.model.transformer import Transformer, build_model
from lmforge.plan.memory import Layout, estimate_memory
from lmforge.plan.params import param_specs
from tests.test_plan_memory import _step_bytes

MLA = {"model.mla.kv_lora_rank": 32, "model.mla.q_lora_rank": 24, "model.mla.qk_nope_head_dim": 16,
       "model.mla.qk_rope_head_dim": 8, "model.mla.v_head_dim": 16, "model.tie_embeddings": False, "model.n_layers": 2}
CASES = {
    "mla": MLA,
    "mla-no-q-latent": {**MLA, "model.mla.q_lora_rank": 0},
    "mla-wide-v": {**MLA, "model.mla.v_head_dim": 24},  # (v not padded: a view of the up-projection's output)
    "mtp": {"model.mtp_depth": 1, "model.tie_embeddings": False, "model.n_layers": 2},
    "mla-mtp2": {**MLA, "model.mtp_depth": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_param_specs_are_the_models_tensors(case):
    cfg = load_config("tiny", CASES[case]).model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert [(s.name, s.shape) for s in param_specs(cfg)] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_saves_exactly_the_planned_activations(case, ac):
    from lmforge.parallel.activation_ckpt import apply_activation_checkpointing

    cfg = load_config("tiny", CASES[case])
    model = build_model(cfg.model, "cpu", seed=0)
    apply_activation_checkpointing(model.blocks, ac)
    s, b = 32, 2
    measured, copies, _, _ = _step_bytes(model, [torch.randint(0, cfg.model.vocab_size, (b, s))])
    mem = estimate_memory(cfg.model, Layout(micro_batch=b, ac=ac), "adamw", s, weights="lmforge")
    rope = mem.detail["rope_tables"] if ac != "full" or cfg.model.mtp_depth else 0
    assert copies == mem.detail["autocast_weight_copies"]
    assert measured == mem.activations + copies + rope


def test_deepseek_v3_plans_with_mla_and_its_mtp_module():
    """The preset's plan counts every parameter the model holds (MTP included) and MLA's activations:
    more per layer than the multi-head attention of the same width would save (its padded 192-wide
    q, k, v and its latents), and the MTP module's block and head on the last stage."""
    cfg = load_config("deepseek-v3-671b").model
    layout = Layout(dp=8, zero=3, ep=8, micro_batch=1, grad_accum=4, ac="none")
    mem = estimate_memory(cfg, layout, "adamw", 4096, weights="lmforge")
    without = estimate_memory(cfg.__class__(**{**cfg.__dict__, "mtp_depth": 0}), layout, "adamw", 4096, weights="lmforge")
    assert mem.detail["activations_outside_blocks"] > without.detail["activations_outside_blocks"] + \
        mem.detail["activations_blocks"] / cfg.n_layers
