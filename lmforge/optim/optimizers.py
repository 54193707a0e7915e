"""Parameter grouping, the optimizer factory, and optimizer-state accounting.

`build_optimizer(cfg.optim, model)` looks the name up in `lmforge.spec.optimizers` and calls that
optimizer's builder. Torch's own optimizers are used where they exist (SGD, Adam, AdamW,
Adafactor); Lion, LAMB, Muon and Adam8bit are hand-written in their own modules (see each module
for why), each with its `build(model, cfg, extra)`.

Param groups carry the parameter names under `"param_names"`, the key torch itself uses for
named parameters (torch keeps it, and any other extra key such as `"group"` or `"use_muon"`,
in `optimizer.param_groups` and in `state_dict()`). A μP model (model.parametrization = "mup") gets
its per-class learning-rate multipliers as groups of their own (`mup_groups`, lmforge.model.mup).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model import mup
from lmforge.spec import optimizers as registry
from lmforge.spec.optimizers import OPTIMIZER_NAMES

__all__ = ["OPTIMIZER_NAMES", "build_optimizer", "describe_groups", "measured_state_bytes",
           "measured_state_bytes_by_param", "mup_groups", "param_groups", "schedule_lr"]


def embedding_ids(model: nn.Module) -> set[int]:
    """ids of the weight tensors of every nn.Embedding / nn.EmbeddingBag (tied heads included)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def param_groups(
    model: nn.Module, weight_decay: float, decay_embeddings: bool = False
) -> list[dict[str, Any]]:
    """Split trainable parameters into a decay group and a no-decay group (always both, maybe empty).

    decay:    parameters with ndim >= 2 that are not embedding weights (Linear/conv weights).
    no_decay: parameters with ndim < 2 (biases, norm weights) and nn.Embedding weights, the
              latter moved to decay when `decay_embeddings=True`.
    A tied parameter (e.g. lm_head.weight is tok_emb.weight) appears once, under its first name;
    being an embedding weight is decided by tensor identity, so a tied head is an embedding.
    Frozen parameters (requires_grad=False) are left out.

    Each group: {"params", "param_names", "weight_decay", "group": "decay" | "no_decay"}.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0")
    embeddings = embedding_ids(model)
    decay: dict[str, list] = {"params": [], "param_names": []}
    no_decay: dict[str, list] = {"params": [], "param_names": []}
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad:
            continue
        is_embedding = id(p) in embeddings
        wants_decay = p.ndim >= 2 and (not is_embedding or decay_embeddings)
        target = decay if wants_decay else no_decay
        target["params"].append(p)
        target["param_names"].append(name)
    return [
        {**decay, "weight_decay": weight_decay, "group": "decay"},
        {**no_decay, "weight_decay": 0.0, "group": "no_decay"},
    ]


def model_config_of(model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of the lmforge Transformer inside `model` (itself, or wrapped: DDP, compile,
    activation checkpointing), None for another module."""
    return next((m.cfg for m in model.modules() if isinstance(getattr(m, "cfg", None), ModelConfig)), None)


