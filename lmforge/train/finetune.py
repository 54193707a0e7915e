"""Starting a fine-tune from pre-trained weights: an lmforge run folder, a safetensors file, or a
Hugging Face transformers folder (Llama / GPT-2, through `lmforge.interop.hf`).

The model is built from the fine-tuning config first; `load_pretrained` then checks that the
checkpoint describes the same architecture and copies its weights. Call it *before*
`apply_lora` (adapters are added on top of the loaded weights).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch
from safetensors import safe_open

from lmforge.ckpt.streaming import TensorRef
from lmforge.config import ModelConfig
from lmforge.folders import CONFIG, WEIGHTS, describe_kind, folder_kind
from lmforge.model.lora import is_adapter
from lmforge.model.materialise import Source
from lmforge.model.transformer import Transformer

# fields that do not change the weights' shapes or the function (training-time or init-only settings)
_IRRELEVANT = {"dropout", "init_std", "ffn_multiple_of", "ffn_hidden", "n_kv_heads",
               "fused_qkv"}  # (the q/k/v layout: weight_refs reads either into either)


def architecture_differences(want: ModelConfig, have: ModelConfig) -> list[str]:
    """`model.key: fine-tune value vs checkpoint value` for every difference that matters.
    max_seq_len may differ for RoPE models (no weights depend on it), not for learned positions."""
    diffs = []
    for f in fields(ModelConfig):
        if f.name in _IRRELEVANT or f.name == "qkv_bias" or (f.name == "max_seq_len" and want.pos_emb == have.pos_emb == "rope"):
            continue
        a, b = getattr(want, f.name), getattr(have, f.name)
        if a != b:
            diffs.append(f"model.{f.name}: {a!r} vs {b!r}")
    for name in ("kv_heads", "ffn_dim", "attn_qkv_bias"):  # derived: compare the resolved values
        a, b = getattr(want, name), getattr(have, name)
        if a != b:
            diffs.append(f"model.{name}: {a!r} vs {b!r}")
    return diffs


def checkpoint_model_config(path: str | Path) -> ModelConfig | None:
    """The ModelConfig of an lmforge run folder or a transformers folder (None for anything else)."""
    path = Path(path)
    kind = folder_kind(path)
    if kind == "run":
        from lmforge.config import load_config

        return load_config(str(path / CONFIG)).model
    if kind == "transformers":
        from lmforge.interop.hf import hf_model_config

        return hf_model_config(path)
    return None


def _checked(init_from: str | Path, want: ModelConfig | None) -> tuple[Path, ModelConfig | None]:
    """`init_from` as a Path and its ModelConfig (None for a bare file), after the checks: it exists,
    is a known kind, and (given `want`) describes the same architecture. ValueError names the
    checkpoint and every mismatching config key."""
    path = Path(init_from).expanduser()
    if not path.exists():
        raise ValueError(f"init_from = {str(path)!r} does not exist; give an lmforge run folder, a transformers "
                         f"folder or a model.safetensors file.")
    if path.is_file():
        return path, None
    have = checkpoint_model_config(path)
    if have is None:
        raise ValueError(f"{path} is neither {describe_kind('run')} nor {describe_kind('transformers')}.")
    diffs = architecture_differences(want, have) if want is not None else []
    if diffs:
        raise ValueError(f"{path}: the checkpoint's architecture differs from this config's (fine-tune vs "
                         f"checkpoint): {'; '.join(diffs)}. Set these model.* keys to the checkpoint's values.")
    return path, have


def weight_refs(path: Path, cfg: ModelConfig) -> dict[str, TensorRef]:
    """Where each lmforge weight of a `cfg` model lies in the checkpoint at `path` (checked by
    `_checked`): lmforge's own file (a run folder's model.safetensors, or a bare file) or a
    transformers folder (lmforge.interop.hf)."""
    if path.is_file() or folder_kind(path) == "run":
        file = path if path.is_file() else path / WEIGHTS
        if not file.is_file():
            raise ValueError(f"{path}: no {WEIGHTS}; finish the run (or `lmforge import` the model) first.")
        refs = {}
        with safe_open(str(file), "pt") as f:
            keys = set(f.keys())
        for name in keys:
            refs[name] = TensorRef(file, name)
        if cfg.tie_embeddings:
            refs.pop("lm_head.weight", None)  # (the head is the embedding)
        from lmforge.interop.hf import qkv_refs

        return qkv_refs(cfg, refs)  # (a run saved with the other model.fused_qkv layout)
    from lmforge.interop.hf import hf_weight_refs

    return hf_weight_refs(cfg, path)


def pretrained_source(cfg: ModelConfig, init_from: str | Path, fallback: Source) -> Source:
    """A `lmforge.model.materialise` source for a `cfg` model from the pre-trained weights at
    `init_from` (an lmforge run folder, a transformers folder or a bare .safetensors file): each
    rank reads only the slices of its own shards. LoRA adapters, which no checkpoint holds, come
    from `fallback` (the initialisation). Checks run at once: a missing or mismatching checkpoint
    is a ValueError before any rank allocates anything."""
    path, _ = _checked(init_from, cfg)
    refs = weight_refs(path, cfg)

    def values(name: str, module, module_name: str, param_name: str, shape, index, dtype) -> torch.Tensor:
        if is_adapter(name):
            return fallback(name, module, module_name, param_name, shape, index, dtype)
        if name not in refs:
            raise ValueError(f"{init_from}: no weights for {name}; they do not match the model config.")
        return refs[name].read(shape, index, name).to(dtype)

    return values


@torch.no_grad()
def load_pretrained(model: Transformer, init_from: str | Path) -> ModelConfig | None:
    """Copy pre-trained weights into a materialised `model` (in place) from `init_from`: an lmforge run
    folder (config.toml + model.safetensors), a transformers folder (config.json + weights), or a
    bare .safetensors file in lmforge's layout. Returns the checkpoint's ModelConfig (None for a
    bare file). ValueError names the checkpoint and every mismatching config key. (Training builds
    its model on the meta device and reads its shards through `pretrained_source` instead.)"""
    path, have = _checked(init_from, model.cfg)
    refs = weight_refs(path, model.cfg)
    params = dict(model.named_parameters())
    missing = [name for name in params if name not in refs]
    if missing:
        raise ValueError(f"{path}: no weights for {missing[:5]}; they do not match the model config.")
    for name, p in params.items():
        p.copy_(refs[name].read(p.shape, (None,) * p.ndim, name).to(p.dtype))
    return have
