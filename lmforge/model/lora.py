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
mlp.proj`` (GELU), and ``lm_head``.

With model.fused_qkv the three q/k/v layers are one, ``attn.wqkv`` (rows grouped by kv head:
`lmforge.model.layers.qkv_layout`). Targets naming any of ``wq``, ``wk``, ``wv`` (all, or some: the
common ``wq,wv``) make it a :class:`FusedQKVLoRA`: one adapter per named part, exactly the adapter the
separate projection would get (A: rank x in, B: that part's rows x rank; same names in
``attn.wqkv.lora.<part>``, same initial values), its update added to that part's rows of the fused
output only. So the function, the gradients and the trainable parameter count are those of the
separate layout with the same targets (tests/test_fused_qkv.py), and a LoRA checkpoint of either
layout resumes in the other (lmforge.ckpt.checkpointer renames the adapters). Why one adapter per
part rather than one over the targeted rows: a single A shared by q and v would be a different
(smaller) model than the separate layout's, so switching model.fused_qkv would change what a LoRA
recipe trains. The target ``wqkv`` itself still puts one plain adapter over all the fused rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.init import InitRule, init_values, separate_adapter_name
from lmforge.model.layers import QKV_PARTS, fuse_qkv


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
            init_lora_a(self.lora_a, name, seed)

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


@torch.no_grad()
def init_lora_a(lora_a: nn.Parameter, name: str, seed: int | None) -> None:
    """Fill an adapter's A (module `name`) as lmforge.model.init does: kaiming_uniform_(a=sqrt(5)), as nn.Linear."""
    rule = InitRule("uniform", 1.0 / math.sqrt(lora_a.shape[1]))
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    lora_a.copy_(init_values(rule, f"{name}.lora_a", lora_a.shape, (None, None), seed))


class QKVAdapter(nn.Module):
    """The LoRA adapter of one of q, k, v inside a :class:`FusedQKVLoRA`: the separate projection's
    ``lora_a`` (rank x in) and ``lora_b`` (that projection's rows x rank, in its own row order)."""

    def __init__(self, in_features: int, out_features: int, rank: int, like: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=like.device, dtype=like.dtype))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=like.device, dtype=like.dtype))


