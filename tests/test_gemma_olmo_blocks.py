"""Gemma 3's and OLMo 2 / 3's block options in one process (lmforge.model.layers): the norm placements
as their formulas written out, interleaved local / global blocks (each its window and RoPE base, under
document masking too), the embedding scale, and every impossible value refused in one line. Logits parity
with transformers: tests/test_interop_hf_gemma_olmo.py; layouts: tests/test_parallel_gemma_olmo.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ConfigError, ModelConfig
from lmforge.model.transformer import build_model

TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
BASE = dict(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, qk_norm=True)
LOCAL = dict(layer_types=TYPES, sliding_window=4, rope_local_theta=100.0)


@pytest.mark.parametrize("placement", ["post", "sandwich"])
def test_the_norm_placements_are_their_formulas(placement):
    cfg = ModelConfig(**BASE, norm_placement=placement, activation="geglu")
    block = build_model(cfg, seed=0).blocks["0"]
    assert (block.attn_norm is None) == (placement == "post") and block.attn_post_norm is not None
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        n = block.attn_norm or (lambda t: t)
        h = x + block.attn_post_norm(block.attn(n(x), None))
        m = block.mlp_norm or (lambda t: t)
        mlp = block.mlp.down(F.gelu(block.mlp.gate(m(h)), approximate="tanh") * block.mlp.up(m(h)))
        assert torch.allclose(block(x), h + block.mlp_post_norm(mlp), atol=1e-6)


def test_local_and_global_blocks_have_their_own_window_and_rope_base():
    model = build_model(ModelConfig(**BASE, **LOCAL), seed=0)
    assert [(b.local, b.attn.window) for b in model.blocks.values()] == [(True, 4), (False, 0), (True, 4)]
    assert torch.allclose(model.rope_local_cos[3, 0], torch.cos(torch.tensor(3.0)))  # (frequency 1 either way)
    assert torch.allclose(model.rope_local_cos[3, 1], torch.cos(3 * torch.tensor(100.0) ** (-2 / 8)))
    assert torch.allclose(model.rope_cos[3, 1], torch.cos(3 * torch.tensor(1e4) ** (-2 / 8)))
    tokens = torch.randint(0, 61, (1, 12))
    with torch.no_grad():  # a token more than the window back moves only what the global block sees
        a, b = model(tokens), model(torch.cat([tokens[:, :1] + 1, tokens[:, 1:]], 1))
        assert not torch.allclose(a[0, -1], b[0, -1])
        model.blocks["1"].attn.window = 4  # (every block local: the first token is out of every window's reach)
        a, b = model(tokens), model(torch.cat([tokens[:, :1] + 1, tokens[:, 1:]], 1))
        assert torch.allclose(a[0, -1], b[0, -1], atol=1e-6)


def test_documents_attend_within_themselves_on_local_and_global_blocks():
    """data.attention = "document": a packed document gives the logits it has alone (positions restarting)."""
    model = build_model(ModelConfig(**BASE, **LOCAL, norm_placement="sandwich", embed_scale=True), seed=0).eval()
    first, second = torch.randint(0, 61, (1, 7)), torch.randint(0, 61, (1, 9))
    packed = torch.cat([first, second], 1)
    doc_ids = torch.tensor([[0] * 7 + [1] * 9])
    positions = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        together = model(packed, doc_ids=doc_ids, positions=positions)
        assert torch.allclose(together[:, :7], model(first), atol=1e-5)
        assert torch.allclose(together[:, 7:], model(second), atol=1e-5)


def test_the_embedding_scale_is_rounded_to_the_model_dtype():
    from lmforge.model.layers import scale_embedding

    cfg = ModelConfig(**BASE, embed_scale=True)
    x = torch.ones(2, dtype=torch.bfloat16)
    assert scale_embedding(cfg, x).tolist() == [torch.tensor(32 ** 0.5).bfloat16().item()] * 2  # 5.65625


@pytest.mark.parametrize("edit, match", [
    ({"qk_norm": False, "qk_norm_scope": "projection"}, "qk_norm_scope = 'projection' .* model.qk_norm = false"),
    ({"rope_local_theta": 1e4}, "rope_local_theta = 10000 applies to 'sliding_attention' blocks"),
    ({"layer_types": TYPES}, "names 'sliding_attention' blocks but model.sliding_window = 0"),
    ({"layer_types": ["local", "full_attention", "full_attention"]}, r"model.layer_types\[0\] = 'local' must be"),
    ({"norm_placement": "middle"}, "model.norm_placement = 'middle' must be 'pre', 'post' or 'sandwich'"),
    ({"attn_scale_dim": 0}, "model.attn_scale_dim = 0 must be >= 1"),
])
def test_impossible_values_are_refused_in_one_line(edit, match):
    with pytest.raises(ConfigError, match=match) as err:
        ModelConfig(**{**BASE, **edit}).check()
    assert "\n" not in str(err.value)
