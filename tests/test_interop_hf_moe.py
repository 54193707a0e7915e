"""Mixtral and Qwen3-MoE interop (lmforge.interop.hf_moe): a random MixtralForCausalLM /
Qwen3MoeForCausalLM made by transformers imports with the same logits, and an lmforge MoE model
exports to a folder transformers loads with the same logits (fp32; atol 1e-5)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.config.sections import MoEConfig  # noqa: E402
from lmforge.interop.hf_moe import (check_mixtral, check_moe, export_mixtral, export_moe,  # noqa: E402
                                    import_mixtral, import_moe)
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


def _through_the_commands(tmp_path, hf):
    """`lmforge import --hf` of the saved `hf`, then `lmforge export` of that run: the run has `hf`'s
    logits, and the export is `hf`'s class with its weights bit for bit. Returns (run config, export)."""
    from lmforge.ckpt.export import load_run
    from lmforge.cli import main

    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    cfg, model = load_run(tmp_path / "run")
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model.eval()(tokens), hf(tokens).logits, atol=1e-5)
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"))
    assert type(again) is type(hf)
    theirs = again.state_dict()
    for name, t in hf.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    return cfg, again


def test_mixtral_through_the_import_and_export_commands(tmp_path):
    """`lmforge import --hf` / `lmforge export` pick Mixtral by model_type / a MoE model without QK-norm."""
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    hf = transformers.MixtralForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.mul_(10)
    hf.save_pretrained(str(tmp_path / "hf"))
    _through_the_commands(tmp_path, hf)


def test_settings_mixtral_cannot_represent_are_refused():
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, moe=MoEConfig(num_experts=4, router="sigmoid",
                                                                                   shared_experts=1))
    with pytest.raises(ValueError, match="router = 'softmax'.*shared_experts"):
        check_mixtral(cfg)


# ------------------------------------------------------------------------------------------------
# Qwen3-MoE
# ------------------------------------------------------------------------------------------------


def _randomise_norms(model):
    """Random norm weights (RMSNorm's init is all ones, which would hide a swapped or missing norm)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def _qwen3_moe(tmp_path, **kw):
    torch.manual_seed(0)
    # head_dim 12: heads x head_dim != hidden_size; 4 layers, 1 dense (mlp_only_layers) + decoder_sparse_step 1
    args = dict(vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2,
                norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1, max_position_embeddings=64,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**args, **kw})).eval()
    with torch.no_grad():  # (larger weights than the init's, so the routing and experts matter)
        for p in hf.parameters():
            p.mul_(10)
    _randomise_norms(hf)
    hf.save_pretrained(str(tmp_path / "hf"))
    return hf


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_transformers_qwen3_moe_imports_with_the_same_logits(tmp_path, norm_topk_prob):
    hf = _qwen3_moe(tmp_path, norm_topk_prob=norm_topk_prob)
    cfg, model = import_moe(tmp_path / "hf")
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.expert_hidden, m.renormalize, m.first_dense, m.every) == \
        (6, 2, 24, norm_topk_prob, 1, 1)
    assert (cfg.qk_norm, cfg.head_dim, cfg.ffn_dim, cfg.rope_theta) == (True, 12, 40, 1e6)
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-5)


def test_qwen3_moe_through_the_import_and_export_commands(tmp_path):
    """`lmforge import --hf` and `lmforge export` pick Qwen3-MoE by model_type / model.qk_norm: the run
    has the model's logits, and the export is a Qwen3MoeForCausalLM with the same weights bit for bit."""
    hf = _qwen3_moe(tmp_path, decoder_sparse_step=2, mlp_only_layers=[])  # MoE blocks 1, 3
    cfg, again = _through_the_commands(tmp_path, hf)
    assert (cfg.model.moe.first_dense, cfg.model.moe.every) == (1, 2)
    assert (again.config.decoder_sparse_step, again.config.mlp_only_layers) in ((1, [0, 2]), (2, []))


def test_lmforge_moe_with_qk_norm_exports_to_qwen3_moe_with_the_same_logits(tmp_path):
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, attn_head_dim=12, ffn_hidden=40,
                      max_seq_len=64, tie_embeddings=True, qk_norm=True,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, renormalize=False, first_dense=1))
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)
    _randomise_norms(model)
    export_moe(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.norm_topk_prob is False
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-5)
    back, again = import_moe(tmp_path / "out")  # and back
    assert back == cfg
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n


def test_qwen3_moe_settings_lmforge_cannot_represent_are_refused(tmp_path):
    _qwen3_moe(tmp_path, mlp_only_layers=[2])  # MoE blocks 0, 1, 3: no first_dense / every gives them
    with pytest.raises(ValueError, match="mlp_only_layers = \\[2\\]"):
        import_moe(tmp_path / "hf")
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, moe=MoEConfig(num_experts=4, shared_experts=1))
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM.*shared_experts = 0.*qk_norm = true"):
        check_moe(cfg, "qwen3_moe")


def test_qwen3_30b_a3b_config_imports_as_the_preset(tmp_path):
    """The published Qwen3-30B-A3B config.json (its values written out here) imports as the
    qwen3-30b-a3b preset's model: the same parameter count, total and active."""
    import json

    from lmforge.config import load_config
    from lmforge.interop.hf import model_config_from_hf
    from lmforge.model.accounting import count_params

    published = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": False,
                 "rope_theta": 1000000.0, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "hidden_act": "silu",
                 "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                 "router_aux_loss_coef": 0.001, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(published))
    imported = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    preset = load_config("qwen3-30b-a3b").model
    assert count_params(imported) == count_params(preset)
    assert imported.moe == preset.moe and imported.qk_norm and preset.qk_norm
