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

Known limitation of deterministic rounding: once a moment changes by less than half a code step
(~4.6%) per update relative to its block's absmax it stops moving; the absmax element itself is
always exact, so moments that scale together with their block stay right. In practice (and in
the tests) trajectories stay close to fp32 AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lmforge.optim._common import check_betas, check_non_negative, evaluate_closure, grad_of
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
        if "step" not in state:
            state["step"] = 0
            for name, _ in _MOMENTS:
                zeros = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
                self._store(state, name, zeros, quantised, group["block_size"])
        state["step"] += 1
        t = state["step"]
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]

        m = self._load(state, "exp_avg", p.shape, quantised)
        v = self._load(state, "exp_avg_sq", p.shape, quantised)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v / (1.0 - beta2**t)).sqrt_().add_(eps)
        update = (m / (1.0 - beta1**t)).div_(denom)
        if wd != 0:
            p.mul_(1.0 - lr * wd)
        p.add_(update.to(p.dtype), alpha=-lr)
        if quantised:  # small tensors were updated in place
            self._store(state, "exp_avg", m, True, group["block_size"])
            self._store(state, "exp_avg_sq", v, True, group["block_size"])

    @staticmethod
    def _store(state: dict[str, Any], name: str, x: torch.Tensor, quantised: bool, block_size: int) -> None:
        if not quantised:
            state[name] = x
            return
        signed = dict(_MOMENTS)[name]
        state[f"{name}_codes"], state[f"{name}_scale"] = quantize_blockwise(x, signed, block_size)

    @staticmethod
    def _load(state: dict[str, Any], name: str, shape: torch.Size, quantised: bool) -> torch.Tensor:
        """The moment as an fp32 tensor (the live state tensor itself when not quantised)."""
        if not quantised:
            return state[name]
        signed = dict(_MOMENTS)[name]
        return dequantize_blockwise(state[f"{name}_codes"], state[f"{name}_scale"], signed, shape)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, keeping each state tensor's saved dtype.

        torch casts every state tensor of a floating-point parameter to the parameter's dtype;
        that would turn uint8 codes into floats and round fp32 scales/moments to bf16 for bf16
        parameters. We restore the saved tensors (moved to the parameter's device) afterwards.
        """
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            for key, value in saved_state.get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, copy=True)
