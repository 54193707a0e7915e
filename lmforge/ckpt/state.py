"""What a checkpoint holds: a mapping of named `Stateful` objects (torch's protocol, as in
torchtitan: `state_dict()` / `load_state_dict()`), each state dict split by how it is stored.

* **Tensors** go to torch.distributed.checkpoint (DCP) under flat, layout-independent keys
  ``<state name>/<path>``, e.g.::

      model/weights/<fqn>              parameters and persistent buffers (full names, no wrapper prefixes)
      model/optim/<fqn>/<state key>    optimizer state per parameter (exp_avg, step, ...; a number
                                       such as LAMB's int step is stored as a 0-d tensor)
      rng/rank<r>/torch                this rank's torch CPU generator state (uint8); cuda, python, numpy

  DCP writes each rank's shard of a sharded (FSDP / DTensor) tensor and one copy of a replicated
  one, and reads back into whatever layout the loading run has (resharding by name).
* **Everything else** (the trainer's step and counters, data-loader position, LR-scheduler and
  grad-scaler state, optimizer hyperparameters, guard state) is plain JSON in one file: no pickle
  anywhere, so loading a checkpoint can never execute code. JSON parts are global (equal on every
  rank); per-rank state is tensors under per-rank keys.

`lmforge.ckpt.checkpointer` saves and loads such a mapping. This module holds the splitting and the
two states that live below the trainer: the model with its optimizer (`ModelOptimizerState`, through
`torch.distributed.checkpoint.state_dict`, which handles plain modules, DDP, FSDP2 and DTensor
alike) and the random generators (`RNGState`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

SEP = "/"  # FQNs contain dots, never slashes


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def split_state(name: str, tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """(tensors keyed `name/path`, the tree with each tensor replaced by its key as {"__tensor__": key},
    other leaves made JSON-able)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(path: str, node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return {"__tensor__": path}
        if isinstance(node, Mapping):
            assert all(isinstance(k, str) and SEP not in k for k in node), list(node)
            return {k: walk(f"{path}{SEP}{k}", v) for k, v in node.items()}
        return _to_json(node)

    return tensors, walk(name, tree)


def join_state(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `split_state`: put the (loaded) tensors back; keys absent from `tensors` (not in the
    checkpoint) are left out of their mapping, so the state decides what a missing entry means."""
    if isinstance(tree, dict) and "__tensor__" in tree:
        raise AssertionError("join_state: a tensor leaf must sit in a mapping")
    if isinstance(tree, dict) and ("__tuple__" in tree or "__dtype__" in tree):
        return _from_json(tree)
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            if isinstance(v, dict) and "__tensor__" in v:
                if v["__tensor__"] in tensors:
                    out[k] = tensors[v["__tensor__"]]
            else:
                out[k] = join_state(v, tensors)
        return out
    return _from_json(tree)


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


# ---------------------------------------------------------------------------------------------
# model + optimizer
# ---------------------------------------------------------------------------------------------

class ModelOptimizerState:
    """The model's parameters and the optimizer's state, keyed by parameter name, so a checkpoint
    reshards across layouts (`get_state_dict` / `set_state_dict` of torch.distributed.checkpoint).

    ZeRO-1 (ZeroRedundancyOptimizer): each rank holds the state of its own partition (its local
    optimizer) under the parameters' names, so a run with another layout reads it back by name.
    Numbers in the per-parameter state (LAMB's and 8-bit Adam's int `step`) travel as 0-d tensors,
    so they follow their parameter like the moments do."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        opts = StateDictOptions(full_state_dict=False, cpu_offload=False)
        out: dict[str, Any] = {"weights": get_model_state_dict(self.model, options=opts)}
        if self.optimizer is not None:
            osd = get_optimizer_state_dict(self.model, local_optimizer(self.optimizer), options=opts)
            out["optim"] = {fqn: {k: _number_tensor(v) for k, v in st.items()} for fqn, st in osd["state"].items()}
            out["optim_groups"] = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
                                   for g in osd["param_groups"]]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        current = self.state_dict()  # what this run's layout holds: every entry must be in the checkpoint
        missing = [f"weights/{k}" for k in current["weights"] if k not in state_dict.get("weights", {})]
        missing += [f"optim/{fqn}/{k}" for fqn, st in current.get("optim", {}).items() for k in st
                    if k not in state_dict.get("optim", {}).get(fqn, {})]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors this run needs (e.g. {missing[:3]}); it was "
                             f"written by another model or optimizer configuration.")
        opts = StateDictOptions(full_state_dict=False, strict=True)
        set_model_state_dict(self.model, state_dict["weights"], options=opts)
        if self.optimizer is None:
            return
        inner = local_optimizer(self.optimizer)
        template = get_optimizer_state_dict(self.model, inner, options=StateDictOptions())
        state = {fqn: {k: _from_number_tensor(v, template["state"].get(fqn, {}).get(k)) for k, v in st.items()}
                 for fqn, st in state_dict["optim"].items() if fqn in current["optim"]}
        own = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        set_optimizer_state_dict(self.model, inner, {"state": state, "param_groups": template["param_groups"]},
                                 options=opts)
        # hyperparameters, matched by the group's name (lmforge's groups are named "decay", "no_decay", ...;
        # a layout may split a group, e.g. TP into DTensor / plain parameters, or drop an empty one, e.g.
        # Muon's AdamW-decay group when its only matrix is a tied embedding), else by position.
        # (set_optimizer_state_dict matches groups through parameter names and can drop the keys of a
        # group that holds a tied weight or nothing, so they are set here.)
        saved = state_dict.get("optim_groups", [])
        by_name = {g.get("group"): g for g in saved}
        named = None not in by_name and all(g.get("group") in by_name for g in inner.param_groups if g["params"])
        if not named and len(saved) != len(inner.param_groups):
            raise ValueError(f"the optimizer has {len(inner.param_groups)} parameter groups but the checkpoint "
                             f"{len(saved)}; was it written with another optim.name?")
        for i, group in enumerate(inner.param_groups):
            if named:  # (an empty group keeps its own settings, which the load above may have dropped)
                group.update(by_name.get(group.get("group"), own[i]))
            else:
                group.update(saved[i])
            # what the group is, as this run built it, is not a hyperparameter: groups of one name may
            # differ in it (Muon's fused q/k/v group, `qkv_heads`), and the checkpoint's layout may too
            group.update({k: own[i][k] for k in _STRUCTURAL_GROUP_KEYS if k in own[i]})


