"""The trainer's side of checkpointing: what goes into a checkpoint and how a run continues from one.

    manager = make_manager(trainer)       # every rank; a gloo group reserved for checkpoint I/O
    save_checkpoint(trainer)              # every rank, at the same step
    path = manager.latest_valid()         # newest checkpoint passing its checksums (or S3 restore)
    load_checkpoint(trainer, path)        # every rank; any world size / data-parallel layout

Bit-exact resume on CPU: the model, the optimizer state, the LR scheduler, the grad scaler, the data
position (global sample index), the guard's window and every rank's python/numpy/torch generators
are restored, so N steps + kill + resume + N steps equals 2N straight steps bit for bit.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lmforge.ckpt.manager import CheckpointManager, read_meta
from lmforge.ckpt.safe_io import safe_read_metadata
from lmforge.ckpt.state import (SEP, _from_json, _to_json, json_tensor, load_model_optim_state, model_optim_state,
                                 rng_tensors, set_rng, tensor_json)
from lmforge.config import ConfigError

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer

log = logging.getLogger("lmforge.ckpt")

# model settings that change the meaning of the weights; anything else (batch, lr, steps, layout,
# precision, activation checkpointing, ...) may differ between the checkpoint and the resuming run
_HARMLESS_MODEL_KEYS = ("dropout", "init_std")


def make_manager(trainer: "Trainer") -> CheckpointManager:
    cfg, c = trainer.cfg, trainer.cfg.checkpoint
    root = Path(c.dir) if c.dir else trainer.out_dir / "checkpoints"
    pg = None
    if trainer.dist.distributed:
        # checkpoint collectives run in a background thread: give them their own (gloo) group so they
        # never interleave with the training collectives on the default group
        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s))
    backup = None
    if c.s3_bucket and trainer.dist.rank == 0:
        from lmforge.ckpt.s3 import S3Backup

        backup = S3Backup(c.s3_bucket, c.s3_prefix, trainer.out_dir.name, c.s3_endpoint, on_event=trainer.log_event)
    return CheckpointManager(root, rank=trainer.dist.rank, world_size=trainer.dist.world_size,
                             async_save=c.async_save, validate=c.validate, keep_last=c.keep_last,
                             keep_every=c.keep_every, backup=backup, process_group=pg, on_event=trainer.log_event)


def save_checkpoint(trainer: "Trainer") -> None:
    """Checkpoint the trainer at its current step (every rank calls this)."""
    rank = trainer.dist.rank
    tensors, other = model_optim_state(trainer.model, trainer.optimizer)
    tensors.update(rng_tensors(rank))
    # this rank's non-tensor optimizer state (per-parameter ints, hyperparameters) as JSON bytes:
    # with ZeRO-1 each rank owns different parameters, so every rank stores its own
    tensors[f"json{SEP}rank{rank}"] = json_tensor(other)
    state = {
        "step": trainer.step, "tokens_seen": trainer.tokens_seen, "batches_drawn": trainer.batches_drawn,
        "skip_batches": sorted(trainer.skip_batches), "rollbacks": trainer.rollbacks,
        "loader": trainer.loader.state_dict(), "scheduler": _to_json(trainer.scheduler.state_dict()),
        "scaler": _to_json(trainer.precision.scaler.state_dict()),
        "guard": trainer.guard.state_dict() if trainer.guard is not None else None,
        "last_loss": trainer.last_loss,
    }
    meta = {"loss": trainer.last_loss, "tokens_seen": trainer.tokens_seen, "config": trainer.cfg.to_dict(),
            "layout": trainer.layout, "optimizer": trainer.cfg.optim.name}
    with trainer.timers("checkpoint"):
        trainer.ckpt.save(trainer.step, tensors, state, meta)


def check_compatible(trainer: "Trainer", meta: dict, path: Path) -> None:
    """Refuse a checkpoint whose weights or optimizer state cannot belong to this config."""
    saved = meta.get("config", {})
    old_model, new_model = saved.get("model", {}), trainer.cfg.to_dict()["model"]
    diffs = [f"model.{k}: checkpoint {old_model.get(k)!r}, config {new_model.get(k)!r}"
             for k in sorted(set(old_model) | set(new_model))
             if k not in _HARMLESS_MODEL_KEYS and old_model.get(k) != new_model.get(k)]
    if meta.get("optimizer") and meta["optimizer"] != trainer.cfg.optim.name:
        diffs.append(f"optim.name: checkpoint {meta['optimizer']!r}, config {trainer.cfg.optim.name!r}")
    if diffs:
        raise ConfigError(
            f"checkpoint {path} is incompatible with this config ({'; '.join(diffs)}). Use the checkpoint's "
            f"settings, or start a fresh run with --checkpoint.resume none or another --train.out_dir.")


def resolve_resume(trainer: "Trainer") -> Path | None:
    """The checkpoint to continue from per `checkpoint.resume` (None = start fresh)."""
    how = trainer.cfg.checkpoint.resume
    if how == "none":
        return None
    if how == "auto":
        return trainer.ckpt.latest_valid()
    path = Path(how).expanduser()
    try:
        trainer.ckpt.verify(path)  # (hashed on rank 0 only, as for "auto")
    except ValueError as e:
        raise ValueError(f"checkpoint.resume = {how!r}: {e}") from e
    return path


def load_checkpoint(trainer: "Trainer", path: Path) -> None:
    """Restore the trainer from `path` (every rank; the checkpoint may come from any world size)."""
    meta = read_meta(path)
    check_compatible(trainer, meta, path)
    rank = trainer.dist.rank
    stored = safe_read_metadata(path).state_dict_metadata
    tensors, _ = model_optim_state(trainer.model, trainer.optimizer)
    missing = [k for k in tensors if k not in stored]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors this run needs (e.g. {missing[:3]}); "
                         f"it was written by another model or optimizer configuration.")
    # every rank's JSON blob (ZeRO-1 spreads non-tensor optimizer state over ranks) + our own RNG
    extra = [k for k in stored if k.startswith(f"json{SEP}") or k.startswith(f"rng{SEP}rank{rank}{SEP}")]
    for key in extra:
        md = stored[key]
        tensors[key] = torch.empty(md.size, dtype=md.properties.dtype)
    state = trainer.ckpt.load(path, tensors)
    other: dict[str, Any] = {}
    for key in sorted(k for k in extra if k.startswith(f"json{SEP}")):
        blob = tensor_json(tensors[key])
        groups = blob.pop("optim_groups", None)
        if groups is not None and ("optim_groups" not in other or key == f"json{SEP}rank{rank}"):
            other["optim_groups"] = groups
        other.update(blob)
    load_model_optim_state(trainer.model, trainer.optimizer, tensors, other)
    if not set_rng(rank, tensors):
        log.warning("checkpoint: %s has no RNG state for rank %d (saved by %s ranks); this rank keeps its seed",
                    path, rank, meta.get("world_size"))
    trainer.step = int(state["step"])
    trainer.tokens_seen = int(state["tokens_seen"])
    trainer.batches_drawn = int(state.get("batches_drawn", state["step"]))
    trainer.skip_batches = set(trainer.skip_batches) | {int(b) for b in state.get("skip_batches", [])}
    trainer.rollbacks = max(trainer.rollbacks, int(state.get("rollbacks", 0)))
    trainer.last_loss = float(state.get("last_loss", float("nan")))
    trainer.loader.load_state_dict(state["loader"])
    # the schedule's position comes from the checkpoint; its shape (steps, base LRs, number of param
    # groups, which a layout may split) from this run's config
    saved = _from_json(state["scheduler"])
    sched = trainer.scheduler.state_dict()
    sched.update({k: saved[k] for k in ("last_epoch", "_step_count") if k in saved})
    sched["lr_lambdas"] = [None] * len(trainer.scheduler.lr_lambdas)
    trainer.scheduler.load_state_dict(sched)
    # the LR of the next step from this run's schedule (the optimizer's saved lr may be stale: ZeRO-1's
    # local optimizer only sees the scheduler's value at its next step)
    lrs = [base * factor(trainer.scheduler.last_epoch)
           for base, factor in zip(trainer.scheduler.base_lrs, trainer.scheduler.lr_lambdas)]
    for group, lr in zip(trainer.optimizer.param_groups, lrs):
        group["lr"] = lr
    trainer.scheduler._last_lr = lrs
    if state.get("scaler"):
        trainer.precision.scaler.load_state_dict(_from_json(state["scaler"]))
    if trainer.guard is not None and state.get("guard"):
        trainer.guard.load_state_dict(state["guard"])
    log.info("resumed from %s: step %d, %s tokens seen (saved by %s rank(s) as %s)", path, trainer.step,
             f"{trainer.tokens_seen:,}", meta.get("world_size"), meta.get("layout"))
