"""DeepSeek-V3 with Hugging Face transformers (lmforge.interop.hf_deepseek), offline: a small random
`DeepseekV3ForCausalLM` made by transformers itself (from a DeepseekV3Config: multi-head latent
attention with interleaved RoPE pairs, dense then MoE blocks with sigmoid group-limited routing, a
shared expert and a non-zero selection bias; YaRN RoPE scaling in one case) imports with logits
parity, exports back to a folder transformers loads with logits parity, and the MTP layer (DeepSeek's
layer index num_hidden_layers) round-trips and matches transformers' own MtpLayer."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.interop.hf import export_hf, import_hf, import_hf_run  # noqa: E402
from lmforge.interop.hf_deepseek import deepseek_hf_config  # noqa: E402
from lmforge.model.transformer import build_model  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
             q_lora_rank=20, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
             num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64, routed_scaling_factor=2.5,
             tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.2, num_nextn_predict_layers=0)
YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 0.8}}


def hf_model(**edit):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SMALL, **edit}))
    with torch.no_grad():  # the selection bias moves routing (a trained model's is not zero)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model.eval()


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("edit", [{}, {"q_lora_rank": None}, YARN], ids=["v3", "no-q-latent", "yarn"])
def test_transformers_deepseek_v3_imports_with_logits_parity(tmp_path, edit):
    hf = hf_model(**edit)
    hf.save_pretrained(tmp_path / "hf")
    cfg, model = import_hf(tmp_path / "hf")
    assert cfg.mla.kv_lora_rank == 16 and cfg.moe.n_groups == 4 and cfg.mtp_depth == 0
    assert cfg.rope_scaling == ("yarn" if edit == YARN else "none")
    tokens = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        ours = model(tokens)
    want = hf_logits(hf, tokens)
    assert torch.allclose(ours, want, atol=2e-5, rtol=1e-4), (ours - want).abs().max()
    assert torch.equal(model.blocks["1"].mlp.expert_bias, torch.linspace(-0.3, 0.3, 8))


def test_lmforge_deepseek_model_exports_to_a_folder_transformers_loads_with_parity(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    _, model = import_hf(tmp_path / "hf")
    with torch.no_grad():  # train-like changes of lmforge's own: the bias and every weight
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        model.blocks["2"].mlp.expert_bias.copy_(torch.linspace(0.2, -0.2, 8))
    export_hf(model, tmp_path / "out")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        ours = model(tokens)
    assert torch.allclose(hf_logits(back, tokens), ours, atol=2e-5, rtol=1e-4)
    # the written weights are DeepSeek's layout: interleaved RoPE rows, one tensor per expert
    stored = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    exported = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert set(stored) == set(exported)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_interleave"] is True


def test_mtp_layer_round_trips_and_matches_transformers_mtp_layer(tmp_path):
    """lmforge's MTP depth 1 against transformers' MtpLayer (enorm, hnorm, eh_proj, its decoder block,
    the post norm and the shared head), with the weights of an exported folder, which stores the layer
    as DeepSeek does (model.layers.<num_hidden_layers>.*, with its copies of the embedding and head)."""
    from safetensors import safe_open
    from transformers.modeling_layers import MtpLayer

    import dataclasses

    _, base = import_hf_from(tmp_path, hf_model())
    cfg = dataclasses.replace(base.cfg, mtp_depth=1)
    model = build_model(cfg, seed=4).eval()
    model.load_state_dict({**model.state_dict(), **base.state_dict()})
    export_hf(model, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        mtp = {k[len("model.layers.3."):]: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.3.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "mlp.experts.7.down_proj.weight"} <= set(mtp)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    cfg_back, again = import_hf(tmp_path / "out")
    assert cfg_back.mtp_depth == 1
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    # transformers' MTP layer on the same hidden states
    hf_cfg = deepseek_hf_config(cfg).get_mtp_config()
    layer = MtpLayer(hf_cfg, transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer,
                     transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm, 0).eval()
    state = {("mtp_block." + k if k.split(".")[0] not in ("enorm", "hnorm", "eh_proj") else k)
             .replace("mtp_block.shared_head.norm", "post_norm"): v
             for k, v in mtp.items() if k not in ("embed_tokens.weight", "shared_head.head.weight") and ".experts." not in k}
    experts = range(cfg.moe.num_experts)  # (transformers holds each layer's experts fused, as it loads them)
    state["mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([mtp[f"mlp.experts.{j}.gate_proj.weight"], mtp[f"mlp.experts.{j}.up_proj.weight"]]) for j in experts])
    state["mtp_block.mlp.experts.down_proj"] = torch.stack([mtp[f"mlp.experts.{j}.down_proj.weight"] for j in experts])
    layer.load_state_dict(state)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        h = hf.model(tokens, output_hidden_states=True).hidden_states[-1]  # the last block's output, before the norm
        pos = torch.arange(15)[None]
        emb = hf.model.embed_tokens(tokens[:, 1:])
        rope = hf.model.rotary_emb(emb, pos)
        mask = torch.full((15, 15), float("-inf")).triu(1)[None, None]
        theirs = hf.lm_head(layer(emb, h[:, :15], rope, mask, pos, None))
        x = model.tok_emb(tokens)
        for block in model.blocks.values():
            x = block(x, (model.rope_cos, model.rope_sin))
        depth = model.mtp["0"]
        ours = model.lm_head(depth.norm(depth(model.tok_emb(tokens[:, 1:]), x[:, :15], (model.rope_cos, model.rope_sin))))
    assert torch.allclose(ours, theirs, atol=2e-5, rtol=1e-4), (ours - theirs).abs().max()


def import_hf_from(tmp_path, hf):
    hf.save_pretrained(tmp_path / "hf")
    return import_hf(tmp_path / "hf")


def test_import_as_a_run_folder_keeps_the_expert_bias(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    run = import_hf_run(tmp_path / "hf", tmp_path / "run")
    from lmforge.ckpt.export import load_run

    _, model = load_run(run)
    tokens = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        assert torch.allclose(model.eval()(tokens), hf_logits(hf, tokens), atol=2e-5, rtol=1e-4)


def test_what_deepseek_v3_cannot_hold_is_refused():
    from lmforge.config import load_config

    with pytest.raises(ValueError, match="model.moe.router = 'sigmoid'"):
        deepseek_hf_config(load_config("tiny-mla-moe", {"model.moe.router": "softmax"}).model)
    with pytest.raises(ValueError, match="model.moe.shared_experts >= 1"):
        deepseek_hf_config(load_config("tiny-mla-moe", {"model.moe.shared_experts": 0}).model)