# param-group keys that say what a group holds rather than how it trains: kept from the run's own
# optimizer when a checkpoint's hyperparameters are loaded
_STRUCTURAL_GROUP_KEYS = ("group", "use_muon", "qkv_heads")


def _number_tensor(value: Any) -> Any:
    """A python number in optimizer state as a 0-d tensor (int64 / float64), tensors unchanged."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)


def _from_number_tensor(value: Any, like: Any) -> Any:
    """Inverse of `_number_tensor`, by the type the run's own optimizer keeps for that entry."""
    if isinstance(like, (int, float)) and not isinstance(like, bool) and isinstance(value, torch.Tensor):
        return type(like)(value.item())
    return value


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that holds this rank's state: ZeroRedundancyOptimizer's inner one, else `optimizer`."""
    zero = sys.modules.get("torch.distributed.optim")  # (not imported: no ZeroRedundancyOptimizer can exist;
    if zero is None:                                    # importing it scripts torch's functional optimizers, 0.2 s)
        return optimizer
    return optimizer.optim if isinstance(optimizer, zero.ZeroRedundancyOptimizer) else optimizer


# ---------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------

class RNGState:
    """This process's generators (torch CPU and CUDA, python, numpy) under rank-specific keys. A
    checkpoint from fewer ranks has no entry for this rank: it keeps its seed (`restored` False)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.restored = False

    def state_dict(self) -> dict[str, Any]:
        """Fixed-size tensors only (a checkpoint's tensors are read into tensors of the saving shape)."""
        version, words, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        assert name == "MT19937", name
        mine = {"torch": torch.get_rng_state(),
                "python": torch.tensor([version, *words], dtype=torch.int64),
                "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
                "numpy": torch.from_numpy(keys.astype(np.int64)),
                "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
                "numpy_gauss": torch.tensor([cached], dtype=torch.float64)}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mine["cuda"] = torch.cuda.get_rng_state()
        return {f"rank{self.rank}": mine}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = state_dict.get(f"rank{self.rank}", {})
        self.restored = all(k in mine for k in ("torch", "python", "python_gauss", "numpy", "numpy_pos", "numpy_gauss"))
        if not self.restored:
            return
        torch.set_rng_state(mine["torch"].to(torch.uint8).cpu())
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["cuda"].to(torch.uint8).cpu())
        version, *words = mine["python"].tolist()
        has_gauss, gauss = mine["python_gauss"].tolist()
        random.setstate((version, tuple(words), gauss if has_gauss else None))
        pos, np_has_gauss = mine["numpy_pos"].tolist()
        np.random.set_state(("MT19937", mine["numpy"].numpy().astype(np.uint32), pos, np_has_gauss,
                             mine["numpy_gauss"].item()))
