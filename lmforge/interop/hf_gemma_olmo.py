"""Hugging Face `transformers` interop for Gemma 3 (text: `Gemma3ForCausalLM`, model_type gemma3_text),
OLMo 2 (`Olmo2ForCausalLM`, olmo2) and OLMo 3 (`Olmo3ForCausalLM`, olmo3).

    cfg, model = import_gemma_olmo("path/to/gemma-3-1b")   # a transformers folder -> an lmforge model
    export_gemma_olmo(model, "out/gemma")                    # an lmforge model -> a transformers folder

`lmforge import` / `lmforge export` (lmforge.interop.hf) come here for these model types, and for every
model with an option only they have (`is_gemma_olmo`): model.norm_placement 'sandwich' exports as
Gemma 3, 'post' as OLMo 3 when model.layer_types has sliding-window blocks, else OLMo 2.

Their blocks are lmforge's with these options (transformers 5.24's source, checked by logits parity):

* Gemma 3: norm_placement 'sandwich' (`input_layernorm` / `post_attention_layernorm` /
  `pre_feedforward_layernorm` / `post_feedforward_layernorm` <- attn_norm / attn_post_norm / mlp_norm /
  mlp_post_norm), per-head QK-norm, GeGLU (gelu_pytorch_tanh), the embeddings times sqrt(hidden_size)
  (model.embed_scale), scores over sqrt(query_pre_attn_scalar) (model.attn_scale_dim), interleaved
  sliding / full attention (layer_types -> model.layer_types, sliding_window) with the sliding blocks'
  own RoPE base (rope_parameters' sliding_attention / rope_local_base_freq -> model.rope_local_theta).
  Gemma's RMSNorm multiplies by (1 + weight): lmforge weight = 1 + transformers weight, for every norm,
  converted here so the model keeps one RMSNorm.
* OLMo 2 / OLMo 3: norm_placement 'post' (`post_attention_layernorm` / `post_feedforward_layernorm`, no
  input norms), QK-norm over the whole projections (model.qk_norm_scope = 'projection'), SwiGLU, their
  RMSNorm as lmforge's (weights copied). OLMo 3 adds the sliding / full layer_types.

Not mapped, refused with a one-line ValueError naming the key: biases, logit soft-capping, bidirectional
attention, RoPE scaling on the sliding blocks, partial RoPE, the gate and linear attention of Qwen3-Next,
MoE, MLA and multi-token prediction. Conversion holds the whole model in memory, through transformers'
own model (as for Mixtral and Qwen3-Next).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.folders import HF_CONFIG
from lmforge.interop.hf_common import (check_tensor_names, gemma_olmo_options, hf_rope_keys, hf_weight_files,
                                       model_from_state_dict, read_hf_config, rope_from_hf, save_through_transformers)
from lmforge.model.layers import qkv_state
from lmforge.model.transformer import Transformer

# model_type -> transformers class
GEMMA_OLMO_DECODERS = {"gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM"}
_CONFIGS = {"gemma3_text": "Gemma3TextConfig", "olmo2": "Olmo2Config", "olmo3": "Olmo3Config"}
# lmforge -> transformers names of a block's norms, per family (Gemma's stored as weight - 1)
_NORMS = {"gemma3_text": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                          "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
          "olmo": {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}}
_COPIED = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
           "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
           "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}


def is_gemma_olmo(cfg: ModelConfig) -> bool:
    """Whether `cfg` has an option only these families represent (then `lmforge export` writes one)."""
    return cfg.has_local_layers or bool(gemma_olmo_options(cfg))


def gemma_olmo_family(cfg: ModelConfig) -> str:
    """The model type an export of `cfg` writes."""
    if cfg.norm_placement == "sandwich":
        return "gemma3_text"
    return "olmo3" if cfg.has_local_layers else "olmo2"


def check_gemma_olmo(cfg: ModelConfig) -> None:
    """ValueError unless the family of `gemma_olmo_family(cfg)` represents `cfg` exactly; the message
    names every setting it cannot."""
    family = gemma_olmo_family(cfg)
    arch, gemma, problems = GEMMA_OLMO_DECODERS[family], family == "gemma3_text", []
    want = {"norm_placement": "sandwich" if gemma else "post", "embed_scale": gemma, "norm": "rmsnorm",
            "activation": "geglu" if gemma else "swiglu", "pos_emb": "rope", "qk_norm": True,
            "qk_norm_scope": "head" if gemma else "projection", "bias": False, "qkv_bias": False,
            "attn_gate": False, "rope_fraction": 1.0, "mla.kv_lora_rank": 0, "moe.num_experts": 0, "mtp_depth": 0,
            "parametrization": "sp", "full_attention_interval": 0}
    have = {key: getattr(cfg, key) for key in want if "." not in key} | {
        "qkv_bias": cfg.attn_qkv_bias, "mla.kv_lora_rank": cfg.mla.kv_lora_rank, "moe.num_experts": cfg.moe.num_experts}
    problems += [f"model.{key} = {have[key]!r} (it needs {value!r})" for key, value in want.items() if have[key] != value]
    if cfg.sliding_window and not cfg.has_local_layers and cfg.rope_scaling != "none":
        problems.append(f"model.sliding_window on every block with model.rope_scaling = {cfg.rope_scaling!r} (its "
                        f"sliding-window blocks take plain RoPE: list them in model.layer_types)")
    if "linear_attention" in cfg.layer_types:
        problems.append("model.layer_types' 'linear_attention' blocks (it has softmax attention only)")
    if not gemma:
        if cfg.attn_scale_dim is not None:
            problems.append(f"model.attn_scale_dim = {cfg.attn_scale_dim} (its scores are over sqrt(head_dim))")
        if cfg.attn_head_dim is not None and cfg.attn_head_dim * cfg.n_heads != cfg.dim:
            problems.append(f"model.attn_head_dim = {cfg.attn_head_dim} (its heads are hidden_size / heads wide)")
        if family == "olmo2" and cfg.sliding_window:
            problems.append(f"model.sliding_window = {cfg.sliding_window} without 'sliding_attention' blocks in "
                            f"model.layer_types (OLMo 3 windows those only)")
        if family == "olmo3" and cfg.rope_local_theta not in (0.0, cfg.rope_theta):
            problems.append(f"model.rope_local_theta = {cfg.rope_local_theta:g} (its blocks share rope_theta)")
    if problems:
        raise ValueError(f"cannot be represented by {arch}: " + "; ".join(problems) + ".")


def gemma_olmo_hf_config(cfg: ModelConfig, eos_id: int | None = None, bos_id: int | None = None,
                         pad_id: int | None = None):
    """The transformers Gemma3TextConfig / Olmo2Config / Olmo3Config equivalent to `cfg`."""
    import transformers

    check_gemma_olmo(cfg)
    family = gemma_olmo_family(cfg)
    arch = GEMMA_OLMO_DECODERS[family]
    special = {k: v for k, v in (("eos_token_id", eos_id), ("bos_token_id", bos_id), ("pad_token_id", pad_id))
               if v is not None}
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
                  max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, attention_bias=False,
                  attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, architectures=[arch], **special)
    if family == "olmo2":
        return transformers.Olmo2Config(hidden_act="silu", **hf_rope_keys(cfg), **common)
    scaling = hf_rope_keys(cfg).get("rope_scaling", {"rope_type": "default"})
    rope = {"full_attention": {**scaling, "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}}
    # (every block's kind: a window on every block is every block 'sliding_attention'; none, every one full)
    types = cfg.layer_types or ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.n_layers
    window = dict(layer_types=list(types), sliding_window=cfg.sliding_window or cfg.max_seq_len, rope_parameters=rope)
    if family == "olmo3":
        return transformers.Olmo3Config(hidden_act="silu", **window, **common)
    return transformers.Gemma3TextConfig(
        hidden_activation="gelu_pytorch_tanh", head_dim=cfg.head_dim, query_pre_attn_scalar=cfg.attn_scale_dim or cfg.head_dim,
        final_logit_softcapping=None, attn_logit_softcapping=None, **window, **common)


def model_config_from_gemma_olmo(hf: dict, source: str = HF_CONFIG) -> ModelConfig:
    """ModelConfig of a Gemma 3 (text) / OLMo 2 / OLMo 3 config.json dict, or ValueError naming the key
    lmforge cannot represent. The dict is read through transformers' own config class, which fills its
    defaults and gathers the RoPE keys of either version (rope_theta / rope_local_base_freq / rope_scaling,
    or transformers 5's rope_parameters per block kind)."""
    import transformers

    family = hf["model_type"]
    config_class = getattr(transformers, _CONFIGS[family])
    c = config_class.from_dict({k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    gemma = family == "gemma3_text"
    for key in ("attention_bias", "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(c, key, None) not in (None, False):
            raise ValueError(f"{source}: {key} = {getattr(c, key)!r} is not supported by lmforge (unset it).")
    act = getattr(c, "hidden_activation" if gemma else "hidden_act")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise ValueError(f"{source}: activation {act!r} is not supported for {family} (lmforge: "
                         f"{'gelu_pytorch_tanh (GeGLU)' if gemma else 'silu (SwiGLU)'}).")
    dim, heads = c.hidden_size, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or dim // heads
    out = dict(vocab_size=c.vocab_size, dim=dim, n_layers=c.num_hidden_layers, n_heads=heads,
               n_kv_heads=c.num_key_value_heads or heads, ffn_hidden=c.intermediate_size,
               max_seq_len=c.max_position_embeddings, norm="rmsnorm", norm_eps=float(c.rms_norm_eps),
               activation="geglu" if gemma else "swiglu", bias=False, tie_embeddings=bool(c.tie_word_embeddings),
               pos_emb="rope", dropout=0.0, qk_norm=True, qk_norm_scope="head" if gemma else "projection",
               norm_placement="sandwich" if gemma else "post", embed_scale=gemma,
               attn_head_dim=None if head_dim * heads == dim else head_dim)
    rope = c.rope_parameters
    if family == "olmo2":
        return ModelConfig(**out, **rope_from_hf({"rope_parameters": rope}, source))
    local = rope["sliding_attention"]
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope type {local['rope_type']!r} on the sliding-window layers is not supported "
                         f"(lmforge scales the full-attention layers' RoPE only).")
    types = list(c.layer_types)
    full = rope_from_hf({"rope_parameters": rope["full_attention"]}, source)
    local_theta = float(local["rope_theta"])
    sliding = "sliding_attention" in types
    return ModelConfig(**out, **full, layer_types=types if sliding else [],
                       sliding_window=int(c.sliding_window) if sliding else 0,
                       rope_local_theta=local_theta if sliding and local_theta != full["rope_theta"] else 0.0,
                       attn_scale_dim=(None if not gemma or c.query_pre_attn_scalar == head_dim
                                       else int(c.query_pre_attn_scalar)))


def _names(cfg: ModelConfig, family: str) -> dict[str, tuple[str, bool]]:
    """lmforge -> (transformers name, stored as weight - 1) of every weight of `cfg` (q, k, v separate)."""
    gemma = family == "gemma3_text"
    out = {"tok_emb.weight": ("model.embed_tokens.weight", False), "norm.weight": ("model.norm.weight", gemma)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", False)
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        for ours, theirs in _NORMS["gemma3_text" if gemma else "olmo"].items():
            out[f"{b}{ours}.weight"] = (f"{h}{theirs}.weight", gemma)
        for ours, theirs in _COPIED.items():
            out[f"{b}{ours}.weight"] = (f"{h}{theirs}.weight", gemma and ours.endswith("_norm"))
    return out


def to_gemma_olmo_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """lmforge weights (unwrapped names, fp32) -> the transformers model's."""
    weights = qkv_state(replace(cfg, fused_qkv=False), weights)  # (a fused attn.wqkv: its q, k, v rows)
    out = {theirs: weights[ours] - 1 if centred else weights[ours]
           for ours, (theirs, centred) in _names(cfg, family).items()}
    if cfg.tie_embeddings:  # (the transformers model's own name for the shared weight; tied over on save)
        out["lm_head.weight"] = weights["tok_emb.weight"]
    return out


def from_gemma_olmo_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The transformers model's weights -> lmforge weights (the inverse of `to_gemma_olmo_state_dict`)."""
    out = {ours: 1 + hf[theirs] if centred else hf[theirs] for ours, (theirs, centred) in _names(cfg, family).items()}
    return qkv_state(cfg, out)  # (model.fused_qkv: q, k, v fused)


def import_gemma_olmo(hf_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A transformers Gemma 3 (text) / OLMo 2 / OLMo 3 folder -> (its ModelConfig, the lmforge model with
    its weights, in eval mode), after the folder's tensor names are checked to be exactly the model's."""
    import transformers

    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_gemma_olmo(hf, str(hf_dir / HF_CONFIG))
    cfg.check()
    family = hf["model_type"]
    expected = {theirs for theirs, _ in _names(replace(cfg, fused_qkv=False), family).values()}
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()  # (a tied copy transformers ties over)
    check_tensor_names(hf_dir, expected, hf_weight_files(hf_dir), optional)
    hf_model = getattr(transformers, GEMMA_OLMO_DECODERS[family]).from_pretrained(str(hf_dir), dtype=torch.float32)
    weights = from_gemma_olmo_state_dict(cfg, hf_model.state_dict(), family)
    return cfg, model_from_state_dict(cfg, weights, device)


def save_gemma_olmo(cfg: ModelConfig, hf_cfg, weights: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write lmforge `weights` as a transformers folder of `hf_cfg` (through save_pretrained)."""
    family = gemma_olmo_family(cfg)
    save_through_transformers(cfg, hf_cfg, weights, lambda w: to_gemma_olmo_state_dict(cfg, w, family), out_dir)


def export_gemma_olmo(model: Transformer, out_dir: str | Path) -> Path:
    """An lmforge model (whole, one process) -> a transformers Gemma 3 / OLMo 2 / OLMo 3 folder, weights
    and config only (`lmforge export` adds the tokenizer and the overwrite checks)."""
    out = Path(out_dir)
    save_gemma_olmo(model.cfg, gemma_olmo_hf_config(model.cfg),
                    {n: p.detach() for n, p in model.named_parameters()}, out)
    return out


__all__ = ["GEMMA_OLMO_DECODERS", "check_gemma_olmo", "export_gemma_olmo", "from_gemma_olmo_state_dict",
           "gemma_olmo_family", "gemma_olmo_hf_config", "import_gemma_olmo", "is_gemma_olmo",
           "model_config_from_gemma_olmo", "save_gemma_olmo", "to_gemma_olmo_state_dict"]
