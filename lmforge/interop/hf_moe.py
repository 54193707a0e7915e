"""Hugging Face `transformers` interop for Mixture-of-Experts models: `MixtralForCausalLM` and
`Qwen3MoeForCausalLM`.

    cfg, model = import_moe("path/to/mixtral")       # a transformers folder -> an lmforge model
    export_moe(model, "out/qwen3-moe")                # an lmforge MoE model -> a transformers folder

`lmforge import` / `lmforge export` (lmforge.interop.hf) come here for these model types
(`MOE_DECODERS`); the family of an export is Qwen3-MoE when the model has QK-norm (model.qk_norm),
else Mixtral.

Weights (lmforge -> transformers 5.x, which keeps each layer's experts fused):

* attention, norms, embedding, head: as Llama's (`model.layers.i.self_attn.q_proj`, ...), plus
  Qwen3-MoE's QK-norm (`self_attn.q_norm` / `k_norm`);
* `blocks.i.mlp.router.weight` (E, dim) -> `model.layers.i.mlp.gate.weight` (same tensor);
* `blocks.i.mlp.experts.w_gate` / `w_up` (E, dim, hidden) -> `model.layers.i.mlp.experts.gate_up_proj`
  (E, 2 hidden, dim): gate rows first, each transposed; `w_down` (E, hidden, dim) ->
  `experts.down_proj` (E, dim, hidden), transposed;
* Qwen3-MoE's dense blocks (model.moe.first_dense / every; its `mlp_only_layers`): `mlp.gate/up/down`
  -> `mlp.gate_proj/up_proj/down_proj`, of model.ffn_hidden's width (its `intermediate_size`).

Both route with lmforge's softmax router (model.moe.router = 'softmax', no shared experts):
Mixtral renormalises the top-k weights, Qwen3-MoE as its `norm_topk_prob` says (model.moe.renormalize).
Mixtral has every block MoE with experts of model.ffn_hidden; Qwen3-MoE's experts have
`moe_intermediate_size` (model.moe.expert_hidden) and its MoE blocks are those not in `mlp_only_layers`
whose (index + 1) is a multiple of `decoder_sparse_step`; lmforge's first_dense / every must give the
same set. The folder's tensor names (from the safetensors headers) must be exactly the model's before
transformers reads anything (hf_common.check_tensor_names): it would leave a missing one at its random
initialisation. Anything either side cannot represent is refused with a ValueError naming it. The
`expert_bias` buffer (zero unless the auxiliary-loss-free update moved it, which neither has a
place for) must be zero to export. Conversion holds the whole model in memory (a tool for models
that fit one host), unlike lmforge's streaming dense export (lmforge.interop.hf).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.config.sections import MoEConfig
from lmforge.folders import HF_CONFIG
from lmforge.interop.hf_common import (check_no_new_attention, model_from_state_dict, check_tensor_names, hf_rope_keys, hf_weight_files,
                                       read_hf_config, rope_from_hf)
from lmforge.interop.mup_fold import fold_multipliers
from lmforge.model.layers import qkv_state
from lmforge.model.transformer import Transformer

# model_type -> transformers class
MOE_DECODERS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

_DENSE = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.wq": "self_attn.q_proj",
          "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj"}
_QK_NORM = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
_MLP = {"mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}


def moe_family(cfg: ModelConfig) -> str:
    """'qwen3_moe' (a model with QK-norm) or 'mixtral': the model type an export of `cfg` writes."""
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


def check_moe(cfg: ModelConfig, family: str | None = None) -> None:
    """ValueError unless the transformers class of `family` (default: `moe_family(cfg)`) represents
    `cfg` exactly; the message names every setting it cannot."""
    family = family or moe_family(cfg)
    arch, m = MOE_DECODERS[family], cfg.moe
    check_no_new_attention(cfg, arch)
    problems = []
    if not m.enabled:
        problems.append("model.moe.num_experts = 0 (a dense model: export it as Llama / Qwen3)")
    if (cfg.norm, cfg.activation, cfg.pos_emb) != ("rmsnorm", "swiglu", "rope") or cfg.bias or cfg.attn_qkv_bias:
        problems.append(f"{arch} is RMSNorm + SwiGLU + RoPE without biases (model.bias = model.qkv_bias = false)")
    if cfg.sliding_window:
        problems.append("model.sliding_window is not supported for MoE exports (set it to 0)")
    if m.router != "softmax" or m.route_scale != 1.0:
        problems.append(f"{arch} routes with softmax top-k (model.moe.router = 'softmax', route_scale = 1)")
    if m.shared_experts:
        problems.append(f"{arch} has no shared experts (model.moe.shared_experts = 0)")
    if family == "mixtral":
        if not m.renormalize:
            problems.append("Mixtral renormalises its top-k weights (model.moe.renormalize = true)")
        if m.first_dense or m.every != 1:
            problems.append("every Mixtral block is MoE (model.moe.first_dense = 0, every = 1)")
        if m.expert_hidden not in (None, cfg.ffn_dim):
            problems.append("Mixtral's experts have model.ffn_hidden's width (set model.moe.expert_hidden to it)")
        if cfg.qk_norm:
            problems.append("Mixtral has no QK-norm (model.qk_norm = false; with it the model exports as Qwen3-MoE)")
    elif not cfg.qk_norm:
        problems.append("Qwen3-MoE has QK-norm (model.qk_norm = true)")
    if problems:
        raise ValueError(f"cannot be represented by {arch}: " + "; ".join(problems) + ".")


def check_mixtral(cfg: ModelConfig) -> None:
    """ValueError unless `MixtralForCausalLM` represents `cfg` exactly."""
    check_moe(cfg, "mixtral")


def moe_hf_config(cfg: ModelConfig, family: str | None = None, eos_id: int | None = None,
                  bos_id: int | None = None, pad_id: int | None = None):
    """The transformers MixtralConfig / Qwen3MoeConfig equivalent to `cfg` (ValueError where none is)."""
    import transformers

    family = family or moe_family(cfg)
    check_moe(cfg, family)
    m = cfg.moe
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, num_experts_per_tok=m.top_k,
        router_aux_loss_coef=m.aux_loss_coef, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu",
        attention_dropout=cfg.dropout, eos_token_id=eos_id, bos_token_id=bos_id, pad_token_id=pad_id,
        architectures=[MOE_DECODERS[family]], **hf_rope_keys(cfg))
    if family == "mixtral":
        return transformers.MixtralConfig(num_local_experts=m.num_experts, sliding_window=None, **common)
    return transformers.Qwen3MoeConfig(
        num_experts=m.num_experts, moe_intermediate_size=m.expert_hidden or cfg.ffn_dim, norm_topk_prob=m.renormalize,
        decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if not m.is_moe_layer(i)],
        attention_bias=False, use_sliding_window=False, sliding_window=None, **common)


def mixtral_config(cfg: ModelConfig):
    """The transformers MixtralConfig equivalent to `cfg`."""
    return moe_hf_config(cfg, "mixtral")


def _moe_layers(hf: dict, source: str, n: int) -> tuple[int, int]:
    """(first_dense, every) giving Qwen3-MoE's MoE blocks (`mlp_only_layers`, `decoder_sparse_step`)."""
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    moe = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if not moe:
        raise ValueError(f"{source}: no MoE block (mlp_only_layers = {sorted(dense)}, decoder_sparse_step = {step}).")
    first, every = moe[0], moe[1] - moe[0] if len(moe) > 1 else n
    if moe != list(range(first, n, every)):
        raise ValueError(f"{source}: MoE blocks {moe} (mlp_only_layers = {sorted(dense)}, decoder_sparse_step = "
                         f"{step}) cannot be represented: lmforge's MoE blocks are every model.moe.every-th block "
                         f"after the first model.moe.first_dense.")
    return first, every


