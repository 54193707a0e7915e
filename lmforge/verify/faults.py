"""TEST-ONLY: layouts broken on purpose, to show that `lmforge plan --verify` names the module where a
layout leaves one process (tests/test_verify_localise.py). Nothing in training reads this module; only
the verify rank driver (lmforge/verify/rank.py) installs a fault, and only when the environment variable
LMFORGE_VERIFY_FAULT names one (an unknown name is an error) in a multi-process run: the one-process
reference stays correct. Each fault is a hook on the model's modules, added when a model root (a
`Transformer`, or a pipeline `StageChunk`) first runs; production code paths are not touched.

  tp-row-bias-twice    every row-parallel nn.Linear with a bias (TP: weight sharded along its input)
                       adds its bias again after the all-reduce: the bias counted twice
  pp-stage-grad-unscaled  the first pipeline stage's parameters receive their gradients SKIPPED_SCALE
                       times too large: the stage skipped the 1 / micro-batches scale of its gradients
  cp-chunks-swapped    each context-parallel rank's two chunks of every sequence swapped in the input
                       tokens (the targets not): the chunks at each other's positions
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from lmforge.model.sharded import local_part

FAULT_ENV = "LMFORGE_VERIFY_FAULT"
SKIPPED_SCALE = 4.0  # the toy's micro-batches per step at pp = 2 (2 x pp): the scale a stage would skip


def _row_parallel(m: nn.Module) -> bool:
    from torch.distributed.tensor import Shard

    placements = getattr(m.weight, "placements", ()) if isinstance(m, nn.Linear) else ()
    return m.bias is not None and any(isinstance(p, Shard) and p.dim == 1 for p in placements)


def tp_row_bias_twice(root: nn.Module) -> None:
    for m in root.modules():
        if isinstance(m, nn.Linear) and _row_parallel(m):
            m.register_forward_hook(lambda mod, args, out: out + local_part(mod.bias).to(out.dtype))


def pp_stage_grad_unscaled(root: nn.Module) -> None:
    from lmforge.parallel.pipeline import StageChunk

    if isinstance(root, StageChunk) and root.tok_emb is not None:  # the first stage
        for p in root.parameters():
            p.register_hook(lambda g: g * SKIPPED_SCALE)


def cp_chunks_swapped(root: nn.Module, args: tuple):
    """(a root's forward arguments, each forward: the tokens with this CP rank's two chunks swapped)"""
    from lmforge.model.layers import current_shard

    if current_shard() is None or not torch.is_grad_enabled() or not args:
        return None
    tokens = args[0]
    half = tokens.shape[1] // 2
    return (torch.cat([tokens[:, half:], tokens[:, :half]], dim=1), *args[1:])


FAULTS = {"tp-row-bias-twice": tp_row_bias_twice, "pp-stage-grad-unscaled": pp_stage_grad_unscaled}
PER_FORWARD = {"cp-chunks-swapped": cp_chunks_swapped}  # faults that change a root's arguments at each forward


@contextlib.contextmanager
def installed(name: str | None) -> Iterator[None]:
    """The fault `name` (None: none) on every model root this process runs, in a multi-process run."""
    if not name or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        yield
        return
    if name not in FAULTS and name not in PER_FORWARD:
        raise ValueError(f"{FAULT_ENV}={name!r} is not one of {', '.join([*FAULTS, *PER_FORWARD])} (test-only faults)")
    from lmforge.verify.probe import _roots

    broken: set[int] = set()

    def install(module: nn.Module, args):
        if not isinstance(module, _roots()):
            return None
        if name in FAULTS and id(module) not in broken:
            broken.add(id(module))
            FAULTS[name](module)
        return PER_FORWARD[name](module, args) if name in PER_FORWARD else None

    handle = nn.modules.module.register_module_forward_pre_hook(install)
    try:
        yield
    finally:
        handle.remove()
