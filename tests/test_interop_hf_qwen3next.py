"""Qwen3-Next / Qwen3.5 / Qwen3.5-MoE interop (lmforge.interop.hf_qwen3next): random tiny models made by
transformers import with the same logits (fp32, within 1e-4) and the same greedy generation, and lmforge
hybrid models export to folders transformers loads with the same logits and generation; what cannot
map is refused in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.config.sections import DeltaNetConfig, MoEConfig  # noqa: E402
from lmforge.eval.generate import generate_tokens  # noqa: E402
from lmforge.interop.hf_qwen3next import check_hybrid, export_qwen3next, import_qwen3next  # noqa: E402
from lmforge.model.transformer import build_model  # noqa: E402

V = 97
# (4 layers in the 3:1 pattern; head_dim 16 with partial_rotary_factor 0.25: 4 rotated dims; 2 key heads
# serving 4 value heads; experts and shared expert of 16)
SHAPE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def _randomise(model):
    """Weights of a trained model's size: N(0, 0.3) (the init's are too small for the gates, routing and
    delta rule to matter), and zero-centred norm weights away from 0 (Qwen's norms multiply by 1 + w)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn.norm" not in name:
                p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0, 0.3)


def _hf(tmp_path, cls: str, config: str, **kw):
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(getattr(transformers, config)(**{**SHAPE, **kw})).eval()
    _randomise(hf)
    hf.save_pretrained(str(tmp_path / "hf"))
    return hf


def _same_logits_and_generation(model, hf):
    tokens = torch.randint(0, V, (2, 21))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert theirs.abs().max() > 1  # (real logits, not vanishing ones)
    assert (ours - theirs).abs().max().item() < 1e-4
    prompt = tokens[:1, :7]  # (an explicit mask: generate would otherwise mask the prompt's tokens equal to pad)
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                       pad_token_id=0)[0, 7:].tolist()
    prompt = prompt[0].tolist()
    assert list(generate_tokens(model, prompt, 10, temperature=0)) == want


def test_transformers_qwen3_next_imports_with_the_same_logits_and_generation(tmp_path):
    hf = _hf(tmp_path, "Qwen3NextForCausalLM", "Qwen3NextConfig", intermediate_size=40, mlp_only_layers=[0],
             norm_topk_prob=True, **MOE)
    cfg, model = import_qwen3next(tmp_path / "hf")
    assert [cfg.is_linear_layer(i) for i in range(4)] == [True, True, True, False]
    assert (cfg.attn_gate, cfg.qk_norm, cfg.rope_dim, cfg.deltanet_shape) == (True, True, 4, (2, 4, 8, 8))
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.expert_hidden, m.shared_experts, m.shared_gate, m.first_dense) == \
        (4, 2, 16, 1, True, 1)
    _same_logits_and_generation(model, hf)


def _hybrid_cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=V, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, attn_head_dim=16, ffn_hidden=40,
                       max_seq_len=64, norm_eps=1e-6, tie_embeddings=False, qk_norm=True, attn_gate=True,
                       rope_fraction=0.25, full_attention_interval=4,
                       deltanet=DeltaNetConfig(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8), **kw)


def _exported(cfg, tmp_path, std):
    """A model of `cfg` with N(0, std) weights and norm weights in [0.5, 1.5] (where w - 1 + 1 is exact),
    exported; (it, what transformers loads of the export)."""
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, std)
    export_qwen3next(model, tmp_path / "out")
    return model, transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()


def _imports_back_bit_for_bit(model, tmp_path):
    back, again = import_qwen3next(tmp_path / "out")
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n
    return back


@pytest.mark.parametrize("moe", [True, False], ids=["qwen3-next", "qwen3.5-dense"])
def test_lmforge_hybrid_models_export_with_the_same_logits_and_generation(tmp_path, moe):
    cfg = _hybrid_cfg(moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, shared_experts=1, shared_gate=True,
                                    first_dense=1) if moe else MoEConfig())
    model, hf = _exported(cfg, tmp_path, 0.3)
    assert type(hf).__name__ == ("Qwen3NextForCausalLM" if moe else "Qwen3_5ForCausalLM")
    _same_logits_and_generation(model, hf)
    assert _imports_back_bit_for_bit(model, tmp_path) == cfg


@pytest.mark.parametrize("moe", [True, False], ids=["qwen3.5-moe", "qwen3.5-dense"])
def test_transformers_qwen3_5_imports_with_the_same_logits_and_generation(tmp_path, moe):
    """Qwen3.5's own Gated DeltaNet projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and its
    multimodal RoPE, which is plain RoPE for text."""
    if moe:
        hf = _hf(tmp_path, "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", **MOE)
    else:
        hf = _hf(tmp_path, "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", intermediate_size=40)
    cfg, model = import_qwen3next(tmp_path / "hf")
    m = cfg.moe
    assert (m.enabled, m.first_dense, m.every, m.renormalize, m.shared_gate) == \
        ((True, 0, 1, True, True) if moe else (False, 0, 1, True, False))
    _same_logits_and_generation(model, hf)


