"""Hugging Face `transformers` interop for the hybrid linear-attention Qwen models: Qwen3-Next
(`Qwen3NextForCausalLM`, model_type qwen3_next), Qwen3.5 (`Qwen3_5ForCausalLM`, qwen3_5_text) and
Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, qwen3_5_moe_text).

    cfg, model = import_qwen3next("path/to/qwen3-next")   # a transformers folder -> an lmforge model
    export_qwen3next(model, "out/qwen3-next")               # an lmforge hybrid model -> a transformers folder

`lmforge import` / `lmforge export` (lmforge.interop.hf) come here for these model types, and for
every model with an option only they have (Gated DeltaNet blocks, gated attention, partial RoPE, a
gated shared expert): a MoE model exports as Qwen3-Next, a dense one as Qwen3.5.

The three share one block, which is lmforge's with these options (transformers 5.24's source, read
and checked here by logits parity):

* pre-norm blocks of RMSNorm; Qwen's RMSNorm multiplies by (1 + weight) (its weights start at 0),
  lmforge's `nn.RMSNorm` by weight: lmforge weight = 1 + transformers weight, for the block norms,
  the final norm and QK-norm (`self_attn.q_norm` / `k_norm`). The Gated DeltaNet's gated norm
  (`linear_attn.norm`) multiplies by its weight as it is: copied.
* full attention with QK-norm (model.qk_norm), partial RoPE (model.rope_fraction, transformers'
  partial_rotary_factor, default 0.25) and the output gate (model.attn_gate): transformers' q_proj
  holds each head's query rows then its gate rows, (heads, 2, head_dim, dim) -> lmforge's `attn.wq`
  and `attn.wg`; no biases (attention_bias = false).
* Gated DeltaNet (lmforge.model.gated_deltanet, model.deltanet.*) on the blocks model.layer_types
  (transformers' layer_types) makes linear. Qwen3-Next packs q, k, v, z of each key head's group side
  by side in `in_proj_qkvz` (key head j: q_j, k_j, its value_heads / key_heads value heads, their z
  rows) and beta's and the decay's inputs likewise in `in_proj_ba`; Qwen3.5 keeps `in_proj_qkv`
  ([q; k; v]), `in_proj_z`, `in_proj_b`, `in_proj_a`. One depthwise `conv1d` over [q; k; v] ->
  lmforge's conv_q / conv_k / conv_v; A_log, dt_bias, norm and out_proj copied.
* the MoE (Qwen3-Next, Qwen3.5-MoE): softmax top-k routing (`mlp.gate` -> `mlp.router`), renormalised
  as norm_topk_prob says (Qwen3.5-MoE: always); experts fused as transformers 5 keeps them
  (`mlp.experts.gate_up_proj` / `down_proj`, as Mixtral's in lmforge.interop.hf_moe); one shared
  expert of shared_expert_intermediate_size (lmforge: model.moe.shared_experts x expert_hidden, so it
  must be a multiple of moe_intermediate_size) with its per-token sigmoid gate `mlp.shared_expert_gate`
  (model.moe.shared_gate). Qwen3-Next's dense blocks (mlp_only_layers / decoder_sparse_step) give
  model.moe.first_dense / every, as Qwen3-MoE's do.
* Qwen3.5's multimodal RoPE (mrope_section) is plain RoPE for text: its three position rows are the
  same token positions, so lmforge's RoPE is the same function.

Not mapped, refused with a one-line ValueError naming the key: RoPE scaling, attention biases, an
activation other than SiLU, a shared-expert width that is no multiple of the experts', and the
multimodal Qwen3.5 folders (model_type qwen3_5 / qwen3_5_moe: import their text model, saved as
Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM). Qwen3-Next's own multi-token prediction weights
(`mtp.*`, which the published checkpoints carry) are not part of the causal LM: transformers drops
them on load, and so does lmforge (every other tensor must be exactly the model's:
hf_common.check_tensor_names). Conversion holds the whole model in memory, as for Mixtral.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.config.sections import DeltaNetConfig, MoEConfig
from lmforge.folders import HF_CONFIG
from lmforge.interop.hf_common import (check_plain_blocks, check_tensor_names, hf_weight_files, model_from_state_dict, read_hf_config,
                                       rope_from_hf, save_through_transformers)
from lmforge.interop.hf_moe import _moe_layers
from lmforge.model.layers import qkv_state
from lmforge.model.transformer import Transformer

# model_type -> transformers class
HYBRID_DECODERS = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                   "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
# the multimodal folders of Qwen3.5 (a vision tower beside the text model), refused by name
MULTIMODAL = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
_MTP = re.compile(r"^mtp\.")  # (Qwen3-Next's multi-token prediction weights: not part of the causal LM)


def is_hybrid(cfg: ModelConfig) -> bool:
    """Whether `cfg` has an option only these families represent (then `lmforge export` writes one)."""
    return cfg.has_linear_layers or cfg.attn_gate or cfg.rope_fraction != 1.0 or cfg.moe.shared_gate


def hybrid_family(cfg: ModelConfig) -> str:
    """The model type an export of `cfg` writes: Qwen3-Next with MoE, Qwen3.5 (dense) without."""
    return "qwen3_next" if cfg.moe.enabled else "qwen3_5_text"


def check_hybrid(cfg: ModelConfig) -> None:
    """ValueError unless the family of `hybrid_family(cfg)` represents `cfg` exactly; the message names
    every setting it cannot."""
    arch, m, problems = HYBRID_DECODERS[hybrid_family(cfg)], cfg.moe, []
    check_plain_blocks(cfg, arch)
    if (cfg.norm, cfg.activation, cfg.pos_emb) != ("rmsnorm", "swiglu", "rope") or cfg.bias or cfg.attn_qkv_bias:
        problems.append(f"{arch} is RMSNorm + SwiGLU + RoPE without biases (model.bias = model.qkv_bias = false)")
    if not (cfg.qk_norm and cfg.attn_gate):
        problems.append(f"{arch}'s full attention has QK-norm and the output gate (model.qk_norm = model.attn_gate = "
                        f"true)")
    for key, value, plain in (("sliding_window", cfg.sliding_window, 0), ("rope_scaling", cfg.rope_scaling, "none"),
                              ("mla.kv_lora_rank", cfg.mla.kv_lora_rank, 0), ("mtp_depth", cfg.mtp_depth, 0),
                              ("parametrization", cfg.parametrization, "sp")):
        if value != plain:
            problems.append(f"model.{key} = {value!r} has no place in {arch} (set it to {plain!r})")
    if m.enabled:
        if m.router != "softmax" or m.route_scale != 1.0 or m.n_groups != 1:
            problems.append(f"{arch} routes with softmax top-k (model.moe.router = 'softmax', route_scale = 1, "
                            f"n_groups = 1)")
        if m.shared_experts < 1 or not m.shared_gate:
            problems.append(f"{arch}'s MoE blocks have a gated shared expert (model.moe.shared_experts >= 1, "
                            f"shared_gate = true)")
    elif m.shared_gate:
        problems.append("model.moe.shared_gate needs MoE blocks")
    if problems:
        raise ValueError(f"cannot be represented by {arch}: " + "; ".join(problems) + ".")


def qwen3next_hf_config(cfg: ModelConfig, eos_id: int | None = None, bos_id: int | None = None,
                        pad_id: int | None = None):
    """The transformers Qwen3NextConfig (MoE) / Qwen3_5TextConfig (dense) equivalent to `cfg`."""
    import transformers

    check_hybrid(cfg)
    family, m = hybrid_family(cfg), cfg.moe
    key_heads, value_heads, key_dim, value_dim = cfg.deltanet_shape
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, attention_dropout=cfg.dropout,
        linear_conv_kernel_dim=cfg.deltanet.conv_kernel, linear_key_head_dim=key_dim, linear_value_head_dim=value_dim,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        layer_types=["linear_attention" if cfg.is_linear_layer(i) else "full_attention" for i in range(cfg.n_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rope_fraction},
        eos_token_id=eos_id, bos_token_id=bos_id, pad_token_id=pad_id, architectures=[HYBRID_DECODERS[family]])
    if family == "qwen3_5_text":
        return transformers.Qwen3_5TextConfig(**common)
    hidden = m.expert_hidden or cfg.ffn_dim
    return transformers.Qwen3NextConfig(
        num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=hidden,
        shared_expert_intermediate_size=m.shared_experts * hidden, norm_topk_prob=m.renormalize,
        decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.n_layers) if not m.is_moe_layer(i)],
        router_aux_loss_coef=m.aux_loss_coef, **common)


def _layer_pattern(types: list[str]) -> dict:
    """model.full_attention_interval where `types` is its pattern (Qwen3-Next's 3:1: 4), else layer_types."""
    n = len(types)
    for interval in range(2, n + 1):
        if types == ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]:
            return {"full_attention_interval": interval}
    return {"layer_types": list(types)}


