"""What a checkpoint holds, split by how it is stored.

* **Tensors** (model, optimizer state, this rank's RNG states) go to torch.distributed.checkpoint
  (DCP) under flat, layout-independent keys::

      model/<fqn>                  parameters and persistent buffers (full names, no wrapper prefixes)
      optim/<fqn>/<state key>      optimizer state per parameter (exp_avg, step, ...)
      rng/rank<r>/torch            this rank's torch CPU generator state (uint8)
      rng/rank<r>/cuda             ... and the CUDA one on a GPU

  DCP writes each rank's shard of a sharded (FSDP / DTensor) tensor and one copy of a replicated
  one, and reads back into whatever layout the loading run has (resharding by name).
* **Everything else** (step, tokens seen, data-loader position, LR-scheduler and grad-scaler
  state, optimizer hyperparameters and non-tensor state, python/numpy RNG, guard state) is plain
  JSON: no pickle anywhere, so loading a checkpoint can never execute code.

The model/optimizer state dicts come from `torch.distributed.checkpoint.state_dict`
(`get_state_dict` / `set_state_dict`), which handles plain modules, DDP, FSDP2 and DTensor alike.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

SEP = "/"  # FQNs contain dots, never slashes


def _flatten(prefix: str, tree: Any, tensors: dict[str, torch.Tensor], other: dict[str, Any]) -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _flatten(f"{prefix}{SEP}{k}", v, tensors, other)
    elif isinstance(tree, torch.Tensor):
        tensors[prefix] = tree
    else:
        other[prefix] = _to_json(tree)


def _to_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint: cannot store a {type(value).__name__} ({value!r}) as JSON")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_from_json(v) for v in value["__tuple__"])
    if isinstance(value, dict) and "__dtype__" in value:
        dtype = getattr(torch, value["__dtype__"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"checkpoint: unknown dtype {value['__dtype__']!r}")
        return dtype
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    return value


def _unflatten(prefix: str, tensors: dict[str, torch.Tensor], other: dict[str, Any]) -> dict:
    out: dict = {}
    head = prefix + SEP
    for key, value in [*tensors.items(), *((k, _from_json(v)) for k, v in other.items())]:
        if not key.startswith(head):
            continue
        node = out
        *parents, leaf = key[len(head):].split(SEP)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


# ---------------------------------------------------------------------------------------------
# model + optimizer
# ---------------------------------------------------------------------------------------------

def model_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, json) of the model and optimizer, keyed by parameter name.

    ZeRO-1 (ZeroRedundancyOptimizer): each rank stores the state of its own partition (its local
    optimizer); the keys are parameter names, so a run with another layout reads it back by name.
    """
    opts = StateDictOptions(full_state_dict=False, cpu_offload=False)
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, Any] = {}
    _flatten("model", get_model_state_dict(model, options=opts), tensors, other)
    if optimizer is not None:
        inner = _local_optimizer(optimizer)
        osd = get_optimizer_state_dict(model, inner, options=opts)
        _flatten("optim", osd["state"], tensors, other)
        other["optim_groups"] = [_to_json({k: v for k, v in g.items() if k not in ("params", "param_names")})
                                 for g in osd["param_groups"]]
    return tensors, other


def load_model_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                           tensors: dict[str, torch.Tensor], other: dict[str, Any]) -> None:
    """Inverse of `model_optim_state` (tensors already read into the run's own layout)."""
    opts = StateDictOptions(full_state_dict=False, strict=True)
    set_model_state_dict(model, _unflatten("model", tensors, other), options=opts)
    if optimizer is not None:
        inner = _local_optimizer(optimizer)
        state = _unflatten("optim", tensors, other)
        current = get_optimizer_state_dict(model, inner, options=StateDictOptions())
        own = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        set_optimizer_state_dict(model, inner, {"state": state, "param_groups": current["param_groups"]},
                                 options=opts)
        # hyperparameters, matched by the group's name (lmforge's groups are named "decay", "no_decay", ...;
        # a layout may split a group, e.g. TP into DTensor / plain parameters, or drop an empty one, e.g.
        # Muon's AdamW-decay group when its only matrix is a tied embedding), else by position.
        # (set_optimizer_state_dict matches groups through parameter names and can drop the keys of a
        # group that holds a tied weight or nothing, so they are set here.)
        saved = [_from_json(g) for g in other.get("optim_groups", [])]
        by_name = {g.get("group"): g for g in saved}
        named = None not in by_name and all(g.get("group") in by_name for g in inner.param_groups if g["params"])
        if not named and len(saved) != len(inner.param_groups):
            raise ValueError(f"checkpoint: the optimizer has {len(inner.param_groups)} parameter groups but "
                             f"the checkpoint {len(saved)}; was it written with another optim.name?")
        for i, group in enumerate(inner.param_groups):
            if named:  # (an empty group keeps its own settings, which the load above may have dropped)
                group.update(by_name.get(group.get("group"), own[i]))
            else:
                group.update(saved[i])


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def json_tensor(obj: Any) -> torch.Tensor:
    """A JSON-able object as a uint8 tensor (so DCP stores it per rank without pickling)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def tensor_json(t: torch.Tensor) -> Any:
    """Inverse of `json_tensor`."""
    return json.loads(bytes(t.to(torch.uint8).cpu().numpy()).decode())


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------

def rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    """This process's generator states as uint8 tensors under rank-specific keys: torch CPU (and
    CUDA), plus python's and numpy's states as JSON bytes."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    host = {"python": [version, list(state), gauss],
            "numpy": [np_state[0], base64.b64encode(np_state[1].astype("<u4").tobytes()).decode(),
                      int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    key = f"rng{SEP}rank{rank}{SEP}"
    out = {key + "torch": torch.get_rng_state(),
           key + "host": json_tensor(host)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[key + "cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng(rank: int, tensors: dict[str, torch.Tensor]) -> bool:
    """Restore this rank's generators from `rng_tensors` output; False if the checkpoint has no
    state for this rank (it was saved by fewer ranks)."""
    key = f"rng{SEP}rank{rank}{SEP}"
    if key + "torch" not in tensors:
        return False
    torch.set_rng_state(tensors[key + "torch"].to(torch.uint8).cpu())
    if key + "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[key + "cuda"].to(torch.uint8).cpu())
    host = tensor_json(tensors[key + "host"])
    version, state, gauss = host["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = host["numpy"]
    np.random.set_state((name, np.frombuffer(base64.b64decode(keys), dtype="<u4").astype(np.uint32),
                         pos, has_gauss, cached))
    return True
