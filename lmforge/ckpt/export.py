"""Weights to and from safetensors (no pickle: loading a file never executes code)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmforge.config import Config, load_config
from lmforge.folders import CONFIG, WEIGHTS, atomic_path
from lmforge.model.transformer import Transformer, build_model


def _unwrap_name(name: str) -> str:
    # activation-checkpoint / compile wrappers insert these prefixes into parameter names
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def model_state(model: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain state dict (of a module, or a given full state dict) with wrapper prefixes removed
    and tied weights stored once."""
    state, seen = {}, set()
    items = model.items() if isinstance(model, dict) else model.state_dict().items()
    for name, tensor in items:
        key = _unwrap_name(name)
        if tensor.untyped_storage().data_ptr() in seen and key == "lm_head.weight":
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        state[key] = tensor.detach().to("cpu").contiguous()
    return state


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Atomically write the model's weights as safetensors (temp file, fsync, rename)."""
    save_state(model, path)


def save_state(model: torch.nn.Module | dict[str, torch.Tensor], path: Path) -> None:
    """Atomically write a module's weights, or a full state dict, as safetensors."""
    with atomic_path(path) as tmp:
        save_file(model_state(model), str(tmp), metadata={"format": "lmforge"})


def load_weights(model: Transformer, path: Path) -> None:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"weights file {str(path)!r} does not exist.")
    state = load_file(str(path))
    if model.cfg.tie_embeddings:
        state.setdefault("lm_head.weight", state["tok_emb.weight"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rope_")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the model config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}).")
    model.tie_weights()


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[Config, Transformer]:
    """Load a finished run folder (config.toml + model.safetensors) for evaluation or generation."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / CONFIG
    if not cfg_path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not an lmforge run folder: {cfg_path.name} is missing.")
    cfg = load_config(str(cfg_path))
    model = build_model(cfg.model, device)
    load_weights(model, run_dir / WEIGHTS)
    model.eval()
    return cfg, model