def model_config_from_moe(hf: dict, source: str = HF_CONFIG) -> ModelConfig:
    """The lmforge ModelConfig of a Mixtral / Qwen3-MoE config.json dict, or ValueError naming what
    lmforge cannot represent."""
    kind, n = hf.get("model_type"), hf["num_hidden_layers"]
    if kind not in MOE_DECODERS:
        raise ValueError(f"{source}: model_type {kind!r} is not one of {', '.join(MOE_DECODERS)}.")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act = {hf['hidden_act']!r}; lmforge's SwiGLU experts use 'silu'.")
    if hf.get("sliding_window") is not None and (kind == "mixtral" or hf.get("use_sliding_window")):
        raise ValueError(f"{source}: sliding_window = {hf['sliding_window']} is not supported for MoE imports.")
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias = true is not supported for {kind} (lmforge's model.bias also "
                         f"covers the experts).")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    if kind == "mixtral":
        first, every, renorm, hidden = 0, 1, True, None
        experts = hf["num_local_experts"]
    else:
        (first, every), renorm = _moe_layers(hf, source, n), bool(hf["norm_topk_prob"])
        hidden = hf["moe_intermediate_size"]
        experts = hf.get("num_experts") or hf["num_local_experts"]  # (transformers 5 stores num_local_experts)
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=n, n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pos_emb="rope", dropout=0.0,
        qk_norm=kind == "qwen3_moe", attn_head_dim=None if head_dim * heads == dim else head_dim,
        **rope_from_hf(hf, source),
        moe=MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"], expert_hidden=hidden, router="softmax",
                      renormalize=renorm, first_dense=first, every=every,
                      aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.02))))


