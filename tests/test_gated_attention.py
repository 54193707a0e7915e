"""Qwen3-Next's full attention as model options (issue 57 item 2): the sigmoid output gate
(model.attn_gate) and partial RoPE (model.rope_fraction), against a direct implementation of their
definitions; the defaults leave the model as it was; the config refuses what cannot be."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ConfigError, ModelConfig
from lmforge.model.layers import Attention, apply_rope, rope_tables
from lmforge.model.transformer import build_model, count_params

GATED = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, fused_qkv=False,
             attn_gate=True, rope_fraction=0.5, rope_theta=500.0)


def _reference(attn: Attention, x: torch.Tensor, rotated: int, theta: float) -> torch.Tensor:
    """The definition, written out in fp64: q/k/v per head; RoPE on each head's first `rotated` dims
    (dim i paired with i + rotated / 2, angle position x theta^(-2i / rotated)), the rest unrotated;
    causal softmax attention (kv heads repeated); the output times sigmoid(x W_g) if there is a
    gate, then W_o."""
    b, s, _ = x.shape
    hd, h, kv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    x = x.double()
    heads = lambda w, n: (x @ w.weight.T.double()).view(b, s, n, hd).transpose(1, 2)  # noqa: E731
    q, k, v = heads(attn.wq, h), heads(attn.wk, kv), heads(attn.wv, kv)
    half = rotated // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotated)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freq  # (s, half)

    def rope(t):
        a, c, rest = t[..., :half], t[..., half:rotated], t[..., rotated:]
        return torch.cat((a * angle.cos() - c * angle.sin(), c * angle.cos() + a * angle.sin(), rest), dim=-1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
    scores = q @ k.transpose(-1, -2) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h * hd)
    if attn.wg is not None:
        out = out * torch.sigmoid(x @ attn.wg.weight.T.double())
    return out @ attn.wo.weight.T.double()


@pytest.mark.parametrize("gate, fraction", [(True, 0.5), (False, 0.25), (True, 1.0)])
def test_gated_attention_with_partial_rope_is_its_definition(gate, fraction):
    cfg = ModelConfig(**{**GATED, "attn_gate": gate, "rope_fraction": fraction})
    torch.manual_seed(0)
    attn = Attention(cfg)
    assert (attn.wg is not None) == gate
    assert cfg.rope_dim == int(cfg.head_dim * fraction)
    x = torch.randn(2, 11, cfg.dim)
    cos, sin = rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta)
    with torch.no_grad():
        ours = attn(x, (cos, sin))
        want = _reference(attn, x, cfg.rope_dim, cfg.rope_theta)
    assert (ours.double() - want).abs().max().item() < 1e-5


def test_partial_rope_rotates_the_first_dims_and_passes_the_rest_through():
    cos, sin = rope_tables(4, 16, 10000.0)
    x = torch.randn(1, 2, 16, 8)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    assert torch.equal(out[..., :4], apply_rope(x[..., :4].contiguous(), cos, sin))


def test_the_defaults_leave_the_model_as_it_was():
    """No gate weight, RoPE over the whole head: the same parameters, and rope tables of head_dim."""
    plain = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4)
    assert (plain.attn_gate, plain.rope_fraction, plain.rope_dim) == (False, 1.0, plain.head_dim)
    model = build_model(plain, seed=0)
    assert not any(".wg." in n for n, _ in model.named_parameters())
    gated = build_model(ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, attn_gate=True), seed=0)
    extra = count_params(gated.cfg)["total"] - count_params(plain)["total"]
    assert extra == gated.num_params() - model.num_params() == 2 * 32 * 32  # one (dim x n_heads head_dim) per block


def test_the_gate_is_split_by_heads_like_q_under_tensor_parallelism():
    from lmforge.parallel.tensor_parallel import tp_plan

    plan = tp_plan(build_model(ModelConfig(**GATED), seed=0), sequence_parallel=False)
    assert type(plan["blocks.0.attn.wg"]) is type(plan["blocks.0.attn.wq"])
    assert "blocks.0.attn.wg" not in tp_plan(build_model(ModelConfig(**{**GATED, "attn_gate": False}), seed=0), False)


@pytest.mark.parametrize("edit, match", [
    ({"rope_fraction": 0.0}, r"model.rope_fraction = 0.0 must be in \(0, 1\]"),
    ({"rope_fraction": 1.5}, r"model.rope_fraction = 1.5 must be in \(0, 1\]"),
    ({"rope_fraction": 0.125}, r"rotates 1 of the 8 dimensions.*even whole number"),
    ({"rope_fraction": 0.3}, r"rotates 2.4 of the 8"),
    ({"rope_fraction": 0.5, "pos_emb": "learned", "norm": "layernorm", "activation": "gelu"},
     r"needs model.pos_emb = 'rope'"),
    ({"attn_gate": True, "n_kv_heads": None, "mla": {"kv_lora_rank": 16}}, r"model.attn_gate = True does not apply to multi-head latent"),
])
def test_impossible_settings_are_refused(edit, match):
    from lmforge.config.sections import MLAConfig

    edit = {k: (MLAConfig(**v) if k == "mla" else v) for k, v in edit.items()}
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**GATED, "rope_fraction": 1.0, "attn_gate": False, **edit}).check()


def test_export_refuses_what_no_family_has():
    from lmforge.interop.hf import hf_family

    for key, value in (("attn_gate", True), ("rope_fraction", 0.5)):
        with pytest.raises(ValueError, match=rf"model.{key} = {value} cannot be represented by LlamaForCausalLM"):
            hf_family(ModelConfig(**{**GATED, "attn_gate": False, "rope_fraction": 1.0, key: value}))