def mup_groups(model: nn.Module, groups: list[dict[str, Any]], lr: float, rule: str | None) -> list[dict[str, Any]]:
    """`groups` with μP's learning-rate multipliers (lmforge.model.mup) when `model`'s config says
    model.parametrization = "mup"; unchanged under SP (or for a module that is not an lmforge model).

    Each group is split by its parameters' μP class: the part whose multiplier is the vector-like
    one keeps the group's name, the hidden matrices go to "<name>.hidden", a readout (MoE router) to
    "<name>.readout" (and an lm_head whose multiplier differs: "<name>.output"); empty parts are left
    out. A part's ``lr`` is the group's (else `lr`) x its multiplier, recorded as ``lr_mult``; schedules
    multiply each group's lr, so they keep the ratios, and ZeRO-1's rebuild and tensor parallelism's
    split copy the group keys. With decoupled weight decay (rules "adamw", "muon") ``weight_decay`` is
    divided by the multiplier: lr x weight_decay per step as at the base width. `rule`: the registry's
    `mup_rule` ("muon": Muon's orthogonalised groups by the "muon" column, its AdamW groups by "adamw")."""
    cfg = model_config_of(model)
    if cfg is None or not mup.enabled(cfg):
        return groups
    if rule is None:
        raise ValueError("model.parametrization = 'mup' has no learning-rate rule for this optimizer "
                         "(lmforge.spec.optimizers's mup_rule); use sgd, momentum, adam, adamw, adam8bit, lion or muon.")
    out = []
    for g in groups:
        own = ("muon" if g.get("use_muon") else "adamw") if rule == "muon" else rule
        vector = mup.lr_multiplier(cfg, "vector", own)
        parts: dict[str, dict[str, Any]] = {}
        for name, p in zip(g["param_names"], g["params"], strict=True):
            kind = mup.param_kind(name, p.ndim)
            mult = mup.lr_multiplier(cfg, kind, own)
            key = kind if kind in ("hidden", "readout") or mult != vector else ""
            part = parts.setdefault(key, {"params": [], "param_names": [], "lr_mult": mult})
            part["params"].append(p)
            part["param_names"].append(name)
        if not parts:
            out.append(g)
        for key in sorted(parts, key=("", "hidden", "readout", "output").index):
            part = parts[key]
            mult = part["lr_mult"]
            decay = g.get("weight_decay", 0.0)
            out.append({**g, **part, "group": f"{g['group']}.{key}" if key else g["group"], "lr": g.get("lr", lr) * mult,
                        "weight_decay": decay / mult if own in mup.DECOUPLED_DECAY else decay})
    return out


def schedule_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the schedule is at (optim.lr x its factor): group 0's lr without its μP
    multiplier (``lr_mult``, lmforge.optim.optimizers.mup_groups)."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_mult", 1.0)


