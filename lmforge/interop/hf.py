"""Hugging Face `transformers` interop: export an lmforge model as a transformers folder, and
import a transformers Llama / Qwen2 / Qwen3 / Mistral / GPT-2 folder (and the families below) as an
lmforge model. Local files only, no hub.

Layouts (lmforge name -> transformers name):

* Llama (`LlamaForCausalLM`): RMSNorm + SwiGLU + RoPE. `blocks.i.attn.wq` -> `model.layers.i.
  self_attn.q_proj`, `mlp.gate/up/down` -> `mlp.gate_proj/up_proj/down_proj`, norms ->
  `input_layernorm` / `post_attention_layernorm`. RoPE: lmforge's `apply_rope` uses the
  half-split convention (dimension i pairs with i + head_dim/2), which is exactly Hugging Face's
  `rotate_half`, so q/k weights are copied as they are, with no permutation. (Meta's original
  checkpoints use interleaved pairs; they would need the permutation that HF's own conversion
  script applies, which is not needed here.)
* The same layout with the families' options (`DECODERS`, chosen by `hf_family`): `Qwen2ForCausalLM`
  (model.qkv_bias: biases on q/k/v only), `Qwen3ForCausalLM` (model.qk_norm: `self_attn.q_norm` /
  `k_norm`, no biases), `MistralForCausalLM` (model.sliding_window; Qwen2/3 take a window on every
  layer as use_sliding_window with max_window_layers 0), and RoPE scaling (`llama3`, `linear`) in
  any of them (`rope_scaling` / transformers 5's `rope_parameters`).
* DeepSeek-V3 (`DeepseekV3ForCausalLM`): a model with multi-head latent attention (model.mla), its
  MoE and multi-token prediction layers (lmforge.interop.hf_deepseek), streamed like the dense ones.
* Mixtral / Qwen3-MoE (lmforge.interop.hf_moe) and the hybrid linear-attention Qwen3-Next /
  Qwen3.5 / Qwen3.5-MoE (lmforge.interop.hf_qwen3next: Gated DeltaNet, gated attention, partial
  RoPE, a gated shared expert), converted whole through transformers' own model.
* Gemma 3 (text) / OLMo 2 / OLMo 3 (lmforge.interop.hf_gemma_olmo: norm placement, scaled embeddings,
  QK-norm per head or over the projection, interleaved sliding / full attention), converted whole
  through transformers' own model.
* GPT-2 (`GPT2LMHeadModel`): LayerNorm + GELU(tanh) + learned positions. GPT-2's `Conv1D`
  stores weights as (in, out), the transpose of `nn.Linear`, and fuses q/k/v into `c_attn`;
  an lmforge GPT-2 without biases exports zero biases (the same function).

Anything else (e.g. RoPE with LayerNorm, GQA in GPT-2, exact-erf GELU, QK-norm with biases, a
sliding window on some layers only) is rejected with a ValueError that names the
setting neither side can represent.

`lmforge import` keeps the folder's tokenizer.json and, beside it in the run, a tokenizer_config.json
naming its eos/bos/pad tokens (lmforge.data.tokenizer reads one next to any tokenizer.json), so the
model's own ids survive into `lmforge prepare`, training and export.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lmforge.config import Config, ModelConfig, to_toml
from lmforge.folders import (CONFIG, HF_CONFIG, RUN_FILES, TOKENIZER, TOKENIZER_CONFIG, WEIGHTS,
                             atomic_write, check_target)
from lmforge.ckpt.export import WEIGHT_DTYPES, WeightReader, model_state, run_weights, save_streaming
from lmforge.ckpt.streaming import TensorRef, safetensors_writer
from lmforge.interop.hf_common import (check_no_new_attention, check_tensor_names, hf_rope_keys, hf_weight_files,
                                       read_hf_config, rope_from_hf)
from lmforge.interop.mup_fold import folded_reader
from lmforge.interop.hf_deepseek import (MODEL_TYPE as DEEPSEEK, deepseek_hf_config, deepseek_refs, deepseek_tensors,
                                         model_config_from_deepseek, mtp_copies, mtp_layers_present)
from lmforge.interop.hf_gemma_olmo import (GEMMA_OLMO_DECODERS, gemma_olmo_hf_config, import_gemma_olmo,
                                           is_gemma_olmo, model_config_from_gemma_olmo, save_gemma_olmo)
from lmforge.interop.hf_moe import MOE_DECODERS, import_moe, model_config_from_moe, moe_hf_config, save_moe
from lmforge.interop.hf_qwen3next import (HYBRID_DECODERS, MULTIMODAL, import_qwen3next, is_hybrid,
                                          model_config_from_qwen3next, qwen3next_hf_config, save_qwen3next)
from lmforge.model.layers import QKV_PARTS, qkv_conversions, qkv_layout, read_fused_qkv, split_qkv
from lmforge.model.materialise import materialise
from lmforge.model.transformer import Transformer

# activations of transformers' GPT-2 that are the tanh approximation lmforge's GeluMLP computes
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


# --------------------------------------------------------------------------------------------
# layout detection and configs
# --------------------------------------------------------------------------------------------


# the decoder families with Llama's layout (RMSNorm, SwiGLU, RoPE; same weight names): transformers class
DECODERS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}


def hf_family(cfg: ModelConfig) -> str:
    """'llama', 'qwen2', 'qwen3', 'mistral' or 'gpt2': the transformers class that represents `cfg`
    exactly, or ValueError naming the setting none can."""
    check_no_new_attention(cfg, "LlamaForCausalLM, Qwen2/3ForCausalLM, MistralForCausalLM or GPT2LMHeadModel")
    llama = (cfg.norm, cfg.activation, cfg.pos_emb) == ("rmsnorm", "swiglu", "rope")
    gpt2 = (cfg.norm, cfg.activation, cfg.pos_emb) == ("layernorm", "gelu", "learned")
    if gpt2 and cfg.kv_heads != cfg.n_heads:
        raise ValueError(
            f"model.n_kv_heads = {cfg.n_kv_heads} (grouped-query attention) cannot be represented by "
            f"GPT2LMHeadModel; export a GPT-2 style model with n_kv_heads unset, or use a Llama-style "
            f"model (rmsnorm, swiglu, rope).")
    if llama:
        return _decoder_family(cfg)
    if gpt2:
        for key, value, plain in (("qkv_bias", cfg.attn_qkv_bias, cfg.bias), ("sliding_window", cfg.sliding_window, 0)):
            if value != plain:
                raise ValueError(f"model.{key} = {value} cannot be represented by GPT2LMHeadModel; unset it.")
        return "gpt2"
    raise ValueError(
        f"model (norm={cfg.norm!r}, activation={cfg.activation!r}, pos_emb={cfg.pos_emb!r}) matches neither "
        f"LlamaForCausalLM (rmsnorm, swiglu, rope) nor GPT2LMHeadModel (layernorm, gelu, learned); "
        f"change model.norm / model.activation / model.pos_emb to one of these combinations to export.")


def _decoder_family(cfg: ModelConfig) -> str:
    """Which of `DECODERS` has `cfg`'s biases, QK-norm and sliding window (RoPE scaling: all of them)."""
    qkv, other = cfg.attn_qkv_bias, cfg.bias
    if cfg.qk_norm:
        if qkv or other:
            raise ValueError(f"model.qk_norm = true with biases (model.bias = {other}, model.qkv_bias = {qkv}) cannot "
                             f"be represented: Qwen3ForCausalLM has QK-norm and no MLP biases; set both to false.")
        return "qwen3"
    if qkv and not other:
        return "qwen2"  # biases on q/k/v only
    if qkv != other:
        raise ValueError(f"model.bias = {other} with model.qkv_bias = {qkv} (biases on o and the MLP but not on q/k/v) "
                         f"cannot be represented by LlamaForCausalLM / Qwen2ForCausalLM; unset model.qkv_bias.")
    if cfg.sliding_window:
        if other:
            raise ValueError(f"model.sliding_window = {cfg.sliding_window} with model.bias = true cannot be "
                             f"represented: MistralForCausalLM has no biases (Qwen2ForCausalLM: q/k/v only).")
        return "mistral"
    return "llama"