def _block_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """lmforge -> transformers names of block i's tensors that map one to one (no MoE experts)."""
    parts = {**_DENSE, **(_QK_NORM if cfg.qk_norm else {})}
    parts.update({"mlp.router": "mlp.gate"} if cfg.moe.is_moe_layer(i) else _MLP)
    return {f"blocks.{i}.{ours}.weight": f"model.layers.{i}.{theirs}.weight" for ours, theirs in parts.items()}


def moe_tensor_names(cfg: ModelConfig, family: str, stored) -> set[str]:
    """Every tensor name a transformers folder of `cfg` holds. The experts come in one of two layouts,
    both of which transformers 5 reads: fused per layer (`mlp.experts.gate_up_proj` / `down_proj`, as
    lmforge's export writes them through transformers' model) or one tensor per expert (what
    `save_pretrained` writes and the published checkpoints hold: Mixtral's `block_sparse_moe.experts.j.w1/w2/w3`
    and router `block_sparse_moe.gate`, Qwen3-MoE's `mlp.experts.j.gate_proj/up_proj/down_proj`);
    `stored` (the folder's names) says which."""
    fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in stored)
    names = {"model.embed_tokens.weight", "model.norm.weight", *([] if cfg.tie_embeddings else ["lm_head.weight"])}
    for i in range(cfg.n_layers):
        block = set(_block_names(cfg, i).values())
        if cfg.moe.is_moe_layer(i):
            h = f"model.layers.{i}."
            if fused:
                block |= {f"{h}mlp.experts.gate_up_proj", f"{h}mlp.experts.down_proj"}
            elif family == "mixtral":
                block = {n.replace(f"{h}mlp.gate.", f"{h}block_sparse_moe.gate.") for n in block}
                block |= {f"{h}block_sparse_moe.experts.{j}.{w}.weight"
                          for j in range(cfg.moe.num_experts) for w in ("w1", "w2", "w3")}
            else:
                block |= {f"{h}mlp.experts.{j}.{w}_proj.weight"
                          for j in range(cfg.moe.num_experts) for w in ("gate", "up", "down")}
        names |= block
    return names