def model_config_from_qwen3next(hf: dict, source: str = HF_CONFIG) -> ModelConfig:
    """The lmforge ModelConfig of a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE config.json dict, or ValueError
    naming what lmforge cannot represent."""
    kind, n = hf.get("model_type"), hf["num_hidden_layers"]
    if kind in MULTIMODAL:
        raise ValueError(f"{source}: model_type {kind!r} is the multimodal Qwen3.5 (a vision tower beside the text "
                         f"model); lmforge imports the text model: save it as {MULTIMODAL[kind]} first.")
    if kind not in HYBRID_DECODERS:
        raise ValueError(f"{source}: model_type {kind!r} is not one of {', '.join(HYBRID_DECODERS)}.")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act = {hf['hidden_act']!r}; lmforge's SwiGLU uses 'silu'.")
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias = true is not supported (lmforge's model.bias also covers the MLP).")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_keys = rope_from_hf(hf, source)
    if "rope_scaling" in rope_keys:
        raise ValueError(f"{source}: rope type {rope_keys['rope_scaling']!r} is not supported for {kind} (lmforge "
                         f"maps its partial RoPE without scaling).")
    # (transformers' default for these families is 0.25)
    fraction = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    moe = MoEConfig()
    hidden = hf.get("moe_intermediate_size")
    if kind == "qwen3_5_moe_text" or (kind == "qwen3_next" and hf.get("num_experts", 512) > 0):
        shared = hf.get("shared_expert_intermediate_size", 512)
        if shared <= 0 or shared % hidden:
            raise ValueError(f"{source}: shared_expert_intermediate_size = {shared} is not a positive multiple of "
                             f"moe_intermediate_size = {hidden}; lmforge's shared experts are shared_experts x "
                             f"expert_hidden wide.")
        first, every = (0, 1) if kind == "qwen3_5_moe_text" else _moe_layers(hf, source, n)
        moe = MoEConfig(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], expert_hidden=hidden,
                        shared_experts=shared // hidden, shared_gate=True, router="softmax",
                        renormalize=bool(hf.get("norm_topk_prob", True)), first_dense=first, every=every,
                        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=n, n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf.get("intermediate_size") or hidden,
        max_seq_len=hf.get("max_position_embeddings", 2048), norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu", bias=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pos_emb="rope",
        dropout=0.0, qk_norm=True, attn_gate=True, rope_fraction=fraction,
        attn_head_dim=None if head_dim * heads == dim else head_dim, **rope_keys, **_layer_pattern(types),
        deltanet=DeltaNetConfig(key_heads=hf.get("linear_num_key_heads", 16),
                                value_heads=hf.get("linear_num_value_heads", 32),
                                key_head_dim=hf.get("linear_key_head_dim", 128),
                                value_head_dim=hf.get("linear_value_head_dim", 128),
                                conv_kernel=hf.get("linear_conv_kernel_dim", 4)),
        moe=moe)


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------


