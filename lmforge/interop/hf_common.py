"""Pieces shared by the dense (lmforge.interop.hf), MoE (lmforge.interop.hf_moe) and DeepSeek-V3
(lmforge.interop.hf_deepseek) transformers interop: RoPE keys both ways, reading a folder's config.json,
the names of the tensors its weights hold, and the one check that they are exactly the model's."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.folders import HF_CONFIG, WEIGHTS


def hf_rope_keys(cfg: ModelConfig) -> dict:
    """rope_theta and rope_scaling keys (transformers 4.x names; 5.x folds them into rope_parameters)."""
    out: dict = {"rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    elif cfg.rope_scaling == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_seq_len,
                               "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                               **({"mscale": cfg.rope_mscale} if cfg.rope_mscale else {}),
                               **({"mscale_all_dim": cfg.rope_mscale_all_dim} if cfg.rope_mscale_all_dim else {})}
    return out


def check_no_new_attention(cfg: ModelConfig, arch: str) -> None:
    """ValueError when `cfg` has an attention option `arch` (a transformers class lmforge exports) has
    no place for: the Gated DeltaNet blocks, gate and partial RoPE of Qwen3-Next (model.layer_types,
    model.attn_gate, model.rope_fraction) would otherwise be dropped from the export without a word.
    (`lmforge export` writes such models as Qwen3-Next / Qwen3.5: lmforge.interop.hf_qwen3next.)"""
    if cfg.has_linear_layers:
        raise ValueError(f"model.layer_types / full_attention_interval make Gated DeltaNet blocks, which {arch} "
                         f"cannot represent; export them as Qwen3-Next / Qwen3.5 (`lmforge export` does).")
    for key, value, plain in (("attn_gate", cfg.attn_gate, False), ("rope_fraction", cfg.rope_fraction, 1.0),
                              ("moe.shared_gate", cfg.moe.shared_gate, False)):
        if value != plain:
            raise ValueError(f"model.{key} = {value} cannot be represented by {arch}; set model.{key} = {plain}, or "
                             f"export as Qwen3-Next / Qwen3.5 (`lmforge export` does).")
    check_plain_blocks(cfg, arch)


def gemma_olmo_options(cfg: ModelConfig) -> list[tuple[str, object, object]]:
    """(key, value, the plain block's value) of every block option of Gemma 3 / OLMo 2 / OLMo 3 that `cfg`
    sets (besides model.layer_types' sliding blocks, `ModelConfig.has_local_layers`): what
    `check_plain_blocks` refuses and what makes `lmforge export` write one of those families
    (lmforge.interop.hf_gemma_olmo.is_gemma_olmo)."""
    options = (("norm_placement", cfg.norm_placement, "pre"), ("embed_scale", cfg.embed_scale, False),
               ("qk_norm_scope", cfg.qk_norm_scope, "head"), ("attn_scale_dim", cfg.attn_scale_dim, None),
               ("activation", cfg.activation, "swiglu" if cfg.activation == "geglu" else cfg.activation))
    return [(key, value, plain) for key, value, plain in options if value != plain]


def check_plain_blocks(cfg: ModelConfig, arch: str) -> None:
    """ValueError when `cfg` has a block option of Gemma 3 / OLMo 2 / OLMo 3 that `arch` has no place for
    (lmforge.interop.hf_gemma_olmo writes those: `lmforge export` goes there for them)."""
    if cfg.has_local_layers:
        raise ValueError(f"model.layer_types' 'sliding_attention' blocks (interleaved local / global attention) cannot "
                         f"be represented by {arch}; export as Gemma 3 / OLMo 3 (`lmforge export` does).")
    found = gemma_olmo_options(cfg)
    if found:
        key, value, plain = found[0]
        raise ValueError(f"model.{key} = {value!r} cannot be represented by {arch}; set model.{key} = {plain!r}, "
                         f"or export as Gemma 3 / OLMo 2 / OLMo 3 (`lmforge export` does).")


def rope_from_hf(hf: dict, source: str) -> dict:
    """ModelConfig RoPE keys of rope_parameters (transformers 5) or rope_theta + rope_scaling (4.x)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return out
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported by lmforge; it has the default, "
                         f"'linear', 'llama3' and 'yarn' RoPE (model.rope_scaling).")
    if float(rope.get("attention_factor") or 1.0) != 1.0:
        raise ValueError(f"{source}: rope attention_factor = {rope['attention_factor']} is not supported (lmforge "
                         f"scales the RoPE tables by YaRN's own factor only, from factor / mscale / mscale_all_dim).")
    out.update(rope_scaling=rope_type, rope_factor=float(rope["factor"]))
    if rope_type == "yarn":
        if rope.get("truncate", True) is False:
            raise ValueError(f"{source}: yarn truncate = false is not supported (lmforge rounds the ramp's ends).")
        out.update(rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
                   rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                   rope_mscale=float(rope.get("mscale") or 0), rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0))
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    return out


