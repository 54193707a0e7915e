"""Config-level pieces shared by the dense (lmforge.interop.hf) and MoE (lmforge.interop.hf_moe)
transformers interop: RoPE keys both ways, and reading a folder's config.json."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.config import ModelConfig
from lmforge.folders import HF_CONFIG


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
