"""Gemma 3 (text) / OLMo 2 / OLMo 3 interop (lmforge.interop.hf_gemma_olmo): random tiny models made by
transformers import with the same logits (fp32, within 1e-4) and the same greedy generation; lmforge
models with these blocks export to folders transformers loads with the same logits and generation, and
import back bit for bit; what cannot map is refused in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.interop.hf_gemma_olmo import check_gemma_olmo, export_gemma_olmo, import_gemma_olmo  # noqa: E402
from lmforge.model.layers import qkv_state  # noqa: E402
from lmforge.model.transformer import build_model  # noqa: E402
from tests.test_interop_hf_qwen3next import V, _same_logits_and_generation, through_the_commands  # noqa: E402

# 4 layers; windows of 4 tokens (shorter than the 21-token parity input and the generation) on the
# sliding blocks, a full block between them
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILIES = {
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(head_dim=16, query_pre_attn_scalar=12, sliding_window=4, layer_types=TYPES, tie_word_embeddings=True,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(tie_word_embeddings=False)),
    "olmo3": ("Olmo3ForCausalLM", "Olmo3Config", dict(sliding_window=4, layer_types=TYPES, tie_word_embeddings=False)),
}


def _hf(tmp_path, family: str):
    cls, config, kw = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(getattr(transformers, config)(**SHAPE, **kw)).eval()
    with torch.no_grad():  # (weights of a trained model's size; norm weights away from their init)
        for name, p in hf.named_parameters():
            p.uniform_(-0.5, 0.5) if name.endswith("norm.weight") else p.normal_(0, 0.3)
    hf.save_pretrained(str(tmp_path / "hf"))
    return hf


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_models_import_with_the_same_logits_and_generation(tmp_path, family):
    hf = _hf(tmp_path, family)
    cfg, model = import_gemma_olmo(tmp_path / "hf")
    gemma = family == "gemma3"
    assert (cfg.norm_placement, cfg.embed_scale, cfg.qk_norm_scope, cfg.activation) == (
        ("sandwich", True, "head", "geglu") if gemma else ("post", False, "projection", "swiglu"))
    assert cfg.layer_types == ([] if family == "olmo2" else TYPES)
    if gemma:
        assert (cfg.attn_scale_dim, cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling) == (12, 1e4, 1e6, "linear")
    _same_logits_and_generation(model, hf)


def _cfg(family: str, **kw) -> ModelConfig:
    common = dict(vocab_size=V, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=40, max_seq_len=64,
                  norm_eps=1e-6, qk_norm=True)
    if family == "gemma3":
        return ModelConfig(**common, norm_placement="sandwich", embed_scale=True, activation="geglu", attn_head_dim=16,
                           attn_scale_dim=12, layer_types=TYPES, sliding_window=4, rope_theta=1e6,
                           rope_local_theta=1e4, **kw)
    window = dict(layer_types=TYPES, sliding_window=4) if family == "olmo3" else {}
    return ModelConfig(**common, norm_placement="post", qk_norm_scope="projection", tie_embeddings=False,
                       **window, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lmforge_models_export_with_the_same_logits_and_generation(tmp_path, family):
    """Fused q/k/v (the default) and the separate projections both export; import gives back every weight."""
    cfg = _cfg(family, fused_qkv=family != "olmo2")
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # (norm weights in [0.5, 1.5]: Gemma's w - 1 + 1 is exact)
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.3)
    export_gemma_olmo(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(hf).__name__ == FAMILIES[family][0]
    _same_logits_and_generation(model, hf)
    back, again = import_gemma_olmo(tmp_path / "out")
    assert back == replace(cfg, fused_qkv=True)  # (an import's default layout)
    theirs = dict(again.named_parameters())
    for n, p in qkv_state(back, {n: p.detach() for n, p in model.named_parameters()}).items():
        assert torch.equal(p, theirs[n]), n


def test_gemma3_through_the_import_and_export_commands(tmp_path):
    """`lmforge import --hf` picks the family by model_type, `lmforge export` by the model's options."""
    hf = _hf(tmp_path, "gemma3")
    theirs = through_the_commands(tmp_path, hf)
    for name, t in hf.state_dict().items():  # (Gemma's norms: to one rounding of 1 + w)
        assert (t - theirs[name]).abs().max().item() <= (2 ** -24 if name.endswith("norm.weight") else 0), name