def to_moe_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """lmforge weights (unwrapped names) -> transformers Mixtral / Qwen3-MoE weights."""
    weights = qkv_state(replace(cfg, fused_qkv=False), weights)  # (a fused attn.wqkv: its q, k, v rows)
    out = {"model.embed_tokens.weight": weights["tok_emb.weight"], "model.norm.weight": weights["norm.weight"],
           "lm_head.weight": weights["tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"]}
    for i in range(cfg.n_layers):
        out.update({theirs: weights[ours] for ours, theirs in _block_names(cfg, i).items()})
        if not cfg.moe.is_moe_layer(i):
            continue
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        bias = weights.get(f"{b}mlp.expert_bias")
        if bias is not None and bias.abs().sum() > 0:
            raise ValueError(f"{b}mlp.expert_bias is not zero (the auxiliary-loss-free update moved it): "
                             f"{MOE_DECODERS[moe_family(cfg)]} has no selection bias.")
        gate, up = weights[f"{b}mlp.experts.w_gate"], weights[f"{b}mlp.experts.w_up"]
        out[f"{h}mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=2).transpose(1, 2).contiguous()
        out[f"{h}mlp.experts.down_proj"] = weights[f"{b}mlp.experts.w_down"].transpose(1, 2).contiguous()
    return out


def from_moe_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers Mixtral / Qwen3-MoE weights -> lmforge weights (the inverse of `to_moe_state_dict`)."""
    out = {"tok_emb.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    hidden = cfg.moe.expert_hidden or cfg.ffn_dim
    for i in range(cfg.n_layers):
        out.update({ours: hf[theirs] for ours, theirs in _block_names(cfg, i).items()})
        if not cfg.moe.is_moe_layer(i):
            continue
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        gate_up = hf[f"{h}mlp.experts.gate_up_proj"].transpose(1, 2)  # (E, dim, 2 hidden)
        out[f"{b}mlp.experts.w_gate"] = gate_up[..., :hidden].contiguous()
        out[f"{b}mlp.experts.w_up"] = gate_up[..., hidden:].contiguous()
        out[f"{b}mlp.experts.w_down"] = hf[f"{h}mlp.experts.down_proj"].transpose(1, 2).contiguous()
    return qkv_state(cfg, out)  # (model.fused_qkv: q, k, v fused)


to_mixtral_state_dict, from_mixtral_state_dict = to_moe_state_dict, from_moe_state_dict


def import_moe(hf_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A transformers Mixtral / Qwen3-MoE folder -> (its ModelConfig, the lmforge model with its
    weights, in eval mode). transformers itself reads the weights (its checkpoint conversions included)."""
    import transformers

    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_moe(hf, str(hf_dir / HF_CONFIG))
    cfg.check()
    stored = hf_weight_files(hf_dir)  # (names only, from the safetensors headers or index: nothing big is read yet)
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()  # (a tied copy transformers ties over)
    check_tensor_names(hf_dir, moe_tensor_names(cfg, hf["model_type"], stored), stored, optional)
    hf_class = getattr(transformers, MOE_DECODERS[hf["model_type"]])
    weights = from_moe_state_dict(cfg, hf_class.from_pretrained(str(hf_dir), dtype=torch.float32).state_dict())
    return cfg, model_from_state_dict(cfg, weights, device)


def save_moe(cfg: ModelConfig, hf_cfg, weights: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write lmforge MoE `weights` as a transformers folder of `hf_cfg` (config.json + safetensors,
    through transformers' own `save_pretrained`); a μP model's forward multipliers folded into the weights
    (lmforge.interop.mup_fold)."""
    import transformers

    weights = {name: fold_multipliers(cfg, name, t) for name, t in weights.items()}
    with torch.device("meta"):
        hf_model = getattr(transformers, hf_cfg.architectures[0])(hf_cfg)
    hf_model.load_state_dict(to_moe_state_dict(cfg, weights), strict=True, assign=True)
    if cfg.tie_embeddings:
        hf_model.tie_weights()
    hf_model.save_pretrained(str(out_dir))


def export_moe(model: Transformer, out_dir: str | Path) -> Path:
    """An lmforge MoE model (whole, one process) -> a transformers Mixtral / Qwen3-MoE folder, weights
    and config only (`lmforge export` / lmforge.interop.hf.export_hf adds the tokenizer and the
    overwrite checks, and writes through `save_moe` too)."""
    weights = {**{n: p.detach() for n, p in model.named_parameters()},
               **{n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}}
    out = Path(out_dir)
    save_moe(model.cfg, moe_hf_config(model.cfg), weights, out)
    return out


import_mixtral, export_mixtral = import_moe, export_moe

__all__ = ["MOE_DECODERS", "check_mixtral", "check_moe", "export_mixtral", "export_moe", "from_mixtral_state_dict",
           "from_moe_state_dict", "import_mixtral", "import_moe", "mixtral_config", "model_config_from_moe",
           "moe_family", "moe_hf_config", "moe_tensor_names", "save_moe", "to_mixtral_state_dict", "to_moe_state_dict"]
