"""An exponential moving average (EMA) of the weights, held exactly like the weights (train.ema_decay).

    ema = WeightEMA.for_run(layout.model, cfg.train, layout.forward_roots())  # None when train.ema_decay = 0
    ema.update(step)                                  # after each optimizer step: no host sync
    with ema.swapped_in():                            # the model holds the EMA (validation, final weights)
        ...
    states["ema"] = ema                               # a `Stateful`: checkpointed, resharded on resume

Where it lives: one fp32 tensor per trainable parameter of this rank's model, made from the
parameter itself (`p.detach().to(float32, copy=True)`): a DTensor parameter (an FSDP2 shard, a
tensor-parallel split, expert-parallel experts) gives a DTensor on the same mesh with the same
placements whose local tensor is this rank's share, and a pipeline rank holds its own stages'
parameters only. So no rank holds more than its share: 4 bytes per parameter of it (`lmforge plan`
counts it as `ema`). Replicated layouts (one process, DDP, ZeRO-1) hold the whole model, as they
hold its weights.

The update, after the optimizer step, runs on the local tensors with torch's multi-tensor kernel:
ema += (1 - decay) (w - ema) (`torch._foreach_lerp_`), decay a Python float; nothing is read back to
the host, so the step stays asynchronous on a GPU. A parameter held in another dtype (16-bit
weights) is lerped one tensor at a time from its fp32 cast (the multi-tensor kernel wants one dtype).
The first update at or after train.ema_start_step copies the weights (so the random initial weights,
or a warmup, never enter the average); after that every train.ema_every-th step updates it.

Checkpoints: the tensors go to DCP under `ema/weights/<name>` (the model's layout-independent
names), so a run of another layout reads them back resharded, and the update count goes to the JSON
part: a resumed run continues the EMA bit for bit. A checkpoint written without an EMA (the EMA
enabled on resume) starts a new one at the next update, with a warning.

Evaluating the EMA on the sharded model (`swapped_in`): the values of each parameter's local tensor
and of its EMA are exchanged in place, one tensor at a time through one temporary, which is exact
both ways for fp32 parameters (no copy of the model is made, nothing is gathered); a parameter in
another dtype keeps its live values in a copy of its own dtype while the EMA, rounded to that dtype,
stands in. FSDP2 modules are resharded before and after, so that no forward reuses parameters
gathered before the exchange (parallel.reshard_after_forward = false keeps them gathered, and so
do the zero-bubble pipeline schedules, which force it false): every FSDP2 module under `roots`,
the modules the layout's forwards run through (`Layout.forward_roots`), not only those under the
model, because a pipeline rank's stage chunks are FSDP2 roots the model does not hold (their
embedding, final norm and head would otherwise be evaluated with the live weights).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lmforge.model.materialise import unwrapped_name

log = logging.getLogger("lmforge.train")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of `t`: a DTensor's local shard (a view of its storage), else `t` itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class WeightEMA:
    """The EMA of `model`'s trainable parameters on this rank (module docstring)."""

    def __init__(self, model: nn.Module, decay: float, start_step: int = 0, every: int = 1,
                 roots: Sequence[nn.Module] | None = None):
        """`roots`: the modules the forwards run through (`Layout.forward_roots`; default: `model`),
        whose FSDP2 modules `swapped_in` reshards."""
        assert 0.0 < decay < 1.0 and start_step >= 0 and every >= 1, (decay, start_step, every)
        self.model, self.decay, self.start_step, self.every = model, decay, start_step, every
        self.roots = list(roots) if roots is not None else [model]
        named = [(unwrapped_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self._live = [_local(p) for p in self.params]
        self._ema = [_local(e) for e in self.shadow]
        self._same = [i for i, p in enumerate(self._live) if p.dtype == torch.float32]
        self._other = [i for i, p in enumerate(self._live) if p.dtype != torch.float32]
        self.updates = 0  # updates so far; 0: not started (the next update copies the weights)

    @classmethod
    def for_run(cls, model: nn.Module, train_cfg, roots: Sequence[nn.Module] | None = None) -> "WeightEMA | None":
        """The run's EMA per train.ema_decay / ema_start_step / ema_every, or None when it is off."""
        t = train_cfg
        if not t.ema_decay:
            return None
        ema = cls(model, t.ema_decay, t.ema_start_step, t.ema_every, roots)
        log.info("ema: decay %g, from step %d, every %d step(s): fp32, %.1f MB on this rank (its share of %d "
                 "tensors)", t.ema_decay, t.ema_start_step, t.ema_every, ema.local_bytes() / 1e6, len(ema.names))
        return ema

    def local_bytes(self) -> int:
        """Bytes of the EMA on this rank."""
        return sum(e.numel() * e.element_size() for e in self._ema)

    @property
    def started(self) -> bool:
        return self.updates > 0

    def due(self, step: int) -> bool:
        """Does optimizer step `step` (1-based) update the EMA?"""
        return step >= max(self.start_step, 1) and step % self.every == 0

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step`: fold the weights into the EMA (or copy them, the first time)."""
        if not self.due(step):
            return
        same_ema = [self._ema[i] for i in self._same]
        same_live = [self._live[i] for i in self._same]
        if self.updates == 0:
            torch._foreach_copy_(same_ema, same_live)
        elif same_ema:
            torch._foreach_lerp_(same_ema, same_live, 1.0 - self.decay)
        for i in self._other:  # (another dtype: one tensor at a time, from its fp32 cast)
            live = self._live[i].float()
            self._ema[i].copy_(live) if self.updates == 0 else self._ema[i].lerp_(live, 1.0 - self.decay)
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the EMA inside the block and its own weights again after it (module
        docstring). Every rank of the layout enters it together (FSDP2 reshards)."""
        kept: dict[int, torch.Tensor] = {}
        _reshard(self.roots)
        with torch.no_grad():
            for i in self._same:
                _exchange(self._live[i], self._ema[i])
            for i in self._other:
                kept[i] = self._live[i].clone()
                self._live[i].copy_(self._ema[i])
        try:
            yield
        finally:
            _reshard(self.roots)
            with torch.no_grad():
                for i in self._same:
                    _exchange(self._live[i], self._ema[i])
                for i, live in kept.items():
                    self._live[i].copy_(live)

    def evaluate(self, evaluate) -> dict[str, float]:
        """`evaluate()` (the trainer's validation: a dict with "loss" and "perplexity") on the EMA, as
        metrics `val_loss_ema` / `val_perplexity_ema`; {} before the EMA has started."""
        if not self.started:
            return {}
        with self.swapped_in():
            val = evaluate()
        return {"val_loss_ema": val["loss"], "val_perplexity_ema": val["perplexity"]}

    # ---- Stateful ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"weights": dict(zip(self.names, self.shadow)), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        weights = state_dict.get("weights", {})
        if not weights:
            log.warning("ema: the checkpoint holds no EMA of the weights (it was written without train.ema_decay): "
                        "the EMA starts again at the next update")
            self.updates = 0
            return
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise ValueError(f"the checkpoint's EMA lacks {len(missing)} of this model's parameters (e.g. "
                             f"{missing[:3]}); it was written by another model or fine-tuning configuration.")
        with torch.no_grad():
            for name, mine in zip(self.names, self.shadow):
                if weights[name] is not mine:  # (loaded in place, unless converted: fused q/k/v)
                    mine.copy_(weights[name])
        self.updates = int(state_dict.get("updates", 0))


def _exchange(a: torch.Tensor, b: torch.Tensor) -> None:
    """Swap the values of two tensors of one shape and dtype in place (one temporary)."""
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)


def _reshard(roots: list[nn.Module]) -> None:
    """Free the parameters FSDP2 keeps gathered after a forward (reshard_after_forward = false; the
    zero-bubble schedules), under every one of `roots`, so the next forward gathers the shards as they
    are now."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a torch built without distributed)
        return
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