class FusedQKVLoRA(nn.Linear):
    """The fused `attn.wqkv` (model.fused_qkv) with LoRA adapters on some or all of q, k, v (module
    docstring): ``lora.<part>`` holds the adapter the separate ``attn.<part>`` would have, and its
    update x A^T B^T is added to that part's rows of the fused output. Built from the fused Linear,
    sharing its parameters."""

    def __init__(self, base: nn.Linear, cfg: ModelConfig, parts: list[str], rank: int, alpha: float,
                 dropout: float = 0.0, name: str = "", seed: int | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.cfg, self.rank, self.alpha = cfg, rank, alpha
        self.scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout)
        rep, hd = cfg.n_heads // cfg.kv_heads, cfg.head_dim
        self.widths = (rep * hd, hd, hd)  # each kv group's rows of q, k, v (lmforge.model.layers.qkv_layout)
        assert self.out_features == cfg.kv_heads * sum(self.widths), (self.out_features, cfg)
        self.lora = nn.ModuleDict()
        for p in QKV_PARTS:  # (q, k, v order whatever the targets' order)
            if p in parts:
                rows = cfg.kv_heads * self.widths[QKV_PARTS.index(p)]
                self.lora[p] = QKVAdapter(self.in_features, rows, rank, base.weight)
                if not base.weight.is_meta:  # (the separate projection's name: the same initial values)
                    init_lora_a(self.lora[p].lora_a, separate_adapter_name(f"{name}.lora.{p}"), seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        h = self.lora_dropout(x)
        # per kv group: its q rows, k rows, v rows; each targeted part's update added to its own rows.
        # Views and a concatenation along unsharded dims only: under tensor parallelism (DTensors
        # sharded over the rows, that is over the kv groups) the same code runs on the shards.
        grouped = out.view(*out.shape[:-1], self.cfg.kv_heads, sum(self.widths))
        pieces = list(grouped.split(self.widths, dim=-1))
        for i, p in enumerate(QKV_PARTS):
            if p in self.lora:
                a = self.lora[p]
                update = F.linear(F.linear(h, a.lora_a), a.lora_b)
                pieces[i] = pieces[i] + self.scaling * update.view(*update.shape[:-1], self.cfg.kv_heads, -1)
        return torch.cat(pieces, dim=-1).view(out.shape)

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function (each part's W rows + scaling * B A), sharing the bias."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        adapters = {p: (a.lora_a, a.lora_b) for p, a in self.lora.items()}
        out.weight = nn.Parameter(merged_qkv_weight(self.cfg, self.weight, adapters, self.rank, self.alpha),
                                  requires_grad=self.weight.requires_grad)
        out.bias = self.bias
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, parts={','.join(self.lora)}"


ADAPTED_MODULES = (LoRALinear, FusedQKVLoRA)  # the modules apply_lora puts in place of an nn.Linear


def _parse_targets(targets: str | list[str]) -> list[str]:
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    if not names:
        raise ValueError("LoRA targets are empty; name linear layers, e.g. 'wq,wk,wv,wo'.")
    return names


def _fused_qkv_targets(wanted: list[str]) -> tuple[list[str], dict[str, set[str]]]:
    """Targets for a model with the fused `attn.wqkv` (model.fused_qkv): the targets that name whole
    layers, and the q/k/v parts named (wq, wk, wv) per fused-layer target (`wqkv`, or `<prefix>.wqkv`
    for a dotted `<prefix>.wq`): one FusedQKVLoRA adapter per part on the fused layers it matches."""
    out, parts = [], {}
    for t in wanted:
        prefix, _, last = t.rpartition(".")
        if last in QKV_PARTS:
            parts.setdefault(f"{prefix}.wqkv" if prefix else "wqkv", set()).add(last)
        else:
            out.append(t)
    return out, parts


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
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not isinstance(m, ADAPTED_MODULES)}
    wanted = _parse_targets(targets)
    part_targets: dict[str, set[str]] = {}
    if any(n.endswith("attn.wqkv") for n in linears):
        wanted, part_targets = _fused_qkv_targets(wanted)
    for target in [*wanted, *part_targets]:
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
        parts = {p for t, named in part_targets.items() if _matches(name, t) for p in named}
        whole = any(_matches(name, t) for t in wanted)
        if whole and parts:
            raise ValueError(f"LoRA targets put both one adapter on all of {name} ('wqkv') and adapters on its "
                             f"parts {', '.join(sorted(parts))}; name either 'wqkv' or some of wq, wk, wv.")
        if parts:
            assert cfg is not None, "a fused attn.wqkv outside a Transformer"
            new: nn.Module = FusedQKVLoRA(module, cfg, sorted(parts), rank, alpha, dropout, name=name, seed=seed)
        elif whole:
            new = LoRALinear(module, rank, alpha, dropout, name=name, seed=seed)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
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
def merged_qkv_weight(cfg: ModelConfig, weight: torch.Tensor, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      rank: int, alpha: float) -> torch.Tensor:
    """A fused `attn.wqkv` weight (model.fused_qkv) + (alpha / rank) * B A of each part's adapter
    (`adapters`: part name -> (lora_a, lora_b)), on that part's rows; in W's dtype (computed in fp32)."""
    n_in = weight.shape[1]
    rows = (cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim)
    deltas = [adapters[p][1].float() @ adapters[p][0].float() if p in adapters
              else torch.zeros(r, n_in, device=weight.device) for p, r in zip(QKV_PARTS, rows)]
    return (weight.float() + fuse_qkv(cfg, *deltas) * (alpha / rank)).to(weight.dtype)


def merge_adapters(name: str, tensor: torch.Tensor, adapters: dict[str, torch.Tensor], rank: int, alpha: float,
                   cfg: ModelConfig | None = None) -> torch.Tensor:
    """The weight `name` (`tensor`) with the adapters of its module folded in, taking them out of
    `adapters` (adapter name -> tensor: a state dict's or a stream's); the weight as it is if none.
    A fused `attn.wqkv` with part adapters (FusedQKVLoRA) needs the model's `cfg`."""
    module = name.removesuffix(".weight")
    if not name.endswith(".weight"):
        return tensor
    if f"{module}.lora_a" in adapters:
        return merged_weight(tensor, adapters.pop(f"{module}.lora_a"), adapters.pop(f"{module}.lora_b"), rank, alpha)
    parts = {p: (adapters.pop(f"{module}.lora.{p}.lora_a"), adapters.pop(f"{module}.lora.{p}.lora_b"))
             for p in QKV_PARTS if f"{module}.lora.{p}.lora_a" in adapters}
    if not parts:
        return tensor
    if cfg is None:
        raise ValueError(f"{name}: merging the q/k/v part adapters of a fused attn.wqkv needs the model config.")
    return merged_qkv_weight(cfg, tensor, parts, rank, alpha)


@torch.no_grad()
def merged_state_dict(state: dict[str, torch.Tensor], rank: int, alpha: float,
                      cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """A full state dict with adapters (``<m>.lora_a`` / ``<m>.lora_b``; ``<m>.lora.<part>.lora_a`` on a
    fused attn.wqkv, which needs the model's `cfg`) -> the base model's state dict with ``<m>.weight +=
    (alpha / rank) * B A``. The same result as `merge_lora` on the module, for code that only holds
    the tensors."""
    adapters = {k: v for k, v in state.items() if is_adapter(k)}
    out = {k: merge_adapters(k, v, adapters, rank, alpha, cfg) for k, v in state.items() if not is_adapter(k)}
    assert not adapters, f"adapters without their weight: {sorted(adapters)}"
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and restore plain nn.Linear modules (in place);
    returns the model. Its state dict then has exactly the base model's names."""
    for name, module in list(model.named_modules()):
        if isinstance(module, ADAPTED_MODULES):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.merged())
    return model