_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_COPIED = {"attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj"}
_QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
_DELTANET = {"attn.A_log": "linear_attn.A_log", "attn.dt_bias": "linear_attn.dt_bias",
             "attn.norm.weight": "linear_attn.norm.weight", "attn.wo.weight": "linear_attn.out_proj.weight"}
_MLP = {"mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
_SHARED = {"mlp.router": "mlp.gate", "mlp.shared.gate": "mlp.shared_expert.gate_proj",
           "mlp.shared.up": "mlp.shared_expert.up_proj", "mlp.shared.down": "mlp.shared_expert.down_proj",
           "mlp.shared_gate": "mlp.shared_expert_gate"}


def _zero_centred_norms(cfg: ModelConfig, i: int) -> dict[str, str]:
    """lmforge -> transformers names of block i's RMSNorm weights that Qwen stores as weight - 1."""
    parts = {**_NORMS, **({} if cfg.is_linear_layer(i) else _QK_NORMS)}
    return {f"blocks.{i}.{ours}.weight": f"model.layers.{i}.{theirs}.weight" for ours, theirs in parts.items()}


def _copied(cfg: ModelConfig, i: int) -> dict[str, str]:
    """lmforge -> transformers names of block i's tensors copied as they are."""
    b, h = f"blocks.{i}.", f"model.layers.{i}."
    if cfg.is_linear_layer(i):
        out = {b + ours: h + theirs for ours, theirs in _DELTANET.items()}
    else:
        out = {f"{b}{ours}.weight": f"{h}{theirs}.weight" for ours, theirs in _COPIED.items()}
    mlp = _SHARED if cfg.moe.is_moe_layer(i) else _MLP
    return out | {f"{b}{ours}.weight": f"{h}{theirs}.weight" for ours, theirs in mlp.items()}


def _deltanet_rows(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(rows of one key head's group of q, k, v, z in Qwen3-Next's in_proj_qkvz, where its v rows end, value
    heads per key head, the q (and k) width)."""
    key_heads, value_heads, key_dim, value_dim = cfg.deltanet_shape
    rep = value_heads // key_heads
    return 2 * key_dim + 2 * rep * value_dim, 2 * key_dim + rep * value_dim, rep, key_heads * key_dim


def to_qwen3next_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                            family: str | None = None) -> dict[str, torch.Tensor]:
    """lmforge weights (unwrapped names) -> the transformers model's (in memory: fused experts)."""
    family = family or hybrid_family(cfg)
    weights = qkv_state(replace(cfg, fused_qkv=False), weights)  # (a fused attn.wqkv: its q, k, v rows)
    key_heads, d, hd = cfg.deltanet_shape[0], cfg.dim, cfg.head_dim
    out = {"model.embed_tokens.weight": weights["tok_emb.weight"], "model.norm.weight": weights["norm.weight"] - 1,
           "lm_head.weight": weights["tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"]}
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out.update({theirs: weights[ours] - 1 for ours, theirs in _zero_centred_norms(cfg, i).items()})
        out.update({theirs: weights[ours] for ours, theirs in _copied(cfg, i).items()})
        if cfg.is_linear_layer(i):
            q, k, v, z, beta, a = (weights[f"{b}attn.in_{n}.weight"] for n in "qkvzba")
            if family == "qwen3_next":
                per_head = lambda t: t.reshape(key_heads, -1, d)  # noqa: E731  (rows of each key head's group)
                out[h + "linear_attn.in_proj_qkvz.weight"] = torch.cat([per_head(t) for t in (q, k, v, z)], 1).reshape(-1, d)
                out[h + "linear_attn.in_proj_ba.weight"] = torch.cat([per_head(beta), per_head(a)], 1).reshape(-1, d)
            else:
                out.update({h + "linear_attn.in_proj_qkv.weight": torch.cat([q, k, v]),
                            h + "linear_attn.in_proj_z.weight": z, h + "linear_attn.in_proj_b.weight": beta,
                            h + "linear_attn.in_proj_a.weight": a})
            out[h + "linear_attn.conv1d.weight"] = torch.cat([weights[f"{b}attn.conv_{n}.weight"] for n in "qkv"])
        else:  # q_proj: per head its query rows, then its gate rows
            q, g = (weights[f"{b}attn.{n}.weight"].view(cfg.n_heads, 1, hd, d) for n in ("wq", "wg"))
            out[h + "self_attn.q_proj.weight"] = torch.cat([q, g], 1).reshape(-1, d)
        if cfg.moe.is_moe_layer(i):
            bias = weights.get(f"{b}mlp.expert_bias")
            if bias is not None and bias.abs().sum() > 0:
                raise ValueError(f"{b}mlp.expert_bias is not zero (the auxiliary-loss-free update moved it): "
                                 f"{HYBRID_DECODERS[family]} has no selection bias.")
            gate, up = weights[f"{b}mlp.experts.w_gate"], weights[f"{b}mlp.experts.w_up"]
            out[h + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=2).transpose(1, 2).contiguous()
            out[h + "mlp.experts.down_proj"] = weights[f"{b}mlp.experts.w_down"].transpose(1, 2).contiguous()
    return out


def from_qwen3next_state_dict(cfg: ModelConfig, hf: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """The transformers model's weights (in memory) -> lmforge weights (the inverse of `to_qwen3next_state_dict`)."""
    key_heads, _, key_dim, _ = cfg.deltanet_shape
    group, v_end, rep, keys = _deltanet_rows(cfg)
    d, hd, hidden = cfg.dim, cfg.head_dim, cfg.moe.expert_hidden or cfg.ffn_dim
    out = {"tok_emb.weight": hf["model.embed_tokens.weight"], "norm.weight": 1 + hf["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        out.update({ours: 1 + hf[theirs] for ours, theirs in _zero_centred_norms(cfg, i).items()})
        out.update({ours: hf[theirs] for ours, theirs in _copied(cfg, i).items()})
        if cfg.is_linear_layer(i):
            if family == "qwen3_next":
                qkvz = hf[h + "linear_attn.in_proj_qkvz.weight"].view(key_heads, group, d)
                ba = hf[h + "linear_attn.in_proj_ba.weight"].view(key_heads, 2 * rep, d)
                rows = lambda t, a, z: t[:, a:z].reshape(-1, d)  # noqa: E731
                parts = {"q": rows(qkvz, 0, key_dim), "k": rows(qkvz, key_dim, 2 * key_dim),
                         "v": rows(qkvz, 2 * key_dim, v_end), "z": rows(qkvz, v_end, group),
                         "b": rows(ba, 0, rep), "a": rows(ba, rep, 2 * rep)}
            else:
                qkv = hf[h + "linear_attn.in_proj_qkv.weight"]
                parts = {"q": qkv[:keys], "k": qkv[keys:2 * keys], "v": qkv[2 * keys:],
                         **{n: hf[f"{h}linear_attn.in_proj_{n}.weight"] for n in "zba"}}
            out.update({f"{b}attn.in_{n}.weight": t.contiguous() for n, t in parts.items()})
            conv = hf[h + "linear_attn.conv1d.weight"]
            out.update({f"{b}attn.conv_q.weight": conv[:keys], f"{b}attn.conv_k.weight": conv[keys:2 * keys],
                        f"{b}attn.conv_v.weight": conv[2 * keys:]})
        else:
            qg = hf[h + "self_attn.q_proj.weight"].view(cfg.n_heads, 2, hd, d)
            out[b + "attn.wq.weight"] = qg[:, 0].reshape(-1, d).contiguous()
            out[b + "attn.wg.weight"] = qg[:, 1].reshape(-1, d).contiguous()
        if cfg.moe.is_moe_layer(i):
            gate_up = hf[h + "mlp.experts.gate_up_proj"].transpose(1, 2)  # (E, dim, 2 hidden)
            out[b + "mlp.experts.w_gate"] = gate_up[..., :hidden].contiguous()
            out[b + "mlp.experts.w_up"] = gate_up[..., hidden:].contiguous()
            out[b + "mlp.experts.w_down"] = hf[h + "mlp.experts.down_proj"].transpose(1, 2).contiguous()
    return qkv_state(cfg, out)  # (model.fused_qkv: q, k, v fused)


def qwen3next_tensor_names(cfg: ModelConfig, family: str, stored) -> set[str]:
    """Every tensor name a transformers folder of `cfg` holds: the in-memory names of
    `to_qwen3next_state_dict` (computed on the meta device), with the experts in the layout `stored`
    (the folder's names) has: fused per layer, or one tensor per expert (`mlp.experts.j.gate_proj /
    up_proj / down_proj`, what transformers' save_pretrained writes for Qwen3-Next)."""
    separate = replace(cfg, fused_qkv=False)  # (q, k, v as transformers has them: nothing to split on meta)
    with torch.device("meta"):
        model = Transformer(separate)
    names = set(to_qwen3next_state_dict(separate, dict(model.named_parameters()), family))
    if cfg.tie_embeddings:
        names.discard("lm_head.weight")
    if any(name.endswith(".mlp.experts.gate_up_proj") for name in stored):
        return names
    for name in [n for n in names if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        names.discard(name)
        h = name.removesuffix("gate_up_proj").removesuffix("down_proj")
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        names |= {f"{h}{j}.{w}.weight" for j in range(cfg.moe.num_experts) for w in parts}
    return names


def import_qwen3next(hf_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A transformers Qwen3-Next / Qwen3.5 / Qwen3.5-MoE folder -> (its ModelConfig, the lmforge model
    with its weights, in eval mode). transformers itself reads the weights (its checkpoint
    conversions included), after the folder's tensor names are checked to be exactly the model's."""
    import transformers

    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_qwen3next(hf, str(hf_dir / HF_CONFIG))
    cfg.check()
    family = hf["model_type"]
    stored = {name: where for name, where in hf_weight_files(hf_dir).items() if not _MTP.match(name)}
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()  # (a tied copy transformers ties over)
    check_tensor_names(hf_dir, qwen3next_tensor_names(cfg, family, stored), stored, optional)
    hf_class = getattr(transformers, HYBRID_DECODERS[family])
    weights = from_qwen3next_state_dict(cfg, hf_class.from_pretrained(str(hf_dir), dtype=torch.float32).state_dict(),
                                        family)
    return cfg, model_from_state_dict(cfg, weights, device)


def save_qwen3next(cfg: ModelConfig, hf_cfg, weights: dict[str, torch.Tensor], out_dir: Path) -> None:
    """Write lmforge `weights` as a transformers folder of `hf_cfg` (config.json + safetensors, through
    transformers' own `save_pretrained`). The norms' weight - 1 is taken in fp32, then stored in the
    weights' dtype."""
    save_through_transformers(cfg, hf_cfg, weights, lambda w: to_qwen3next_state_dict(cfg, w), out_dir)


def export_qwen3next(model: Transformer, out_dir: str | Path) -> Path:
    """An lmforge model (whole, one process) -> a transformers Qwen3-Next / Qwen3.5 folder, weights and
    config only (`lmforge export` / lmforge.interop.hf.export_hf adds the tokenizer and the overwrite
    checks, and writes through `save_qwen3next` too)."""
    weights = {**{n: p.detach() for n, p in model.named_parameters()},
               **{n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}}
    out = Path(out_dir)
    save_qwen3next(model.cfg, qwen3next_hf_config(model.cfg), weights, out)
    return out


__all__ = ["HYBRID_DECODERS", "check_hybrid", "export_qwen3next", "from_qwen3next_state_dict", "hybrid_family",
           "import_qwen3next", "is_hybrid", "model_config_from_qwen3next", "qwen3next_hf_config",
           "qwen3next_tensor_names", "save_qwen3next", "to_qwen3next_state_dict"]