def read_hf_config(hf_dir: Path) -> dict:
    cfg_path = hf_dir / HF_CONFIG
    if not cfg_path.is_file():
        raise ValueError(f"{hf_dir} is not a transformers model folder: {cfg_path.name} is missing.")
    try:
        return json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{cfg_path}: invalid JSON ({exc})") from exc


def hf_weight_files(hf_dir: Path) -> dict[str, tuple[Path, dict | None]]:
    """Stored tensor name -> (its file, the memory-mapped tensors of a pytorch_model.bin or None)."""
    from safetensors import SafetensorError, safe_open

    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / WEIGHTS).is_file():
        files = [hf_dir / WEIGHTS]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc}); save the model again.") from None
        return {key: (hf_dir / name, None) for key, name in weight_map.items()}
    elif (hf_dir / "pytorch_model.bin").is_file():  # (loaded with weights_only=True: no code runs; mmap: no copy)
        path = hf_dir / "pytorch_model.bin"
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return {key: (path, tensors) for key in tensors}
    else:
        raise ValueError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
                         f"save the model with `save_pretrained` first.")
    where = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                where.update({key: (file, None) for key in f.keys()})
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{file} is not a complete safetensors file ({exc}): it was truncated or is "
                             f"corrupt. Fix: copy or write it again from its source.") from None
    return where


# Tensors a folder may hold that no model has as a weight: derived buffers that older transformers
# versions saved (GPT-2's causal-mask `attn.bias` / `attn.masked_bias`, Llama's `rotary_emb.inv_freq`).
# transformers recomputes them on load, and so does lmforge.
_DERIVED_BUFFERS = re.compile(r"(^|\.)(h\.\d+\.attn\.(bias|masked_bias)|rotary_emb\.inv_freq)$")


def _natural(name: str) -> list:
    """Sort key putting model.layers.2 before model.layers.10 (the first missing tensor named is the first layer's)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def check_tensor_names(hf_dir: Path, expected: Iterable[str], stored: Iterable[str],
                       optional: Iterable[str] = ()) -> None:
    """ValueError, one line naming the first tensor, unless the folder's `stored` tensor names are
    exactly the `expected` ones (plus any of `optional`, and derived buffers). Every family's import
    calls it before it builds anything, from the names in the safetensors headers or index: a missing
    tensor would otherwise be left at a random initialisation, an unexpected one silently dropped."""
    expected, stored = set(expected), set(stored)
    missing = sorted(expected - stored, key=_natural)
    extra = sorted((n for n in stored - expected - set(optional) if not _DERIVED_BUFFERS.search(n)), key=_natural)
    more = lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else ""  # noqa: E731
    if missing:
        raise ValueError(f"{hf_dir}: weight {missing[0]!r} is missing{more(missing)}; the weights do not match "
                         f"config.json (layers, experts, biases or tied embeddings). Fix: save the model again "
                         f"with all its weights, or correct config.json.")
    if extra:
        raise ValueError(f"{hf_dir}: weight {extra[0]!r} is not part of the model config.json describes{more(extra)}; "
                         f"the weights do not match config.json (layers, experts, biases or tied embeddings). Fix: "
                         f"save the model again, or correct config.json.")


def model_from_state_dict(cfg, weights: dict, device):
    """The lmforge model of `cfg`, built on the meta device and materialised on `device` from a whole
    lmforge-named state dict (the import paths that convert through transformers' own model)."""
    import torch

    from lmforge.model.materialise import materialise
    from lmforge.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)

    def source(name, module, module_name, own, shape, index, dtype):
        t = weights[name]
        for d, keep in enumerate(index):
            if keep is not None:
                t = t.index_select(d, keep)
        return t.to(dtype)

    return materialise(model, device, source).eval()



def save_through_transformers(cfg, hf_cfg, weights: dict, to_hf, out_dir: Path) -> None:
    """Write lmforge `weights` as a transformers folder of `hf_cfg` through transformers' own model and
    `save_pretrained` (the families converted whole): `to_hf` maps the fp32 lmforge weights to the
    transformers model's state dict (its norms' weight - 1 taken in fp32), stored in the weights' dtype."""
    import transformers

    state = to_hf({name: t.float() for name, t in weights.items()})
    dtype = next((t.dtype for t in weights.values() if t.dtype.is_floating_point), torch.float32)
    with torch.device("meta"):
        hf_model = getattr(transformers, hf_cfg.architectures[0])(hf_cfg)
    hf_model.load_state_dict({name: t.to(dtype) for name, t in state.items()}, strict=True, assign=True)
    if cfg.tie_embeddings:
        hf_model.tie_weights()
    hf_model.save_pretrained(str(out_dir))
