"""AdamW with 8-bit block-wise quantised moments (in the spirit of Dettmers et al. 2022).

Hand-written because torch.optim has no low-bit optimizer state, and pure PyTorch so it runs
wherever torch does (no bitsandbytes / CUDA extension). The update is AdamW's, computed in fp32:

    m = beta1 m + (1 - beta1) g;    v = beta2 v + (1 - beta2) g^2
    p = p (1 - lr wd) - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

Between steps m and v live in `quant8` format: 1 byte per element plus one fp32 absmax per
256-element block each, ~2.03 bytes/param versus 8 for fp32 AdamW. Each step dequantises a
parameter's moments to fp32, updates them, and re-quantises (so the transient peak is the fp32
moments of one parameter tensor at a time).

Tensors with fewer than `min_8bit_size` (default 4096) elements keep plain fp32 `exp_avg` /
`exp_avg_sq`: for norms and biases the saving is negligible and quantisation error is not.

Sharded parameters (FSDP2 / tensor parallel DTensors): each rank quantises and updates its own
shard (the update is elementwise, so only the block boundaries depend on the layout).

`state_dict()` holds the moments dequantised to fp32 `exp_avg` / `exp_avg_sq` in the parameter's
shape (a DTensor with the parameter's placements when it is one), and `load_state_dict()`
re-quantises them. That makes a checkpoint independent of the layout and the block size (DCP
reshards it like AdamW's), and resume exact: re-quantising a dequantised block gives back the same
codes and absmax, since the absmax element always sits on the code 1.0. The price is that a
checkpoint of this optimizer is as large as AdamW's and `state_dict()` briefly holds the fp32
moments (8 bytes/param) while it is being saved.

Known limitation of deterministic rounding: once a moment changes by less than half a code step
(~4.6%) per update relative to its block's absmax it stops moving; the absmax element itself is
always exact, so moments that scale together with their block stay right. In practice (and in
the tests) trajectories stay close to fp32 AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from lmforge.optim._common import check_betas, check_non_negative, evaluate_closure, grad_of
from lmforge.optim.optimizers import betas, groups

if TYPE_CHECKING:
    from lmforge.config import OptimConfig
from lmforge.optim.quant8 import dequantize_blockwise, quantize_blockwise

_MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (state name, signed)


class Adam8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with block-wise 8-bit `exp_avg` / `exp_avg_sq`.

    State per quantised parameter: `step` (int), `exp_avg_codes`/`exp_avg_sq_codes` (uint8),
    `exp_avg_scale`/`exp_avg_sq_scale` (fp32, one per block). Small parameters: `step`,
    `exp_avg`, `exp_avg_sq` (fp32).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        block_size: int = 256,
        min_8bit_size: int = 4096,
    ) -> None:
        check_non_negative(lr=lr, eps=eps, weight_decay=weight_decay, min_8bit_size=min_8bit_size)
        check_betas(betas)
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1 (default 256)")
        defaults = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
            "block_size": block_size, "min_8bit_size": min_8bit_size,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One AdamW update for every parameter that has a gradient."""
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                g = grad_of(p, "Adam8bit")
                if g is not None:
                    self._update(p, g.float(), group)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        quantised = p.numel() >= group["min_8bit_size"]
        if isinstance(g, DTensor) and g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        p_local, g_local = _local(p), _local(g)
        if "step" not in state:
            state["step"] = 0
            for name, signed in _MOMENTS:
                if quantised:  # codes of this rank's shard
                    zeros = torch.zeros(p_local.shape, dtype=torch.float32, device=p_local.device)
                    state[f"{name}_codes"], state[f"{name}_scale"] = quantize_blockwise(
                        zeros, signed, group["block_size"])
                else:  # a DTensor like the parameter when it is one
                    state[name] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["step"] += 1
        t = state["step"]
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]

        m = self._load(state, "exp_avg", p_local.shape, quantised)
        v = self._load(state, "exp_avg_sq", p_local.shape, quantised)
        m.lerp_(g_local, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g_local, g_local, value=1.0 - beta2)
        denom = (v / (1.0 - beta2**t)).sqrt_().add_(eps)
        update = (m / (1.0 - beta1**t)).div_(denom)
        if wd != 0:
            p_local.mul_(1.0 - lr * wd)
        p_local.add_(update.to(p_local.dtype), alpha=-lr)
        if quantised:  # small tensors were updated in place
            for name, x in (("exp_avg", m), ("exp_avg_sq", v)):
                state[f"{name}_codes"], state[f"{name}_scale"] = quantize_blockwise(
                    x, dict(_MOMENTS)[name], group["block_size"])

    @staticmethod
    def _load(state: dict[str, Any], name: str, shape: torch.Size, quantised: bool) -> torch.Tensor:
        """This rank's moment as an fp32 tensor (the live state tensor itself when not quantised)."""
        if not quantised:
            return _local(state[name])
        signed = dict(_MOMENTS)[name]
        return dequantize_blockwise(state[f"{name}_codes"], state[f"{name}_scale"], signed, shape)

    def _params_by_index(self) -> list[torch.Tensor]:
        """Parameters in the order of torch's state_dict indices."""
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict with every quantised moment as an fp32 `exp_avg` / `exp_avg_sq` of the
        parameter's shape (see the module docstring)."""
        sd = super().state_dict()
        params = self._params_by_index()
        state = {}
        for index, st in sd["state"].items():
            if "exp_avg_codes" not in st:
                state[index] = st
                continue
            p = params[index]
            local_shape = _local(p).shape
            out = {k: v for k, v in st.items() if not k.endswith(("_codes", "_scale"))}
            for name, signed in _MOMENTS:
                x = dequantize_blockwise(st[f"{name}_codes"], st[f"{name}_scale"], signed, local_shape)
                if isinstance(p, DTensor):
                    x = DTensor.from_local(x, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
                out[name] = x
            state[index] = out
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, then the moments of large parameters re-quantised.

        torch casts every state tensor of a floating-point parameter to the parameter's dtype
        (fp32 moments would become bf16 for bf16 parameters); we take the saved tensors instead,
        quantise the fp32 moments of parameters with >= `min_8bit_size` elements (this rank's shard
        of a DTensor) and keep the others as fp32 tensors (DTensors like the parameter). The older
        format with `*_codes` / `*_scale` tensors loads as it is.
        """
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        for saved_id, p in zip(saved_ids, self._params_by_index(), strict=True):
            saved = saved_state.get(saved_id, {})
            if not saved:
                continue
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            state = {"step": saved["step"]}
            quantised = p.numel() >= group["min_8bit_size"]
            for key, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if quantised and key in dict(_MOMENTS):
                    local = _local(value).to(device=_local(p).device, dtype=torch.float32)
                    state[f"{key}_codes"], state[f"{key}_scale"] = quantize_blockwise(
                        local, dict(_MOMENTS)[key], group["block_size"])
                else:
                    state[key] = value.to(device=value.device if isinstance(value, DTensor) else p.device,
                                          copy=True)
            self.state[p] = state


def _local(x: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage); a plain tensor itself."""
    return x.to_local() if isinstance(x, DTensor) else x


def build(model: torch.nn.Module, cfg: "OptimConfig", extra: dict[str, Any]) -> Adam8bit:
    """The registry's builder (lmforge.spec.optimizers); extra: block_size, min_8bit_size."""
    return Adam8bit(groups(model, cfg), lr=cfg.lr, betas=betas(cfg), eps=cfg.eps,
                    block_size=extra.pop("block_size", 256), min_8bit_size=extra.pop("min_8bit_size", 4096))