def require_transformers(command: str) -> None:
    """ValueError with the install command when the `transformers` package cannot be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ValueError(f'{command} needs the transformers package, which is not installed ({exc}); '
                         f'install it with: pip install "lmforge[eval]"') from None


def hf_config(cfg: ModelConfig, eos_id: int | None = None, bos_id: int | None = None,
              pad_id: int | None = None):
    """The transformers config object (Llama, Qwen2, Qwen3, Mistral or GPT-2) equivalent to `cfg`."""
    import transformers

    special = {"eos_token_id": eos_id, "bos_token_id": bos_id, "pad_token_id": pad_id}
    family = hf_family(cfg)
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_embd=cfg.dim, n_layer=cfg.n_layers, n_head=cfg.n_heads,
            n_inner=cfg.ffn_dim, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
            activation_function="gelu_pytorch_tanh", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, architectures=["GPT2LMHeadModel"],
            **special)
    arch = DECODERS[family]
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        hidden_act="silu", attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings,
        architectures=[arch], **hf_rope_keys(cfg), **_hf_attention(cfg, family), **special)


def _hf_attention(cfg: ModelConfig, family: str) -> dict:
    """The family's bias and sliding-window keys (a window applies to every layer)."""
    if family == "llama":
        return {"attention_bias": cfg.bias, "mlp_bias": cfg.bias}
    if family == "mistral":
        return {"sliding_window": cfg.sliding_window}
    window = {"use_sliding_window": bool(cfg.sliding_window), "sliding_window": cfg.sliding_window or None,
              "max_window_layers": 0}
    return {**window, "attention_bias": False} if family == "qwen3" else window


