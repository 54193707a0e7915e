"""μP's forward multipliers folded into the weights for export (lmforge.model.mup), so that a
standard transformers model (attention scaled by 1/sqrt(head_dim), plain logits) computes what the
μP model computes.

* The attention factor sqrt(base head_dim / head_dim) multiplies q: it goes into the q rows of the
  projection (``wq``, or q's rows of the fused ``wqkv``; weight and bias), or, with QK-norm, into the
  q-norm's gain (the norm would undo a scale of its input).
* The logits multiplier 1/m multiplies the final norm's output, which feeds only the head: it goes
  into that norm's gain (and bias), so a tied embedding stays tied.

Every other weight, and every weight of an SP model, is returned as it is.
"""

from __future__ import annotations

import torch

from lmforge.config import ModelConfig
from lmforge.model import mup
from lmforge.model.layers import qkv_layout


def fold_multipliers(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Weight `name` (unwrapped lmforge name) with μP's forward multipliers folded in."""
    if not mup.enabled(cfg):
        return tensor
    if name in ("norm.weight", "norm.bias"):
        return tensor * mup.output_multiplier(cfg)
    a = mup.attention_factor(cfg)
    if a == 1.0:
        return tensor
    if cfg.qk_norm:
        return tensor * a if name.endswith("attn.q_norm.weight") else tensor
    if name.endswith(("attn.wq.weight", "attn.wq.bias")):
        return tensor * a
    if name.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
        part, _ = qkv_layout(cfg)
        scale = torch.where(part == 0, a, 1.0).to(tensor.dtype)
        return tensor * scale.view(-1, *([1] * (tensor.ndim - 1)))
    return tensor


def folded_reader(cfg: ModelConfig, read):
    """`read(name)` (a WeightReader's) returning the folded weights."""
    if not mup.enabled(cfg):
        return read
    return lambda name: fold_multipliers(cfg, name, read(name))