def test_a_missing_layer_and_an_extra_tensor_are_refused(tmp_path):
    from tests.test_interop_hf_qwen3next import _drop

    _hf(tmp_path, "olmo3")
    _drop(tmp_path, lambda k: not k.startswith("model.layers.2."))
    with pytest.raises(ValueError, match=r"weight 'model.layers.2\..*' is missing \(and \d+ more\)"):
        import_gemma_olmo(tmp_path / "hf")
    _hf(tmp_path, "gemma3")
    _drop(tmp_path, lambda k: True, {"model.layers.0.input_layernorm.bias": torch.zeros(32)})
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.input_layernorm.bias' is not part of the model"):
        import_gemma_olmo(tmp_path / "hf")


def test_what_cannot_map_is_refused_in_one_line(tmp_path):
    from lmforge.interop.hf import hf_config

    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM: model.embed_scale = False \(it needs True\)"):
        check_gemma_olmo(replace(_cfg("gemma3"), embed_scale=False))
    with pytest.raises(ValueError, match=r"Olmo2ForCausalLM: model.qk_norm_scope = 'head' \(it needs 'projection'\)"):
        check_gemma_olmo(replace(_cfg("olmo2"), qk_norm_scope="head"))
    with pytest.raises(ValueError, match="sliding_window on every block with model.rope_scaling = 'linear'"):
        check_gemma_olmo(replace(_cfg("gemma3"), layer_types=[], rope_local_theta=0.0, rope_scaling="linear"))
    with pytest.raises(ValueError, match="model.norm_placement = 'post' cannot be represented by LlamaForCausalLM"):
        hf_config(replace(_cfg("olmo2"), qk_norm_scope="head", norm_placement="post"))
    hf = _hf(tmp_path, "gemma3")
    hf.config.final_logit_softcapping = 30.0
    hf.config.save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="final_logit_softcapping = 30.0 is not supported"):
        import_gemma_olmo(tmp_path / "hf")


@pytest.mark.parametrize("preset, family", [("gemma3-1b", "gemma3_text"), ("olmo2-7b", "olmo2"), ("olmo3-7b", "olmo3")])
def test_the_presets_export_the_published_configs_and_import_back(preset, family):
    """The keys of the released config.json files (gemma-3-1b-pt, OLMo-2-1124-7B, Olmo-3-1025-7B at its
    8,192-token pretraining context), and the import of the exported config gives the preset's model back."""
    from lmforge.config import load_config
    from lmforge.interop.hf_gemma_olmo import gemma_olmo_hf_config, model_config_from_gemma_olmo

    m = load_config(preset).model
    hf = gemma_olmo_hf_config(m).to_dict()
    assert hf["model_type"] == family
    if family == "gemma3_text":
        assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
                hf["num_key_value_heads"], hf["head_dim"], hf["query_pre_attn_scalar"], hf["sliding_window"],
                hf["vocab_size"], hf["hidden_activation"]) == (1152, 6912, 26, 4, 1, 256, 256, 512, 262144,
                                                               "gelu_pytorch_tanh")
        assert hf["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2
        assert (hf["rope_parameters"]["sliding_attention"]["rope_theta"],
                hf["rope_parameters"]["full_attention"]["rope_theta"]) == (1e4, 1e6)
    else:
        assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["num_attention_heads"],
                hf["num_key_value_heads"], hf["vocab_size"], hf["rms_norm_eps"]) \
            == (4096, 11008, 32, 32, 32, 100352 if family == "olmo2" else 100278, 1e-6)
        rope = hf["rope_parameters"]
        if family == "olmo2":
            assert rope["rope_theta"] == 5e5
        else:  # (one RoPE base, written per layer type) 3 sliding : 1 full
            assert rope["sliding_attention"]["rope_theta"] == rope["full_attention"]["rope_theta"] == 5e5
            assert hf["sliding_window"] == 4096
            assert hf["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 8
    assert model_config_from_gemma_olmo(hf) == replace(m, n_kv_heads=m.kv_heads)  # (the count written out)
