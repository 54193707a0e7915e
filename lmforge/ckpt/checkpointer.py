"""Checkpointing a run's state: a mapping of named `Stateful` objects plus run metadata in, files
out, and back. It knows nothing of the trainer (torchtitan's `CheckpointManager(states=...)` shape).

    manager = manager_for_run(cfg, out_dir, dist_info, on_event)   # every rank
    save_states(manager, step, states, meta)          # every rank, at the same step (async by default)
    path = resolve_resume(cfg.checkpoint, manager)     # newest valid checkpoint, an explicit path, or None
    check_compatible(read_meta(path), cfg, path)       # model / optimizer must match the config
    load_states(manager, path, states, cfg.model)      # every rank; any world size / layout

`states` maps names to objects with `state_dict()` / `load_state_dict()` (lmforge.ckpt.state): their
tensors go through DCP (resharded by key on load), everything else into one JSON file that rank 0
writes. Loading reads the JSON and each state's tensors into the state's own current tensors (the
run's layout), then calls its `load_state_dict`; tensors the checkpoint lacks are left out of the
dict the state receives, and the state decides whether that is an error.

Bit-exact resume on CPU: model, optimizer, LR scheduler, grad scaler, data position, guard window
and every rank's generators are states, so N steps + kill + resume + N steps equals 2N straight
steps bit for bit.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from lmforge.ckpt.manager import WAIT_GROUP_TIMEOUT, CheckpointManager
from lmforge.ckpt.safe_io import safe_read_metadata
from lmforge.ckpt.state import Stateful, join_state, split_state
from lmforge.config import Config, ConfigError, ModelConfig
from lmforge.model.layers import fuse_qkv, split_qkv
from lmforge.folders import CHECKPOINTS
from lmforge.parallel.mesh import DistInfo, folder_is_shared

log = logging.getLogger("lmforge.ckpt")

# model settings that change the meaning of the weights; anything else (batch, lr, steps, layout,
# precision, activation checkpointing, ...) may differ between the checkpoint and the resuming run
# (model.fused_qkv is the q/k/v layout: load_states converts a checkpoint of the other layout)
_HARMLESS_MODEL_KEYS = ("dropout", "init_std", "fused_qkv")
# model.parametrization ("sp" / "mup") changes the meaning of the weights (μP's forward multipliers) and the
# optimizer's per-group learning rates: a μP checkpoint never resumes as SP, nor the reverse
_MUP_BASE_KEYS = ("mup_base_width", "mup_base_head_dim")


def manager_for_run(cfg: Config, out_dir: Path, info: DistInfo, on_event: Callable[[dict], None],
                    run_id: str = "") -> CheckpointManager:
    """The run's checkpoint manager (every rank): folder, rotation, validation, S3 backup, and a gloo
    group of its own for the collectives of its background thread (they must never interleave with
    the training collectives), plus a second one on which the other ranks wait for rank 0's (or the
    node leaders') checkpoint-sized work with a timeout sized to it, never parallel.timeout_s
    (lmforge.ckpt.manager's docstring).

    When the ranks do not share the checkpoint folder (node-local disks, found by a probe file), a
    checkpoint can only be resumed through the S3 backup, so checkpoint.s3_bucket is then required
    (a ConfigError names the two keys otherwise); each node's local rank 0 then backs its files up.

    `run_id` (the same on every rank) keys the run's S3 objects; rank 0 checks that the bucket holds
    no other run's backup under the run's folder name (`S3Backup.claim`), or adopts it when
    checkpoint.s3_adopt says so: the manager's `run_id` is then the adopted run's, on every rank."""
    c = cfg.checkpoint
    root = Path(os.path.expandvars(c.dir)).expanduser() if c.dir else Path(out_dir) / CHECKPOINTS
    pg = wait_pg = None
    if dist.is_available() and dist.is_initialized():
        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s))
        wait_pg = dist.new_group(backend="gloo", timeout=WAIT_GROUP_TIMEOUT)
    node_local = not folder_is_shared(root, info)
    if node_local and not c.s3_bucket:
        raise ConfigError(
            f"checkpoint.dir = {str(root)!r} is not the same folder on every node (node-local disks): a checkpoint "
            f"spread over them cannot be resumed. Set checkpoint.dir to a folder every node sees (a shared file "
            f"system), or checkpoint.s3_bucket so that every node restores from the backup.")
    leader = info.local_rank == 0 if node_local else info.rank == 0
    backup, problem = None, [None]
    if c.s3_bucket and leader:  # the endpoint and bucket are checked once, here, before any training
        from lmforge.ckpt.s3 import S3Backup

        try:
            backup = S3Backup(c.s3_bucket, c.s3_prefix, Path(out_dir).name, c.s3_endpoint, on_event=on_event,
                              run_id=run_id, out_dir=os.path.abspath(out_dir))
            backup.check()
            if info.rank == 0:
                run_id = backup.claim(adopt=c.s3_adopt)
        except ConfigError as e:
            problem[0] = str(e)
    if pg is not None and c.s3_bucket:  # every rank stops with the first verdict (no rank left waiting)
        verdicts: list[Any] = [None] * info.world_size
        dist.all_gather_object(verdicts, (problem[0], run_id), group=pg)
        problem[0] = next((v for v, _ in verdicts if v), None)
        run_id = verdicts[0][1]  # rank 0's claim (an adopted run's id)
        if backup is not None:
            backup.run_id = run_id
    if problem[0]:
        raise ConfigError(problem[0])
    if node_local and info.rank == 0:
        log.info("checkpoint: %s is node-local (not shared by every rank): each node keeps its shards and backs "
                 "them up to s3://%s; a resume restores from there", root, c.s3_bucket)
    manager = CheckpointManager(root, rank=info.rank, world_size=info.world_size, async_save=c.async_save,
                                validate=c.validate, keep_last=c.keep_last, keep_every=c.keep_every, backup=backup,
                                process_group=pg, wait_group=wait_pg, timeout_s=cfg.parallel.timeout_s,
                                on_event=on_event, local_rank=info.local_rank, node_local=node_local,
                                max_failed_saves=c.max_failed_saves)
    manager.run_id = run_id
    return manager


def save_states(manager: CheckpointManager, step: int, states: Mapping[str, Stateful], meta: dict[str, Any]) -> None:
    """Checkpoint `states` at `step` (every rank calls this, in the same order). The time spent
    building the state dicts counts as blocking time, with the staging copy."""
    t0 = time.perf_counter()
    tensors: dict = {}
    trees: dict[str, Any] = {}
    for name, state in states.items():
        t, trees[name] = split_state(name, state.state_dict())
        tensors.update(t)
    manager.save(step, tensors, trees, meta, started=t0)


def load_states(manager: CheckpointManager, path: Path, states: Mapping[str, Stateful],
                model: ModelConfig | None = None) -> None:
    """Restore `states` from the checkpoint at `path` (every rank; any world size or layout). With the
    run's `model` config, a checkpoint saved with the other q/k/v layout (model.fused_qkv) loads too:
    `_qkv_conversions`."""
    stored = safe_read_metadata(path).state_dict_metadata
    tensors: dict = {}
    trees: dict[str, Any] = {}
    wanted: dict = {}
    for name, state in states.items():
        t, trees[name] = split_state(name, state.state_dict())
        tensors.update({k: v for k, v in t.items() if k in stored})
        wanted.update({k: v for k, v in t.items() if k not in stored})
    convert = _qkv_conversions(wanted, stored, model) if model is not None else {}
    for sources in convert.values():  # each source whole, in plain tensors
        tensors.update({k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype)
                        for k in sources if k not in tensors})
    saved = manager.load(path, tensors)
    for key, sources in convert.items():
        tensors[key] = _place(_convert_qkv(model, key, [tensors[k] for k in sources]), wanted[key])
    for key in {k for sources in convert.values() for k in sources}:
        del tensors[key]  # (the checkpoint's layout: this run's states have no such entries)
    for name, state in states.items():
        state.load_state_dict(join_state(_merge(saved.get(name, _MISSING), trees[name]), tensors))


_QKV = re.compile(r"(.*\battn\.)(wqkv|wq|wk|wv)(\.(?:weight|bias)(?:/.*)?)")
# a LoRA adapter of q, k or v: `attn.wq.lora_a` (separate) is `attn.wqkv.lora.wq.lora_a` (fused), the same tensor
_QKV_ADAPTER = re.compile(r"(.*\battn\.)(wqkv\.lora\.)?(wq|wk|wv)(\.lora_[ab](?:/.*)?)")


def _qkv_conversions(wanted: Mapping[str, torch.Tensor], stored: Mapping[str, Any],
                     model: ModelConfig) -> dict[str, list[str]]:
    """For each q/k/v tensor this run needs (`wanted`: weights and their optimizer state) that the
    checkpoint holds in the other layout (model.fused_qkv): the checkpoint keys it is made of (the
    separate wq, wk, wv ones for a fused `attn.wqkv`; the fused one for each of wq, wk, wv; a LoRA
    adapter of q, k or v under its other name: lmforge.model.lora.FusedQKVLoRA)."""
    out = {}
    for key in wanted:
        a = _QKV_ADAPTER.fullmatch(key)
        if a is not None:  # (renamed only: the adapters are the same in both layouts)
            other = f"{a[1]}{a[3]}{a[4]}" if a[2] else f"{a[1]}wqkv.lora.{a[3]}{a[4]}"
            if other in stored:
                out[key] = [other]
            continue
        m = _QKV.fullmatch(key)
        if m is None:
            continue
        names = ["wq", "wk", "wv"] if m[2] == "wqkv" else ["wqkv"]
        sources = [f"{m[1]}{n}{m[3]}" for n in names]
        if all(k in stored for k in sources):
            out[key] = sources
    return out


def _convert_qkv(model: ModelConfig, key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The whole tensor `key` of this run's q/k/v layout from the checkpoint's `parts` (_qkv_conversions):
    fused rows by lmforge.model.layers.qkv_layout. A 0-d state (an optimizer's step) is shared."""
    if parts[0].dim() == 0 or _QKV_ADAPTER.fullmatch(key):
        return parts[0]
    rows = {"wq": model.n_heads, "wk": model.kv_heads, "wv": model.kv_heads, "wqkv": model.n_heads + 2 * model.kv_heads}
    name = _QKV.fullmatch(key)[2]
    got = [p.shape[0] for p in parts]
    need = [rows[n] * model.head_dim for n in (["wq", "wk", "wv"] if name == "wqkv" else ["wqkv"])]
    if got != need:  # (a state that is not one value per row: e.g. a factored second moment's columns)
        raise ValueError(f"{key}: the checkpoint holds it in the other q/k/v layout (model.fused_qkv) and this "
                         f"state ({list(parts[0].shape)}) cannot be converted by rows; resume with the "
                         f"checkpoint's model.fused_qkv.")
    if name == "wqkv":
        return fuse_qkv(model, *parts)
    return split_qkv(model, parts[0])[["wq", "wk", "wv"].index(name)]


def _place(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` in the layout of this run's tensor `like` (plain, or a DTensor: this rank's shard)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(device=like.device, dtype=like.dtype, copy=True)  # (never shared: wq/wk/wv's step is one tensor each)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


_MISSING = object()


def _merge(saved: Any, mine: Any) -> Any:
    """The checkpoint's tree (rank 0's JSON) with this rank's tensor references added (per-rank
    tensors, e.g. its generators or its ZeRO-1 partition, appear only in their rank's tree) and this
    run's values where the checkpoint has none."""
    if _is_ref(mine):
        return mine
    if isinstance(saved, dict) and isinstance(mine, dict) and not _is_ref(saved):
        return {k: _merge(saved.get(k, _MISSING), mine.get(k, _MISSING)) for k in [*saved, *(k for k in mine
                                                                                          if k not in saved)]}
    return mine if saved is _MISSING else saved


def _is_ref(node: Any) -> bool:
    return isinstance(node, dict) and "__tensor__" in node


def check_compatible(meta: dict, cfg: Config, path: Path) -> None:
    """Refuse a checkpoint whose weights or optimizer state cannot belong to this config."""
    saved = meta.get("config", {})
    new_model = cfg.to_dict()["model"]
    # a key the checkpoint predates had its default then (model.parametrization: "sp")
    old_model = {**Config().to_dict()["model"], **saved["model"]} if saved.get("model") else {}
    harmless = _HARMLESS_MODEL_KEYS
    if old_model.get("parametrization") == new_model.get("parametrization") == "sp":
        harmless += _MUP_BASE_KEYS  # (the μP base shapes mean nothing under SP)
    diffs = [f"model.{k}: checkpoint {old_model.get(k)!r}, config {new_model.get(k)!r}"
             for k in sorted(set(old_model) | set(new_model))
             if k not in harmless and old_model.get(k) != new_model.get(k)]
    if meta.get("optimizer") and meta["optimizer"] != cfg.optim.name:
        diffs.append(f"optim.name: checkpoint {meta['optimizer']!r}, config {cfg.optim.name!r}")
    if diffs:
        raise ConfigError(
            f"checkpoint {path} is incompatible with this config ({'; '.join(diffs)}). Use the checkpoint's "
            f"settings, or start a fresh run with --checkpoint.resume none or another --train.out_dir.")


def resolve_resume(c, manager: CheckpointManager) -> Path | None:
    """The checkpoint to continue from per `checkpoint.resume` (None = start fresh)."""
    if c.resume == "none":
        return None
    if c.resume == "auto":
        return manager.latest_valid()
    path = Path(c.resume).expanduser()
    try:
        manager.verify(path)  # (hashed on rank 0 only, as for "auto")
    except ValueError as e:
        raise ValueError(f"checkpoint.resume = {c.resume!r}: {e}") from e
    return path