def describe_groups(groups: list[dict[str, Any]] | torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per group: label, tensor count, element count, weight decay and lr (if set), for logging."""
    if isinstance(groups, torch.optim.Optimizer):
        groups = groups.param_groups
    rows = []
    for i, g in enumerate(groups):
        row = {
            "group": g.get("group", str(i)),
            "tensors": len(g["params"]),
            "params": sum(p.numel() for p in g["params"]),
            "weight_decay": g.get("weight_decay"),
        }
        if "lr" in g:
            row["lr"] = g["lr"]
        rows.append(row)
    return rows


def fused_devices() -> frozenset[str]:
    """Device types for which this torch build has fused SGD/Adam/AdamW kernels (CUDA, and the
    CPU since torch 2.4)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return frozenset(_get_fused_kernels_supported_devices())
    except ImportError:  # (a private helper: if it moves, fall back to what every torch has)
        return frozenset({"cuda"})


def _fast_path_kwargs(model: nn.Module, cfg: OptimConfig) -> dict[str, bool]:
    """optim.fused: 'auto' = torch's fused kernels wherever this torch has them for the parameters
    (CUDA; CPU since torch 2.4, for fp32/fp64 parameters: lmforge keeps fp32 master weights; on
    DTensor parameters only for the optimizers whose registry entry says `dtensor_fused`: Adam and
    AdamW), foreach (multi-tensor) elsewhere; 'on' / 'off' force fused / foreach.

    The fused kernels compute the same update as foreach, element by element in one pass (same
    formula; results agree to float rounding, tests/test_fast_path_defaults.py) and are faster:
    on the 2-core AMD EPYC CPU the fused AdamW step of a 16M-parameter model took 5.5x less CPU
    time than foreach (26.6 vs 147 ms, 1 thread). On the CPU auto keeps foreach for 16-bit
    parameters: torch 2.13's fused CPU SGD with momentum is not deterministic on bf16 parameters
    (two identical runs differ after 4 steps; tests/test_optim_state.py's bitwise resume caught it).
    """
    fused = {"auto": None, "on": True, "off": False}[cfg.fused]
    if fused is None:
        from torch.distributed.tensor import DTensor

        params = [p for p in model.parameters() if p.requires_grad]
        exact = lambda p: p.device.type != "cpu" or p.dtype in (torch.float32, torch.float64)  # noqa: E731
        sharded = any(isinstance(p, DTensor) for p in params)
        fused = (bool(params) and all(p.device.type in fused_devices() and exact(p) for p in params)
                 and (not sharded or registry.spec(cfg.name).dtensor_fused))
    return {"fused": True} if fused else {"foreach": True}


def build_optimizer(cfg: OptimConfig, model: nn.Module, **extra: Any) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` (see `lmforge.spec.optimizers`) over `model`'s trainable parameters,
    grouped by `param_groups` (Muon: its own grouping). Hyperparameters come from the section;
    optimizer-specific knobs without a config key are keyword arguments:

      adafactor: beta2_decay (-0.8), clip_threshold (1.0), adafactor_eps ((None, 1e-3)).
          torch's Adafactor always uses the relative step rho_t = min(lr, 1/sqrt(t)) and
          parameter scaling, keeps no first moment, and decays weights by lr * weight_decay.
      muon: muon_nesterov (True), muon_ns_steps (5), muon_ns_dtype (None = bf16 on GPUs, fp32 on
          CPUs), muon_weight_decay (= weight_decay), muon_exclude (("lm_head",): name substrings of
          matrices kept on AdamW). `lr`, `beta1/2`, `eps` are the AdamW settings for embeddings,
          lm_head, norms, biases; optim.muon_lr / muon_momentum those of the matrices.
      adam8bit: block_size (256), min_8bit_size (4096).
    """
    spec = registry.spec(cfg.name)
    if cfg.lr < 0:
        raise ValueError(f"optim.lr = {cfg.lr} must be >= 0")
    if cfg.fused == "on" and not spec.fused:
        raise ValueError(f"optim.fused = 'on' is only available for {', '.join(registry.names_with(fused=True))}, "
                         f"not {cfg.name!r}")
    if cfg.nesterov and cfg.name != "momentum":
        raise ValueError(f"optim.nesterov = true applies to optim.name = 'momentum', not {cfg.name!r}")
    module, function = spec.builder.split(":")
    build = getattr(importlib.import_module(f"lmforge.optim.{module}"), function)
    extra = dict(extra)
    optimizer = build(model, cfg, extra)
    if extra:
        raise ValueError(f"unexpected keyword arguments {sorted(extra)} for optimizer {cfg.name!r}")
    return optimizer


def groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """`param_groups` with the section's weight decay settings and, for a μP model, its learning-rate
    multipliers (`mup_groups`): what every optimizer but Muon uses."""
    return mup_groups(model, param_groups(model, cfg.weight_decay, cfg.decay_embeddings), cfg.lr,
                      registry.spec(cfg.name).mup_rule)


def betas(cfg: OptimConfig) -> tuple[float, float]:
    return (cfg.beta1, cfg.beta2)


# torch's own optimizers (registry builders "optimizers:build_*")

def build_sgd(model: nn.Module, cfg: OptimConfig, extra: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups(model, cfg), lr=cfg.lr, momentum=0.0, **_fast_path_kwargs(model, cfg))


def build_momentum(model: nn.Module, cfg: OptimConfig, extra: dict[str, Any]) -> torch.optim.Optimizer:
    if not 0.0 < cfg.momentum < 1.0:
        raise ValueError(f"optim.momentum = {cfg.momentum} must be in (0, 1) for optim.name = 'momentum' "
                         "(use optim.name = 'sgd' for 0)")
    return torch.optim.SGD(groups(model, cfg), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                           **_fast_path_kwargs(model, cfg))


def build_adam(model: nn.Module, cfg: OptimConfig, extra: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adam(groups(model, cfg), lr=cfg.lr, betas=betas(cfg), eps=cfg.eps,
                            **_fast_path_kwargs(model, cfg))


def build_adamw(model: nn.Module, cfg: OptimConfig, extra: dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups(model, cfg), lr=cfg.lr, betas=betas(cfg), eps=cfg.eps,
                             **_fast_path_kwargs(model, cfg))


def _tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in `value` (a tensor, or dicts / lists / tuples of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def measured_state_bytes_by_param(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, int]:
    """Bytes of the tensors in `optimizer.state[p]`, for every parameter p that has state."""
    return {p: _tensor_bytes(state) for p, state in optimizer.state.items()}


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor held in `optimizer.state` (nested dicts/lists included)."""
    return sum(measured_state_bytes_by_param(optimizer).values())
