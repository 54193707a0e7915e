"""Where a layout leaves one process: per-module norms at one optimizer step, recorded by hooks in the
runs of `lmforge plan --verify` (lmforge/verify/rank.py) and compared by `first_diverging` (certify).

`Probe(step)`, around a run, records at optimizer step `step`, for every module of the model under its
name in the full model (a pipeline stage's modules keep them; wrappers' segments such as activation
checkpointing's are dropped):

  forward    the squared norm of the module's output, summed over the step's micro-batches; forwards
             run inside a backward (activation checkpointing's recompute) are not counted twice
  gradient   the squared norm of the gradient of the module's own parameters as the optimizer receives it
             (after clipping: `first_diverging` undoes the clip with the run's reported norm), of the full
             tensor (a DTensor's shards gathered over its mesh: `full_tensor`, toy sizes)

Nothing is patched: a global module forward pre-hook names the modules when a model's root (`Transformer`
or a pipeline `StageChunk`) first runs and adds each a forward hook of its own (after the layout's: the
output seen is the module's, TP's redistribution done) and global optimizer step hooks (which count steps
and read the gradients before the update). Each rank writes its own record with its coordinates; ranks
that hold different data (data-parallel, context-parallel) add up, and tensor-parallel ranks add up
when their outputs are shards and count once when they are replicated (equal on every TP rank):
`merge_ranks`. A forward output that is a DTensor is gathered (`full_tensor`) and counts once.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

PROBE_FILE = "probe.rank{rank}.json"
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
SHAPE_INFERENCE = ("_forward_metadata_inference", "_shape_inference")  # torch pipelining's extra forward
REPLICATED_RTOL = 1e-6  # TP ranks whose output norms agree this closely hold the same (replicated) tensor


def _roots() -> tuple[type, ...]:
    from lmforge.model.transformer import Transformer
    from lmforge.parallel.pipeline import StageChunk

    return Transformer, StageChunk


def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _full(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the tensor whole, whether it is whole on every rank): a DTensor gathered over its mesh."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor(), True
    return t, False


def _in_shape_inference() -> bool:
    """Whether a pipeline schedule runs this forward to infer its stage's shapes (torch's
    PipelineStage._forward_metadata_inference in torch 2.13, _shape_inference before: the first
    step's extra forward, on empty tensors)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in SHAPE_INFERENCE:
            return True
        frame = frame.f_back
    return False


def _square(t: torch.Tensor) -> float:
    return float(t.detach().to(torch.float64).pow(2).sum())


class Probe:
    def __init__(self, step: int):
        self.step, self.done = step, 0
        self.names: dict[int, str] = {}
        self.modules: dict[str, nn.Module] = {}
        self.forward: dict[str, float] = {}
        self.whole: set[str] = set()  # outputs gathered whole (DTensor): count once across ranks
        self.order: list[str] = []
        self.gradient: dict[str, float] = {}
        self._optimizer = None
        self._skip = False  # the root's forward now running is a pipeline's shape inference
        self._handles = []

    def __enter__(self) -> Probe:
        from torch.optim import optimizer as opt

        self._handles = [nn.modules.module.register_module_forward_pre_hook(self._name_roots),
                         opt.register_optimizer_step_pre_hook(self._record_gradients),
                         opt.register_optimizer_step_post_hook(self._count)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    @property
    def recording(self) -> bool:
        return self.done + 1 == self.step

    def _name_roots(self, module: nn.Module, args) -> None:
        if isinstance(module, _roots()):
            self._skip = _in_shape_inference()
        if isinstance(module, _roots()) and id(module) not in self.names:
            for name, m in module.named_modules():
                if id(m) not in self.names:
                    self.names[id(m)] = _clean(name)
                    self.modules.setdefault(_clean(name), m)
                    # (the module's own hook, after those of the layout: TP's output redistribution has run)
                    self._handles.append(m.register_forward_hook(self._record_forward))

    def _record_forward(self, module: nn.Module, args, output) -> None:
        name = self.names.get(id(module))
        if not name or not self.recording or not torch.is_grad_enabled() or self._skip:
            return
        if torch._C._current_graph_task_id() != -1:  # a forward inside a backward: the recompute of checkpointing
            return
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        out, whole = _full(out)
        if whole:
            self.whole.add(name)
        if name not in self.forward:
            self.order.append(name)
        self.forward[name] = self.forward.get(name, 0.0) + _square(out)

    def _record_gradients(self, optimizer, args, kwargs) -> None:
        if self._optimizer is None:
            self._optimizer = optimizer
        if optimizer is not self._optimizer or not self.recording:
            return
        for name, module in sorted(self.modules.items()):  # (every rank of a mesh in one order: full_tensor gathers)
            grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            if grads:
                self.gradient[name] = sum(_square(_full(g)[0]) for g in grads)

    def _count(self, optimizer, args, kwargs) -> None:
        if optimizer is self._optimizer or self._optimizer is None:
            self.done += 1

    def write(self, path: Path, coords: dict[str, int]) -> None:
        path.write_text(json.dumps({"coords": coords, "forward": self.forward, "whole": sorted(self.whole),
                                    "order": self.order, "gradient": self.gradient}))


def read_probe(run: Path) -> dict:
    """A run's per-module norms at the probed step, the ranks merged: {"order": forward order,
    "forward": {name: norm}, "gradient": {name: norm (as the optimizer received it)}}."""
    ranks = [json.loads(p.read_text()) for p in sorted(Path(run).glob("probe.rank*.json"))]
    if not ranks:
        raise FileNotFoundError(f"{run} holds no probe records ({PROBE_FILE.format(rank='*')})")
    order = max((r["order"] for r in ranks), key=len) if len(ranks) == 1 else _order(ranks)
    return {"order": order, "forward": merge_ranks(ranks), "gradient": _gradients(ranks)}


def _order(ranks: list[dict]) -> list[str]:
    """Forward order over the pipeline stages (stage by stage), each stage's from its first rank."""
    seen, order = set(), []
    for r in sorted(ranks, key=lambda r: (r["coords"]["pp"], r["coords"]["rank"])):
        for name in r["order"]:
            if name not in seen:
                seen.add(name)
                order.append(name)
    return order


def merge_ranks(ranks: list[dict]) -> dict[str, float]:
    """Per module, the norm of its output over the whole step: ranks of other data (dp, cp) add up; the TP
    ranks of one (pp, dp, cp) add up when they hold shards, count once when replicated or gathered whole."""
    groups: dict[tuple[str, tuple], list[float]] = {}
    whole = {n for r in ranks for n in r["whole"]}
    for r in ranks:
        c = r["coords"]
        for name, sq in r["forward"].items():
            groups.setdefault((name, (c["pp"], c["dp"], c["cp"])), []).append(sq)
    total: dict[str, float] = {}
    for (name, _), values in groups.items():
        replicated = name in whole or max(values) - min(values) <= REPLICATED_RTOL * max(values)
        total[name] = total.get(name, 0.0) + (values[0] if replicated else sum(values))
    return {name: math.sqrt(sq) for name, sq in total.items()}


def _gradients(ranks: list[dict]) -> dict[str, float]:
    """Per module, its parameters' gradient norm: whole on every rank that holds the module (a DTensor's
    gathered; DDP's reduced), so the first rank's."""
    out: dict[str, float] = {}
    for r in sorted(ranks, key=lambda r: r["coords"]["rank"]):
        for name, sq in r["gradient"].items():
            out.setdefault(name, math.sqrt(sq))
    return out
