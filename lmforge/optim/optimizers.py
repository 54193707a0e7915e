"""Parameter grouping, the optimizer factory, and optimizer-state accounting.

Torch's own optimizers are used where they exist (SGD, Adam, AdamW, Adafactor); Lion, LAMB,
Muon and Adam8bit are hand-written in their own modules (see each module for why).

Param groups carry the parameter names under `"param_names"`, the key torch itself uses for
named parameters (torch keeps it, and any other extra key such as `"group"` or `"use_muon"`,
in `optimizer.param_groups` and in `state_dict()`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lmforge.optim.adafactor import Adafactor
from lmforge.optim.adam8bit import Adam8bit
from lmforge.optim.lamb import LAMB
from lmforge.optim.lion import Lion
from lmforge.optim.muon import Muon, zeropower_via_newtonschulz5
from lmforge.optim.state_memory import OPTIMIZER_NAMES, optimizer_state_bytes_per_param

__all__ = [
    "LAMB", "Adam8bit", "Lion", "Muon", "OPTIMIZER_NAMES", "build_optimizer", "describe_groups",
    "measured_state_bytes", "optimizer_state_bytes_per_param", "param_groups",
    "zeropower_via_newtonschulz5",
]

# Optimizers that take a `fused` / `foreach` choice (torch's own).
_TORCH_FAST_PATH = ("sgd", "momentum", "adam", "adamw")


def _embedding_ids(model: nn.Module) -> set[int]:
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
    embeddings = _embedding_ids(model)
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


def _fast_path_kwargs(model: nn.Module, fused: bool | None) -> dict[str, bool]:
    """fused=None: fused kernels on CUDA, foreach elsewhere; True/False forces fused/foreach.

    (torch 2.13 also has fused SGD/Adam/AdamW kernels for CPU; pass fused=True to use them.)
    """
    if fused is None:
        first = next(model.parameters(), None)
        fused = first is not None and first.device.type == "cuda"
    return {"fused": True} if fused else {"foreach": True}


def _muon_groups(
    model: nn.Module, lr: float, weight_decay: float, decay_embeddings: bool, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """Muon groups: decay-group matrices not named in `muon_exclude` go to Muon, the rest to AdamW."""
    exclude = tuple(extra.pop("muon_exclude", ("lm_head",)))
    muon_group: dict[str, Any] = {
        "params": [], "param_names": [], "group": "muon", "use_muon": True,
        "lr": extra.pop("muon_lr", 0.02),
        "momentum": extra.pop("muon_momentum", 0.95),
        "nesterov": extra.pop("muon_nesterov", True),
        "ns_steps": extra.pop("muon_ns_steps", 5),
        "ns_dtype": extra.pop("muon_ns_dtype", None),
        "weight_decay": extra.pop("muon_weight_decay", weight_decay),
    }
    decay, no_decay = param_groups(model, weight_decay, decay_embeddings)
    adamw_decay: dict[str, Any] = {"params": [], "param_names": []}
    embeddings = _embedding_ids(model)
    for name, p in zip(decay["param_names"], decay["params"], strict=True):
        to_muon = id(p) not in embeddings and not any(key in name for key in exclude)
        target = muon_group if to_muon else adamw_decay
        target["params"].append(p)
        target["param_names"].append(name)
    adamw_decay.update(group="adamw_decay", use_muon=False, lr=lr, weight_decay=weight_decay)
    no_decay.update(group="adamw_no_decay", use_muon=False, lr=lr)
    return [muon_group, adamw_decay, no_decay]


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    momentum: float = 0.9,
    nesterov: bool = False,
    decay_embeddings: bool = False,
    fused: bool | None = None,
    **extra: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer `name` over `param_groups(model, weight_decay, decay_embeddings)`.

    Names: sgd (no momentum), momentum (SGD + momentum, optional nesterov), adam (torch Adam:
    weight decay is an L2 term added to the gradient), adamw (decoupled decay), lion, adafactor
    (torch.optim.Adafactor), lamb, muon, adam8bit. `fused` only applies to the torch
    sgd/momentum/adam/adamw (None: fused on CUDA, foreach otherwise).

    Extra keyword arguments by name:
      adafactor: beta2_decay (-0.8), clip_threshold (1.0), adafactor_eps ((None, 1e-3)).
          torch's Adafactor always uses the relative step rho_t = min(lr, 1/sqrt(t)) and
          parameter scaling, keeps no first moment, and decays weights by lr * weight_decay.
      muon: muon_lr (0.02), muon_momentum (0.95), muon_nesterov (True), muon_ns_steps (5),
          muon_ns_dtype (None = bf16 on GPUs, fp32 on CPUs), muon_weight_decay (= weight_decay),
          muon_exclude (("lm_head",): name substrings of matrices kept on AdamW).
          `lr`, `betas`, `eps` are the AdamW settings for embeddings, lm_head, norms, biases.
      adam8bit: block_size (256), min_8bit_size (4096).
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer name {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    if lr < 0:
        raise ValueError(f"lr={lr} must be >= 0")
    if fused and name not in _TORCH_FAST_PATH:
        raise ValueError(f"fused=True is only available for {', '.join(_TORCH_FAST_PATH)}, not {name!r}")
    if nesterov and name != "momentum":
        raise ValueError(f"nesterov=True applies to name='momentum', not {name!r}")
    extra = dict(extra)
    betas = tuple(betas)

    if name == "muon":
        groups = _muon_groups(model, lr, weight_decay, decay_embeddings, extra)
        optimizer: torch.optim.Optimizer = Muon(groups, lr=lr, betas=betas, eps=eps, foreach=True)
    else:
        groups = param_groups(model, weight_decay, decay_embeddings)
        optimizer = _build_elementwise(name, groups, lr, betas, eps, momentum, nesterov, model, fused, extra)
    if extra:
        raise ValueError(f"unexpected keyword arguments {sorted(extra)} for optimizer {name!r}")
    return optimizer


def _build_elementwise(
    name: str, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float,
    momentum: float, nesterov: bool, model: nn.Module, fused: bool | None, extra: dict[str, Any],
) -> torch.optim.Optimizer:
    """Every optimizer but Muon; consumes the keys it understands from `extra`."""
    if name in _TORCH_FAST_PATH:
        fast = _fast_path_kwargs(model, fused)
        if name == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=0.0, **fast)
        if name == "momentum":
            if not 0.0 < momentum < 1.0:
                raise ValueError(
                    f"momentum={momentum} must be in (0, 1) for name='momentum' (use name='sgd' for 0)"
                )
            return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, **fast)
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(groups, lr=lr, betas=betas, eps=eps, **fast)
    if name == "lion":
        return Lion(groups, lr=lr, betas=betas)
    if name == "lamb":
        return LAMB(groups, lr=lr, betas=betas, eps=eps)
    if name == "adam8bit":
        return Adam8bit(
            groups, lr=lr, betas=betas, eps=eps,
            block_size=extra.pop("block_size", 256), min_8bit_size=extra.pop("min_8bit_size", 4096),
        )
    assert name == "adafactor", name
    for unsupported in ("beta1", "relative_step", "scale_parameter"):
        if unsupported in extra:
            raise ValueError(
                f"adafactor option {unsupported!r} is not supported: lmforge uses torch.optim.Adafactor, "
                "which always uses the relative step and parameter scaling and keeps no first moment; "
                "drop the option or pick another optimizer (e.g. adamw)"
            )
    return Adafactor(
        groups, lr=lr,
        beta2_decay=extra.pop("beta2_decay", -0.8),
        d=extra.pop("clip_threshold", 1.0),
        eps=tuple(extra.pop("adafactor_eps", (None, 1e-3))),
    )


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor held in `optimizer.state` (nested dicts/lists included)."""

    def tensor_bytes(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(tensor_bytes(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(tensor_bytes(v) for v in value)
        return 0

    return sum(tensor_bytes(s) for s in optimizer.state.values())
