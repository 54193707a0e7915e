"""Hugging Face `transformers` interop for Mixture-of-Experts models: `MixtralForCausalLM`.

    cfg, model = import_mixtral("path/to/mixtral")    # a transformers folder -> an lmforge model
    export_mixtral(model, "out/mixtral")               # an lmforge MoE model -> a transformers folder

Weights (lmforge -> transformers 5.x, whose Mixtral keeps each layer's experts fused):

* attention, norms, embedding, head: as Llama's (`model.layers.i.self_attn.q_proj`, ...);
* `blocks.i.mlp.router.weight` (E, dim) -> `model.layers.i.mlp.gate.weight` (same tensor);
* `blocks.i.mlp.experts.w_gate` / `w_up` (E, dim, hidden) -> `model.layers.i.mlp.experts.gate_up_proj`
  (E, 2 hidden, dim): gate rows first, each transposed; `w_down` (E, hidden, dim) ->
  `experts.down_proj` (E, dim, hidden), transposed.

Mixtral's routing is lmforge's softmax router with renormalised top-k weights (model.moe.router =
'softmax', renormalize = true, no shared experts, every block MoE); other settings are refused
with a ValueError naming them. The `expert_bias` buffer (zero unless the auxiliary-loss-free update
moved it, which Mixtral has no place for) must be zero to export.

Qwen3-MoE (`Qwen3MoeForCausalLM`) needs QK-norm in the attention, which this branch's model does not
have yet: not supported here. Conversion holds the whole model in memory (a tool for models that fit
one host), unlike lmforge's streaming Llama export (lmforge.interop.hf).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.config.sections import MoEConfig
from lmforge.model.layers import qkv_state
from lmforge.model.transformer import Transformer
from lmforge.model.materialise import materialise

_DENSE = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.wq": "self_attn.q_proj",
          "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj"}


def check_mixtral(cfg: ModelConfig) -> None:
    """ValueError unless `MixtralForCausalLM` represents `cfg` exactly."""
    m = cfg.moe
    problems = []
    if not m.enabled:
        problems.append("model.moe.num_experts = 0 (a dense model: export it as Llama)")
    if (cfg.norm, cfg.activation, cfg.pos_emb, cfg.bias) != ("rmsnorm", "swiglu", "rope", False):
        problems.append("Mixtral is RMSNorm + SwiGLU + RoPE without biases")
    if m.router != "softmax" or not m.renormalize or m.route_scale != 1.0:
        problems.append("Mixtral routes with softmax top-k, renormalised (model.moe.router = 'softmax', "
                        "renormalize = true, route_scale = 1)")
    if m.shared_experts or m.first_dense or m.every != 1:
        problems.append("every Mixtral block is MoE without shared experts (model.moe.shared_experts = 0, "
                        "first_dense = 0, every = 1)")
    if m.expert_hidden not in (None, cfg.ffn_dim):
        problems.append("Mixtral's experts have model.ffn_hidden's width (set model.moe.expert_hidden to it)")
    if problems:
        raise ValueError("cannot be represented by MixtralForCausalLM: " + "; ".join(problems) + ".")


def mixtral_config(cfg: ModelConfig):
    """The transformers MixtralConfig equivalent to `cfg`."""
    from transformers import MixtralConfig

    check_mixtral(cfg)
    return MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
        router_aux_loss_coef=cfg.moe.aux_loss_coef, tie_word_embeddings=cfg.tie_embeddings,
        sliding_window=None, architectures=["MixtralForCausalLM"])


def model_config_from_mixtral(hf) -> ModelConfig:
    """The lmforge ModelConfig of a transformers MixtralConfig."""
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Mixtral config with rope_parameters {rope}: only unscaled RoPE is supported.")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return ModelConfig(
        vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads, ffn_hidden=hf.intermediate_size, max_seq_len=hf.max_position_embeddings,
        rope_theta=float(theta), norm="rmsnorm", norm_eps=hf.rms_norm_eps, activation="swiglu", bias=False,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), pos_emb="rope",
        attn_head_dim=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
        moe=MoEConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok, router="softmax",
                      renormalize=True, aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.02))))


def to_mixtral_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lmforge weights (unwrapped names) -> transformers Mixtral weights."""
    weights = qkv_state(replace(cfg, fused_qkv=False), weights)  # (a fused attn.wqkv: its q, k, v rows)
    out = {"model.embed_tokens.weight": weights["tok_emb.weight"], "model.norm.weight": weights["norm.weight"],
           "lm_head.weight": weights["tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"]}
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _DENSE.items():
            out[f"{h}{theirs}.weight"] = weights[f"{b}{ours}.weight"]
        bias = weights.get(f"{b}mlp.expert_bias")
        if bias is not None and bias.abs().sum() > 0:
            raise ValueError(f"{b}mlp.expert_bias is not zero (the auxiliary-loss-free update moved it): "
                             f"MixtralForCausalLM has no selection bias.")
        out[f"{h}mlp.gate.weight"] = weights[f"{b}mlp.router.weight"]
        gate, up = weights[f"{b}mlp.experts.w_gate"], weights[f"{b}mlp.experts.w_up"]
        out[f"{h}mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=2).transpose(1, 2).contiguous()
        out[f"{h}mlp.experts.down_proj"] = weights[f"{b}mlp.experts.w_down"].transpose(1, 2).contiguous()
    return out


def from_mixtral_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers Mixtral weights -> lmforge weights (the inverse of `to_mixtral_state_dict`)."""
    out = {"tok_emb.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    hidden = cfg.ffn_dim
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _DENSE.items():
            out[f"{b}{ours}.weight"] = hf[f"{h}{theirs}.weight"]
        out[f"{b}mlp.router.weight"] = hf[f"{h}mlp.gate.weight"]
        gate_up = hf[f"{h}mlp.experts.gate_up_proj"].transpose(1, 2)  # (E, dim, 2 hidden)
        out[f"{b}mlp.experts.w_gate"] = gate_up[..., :hidden].contiguous()
        out[f"{b}mlp.experts.w_up"] = gate_up[..., hidden:].contiguous()
        out[f"{b}mlp.experts.w_down"] = hf[f"{h}mlp.experts.down_proj"].transpose(1, 2).contiguous()
    return qkv_state(cfg, out)  # (model.fused_qkv: q, k, v fused)


def import_mixtral(hf_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A transformers Mixtral folder -> (its ModelConfig, the lmforge model with its weights)."""
    from transformers import AutoConfig
    from transformers import MixtralForCausalLM

    hf_cfg = AutoConfig.from_pretrained(str(hf_dir))
    if hf_cfg.model_type != "mixtral":
        raise ValueError(f"{hf_dir}: model_type {hf_cfg.model_type!r}, not 'mixtral'.")
    cfg = model_config_from_mixtral(hf_cfg)
    cfg.check()
    weights = from_mixtral_state_dict(cfg, MixtralForCausalLM.from_pretrained(str(hf_dir)).state_dict())
    with torch.device("meta"):
        model = Transformer(cfg)

    def source(name, module, module_name, own, shape, index, dtype):
        t = weights[name]
        for d, keep in enumerate(index):
            if keep is not None:
                t = t.index_select(d, keep)
        return t.to(dtype)

    return cfg, materialise(model, device, source)


def export_mixtral(model: Transformer, out_dir: str | Path) -> Path:
    """An lmforge MoE model (whole, one process) -> a transformers Mixtral folder (config.json +
    safetensors, transformers' own `save_pretrained`)."""
    from transformers import MixtralForCausalLM

    cfg = model.cfg
    hf_cfg = mixtral_config(cfg)
    with torch.device("meta"):
        hf_model = MixtralForCausalLM(hf_cfg)
    weights = {**{n: p.detach() for n, p in model.named_parameters()},
               **{n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}}
    hf_model.load_state_dict(to_mixtral_state_dict(cfg, weights), strict=True, assign=True)
    if cfg.tie_embeddings:
        hf_model.tie_weights()
    out = Path(out_dir)
    hf_model.save_pretrained(str(out))
    return out


__all__ = ["check_mixtral", "export_mixtral", "from_mixtral_state_dict", "import_mixtral", "mixtral_config",
           "model_config_from_mixtral", "to_mixtral_state_dict"]