def model_config_from_hf(hf: dict, source: str = HF_CONFIG) -> ModelConfig:
    """ModelConfig equivalent to a transformers config.json dict (Llama or GPT-2), or ValueError."""
    kind = hf.get("model_type")
    if kind in MOE_DECODERS:  # (Mixtral, Qwen3-MoE: lmforge.interop.hf_moe)
        return model_config_from_moe(hf, source)
    if kind in HYBRID_DECODERS or kind in MULTIMODAL:  # (Qwen3-Next, Qwen3.5: lmforge.interop.hf_qwen3next)
        return model_config_from_qwen3next(hf, source)
    if kind in GEMMA_OLMO_DECODERS:  # (Gemma 3, OLMo 2 / 3: lmforge.interop.hf_gemma_olmo)
        return model_config_from_gemma_olmo(hf, source)
    if kind == DEEPSEEK:  # (lmforge.interop.hf_deepseek)
        return model_config_from_deepseek(hf, source)
    if kind in DECODERS:
        return _decoder_config(hf, source, kind)
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in _TANH_GELUS:
            raise ValueError(f"{source}: activation_function = {act!r}; lmforge's GPT-2 MLP computes the tanh "
                             f"GELU approximation ({', '.join(_TANH_GELUS)}).")
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise ValueError(f"{source}: non-standard attention scaling (scale_attn_by_inverse_layer_idx / "
                             f"scale_attn_weights) is not supported.")
        dim = hf["n_embd"]
        return ModelConfig(
            vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"], n_heads=hf["n_head"],
            ffn_hidden=hf.get("n_inner") or 4 * dim, max_seq_len=hf["n_positions"], pos_emb="learned",
            norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), activation="gelu", bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dropout=0.0)
    raise ValueError(f"{source}: model_type = {kind!r} is not supported; lmforge imports "
                     f"{', '.join(repr(k) for k in [*DECODERS, *MOE_DECODERS, *HYBRID_DECODERS, *GEMMA_OLMO_DECODERS, DEEPSEEK, 'gpt2'])}.")


def hf_model_config(hf_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a transformers folder: its config.json's (`model_config_from_hf`), with
    DeepSeek-V3's multi-token prediction depth limited to the MTP layers its weights hold (transformers
    writes num_nextn_predict_layers = 1 without them)."""
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    if hf.get("model_type") != DEEPSEEK:
        return model_config_from_hf(hf, str(hf_dir / HF_CONFIG))
    return model_config_from_deepseek(hf, str(hf_dir / HF_CONFIG), mtp_layers_present(hf, hf_weight_files(hf_dir)))


def _decoder_config(hf: dict, source: str, kind: str) -> ModelConfig:
    """ModelConfig of a Llama / Qwen2 / Qwen3 / Mistral config.json dict, or ValueError."""
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or dim // heads  # (Qwen3 0.6B-4B: heads x head_dim != hidden_size)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act = {hf['hidden_act']!r}; lmforge's SwiGLU uses 'silu'.")
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf["intermediate_size"],
        attn_head_dim=None if head_dim * heads == dim else head_dim,
        max_seq_len=hf.get("max_position_embeddings", 2048), pos_emb="rope", norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0, qk_norm=kind == "qwen3",
        sliding_window=_window_from_hf(hf, source, kind), **rope_from_hf(hf, source), **_biases_from_hf(hf, source, kind))


def _biases_from_hf(hf: dict, source: str, kind: str) -> dict:
    """model.bias / model.qkv_bias of the family: Qwen2 on q/k/v only; Mistral none; Llama and Qwen3
    by attention_bias (and mlp_bias), where lmforge's model.bias covers every linear layer."""
    if kind == "qwen2":
        return {"bias": False, "qkv_bias": True}
    attention, mlp = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if kind == "qwen3" and attention:
        raise ValueError(f"{source}: attention_bias = true (biases on q/k/v/o, none in the MLP) is not supported "
                         f"for Qwen3: lmforge's model.bias also covers the MLP.")
    if attention != mlp:
        raise ValueError(f"{source}: attention_bias and mlp_bias differ; lmforge has one model.bias for all "
                         f"linear layers (and model.qkv_bias for q/k/v alone).")
    return {"bias": attention}


