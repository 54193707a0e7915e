"""LoRA (Hu et al., 2021): low-rank adapters on chosen linear layers, base weights frozen.

``apply_lora(model, "wq,wk,wv,wo", rank=8, alpha=16)`` turns each matching ``nn.Linear`` into a
:class:`LoRALinear` *in place*: the module keeps its ``weight``/``bias`` parameters (same names,
so checkpoints and the Hugging Face export still match) and gains ``lora_a`` (rank x in, Kaiming
uniform) and ``lora_b`` (out x rank, zeros), computing

    y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T.

B = 0 at the start, so the adapted model is exactly the base model until the first update. Every
parameter except the adapters is frozen (requires_grad = False; `build_optimizer` skips frozen
parameters). ``merge_lora(model)`` folds ``(alpha / rank) * B A`` into ``W`` and turns the modules
back into plain ``nn.Linear``: the merged model has the base model's state-dict names and no
extra cost at inference, ready for `save_weights` / `export_hf`.

Targets are module names: the last component (``wq`` matches every ``blocks.i.attn.wq``) or a
dotted suffix (``attn.wq``, ``blocks.0.mlp.up``). The Transformer's linear layers are
``attn.wq, attn.wk, attn.wv, attn.wo`` and ``mlp.gate, mlp.up, mlp.down`` (SwiGLU) or ``mlp.fc,
mlp.proj`` (GELU), and ``lm_head``. With model.fused_qkv the three q/k/v layers are one,
``attn.wqkv``: the targets ``wq,wk,wv`` (all three; the default ``wq,wk,wv,wo`` stays valid) or
``wqkv`` put one adapter on it, and naming only some of them is a ValueError.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.init import InitRule, init_values


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank update; built from an existing Linear, sharing its parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0, name: str = "",
                 seed: int | None = None) -> None:
        nn.Module.__init__(self)  # no fresh weight: take the base module's parameters
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout)
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        if not w.is_meta:  # (on the meta device lmforge.model.materialise fills them, by the same rule)
            rule = InitRule("uniform", 1.0 / math.sqrt(self.in_features))  # kaiming_uniform_(a=sqrt(5)), as nn.Linear
            if seed is None:
                seed = int(torch.randint(0, 2**62, ()).item())
            with torch.no_grad():
                self.lora_a.copy_(init_values(rule, f"{name}.lora_a", self.lora_a.shape, (None, None), seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function (W + scaling * B A), sharing the bias."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        out.weight = nn.Parameter(merged_weight(self.weight, self.lora_a, self.lora_b, self.rank, self.alpha),
                                  requires_grad=self.weight.requires_grad)
        out.bias = self.bias
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def _parse_targets(targets: str | list[str]) -> list[str]:
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    if not names:
        raise ValueError("LoRA targets are empty; name linear layers, e.g. 'wq,wk,wv,wo'.")
    return names


def _fused_qkv_targets(wanted: list[str]) -> list[str]:
    """Targets for a model with the fused `attn.wqkv` (model.fused_qkv): wq, wk and wv named together
    (with the same dotted prefix, if any) become one target `wqkv`, one adapter on the fused layer (its
    B's rows follow the fused layout, so it adapts q, k and v like three adapters sharing one A).
    ValueError for some but not all of them: one adapter cannot leave k (say) alone."""
    parts = {"wq", "wk", "wv"}
    out, groups = [], {}
    for t in wanted:
        prefix, _, last = t.rpartition(".")
        if last in parts:
            groups.setdefault(prefix, set()).add(last)
        else:
            out.append(t)
    for prefix, named in groups.items():
        if named != parts:
            raise ValueError(f"LoRA targets name {', '.join(sorted(named))} but not all of wq, wk, wv, and "
                             f"model.fused_qkv = true makes them one layer (attn.wqkv): target all three (or "
                             f"'wqkv'), or set model.fused_qkv = false to adapt them separately.")
        out.append(f"{prefix}.wqkv" if prefix else "wqkv")
    return out


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(model: nn.Module, targets: str | list[str] = "wq,wk,wv,wo", rank: int = 8, alpha: float = 16.0,
               dropout: float = 0.0, seed: int | None = None) -> list[str]:
    """Put LoRA adapters on the linear layers named by `targets`, freeze everything else; returns
    the names of the adapted modules. ValueError for a target that matches no linear layer (the
    message lists the names that exist) or for a tied lm_head."""
    if rank < 1:
        raise ValueError(f"LoRA rank = {rank} must be >= 1.")
    if alpha <= 0:
        raise ValueError(f"LoRA alpha = {alpha} must be > 0.")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout = {dropout} must be in [0, 1).")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, LoRALinear)}
    wanted = _parse_targets(targets)
    if any(n.endswith("attn.wqkv") for n in linears):
        wanted = _fused_qkv_targets(wanted)
    for target in wanted:
        if not any(_matches(n, target) for n in linears):
            short = sorted({n.split(".")[-1] for n in linears} | {".".join(n.split(".")[-2:]) for n in linears})
            raise ValueError(f"LoRA target {target!r} matches no linear layer; available: {', '.join(short)}.")
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.tie_embeddings and any(_matches("lm_head", t) for t in wanted):
        raise ValueError("LoRA target 'lm_head' shares its weight with the token embedding (model.tie_embeddings = "
                         "true); merging would change the embedding too. Leave lm_head out.")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for name, module in linears.items():
        if any(_matches(name, t) for t in wanted):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoRALinear(module, rank, alpha, dropout, name=name, seed=seed))
            adapted.append(name)
    return adapted


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter parameters by name (what a LoRA checkpoint needs to store)."""
    return {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``<module>.lora_a`` / ``<module>.lora_b``)."""
    return name.endswith((".lora_a", ".lora_b"))


@torch.no_grad()
def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int,
                  alpha: float) -> torch.Tensor:
    """W + (alpha / rank) * B A in W's dtype (computed in fp32)."""
    return (weight.float() + (lora_b.float() @ lora_a.float()) * (alpha / rank)).to(weight.dtype)


@torch.no_grad()
def merged_state_dict(state: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """A full state dict with adapters (``<m>.lora_a`` / ``<m>.lora_b``) -> the base model's state dict
    with ``<m>.weight += (alpha / rank) * B A``. The same result as `merge_lora` on the module, for
    code that only holds the tensors."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if key.endswith(".lora_a"):
            module = key[: -len(".lora_a")]
            out[module + ".weight"] = merged_weight(state[module + ".weight"], state[key], state[module + ".lora_b"],
                                                    rank, alpha)
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and restore plain nn.Linear modules (in place);
    returns the model. Its state dict then has exactly the base model's names."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.merged())
    return model
