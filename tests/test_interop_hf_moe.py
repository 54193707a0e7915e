"""Mixtral interop (lmforge.interop.hf_moe): a random MixtralForCausalLM made by transformers imports
with the same logits, and an lmforge MoE model exports to a folder transformers loads with the same
logits (fp32; atol 1e-5)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.config.sections import MoEConfig  # noqa: E402
from lmforge.interop.hf_moe import check_mixtral, export_mixtral, import_mixtral  # noqa: E402
from lmforge.model.transformer import build_model  # noqa: E402


def test_transformers_mixtral_imports_with_the_same_logits(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, rope_theta=1e6)
    hf = transformers.MixtralForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # (larger weights than the init's, so the routing and experts matter)
        for p in hf.parameters():
            p.mul_(10)
    hf.save_pretrained(str(tmp_path / "hf"))
    cfg, model = import_mixtral(tmp_path / "hf")
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.rope_theta) == (4, 2, 1e6)
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model.eval()(tokens), hf(tokens).logits, atol=1e-5)


def test_lmforge_moe_exports_to_transformers_mixtral_with_the_same_logits(tmp_path):
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64,
                      tie_embeddings=False, moe=MoEConfig(num_experts=4, top_k=2))
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():  # (larger weights than the init's, so the routing and experts matter)
        for p in model.parameters():
            p.mul_(10)
    export_mixtral(model, tmp_path / "out")
    hf = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-4)
    _, again = import_mixtral(tmp_path / "out")  # and back
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n


def test_settings_mixtral_cannot_represent_are_refused():
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, moe=MoEConfig(num_experts=4, router="sigmoid",
                                                                                   shared_experts=1))
    with pytest.raises(ValueError, match="router = 'softmax'.*shared_experts"):
        check_mixtral(cfg)