def _window_from_hf(hf: dict, source: str, kind: str) -> int:
    """model.sliding_window: Mistral's sliding_window; Qwen's when use_sliding_window applies to every layer."""
    if kind == "mistral":
        return int(hf.get("sliding_window") or 0)
    if kind == "llama" or not hf.get("use_sliding_window"):
        return 0
    n, first = hf["num_hidden_layers"], hf.get("max_window_layers", 0)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if set(types) != {"sliding_attention"}:
        raise ValueError(f"{source}: a sliding window on some layers only (layer_types / max_window_layers = {first}) "
                         f"is not supported; lmforge's model.sliding_window applies to every layer.")
    return int(hf["sliding_window"])


# --------------------------------------------------------------------------------------------
# weight name mapping
# --------------------------------------------------------------------------------------------


def _decoder_names(cfg: ModelConfig) -> dict[str, str]:
    """lmforge parameter name -> transformers Llama / Qwen2 / Qwen3 / Mistral name (same tensors, no
    transposition)."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    parts = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
             "mlp.down": "mlp.down_proj"}
    if cfg.qk_norm:
        parts.update({"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"})
    for i in range(cfg.n_layers):
        for ours, theirs in parts.items():
            biased = cfg.attn_qkv_bias if ours in ("attn.wq", "attn.wk", "attn.wv") else cfg.bias and "norm" not in ours
            for kind in ("weight", "bias") if biased else ("weight",):
                names[f"blocks.{i}.{ours}.{kind}"] = f"model.layers.{i}.{theirs}.{kind}"
    return names


def _separate_qkv(cfg: ModelConfig, get: Callable[[str], torch.Tensor],
                  has: Callable[[str], bool]) -> tuple[Callable[[str], torch.Tensor], Callable[[str], bool]]:
    """`get` / `has` that also answer the separate `attn.wq/wk/wv` names of a fused model
    (model.fused_qkv), as rows of its `attn.wqkv` (exact copies: the export is bit-equal)."""
    if not cfg.fused_qkv:
        return get, has
    pattern = re.compile(r"(blocks\.\d+\.attn\.)(wq|wk|wv)\.(weight|bias)")

    def get_(name: str) -> torch.Tensor:
        m = pattern.fullmatch(name)
        if m is None:
            return get(name)
        fused = get(f"{m[1]}wqkv.{m[3]}")
        if fused.device.type == "meta":  # (shapes only)
            rows = {"wq": cfg.n_heads, "wk": cfg.kv_heads, "wv": cfg.kv_heads}[m[2]] * cfg.head_dim
            return fused.new_empty((rows, *fused.shape[1:]))
        return split_qkv(cfg, fused)[QKV_PARTS.index(m[2])]

    def has_(name: str) -> bool:
        m = pattern.fullmatch(name)
        return has(name) if m is None else has(f"{m[1]}wqkv.{m[3]}")

    return get_, has_


def _hf_tensors(cfg: ModelConfig, get: Callable[[str], torch.Tensor],
                has: Callable[[str], bool]) -> dict[str, Callable[[], torch.Tensor]]:
    """transformers name -> a function making that tensor from lmforge's (`get(name)`; `has(name)`:
    whether the model has it). Nothing is read until a function is called, so an export holds one
    output tensor at a time (called on meta tensors: the shapes and dtypes, for free)."""
    if cfg.mla.enabled:  # DeepSeek-V3 (lmforge.interop.hf_deepseek)
        return deepseek_tensors(cfg, get, has)
    get, has = _separate_qkv(cfg, get, has)
    if hf_family(cfg) != "gpt2":
        return {theirs: functools.partial(get, ours) for ours, theirs in _decoder_names(cfg).items()}

    def bias(name: str, shape_of: str) -> torch.Tensor:
        # lmforge without biases: zero biases give GPT-2 the same function
        if has(name):
            return get(name)
        like = get(shape_of)
        return torch.zeros(like.shape[0], dtype=like.dtype, device=like.device)

    def qkv(b: str, kind: str) -> torch.Tensor:
        names = [b + f"attn.{w}" for w in ("wq", "wk", "wv")]
        if kind == "weight":
            return torch.cat([get(n + ".weight") for n in names]).t()
        return torch.cat([bias(n + ".bias", n + ".weight") for n in names])

    part = functools.partial
    out = {"transformer.wte.weight": part(get, "tok_emb.weight"), "transformer.wpe.weight": part(get, "pos_emb.weight"),
           "transformer.ln_f.weight": part(get, "norm.weight"),
           "transformer.ln_f.bias": part(bias, "norm.bias", "norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = part(get, "lm_head.weight")
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[h + theirs + ".weight"] = part(get, b + ours + ".weight")
            out[h + theirs + ".bias"] = part(bias, b + ours + ".bias", b + ours + ".weight")
        out[h + "attn.c_attn.weight"] = part(qkv, b, "weight")
        out[h + "attn.c_attn.bias"] = part(qkv, b, "bias")
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[h + theirs + ".weight"] = lambda n=b + ours + ".weight": get(n).t()
            out[h + theirs + ".bias"] = part(bias, b + ours + ".bias", b + ours + ".weight")
    return out


@dataclass(frozen=True)
class FusedQKVRef:
    """A fused `attn.wqkv` weight or bias (model.fused_qkv) read from the separate q, k, v tensors of a
    checkpoint (`parts`: their refs), only the rows asked for (lmforge.model.layers.qkv_layout)."""

    cfg: ModelConfig
    parts: tuple

    def read(self, shape, index, name: str = "") -> torch.Tensor:
        return read_fused_qkv(self.cfg, lambda p, s, i: self.parts[p].read(s, i, name), shape, index)


@dataclass(frozen=True)
class SplitQKVRef:
    """One of q, k, v (`part`: 0, 1, 2) of a checkpoint that holds the fused `attn.wqkv` (`fused`: its
    ref), for a model with separate projections: reads only that projection's rows."""

    cfg: ModelConfig
    fused: object
    part: int

    def read(self, shape, index, name: str = "") -> torch.Tensor:
        layout_part, layout_row = qkv_layout(self.cfg)
        rows = (layout_part == self.part).nonzero().flatten()  # fused rows of this projection, by its row
        rows = rows[torch.argsort(layout_row[rows])]
        want = rows if index[0] is None else rows[index[0].to(torch.int64)]
        order = torch.argsort(want)
        full = (len(layout_part), *shape[1:])
        got = self.fused.read(full, (want[order], *index[1:]), name)
        return got[torch.argsort(order)]


