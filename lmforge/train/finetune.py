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

from lmforge.config import ModelConfig
from lmforge.folders import CONFIG, HF_CONFIG, WEIGHTS, describe_kind, folder_kind
from lmforge.model.transformer import Transformer

# fields that do not change the weights' shapes or the function (training-time or init-only settings)
_IRRELEVANT = {"dropout", "init_std", "ffn_multiple_of", "ffn_hidden", "n_kv_heads"}


def architecture_differences(want: ModelConfig, have: ModelConfig) -> list[str]:
    """`model.key: fine-tune value vs checkpoint value` for every difference that matters.
    max_seq_len may differ for RoPE models (no weights depend on it), not for learned positions."""
    diffs = []
    for f in fields(ModelConfig):
        if f.name in _IRRELEVANT or (f.name == "max_seq_len" and want.pos_emb == have.pos_emb == "rope"):
            continue
        a, b = getattr(want, f.name), getattr(have, f.name)
        if a != b:
            diffs.append(f"model.{f.name}: {a!r} vs {b!r}")
    for name in ("kv_heads", "ffn_dim"):  # derived: compare the resolved values
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
        import json

        from lmforge.interop.hf import model_config_from_hf

        return model_config_from_hf(json.loads((path / HF_CONFIG).read_text()), str(path / HF_CONFIG))
    return None


@torch.no_grad()
def load_pretrained(model: Transformer, init_from: str | Path) -> ModelConfig | None:
    """Copy pre-trained weights into `model` (in place) from `init_from`: an lmforge run folder
    (config.toml + model.safetensors), a transformers folder (config.json + weights), or a bare
    .safetensors file in lmforge's layout. Returns the checkpoint's ModelConfig (None for a bare
    file). ValueError names the checkpoint and every mismatching config key."""
    path = Path(init_from).expanduser()
    if not path.exists():
        raise ValueError(f"init_from = {str(path)!r} does not exist; give an lmforge run folder, a transformers "
                         f"folder or a model.safetensors file.")
    from lmforge.ckpt.export import load_weights

    if path.is_file():
        try:
            load_weights(model, path)
        except RuntimeError as exc:  # shape mismatches from load_state_dict
            raise ValueError(f"{path}: weights do not fit the model config ({str(exc).splitlines()[-1].strip()}).") \
                from exc
        return None
    have = checkpoint_model_config(path)
    if have is None:
        raise ValueError(f"{path} is neither {describe_kind('run')} nor {describe_kind('transformers')}.")
    diffs = architecture_differences(model.cfg, have)
    if diffs:
        raise ValueError(f"{path}: the checkpoint's architecture differs from this config's (fine-tune vs "
                         f"checkpoint): {'; '.join(diffs)}. Set these model.* keys to the checkpoint's values.")
    if folder_kind(path) == "run":
        load_weights(model, path / WEIGHTS)
    else:
        from lmforge.interop.hf import load_hf_weights

        load_hf_weights(model, path)
    return have