def test_qwen3_next_through_the_import_and_export_commands(tmp_path):
    """`lmforge import --hf` picks the family by model_type, `lmforge export` by the model's options: the
    run has the model's logits, and the export is a Qwen3NextForCausalLM with the same weights (the
    zero-centred norms to one rounding of 1 + w)."""
    hf = _hf(tmp_path, "Qwen3NextForCausalLM", "Qwen3NextConfig", intermediate_size=40, **MOE)
    theirs = through_the_commands(tmp_path, hf)
    for name, t in hf.state_dict().items():
        if name.endswith("norm.weight") and "linear_attn" not in name:
            assert (t - theirs[name]).abs().max().item() <= 2 ** -24, name
        else:
            assert torch.equal(t, theirs[name]), name


def through_the_commands(tmp_path, hf) -> dict[str, torch.Tensor]:
    """`lmforge import --hf` of the folder tmp_path / "hf" (of the transformers model `hf`): a run with
    hf's logits; then `lmforge export` of the run: a folder of hf's class; its state dict."""
    from lmforge.ckpt.export import load_run
    from lmforge.cli import main

    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    _, model = load_run(tmp_path / "run")
    tokens = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        assert (model.eval()(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf2"))
    assert type(again) is type(hf)
    return again.state_dict()


def _drop(tmp_path, keep, add=None):
    """Rewrite the folder's safetensors without the tensors `keep` refuses (and with `add`)."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "hf" / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if keep(k)}
    save_file({**tensors, **(add or {})}, str(path), metadata={"format": "pt"})


def test_a_missing_layer_a_missing_expert_and_an_extra_tensor_are_refused(tmp_path):
    _hf(tmp_path, "Qwen3NextForCausalLM", "Qwen3NextConfig", intermediate_size=40, **MOE)
    _drop(tmp_path, lambda k: not k.startswith("model.layers.1."))
    with pytest.raises(ValueError, match=r"weight 'model.layers.1\..*' is missing \(and \d+ more\)"):
        import_qwen3next(tmp_path / "hf")
    _hf(tmp_path, "Qwen3NextForCausalLM", "Qwen3NextConfig", intermediate_size=40, **MOE)
    _drop(tmp_path, lambda k: k != "model.layers.2.mlp.experts.3.up_proj.weight")
    with pytest.raises(ValueError, match=r"weight 'model.layers.2.mlp.experts.3.up_proj.weight' is missing;"):
        import_qwen3next(tmp_path / "hf")
    _hf(tmp_path, "Qwen3NextForCausalLM", "Qwen3NextConfig", intermediate_size=40, **MOE)
    _drop(tmp_path, lambda k: True, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 32),
                                     "mtp.fc.weight": torch.zeros(2, 2)})  # (mtp.*: dropped, as transformers does)
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.self_attn.q_proj.weight' is not part of the model"):
        import_qwen3next(tmp_path / "hf")


def test_what_cannot_map_is_refused_in_one_line(tmp_path):
    from lmforge.interop.hf import hf_model_config

    _hf(tmp_path, "Qwen3NextForCausalLM", "Qwen3NextConfig", intermediate_size=40,
        **{**MOE, "shared_expert_intermediate_size": 24})
    with pytest.raises(ValueError, match="shared_expert_intermediate_size = 24 is not a positive multiple of "
                                         "moe_intermediate_size = 16"):
        import_qwen3next(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5"}))
    with pytest.raises(ValueError, match="multimodal Qwen3.5.*save it as Qwen3_5ForCausalLM"):
        hf_model_config(tmp_path / "hf")
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM.*model.qk_norm = model.attn_gate = true"):
        check_hybrid(replace(_hybrid_cfg(), attn_gate=False))
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM.*gated shared expert"):
        check_hybrid(_hybrid_cfg(moe=MoEConfig(num_experts=4, top_k=2, shared_experts=1)))


@pytest.mark.parametrize("command", ["import", "export"])
def test_the_help_of_import_and_export_names_the_hybrid_families(command, capsys):
    from lmforge.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Qwen3-Next" in text and "Qwen3.5 (dense or MoE)" in text, text


def test_the_tiny_hybrid_preset_exports_tied_over_several_chunks(tmp_path):
    """tiny-hybrid (tied embeddings, default shapes) exports as Qwen3.5 with its logits over 100 tokens
    (two chunks of the chunked delta rule) and imports back as the same model."""
    from lmforge.config import load_config
    from lmforge.model.accounting import count_params

    cfg = load_config("tiny-hybrid").model
    model, hf = _exported(cfg, tmp_path, 0.1)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM" and hf.config.tie_word_embeddings
    tokens = torch.randint(0, cfg.vocab_size, (2, 100))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4
    assert count_params(_imports_back_bit_for_bit(model, tmp_path)) == count_params(cfg)