def qkv_refs(cfg: ModelConfig, refs: dict) -> dict:
    """`refs` (lmforge name -> ref) with the q/k/v projections in `cfg`'s layout (model.fused_qkv),
    whichever layout the checkpoint holds: fused `attn.wqkv` refs made of separate wq/wk/wv ones or
    the reverse. Other names unchanged."""
    out = dict(refs)
    for fused, parts in list(qkv_conversions(cfg, refs)):
        if cfg.fused_qkv:
            out[fused] = FusedQKVRef(cfg, tuple(out.pop(p) for p in parts))
        else:
            ref = out.pop(fused)
            out.update({p: SplitQKVRef(cfg, ref, j) for j, p in enumerate(parts)})
    return out


def hf_weight_refs(cfg: ModelConfig, hf_dir: str | Path) -> dict[str, TensorRef]:
    """Where each lmforge weight of a `cfg` model lies in the transformers folder `hf_dir`
    (model.safetensors, a sharded index, or pytorch_model.bin memory-mapped): read slice by slice,
    a rank of a sharded run reads only its own parts (lmforge.ckpt.streaming.TensorRef). ValueError
    names a missing weight, or a stored one the model has no place for (hf_common.check_tensor_names)."""
    hf_dir = Path(hf_dir)
    where, used = hf_weight_files(hf_dir), set()

    def ref(key: str, transpose: bool = False, offset: tuple[int, ...] = ()) -> TensorRef | None:
        for k in (key, f"transformer.{key}"):
            if k in where:
                used.add(k)
                file, tensors = where[k]
                return TensorRef(file, k, transpose, offset, tensors)
        used.add(key)  # (missing: the check below names it, with how many more are)
        return None

    refs = _weight_refs(cfg, hf_dir, ref)
    # A tied model's folder may keep a copy of the embedding as lm_head.weight (transformers ties over it);
    # DeepSeek-V3's MTP layers keep their own copies of the embedding and head (lmforge shares the model's).
    optional = {"lm_head.weight"} if cfg.tie_embeddings else set()
    check_tensor_names(hf_dir, used, where, optional | set(mtp_copies(cfg)))
    return refs


def _weight_refs(cfg: ModelConfig, hf_dir: Path, ref: Callable[..., TensorRef]) -> dict[str, TensorRef]:
    """`hf_weight_refs` of a folder whose stored tensors `ref(key, transpose, offset)` finds."""
    if cfg.mla.enabled:  # DeepSeek-V3 (lmforge.interop.hf_deepseek), its expert_bias buffers included
        return deepseek_refs(cfg, ref, bool(read_hf_config(hf_dir).get("rope_interleave", True)))
    if hf_family(cfg) != "gpt2":
        return qkv_refs(cfg, {ours: ref(theirs) for ours, theirs in _decoder_names(cfg).items()})
    out = {"tok_emb.weight": ref("wte.weight"), "pos_emb.weight": ref("wpe.weight"),
           "norm.weight": ref("ln_f.weight"), "norm.bias": ref("ln_f.bias")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ref("lm_head.weight")
    d = cfg.dim
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[b + ours + ".weight"], out[b + ours + ".bias"] = ref(h + theirs + ".weight"), ref(h + theirs + ".bias")
        for j, name in enumerate(("wq", "wk", "wv")):  # c_attn (in, 3 out): q, k, v side by side, transposed
            out[b + f"attn.{name}.weight"] = ref(h + "attn.c_attn.weight", transpose=True, offset=(0, j * d))
            out[b + f"attn.{name}.bias"] = ref(h + "attn.c_attn.bias", offset=(j * d,))
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[b + ours + ".weight"], out[b + ours + ".bias"] = ref(h + theirs + ".weight", transpose=True), \
                ref(h + theirs + ".bias")
    return qkv_refs(cfg, out)


def write_hf_weights(cfg: ModelConfig, weights: WeightReader, path: Path) -> None:
    """model.safetensors of a transformers folder, written one tensor at a time from an lmforge weight
    reader (lmforge.ckpt.export): the peak is one output tensor (GPT-2's fused c_attn: three). A μP model's
    forward multipliers are folded into the weights (lmforge.interop.mup_fold): the folder is a standard model."""
    meta = lambda name: torch.empty(weights.shapes[name], dtype=weights.dtypes[name], device="meta")  # noqa: E731
    has = weights.shapes.__contains__
    specs = [(name, t.dtype, tuple(t.shape)) for name, make in _hf_tensors(cfg, meta, has).items() for t in [make()]]
    with safetensors_writer(path, specs, metadata={"format": "pt"}) as write:
        for name, make in _hf_tensors(cfg, folded_reader(cfg, weights.read), has).items():
            write(name, make().contiguous())


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


HF_FILES = (HF_CONFIG, "generation_config.json", WEIGHTS, TOKENIZER, TOKENIZER_CONFIG)


def export_hf(run_or_model: str | Path | Transformer, out_dir: str | Path, tokenizer=None,
              overwrite: bool = False, ema: bool = False, dtype: str | None = None) -> Path:
    """Write a transformers folder (config.json, generation_config.json, model.safetensors, and
    tokenizer.json + tokenizer_config.json when a tokenizer is known) for an lmforge run folder or
    model. `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained`
    then load it offline. `tokenizer`: an lmforge Tokenizer (default: the run's tokenizer.json).
    Existing files are replaced only with `overwrite`; a run folder is never written into. `ema`: the
    run's EMA of the weights (train.ema_decay: model.ema.safetensors) instead of its weights. `dtype`
    ('fp32' | 'bf16' | 'fp16'; None: as the run's model.safetensors holds them, its
    checkpoint.weights_dtype): the floating-point weights' dtype, recorded as config.json's `dtype`."""
    from lmforge.data.tokenizer import Tokenizer

    # every check before the first write: a refused export creates nothing (no empty --out folder)
    require_transformers("lmforge export")
    check_target(out_dir, "transformers", HF_FILES, "--out", overwrite)
    if isinstance(run_or_model, Transformer):
        cfg, weights = run_or_model.cfg, WeightReader.of_model(run_or_model)
    else:
        run_dir = Path(run_or_model)
        cfg, weights = run_weights(run_dir, ema=ema)
        if tokenizer is None and (run_dir / TOKENIZER).is_file():
            tokenizer = Tokenizer.load(run_dir / TOKENIZER)
    weights = weights.in_dtype(WEIGHT_DTYPES[dtype] if dtype else None)
    ids = {}
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size = {cfg.vocab_size}.")
        ids = {"eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "pad_id": tokenizer.pad_id}
    hybrid = is_hybrid(cfg) and not cfg.mla.enabled  # (Qwen3-Next / Qwen3.5: lmforge.interop.hf_qwen3next)
    # (Gemma 3, OLMo 2 / 3: lmforge.interop.hf_gemma_olmo)
    gemma_olmo = is_gemma_olmo(cfg) and not hybrid and not cfg.mla.enabled and not cfg.moe.enabled
    if hybrid:
        hf_cfg = qwen3next_hf_config(cfg, **ids)
    elif gemma_olmo:
        hf_cfg = gemma_olmo_hf_config(cfg, **ids)
    elif cfg.mla.enabled:  # (DeepSeek-V3: streamed as the dense models are)
        hf_cfg = deepseek_hf_config(cfg, **ids)
    else:
        hf_cfg = moe_hf_config(cfg, **ids) if cfg.moe.enabled else hf_config(cfg, **ids)
    hf_cfg.dtype = str(next(d for d in weights.dtypes.values() if d.is_floating_point)).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hybrid or gemma_olmo or (cfg.moe.enabled and not cfg.mla.enabled):  # (whole, through transformers)
        save = save_qwen3next if hybrid else save_gemma_olmo if gemma_olmo else save_moe
        save(cfg, hf_cfg, {name: weights.read(name) for name in weights.shapes}, out)
    else:
        hf_cfg.save_pretrained(out)
        write_hf_weights(cfg, weights, out / WEIGHTS)
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out, cfg.max_seq_len)
    return out


def save_hf_tokenizer(tokenizer, out_dir: Path, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json loadable by `PreTrainedTokenizerFast`/`AutoTokenizer`."""
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend
    name = backend.id_to_token
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=name(tokenizer.eos_id),
        bos_token=name(tokenizer.bos_id) if tokenizer.bos_id is not None else None,
        pad_token=name(tokenizer.pad_id) if tokenizer.pad_id is not None else None, model_max_length=max_len)
    fast.save_pretrained(str(out_dir))


# --------------------------------------------------------------------------------------------
# import
# --------------------------------------------------------------------------------------------


def import_hf(hf_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A local transformers folder (Llama, Qwen2, Qwen3, Mistral, GPT-2; Mixtral, Qwen3-MoE, Qwen3-Next, Qwen3.5,
    Gemma 3, OLMo 2 / 3 read whole through transformers) -> (ModelConfig, lmforge Transformer in eval mode),
    built on the meta device and filled one weight at a time."""
    hf_dir = Path(hf_dir)
    whole = _whole_importer(hf_dir)
    if whole is not None:
        return whole(hf_dir, device)
    cfg = hf_model_config(hf_dir)
    refs = hf_weight_refs(cfg, hf_dir)

    def values(name, module, module_name, param_name, shape, index, dtype):
        if name not in refs:
            raise ValueError(f"{hf_dir}: no weights for {name}.")
        return refs[name].read(shape, index, name).to(dtype)

    with torch.device("meta"):
        model = Transformer(cfg)
    materialise(model, device, values)
    with torch.no_grad():
        for name, buf in model.named_buffers():  # (persistent buffers a folder holds: DeepSeek-V3's expert bias)
            if name in refs:
                buf.copy_(refs[name].read(tuple(buf.shape), (None,) * buf.dim(), name))
    model.eval()
    return cfg, model


def _whole_importer(hf_dir: Path):
    """The import of a family read whole through transformers (lmforge.interop.hf_moe / hf_qwen3next) for
    the folder's model_type, or None for the streamed ones."""
    kind = read_hf_config(hf_dir).get("model_type")
    whole = {**dict.fromkeys(MOE_DECODERS, import_moe), **dict.fromkeys(HYBRID_DECODERS, import_qwen3next),
             **dict.fromkeys(GEMMA_OLMO_DECODERS, import_gemma_olmo)}
    return whole.get(kind)


def import_hf_tokenizer(hf_dir: Path):
    """The lmforge Tokenizer of a transformers folder (tokenizer.json, with the eos/bos/pad tokens of
    its tokenizer_config.json, or GPT-2 vocab/merges files), or None when the folder has none."""
    from lmforge.data.tokenizer import find_gpt2_files, load_gpt2_files, Tokenizer

    if (hf_dir / TOKENIZER).is_file():
        return Tokenizer.load(hf_dir / TOKENIZER)  # (reads the tokenizer_config.json beside it)
    files = find_gpt2_files(hf_dir)
    return load_gpt2_files(*files) if files else None


def special_tokens_config(tokenizer) -> str:
    """tokenizer_config.json text naming `tokenizer`'s eos/bos/pad tokens, kept beside an imported
    run's tokenizer.json so every later load (prepare, train, export) has the model's own ids."""
    name = tokenizer.backend.id_to_token
    ids = {"eos_token": tokenizer.eos_id, "bos_token": tokenizer.bos_id, "pad_token": tokenizer.pad_id}
    return json.dumps({key: name(i) for key, i in ids.items() if i is not None}, indent=2) + "\n"


def import_hf_run(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write an lmforge run folder (config.toml, model.safetensors, tokenizer.json if the source
    has a tokenizer) from a transformers folder, usable by `lmforge generate/eval` and fine-tuning.
    Existing files are replaced only with `overwrite`; a transformers folder is never written into."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    check_target(out, "run", RUN_FILES + (TOKENIZER_CONFIG,), "--out", overwrite)
    cfg = hf_model_config(hf_dir)
    whole = _whole_importer(hf_dir)
    if whole is not None:  # (Mixtral / Qwen3-MoE / Qwen3-Next / Qwen3.5: read whole by transformers; buffers too)
        state = model_state(whole(hf_dir)[1])
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in state.items()]
        read = lambda name, shape: state[name]  # noqa: E731
    else:
        refs = hf_weight_refs(cfg, hf_dir)
        with torch.device("meta"):
            meta = Transformer(cfg)
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in [*meta.named_parameters(), *meta.named_buffers()]
                 if name in refs]  # (persistent buffers the folder holds too: DeepSeek-V3's expert bias)
        read = lambda name, shape: refs[name].read(shape, (None,) * len(shape), name)  # noqa: E731
    tokenizer = import_hf_tokenizer(hf_dir)  # read everything before the first write
    out.mkdir(parents=True, exist_ok=True)
    run_cfg = Config(preset="imported", description=f"imported from {hf_dir}", model=cfg)
    # data.tokenizer names the run's own tokenizer file ("none" when the source had none), so the
    # BPE-training checks of the config do not apply to an imported vocabulary
    run_cfg.data = replace(run_cfg.data, seq_len=min(run_cfg.data.seq_len, cfg.max_seq_len),
                           tokenizer=str((out / TOKENIZER).resolve()) if tokenizer else "none")
    if tokenizer is not None:
        tokenizer.save(out / TOKENIZER)  # atomic: Tokenizer.save writes through folders.atomic_write
        atomic_write(out / TOKENIZER_CONFIG, special_tokens_config(tokenizer))
    # Only what the import knows: the model and its data settings. The training keys stay
    # defaults rather than choices, so a fine-tuning run from this file adapts them to its layout
    # as it would a preset's (a file's own keys are never adapted).
    atomic_write(out / CONFIG, to_toml(run_cfg.validate(), sections=("model", "data")))
    with save_streaming(out / WEIGHTS, specs) as write:  # one tensor at a time, in fp32
        for name, dtype, shape in specs:
            write(name, read(name, shape).to(dtype))
    return out
