"""Checkpoint folder management: asynchronous, atomic, checksummed, validated, rotated, backed up.

    <dir>/step_00000200/          a finished checkpoint
        __0_0.distcp, ...         DCP shards (each rank writes its own)
        .metadata                 DCP's index of the shards
        trainer_state.json        step, tokens, data position, scheduler, scaler, guard, ... (JSON)
        meta.json                 written last: step, loss, time, versions, config, sha256 + size per file
    <dir>/step_00000300.tmp/      a checkpoint being written (never read; removed at start-up)

Save (every rank calls it; collectives inside):
  1. wait for the previous save to finish (that wait is the only blocking besides step 2)
  2. copy the state to host memory (DCP async staging) and return to training
  3. background: DCP writes the shards (+ fsync) -> rank 0 writes trainer_state.json and meta.json
     with the checksums, fsyncs, renames `.tmp` to the final name, fsyncs the parent folder ->
     validates (re-hash + test load) -> rotates older checkpoints (keep-last-N + keep-every-M) ->
     uploads to S3 (if configured).
A crash at any point leaves either the complete new checkpoint or only a `.tmp` folder; older
checkpoints are deleted only after a newer one passed validation. A failed write is logged, its
`.tmp` removed, and training goes on, but not for long: the error names its cause (a full disk:
ENOSPC, the bytes free and the bytes the checkpoint needs; the free space is also checked before
writing, so a checkpoint that cannot fit is not attempted), a save after a failed one is waited for
(so the count is known at once), and `max_failed_saves` consecutive failures stop the run with
CheckpointFailure (the command exits EXIT_CHECKPOINT_FAILED) instead of training on unprotected.

Waiting for the leader (ARCHITECTURE.md, "Collectives"). Work that grows with the checkpoint runs
on rank 0 (or each node's leader) alone: validating a new checkpoint (re-hash + test load), finding
the newest valid one at start-up or a rollback (re-hash), a restore or fetch from S3, a node's S3
upload. The other ranks then wait for it, but never in a collective with the training timeout
(parallel.timeout_s), which a checkpoint of hundreds of GB would outlast: they wait in a barrier on
the manager's *wait group* (gloo, created with a 7-day timeout) and give up after a timeout sized
to the work, `leader_wait_s`: the bytes the leader reads at a conservative LEADER_BYTES_PER_S, plus
parallel.timeout_s. Every other collective of the manager (its own gloo group) and of training
keeps the training timeout. The leader's outcome (its error, if any) is shared after the wait, so
every rank counts a failed validation alike and the manager's collectives stay in step.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import lmforge
from lmforge.ckpt.safe_io import SafeFileSystemReader, check_relative, safe_read_metadata
from lmforge.folders import atomic_write, atomic_write_json, fsync_dir, sha256_file

log = logging.getLogger("lmforge.ckpt")
# DCP warns on every single-process save/load; lmforge passes no_dist deliberately there
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STEP_DIR = re.compile(r"^step_(\d{8})$")
META = "meta.json"
TRAINER_STATE = "trainer_state.json"
FORMAT = 1
LEADER_BYTES_PER_S = 25e6  # a leader reads checkpoint files at least this fast (a slow network file system)
WAIT_GROUP_TIMEOUT = datetime.timedelta(days=7)  # the wait group's own limit (each wait sets a shorter one)


EXIT_CHECKPOINT_FAILED = 74  # `lmforge train`'s exit status when checkpoints fail (sysexits EX_IOERR)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointFailure(RuntimeError):
    """The run's work is no longer protected: `max_failed_saves` checkpoints in a row failed, or the
    final checkpoint or final weights could not be written. `lmforge train` exits with
    EXIT_CHECKPOINT_FAILED."""


def _errors(exc: BaseException | None):
    """`exc` and every error inside it: DCP's CheckpointException holds each rank's in `failures`
    ({rank: (error, traceback)}), others chain theirs (__cause__, __context__)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for item in (getattr(e, "failures", None) or {}).values():
            todo.append(item[0] if isinstance(item, tuple) else item)
        todo += [e.__cause__, e.__context__]


def free_bytes(folder: Path) -> int | None:
    """Bytes free to this user on the file system of `folder` (or of its nearest existing parent)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def disk_full_message(folder: Path, needed: int, free: int | None, code: str = "ENOSPC") -> str:
    have = "an unknown number of bytes" if free is None else f"{free:,} bytes"
    return (f"disk full ({code}): {have} free on the file system of {folder}, {needed:,} bytes needed; free "
            f"space there, or move the folder to a larger disk (checkpoint.dir for checkpoints)")


def describe_write_error(exc: BaseException, folder: Path, needed: int, free: int | None) -> str:
    """One line saying why writing `needed` bytes into `folder` failed: a full disk (an ENOSPC /
    EDQUOT anywhere inside `exc`, or less space free before the write than it needed: a short write
    can surface as another error, e.g. torch.save's 'unexpected pos') with the bytes free and needed,
    else the innermost error. `free`: the bytes free before the write."""
    full = next((e for e in _errors(exc) if isinstance(e, OSError) and e.errno in DISK_FULL), None)
    inner = full or exc
    while getattr(inner, "failures", None):  # DCP's CheckpointException: the first rank's own error
        item = next(iter(inner.failures.values()))
        inner = item[0] if isinstance(item, tuple) else item
    cause = f"{type(inner).__name__}: {' '.join(str(inner).split())}"
    if full is not None or (free is not None and free < needed):
        code = errno.errorcode.get(full.errno, "ENOSPC") if full is not None else "ENOSPC, from the free space"
        return f"{disk_full_message(folder, needed, free, code)} ({cause})"
    return cause


def leader_wait_s(nbytes: float, timeout_s: float) -> float:
    """How long the other ranks wait for the leader's work on `nbytes` of checkpoint files (count a
    file once per read: validation hashes and test-loads, 2x): `nbytes` at LEADER_BYTES_PER_S, plus
    the training timeout as the margin for everything else."""
    return nbytes / LEADER_BYTES_PER_S + timeout_s


def listed_bytes(folder: Path) -> int:
    """The bytes a checkpoint's meta.json lists (0 if it has none readable)."""
    try:
        return sum(int(rec.get("bytes", 0)) for rec in read_meta(folder)["files"].values())
    except (ValueError, TypeError, AttributeError):
        return 0


def device_stager(cuda: bool) -> tuple[Any, str]:
    """The stager `dcp.async_save` copies accelerator tensors to host memory with, kept by the manager
    for the whole run so that the host buffers are allocated at the first save and reused by every
    later one (without it, DCP stages each save into freshly allocated pageable memory), and its
    name for the records. Feature-detected, newest first:

    * `pinned` (CUDA) / `cached`: torch's `DefaultStager` where it can be reused (2.13): its
      `StateDictStager` caches one host storage per device storage; on CUDA the buffers are pinned
      and the copies non-blocking on the current stream, then synchronised (staging stays
      synchronous, so the next optimizer step cannot race a copy). The save blocks for one
      device-to-host copy at pinned-memory bandwidth.
    * `pinned` on CUDA where `DefaultStager` closes itself after every stage (torch 2.11: it empties
      its cache and its copy table, so a second save with it fails with `KeyError: <class 'type'>`,
      as every CUDA run's second checkpoint did on the H100, benchmarks/RESULTS.md) or does not exist:
      `BlockingAsyncStager(cache_staged_state_dict=True)`, pinned host copies of the whole state dict
      made at the first save and copied into by every later one.
    * `dcp default`: otherwise (a host-only machine on such a torch, or no `async_stager` at all):
      DCP's own per-save staging.
    """
    import inspect

    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return None, "dcp default"
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        DefaultStager = StagingOptions = None
    if DefaultStager is not None and default_stager_is_reusable():
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                 use_non_blocking_copy=cuda)
        return DefaultStager(options), "pinned" if cuda else "cached"
    if cuda:  # (BlockingAsyncStager's cache is always pinned: it needs the accelerator)
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return BlockingAsyncStager(cache_staged_state_dict=True), "pinned"
    return None, "dcp default"


def default_stager_is_reusable() -> bool:
    """Whether this torch's `DefaultStager` keeps its staging state after a stage (2.13) rather than
    closing itself (2.11): one stage of a one-element host tensor, then a look at its copy table."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    try:
        stager.stage({"probe": torch.zeros(1)})
        inner = getattr(stager, "_state_dict_stager", None)
        return bool(getattr(inner, "_deepcopy_dispatch", True))  # (a torch without these: trust it)
    finally:
        stager.close()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Finished checkpoint folders (by name), newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def read_meta(folder: Path) -> dict:
    path = folder / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder}: no {META} (the checkpoint was never finished)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or "step" not in meta:
        raise ValueError(f"{path}: not an lmforge checkpoint metadata file (no 'files' / 'step')")
    if meta.get("format", 0) > FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta['format']} is newer than this lmforge "
                         f"({lmforge.__version__}) reads ({FORMAT}); upgrade lmforge.")
    return meta


def verify_checkpoint(folder: Path, test_load: bool = False, present_only: bool = False) -> dict:
    """Checks a finished checkpoint: meta.json readable, every listed file present inside the folder
    with its recorded size and sha256, no unlisted shard, DCP metadata safe; optionally reads every
    tensor back (a test load). Returns the meta; raises ValueError naming the problem."""
    meta = read_meta(folder)
    for name, rec in meta["files"].items():
        path = check_relative(folder, name)
        if not path.is_file():
            if present_only:  # (node-local disks: other nodes' shards live on their disks)
                continue
            raise ValueError(f"{folder}: file {name} listed in {META} is missing")
        size = path.stat().st_size
        if size != rec.get("bytes"):
            raise ValueError(f"{folder}: {name} has {size} bytes, {META} says {rec.get('bytes')} (truncated?)")
        if sha256_file(path) != rec.get("sha256"):
            raise ValueError(f"{folder}: {name} fails its sha256 checksum (corrupted)")
    for extra in folder.iterdir():
        if extra.name.endswith(".distcp") and extra.name not in meta["files"]:
            raise ValueError(f"{folder}: shard {extra.name} is not listed in {META}")
    metadata = safe_read_metadata(folder)
    if test_load:
        # read every tensor back into host memory, in batches of <= 256 MB (no process group involved)
        batch: dict[str, torch.Tensor] = {}
        nbytes = 0
        items = list(metadata.state_dict_metadata.items())
        for i, (key, md) in enumerate(items):
            batch[key] = torch.empty(md.size, dtype=md.properties.dtype)
            nbytes += batch[key].numel() * batch[key].element_size()
            if nbytes >= 256 << 20 or i == len(items) - 1:
                dcp.load(batch, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
                batch, nbytes = {}, 0
    return meta


@dataclass
class SaveRequest:
    step: int
    trainer_state: dict[str, Any]
    meta: dict[str, Any]


class CheckpointManager:
    """Owns a checkpoint folder for one run. Every rank creates one and hashes the files it wrote;
    rank 0 writes the metadata and does the folder work.

    Node-local disks (`node_local`: ranks do not share the folder): each node's local rank 0 (the
    node's `leader`) publishes, validates and rotates its own folder, which holds its node's shards
    and a copy of the metadata; every leader backs its node's files up to S3 (which is then
    required) and rank 0 uploads meta.json last; a resume restores the whole checkpoint from S3
    into every node's folder first (files already there with the right checksum are kept)."""

    def __init__(self, root: Path, *, rank: int = 0, world_size: int = 1, async_save: bool = True,
                 validate: bool = True, keep_last: int = 2, keep_every: int = 0,
                 backup: "Any | None" = None, process_group: Any = None, wait_group: Any = None,
                 timeout_s: float = 600.0, on_event: Callable[[dict], None] | None = None, local_rank: int = 0,
                 node_local: bool = False, max_failed_saves: int = 3, staging: str = "auto"):
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.node_local = node_local
        self.leader = local_rank == 0 if node_local else rank == 0  # who does this folder's file work
        self.distributed = dist.is_available() and dist.is_initialized()
        self.async_save = async_save
        self.validate = validate
        self.keep_last, self.keep_every = keep_last, keep_every
        self.backup = backup
        self.pg = process_group
        self.wait_pg = wait_group  # gloo, long timeout: the waits for the leader (module docstring)
        self.timeout_s = timeout_s  # parallel.timeout_s: the margin of those waits
        self.on_event = on_event or (lambda e: None)
        self._pending: threading.Thread | None = None
        self._staging: dict[str, torch.Tensor] = {}  # host copies of the last save, reused by the next
        self._stager: Any = None  # accelerator tensors: DCP's stager, kept so its host buffers are reused
        # async staging: "auto" = host tensors through `_stage`, accelerator tensors through DCP with the
        # run's stager (`device_stager`); "dcp" = DCP with the run's stager for host tensors too;
        # "dcp-per-save" = DCP's own staging, fresh host memory per save (the benchmark's "before")
        assert staging in ("auto", "dcp", "dcp-per-save"), staging
        self.staging_mode = staging
        self.staging = ""  # how the last DCP save was staged (`device_stager`'s names), for the records
        self._error: BaseException | None = None
        self.blocking_s = 0.0  # time the training loop spent blocked on checkpoints
        self.last_save: dict[str, Any] = {}
        self.saves = 0
        self.failures = 0
        self.consecutive_failures = 0  # failed saves since the last good one (the same count on every rank)
        self.max_failed_saves = max_failed_saves  # this many in a row stop the run (0 = never)
        self.last_error = ""  # why the last failed save failed
        self._space: tuple[int, int | None] = (0, None)  # the save in flight: bytes needed, bytes free before it
        self._prepared = False

    def prepare(self) -> None:
        """Create the folder and remove what an interrupted save left (every rank; once). Reading
        (`latest_valid`, `load`) needs no preparation, so a run refused at start-up changes nothing."""
        if self._prepared:
            return
        if self.leader:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("step_*.tmp"):
                log.warning("checkpoint: removing %s left by an interrupted save", stale)
                shutil.rmtree(stale, ignore_errors=True)
        self._barrier()
        self._prepared = True

    # ---------------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

    def _wait_for_leader(self, nbytes: float, what: str) -> None:
        """Every rank: wait until the leader(s) finished `what`, work reading `nbytes` of checkpoint
        files, in a barrier on the wait group with a timeout sized to it (`leader_wait_s`), not the
        training timeout. (Without a wait group: a barrier on the manager's group.)"""
        if not self.distributed:
            return
        if self.wait_pg is None:
            self._barrier()
            return
        limit = leader_wait_s(nbytes, self.timeout_s)
        work = dist.barrier(group=self.wait_pg, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError as e:
            raise RuntimeError(
                f"rank {self.rank} waited {limit:.0f} s for the checkpoint leader to {what} ({nbytes / 1e9:.2f} GB "
                f"read at >= {LEADER_BYTES_PER_S / 1e6:.0f} MB/s + parallel.timeout_s {self.timeout_s:g} s) and gave "
                f"up ({e}); is its file system that slow, or is it stuck?") from e

    def _problems(self, problem: str | None) -> list[str]:
        """Every rank's problem (None = none), on every rank (a quick collective after a wait)."""
        if not self.distributed:
            return [problem] if problem else []
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.pg)
        return [p for p in problems if p]

    def _leader_result(self, nbytes: Callable[[], float], work: Callable[[], Any], what: str) -> Any:
        """Rank 0 runs `work` (reading about `nbytes()` bytes of checkpoint files, which it tells the
        others first) while they wait for it (`_wait_for_leader`); its result, or its error, on every
        rank (ValueError stays ValueError)."""
        plan: list[Any] = [nbytes() if self.rank == 0 else None]
        if self.distributed:
            dist.broadcast_object_list(plan, src=0, group=self.pg)
        result: list[Any] = [None]
        if self.rank == 0:
            try:
                result[0] = (None, work())
            except ValueError as e:  # (raised on every rank below)
                result[0] = (ValueError, str(e))
            except Exception as e:  # noqa: BLE001
                result[0] = (RuntimeError, f"{type(e).__name__}: {e}")
        self._wait_for_leader(plan[0], what)
        if self.distributed:
            dist.broadcast_object_list(result, src=0, group=self.pg)
        error, value = result[0]
        if error is not None:
            raise error(value)
        return value

    def wait(self) -> None:
        """Block until the save in flight (if any) is finished, validated and rotated."""
        if self._pending is not None:
            t0 = time.perf_counter()
            self._pending.join()
            self.blocking_s += time.perf_counter() - t0
            self._pending = None

    def save(self, step: int, tensors: dict[str, torch.Tensor], trainer_state: dict[str, Any],
             meta: dict[str, Any], started: float | None = None) -> None:
        """Checkpoint `step` (every rank, same order). Returns once the state is staged in host
        memory when async, or fully written and validated otherwise. `started`: the perf_counter
        time the caller began building `tensors` (that counts as blocking too)."""
        t0 = time.perf_counter() if started is None else started
        self.prepare()
        self.wait()
        self.check_failures()
        tmp = self.root / (step_name(step) + ".tmp")
        needed = self._expected_bytes(tensors)
        free = free_bytes(self.root) if self.leader else None
        fits = free is None or free >= needed
        if self.leader and fits:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if self.distributed:  # (a barrier too: the folder exists) every rank skips a save that cannot fit
            flag = torch.tensor([1 if fits else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
            fits = bool(flag.item())
        self._space = (needed, free)
        writer = FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True, thread_count=1)
        started = time.time()
        future: Future | None = None
        error: BaseException | None = None
        write = None
        try:
            if not fits:  # (checked before writing: nothing is written, nothing half-written to clean up)
                raise OSError(errno.ENOSPC, "not written: the free space checked before writing is too small")
            if not self.async_save:
                dcp.save(tensors, storage_writer=writer, process_group=self.pg, no_dist=not self.distributed)
            elif self.staging_mode == "auto" and all(_local(t).device.type == "cpu" for t in tensors.values()):
                # host tensors: one copy here, the (synchronous) DCP write in the background thread.
                # Measured on CPU this stages ~1.6x faster and writes ~2x faster than dcp.async_save,
                # whose stager copies into shared memory first (benchmarks/RESULTS.md).
                staged = self._stage(tensors)
                write = lambda: dcp.save(staged, storage_writer=writer, process_group=self.pg,  # noqa: E731
                                         no_dist=not self.distributed)
            else:  # accelerator tensors: DCP's staging into host buffers kept from save to save
                # (pinned, where torch has DefaultStager: see `device_stager`), then a background write
                if self.staging_mode == "dcp-per-save":
                    self.staging = "dcp default"
                elif self._stager is None:
                    self._stager, self.staging = device_stager(any(_local(t).device.type == "cuda"
                                                                   for t in tensors.values()))
                extra = {"async_stager": self._stager} if self._stager is not None else {}
                future = dcp.async_save(tensors, storage_writer=writer, process_group=self.pg,
                                        no_dist=not self.distributed, **extra)
        except BaseException as e:  # noqa: BLE001 - reported; training continues
            error = e
        req = SaveRequest(step, trainer_state, meta)
        staged_s = time.perf_counter() - t0
        self.blocking_s += staged_s
        self._pending = threading.Thread(target=self._finish, args=(req, tmp, future, write, error, started, staged_s),
                                         name=f"lmforge-ckpt-{step}", daemon=True)
        self._pending.start()
        if not self.async_save or self.consecutive_failures:  # after a failure: know this one's outcome now
            self.wait()
            self.check_failures()

    def _expected_bytes(self, tensors: dict[str, torch.Tensor]) -> int:
        """What the checkpoint will take on this folder's file system: the tensors' bytes (a sharded
        tensor counted whole: every rank writes its shard there), or on a node-local disk this rank's
        own part; the file formats add little."""
        return sum((_local(t) if self.node_local else t).numel() * t.element_size() for t in tensors.values())

    def check_failures(self) -> None:
        """Raise CheckpointFailure once `max_failed_saves` saves in a row have failed (every rank alike:
        the outcome of each save is agreed on)."""
        if self.max_failed_saves and self.consecutive_failures >= self.max_failed_saves:
            raise CheckpointFailure(
                f"{self.consecutive_failures} checkpoints in a row failed (checkpoint.max_failed_saves = "
                f"{self.max_failed_saves}); stopping rather than training on without a checkpoint. The last "
                f"failure: {self.last_error}. Fix that and run the same command again: it resumes from the newest "
                f"valid checkpoint in {self.root}.")

    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy into host buffers kept from the previous save (allocating fresh ones costs a page fault
        per 4 KB: ~1 s per GB on this VM); the previous save is finished, so they are free."""
        staged = {}
        for k, t in tensors.items():
            buf = self._staging.get(k)
            t = t.detach()
            if buf is None or type(buf) is not type(t) or buf.shape != t.shape or buf.dtype != t.dtype or (
                    hasattr(t, "placements") and buf.placements != t.placements):
                buf = t.clone()
            else:
                buf.copy_(t)
            staged[k] = buf
        self._staging = staged
        return staged

    def _finish(self, req: SaveRequest, tmp: Path, future: Future | None, write: Callable[[], Any] | None,
                error: BaseException | None, started: float, staged_s: float) -> None:
        """The background end of a save: agree that every shard is written, hash (each rank its own
        files), write the metadata, publish, validate, rotate, back up. Collectives run on the
        manager's own gloo group, every rank in the same order."""
        try:
            if error is None and (future is not None or write is not None):
                try:
                    future.result() if future is not None else write()
                except BaseException as e:  # noqa: BLE001
                    error = e
            if self.distributed:  # agree on success before anything is published
                flag = torch.tensor([1 if error is None else 0], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
                if error is None and flag.item() == 0:
                    error = RuntimeError("another rank failed to write its shard")
            if error is not None:
                raise error
            self._publish(req, tmp, started, staged_s)
            self.consecutive_failures = 0
        except BaseException as e:  # noqa: BLE001 - a failed checkpoint must not kill the run
            self.failures += 1
            self.consecutive_failures += 1
            needed, free = self._space
            self.last_error = why = f"step {req.step}: {describe_write_error(e, self.root, needed, free)}"
            if self.leader:
                shutil.rmtree(tmp, ignore_errors=True)
            left = self.max_failed_saves - self.consecutive_failures
            log.error("checkpoint at step %d FAILED (%s); previous checkpoints are intact, %s", req.step,
                      why.split(": ", 1)[1], "training goes on" if left > 0 or not self.max_failed_saves else
                      "the run stops (checkpoint.max_failed_saves)")
            self.on_event({"step": req.step, "event": "checkpoint_failed", "error": why,
                           "consecutive": self.consecutive_failures,
                           "message": f"checkpoint at step {req.step} failed: {why.split(': ', 1)[1]}"})

    def _own_files(self, tmp: Path) -> dict[str, dict]:
        """{file: {bytes, sha256}} of what this rank wrote: its DCP shard files (and, on rank 0, the
        DCP index and the trainer state)."""
        mine = sorted(tmp.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine += [tmp / ".metadata", tmp / TRAINER_STATE]
        return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in mine if p.is_file()}

    def _publish(self, req: SaveRequest, tmp: Path, started: float, staged_s: float) -> None:
        if self.rank == 0:
            atomic_write_json(tmp / TRAINER_STATE, req.trainer_state, sort_keys=True)
        own = self._own_files(tmp)
        parts: list[Any] = [own]
        if self.distributed:  # the metadata combines every rank's checksums (every rank: the size too)
            parts = [None] * self.world_size
            dist.all_gather_object(parts, own, group=self.pg)
        nbytes = sum(rec["bytes"] for part in parts for rec in part.values())
        shared: list[Any] = [None]
        if self.rank == 0:
            files = {name: rec for part in parts for name, rec in sorted(part.items())}
            meta = {**req.meta, "format": FORMAT, "step": req.step, "files": dict(sorted(files.items())),
                    "lmforge_version": lmforge.__version__, "torch_version": torch.__version__,
                    "world_size": self.world_size, "node_local": self.node_local,
                    "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            shared = [(meta, req.trainer_state, (tmp / ".metadata").read_bytes() if self.node_local else None)]
        if self.node_local:  # every node's folder gets the metadata beside its own shards
            dist.broadcast_object_list(shared, src=0, group=self.pg)
        meta, trainer_state, dcp_index = shared[0] if shared[0] is not None else (None, None, None)
        final = self.root / step_name(req.step)
        problem = None
        if self.leader:
            try:
                self._publish_folder(tmp, final, meta, trainer_state, dcp_index)
            except Exception as e:  # noqa: BLE001 - every rank raises it below, after the wait
                problem = f"{type(e).__name__}: {e}"
        # the others wait while the leader validates (re-hash + test load: the checkpoint read twice)
        self._wait_for_leader(2 * nbytes if self.validate else 0, f"publish and validate {final.name}")
        problems = self._problems(problem)
        if problems:
            raise RuntimeError(f"checkpoint leader: {problems[0]}")
        written_s = time.time() - started
        if self.rank == 0:
            size = sum(rec["bytes"] for rec in meta["files"].values())
            self.saves += 1
            self.last_save = {"step": req.step, "path": str(final), "bytes": size, "blocking_s": staged_s,
                              "total_s": time.time() - started, "write_s": written_s}
            log.info("checkpoint: step %d -> %s (%.1f MB; %.2fs blocking, %.2fs total%s)", req.step, final,
                     size / 1e6, staged_s, self.last_save["total_s"], ", validated" if self.validate else "")
            self.on_event({"step": req.step, "event": "checkpoint", "path": str(final), "bytes": size,
                           "blocking_s": staged_s, "total_s": self.last_save["total_s"]})
        if self.node_local:  # every node backs up its own files; rank 0 the meta.json that completes them
            problem = None
            if self.leader:
                try:
                    self.backup.upload_files(final, [n for n in meta["files"] if (final / n).is_file()])
                except Exception as e:  # noqa: BLE001 - every rank raises it below, after the wait
                    problem = f"S3 upload of {final.name}: {type(e).__name__}: {e}"
            self._wait_for_leader(nbytes, f"upload its node's files of {final.name} to S3")
            problems = self._problems(problem)
            if problems:
                raise RuntimeError(problems[0])
            if self.rank == 0:
                self.backup.upload_files(final, [META], keep=[p.name for _, p in list_checkpoints(self.root)])
        elif self.backup is not None:
            self.backup.upload(final, keep=[p.name for _, p in list_checkpoints(self.root)])

    def _publish_folder(self, tmp: Path, final: Path, meta: dict, trainer_state: Any, dcp_index: Any) -> None:
        """The leader's part of a save: metadata, atomic rename, validation, rotation."""
        if self.node_local and self.rank != 0:
            atomic_write_json(tmp / TRAINER_STATE, trainer_state, sort_keys=True)
            atomic_write(tmp / ".metadata", dcp_index)
        atomic_write_json(tmp / META, meta, sort_keys=True)
        fsync_dir(tmp)
        if final.exists():  # left by a run that rolled back or crashed after resuming earlier
            aside = final.with_name(final.name + ".replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.root)
        if self.validate:  # (node-local: the files on this node; a test load needs them all)
            verify_checkpoint(final, test_load=not self.node_local, present_only=self.node_local)
        self.rotate()

    def rotate(self) -> None:
        """Delete checkpoints beyond keep-last-N (valid ones counted) except keep-every-M steps."""
        kept_valid = 0
        for step, path in list_checkpoints(self.root):
            if kept_valid < self.keep_last:
                try:
                    read_meta(path)
                    kept_valid += 1
                    continue
                except ValueError:
                    pass  # an unfinished/corrupt folder does not count towards keep_last
            if self.keep_every and step % self.keep_every == 0:
                continue
            log.info("checkpoint: rotating away %s", path)
            shutil.rmtree(path, ignore_errors=True)

    # ---------------------------------------------------------------------------------------
    def latest_valid(self) -> Path | None:
        """Newest checkpoint that passes `verify_checkpoint` (rank 0's answer, on every rank; the others
        wait with a timeout sized to what it re-hashes, or downloads from the S3 backup when no local
        one is valid). Node-local disks: the newest complete one in the S3 backup, fetched into every
        node's folder."""
        if self.node_local:
            return self._latest_from_backup()
        found = self._leader_result(lambda: sum(listed_bytes(p) for _, p in list_checkpoints(self.root)),
                                    self._first_valid, f"verify the checkpoints in {self.root}")
        if found is None:  # (every rank: rank 0's answer) the backup, downloaded and verified: read twice
            found = self._leader_result(lambda: 2 * self.backup.remote_bytes() if self.backup is not None else 0,
                                        self._restore, "restore the newest valid checkpoint from the S3 backup")
        return Path(found) if found else None

    def _first_valid(self) -> str | None:
        for step, path in list_checkpoints(self.root):
            try:
                verify_checkpoint(path)
                return str(path)
            except ValueError as e:
                log.warning("checkpoint: skipping %s: %s", path, e)
                self.on_event({"step": step, "event": "checkpoint_invalid", "path": str(path), "error": str(e),
                               "message": f"skipping invalid checkpoint {path}: {e}"})
        return None

    def _restore(self) -> str | None:
        restored = self.backup.restore_latest(self.root) if self.backup is not None else None
        return str(restored) if restored else None

    def _latest_from_backup(self) -> Path | None:
        """Node-local disks: the newest complete checkpoint of the S3 backup that every node's leader
        fetches and verifies; one with a missing or corrupt object on any node is skipped for the next
        older one (as the local store skips an invalid checkpoint)."""
        plan: list[Any] = [None]
        if self.rank == 0:
            plan[0] = [(n, self.backup.remote_bytes(n)) for n in self.backup.complete_checkpoints()]
        dist.broadcast_object_list(plan, src=0, group=self.pg)
        for name, nbytes in plan[0]:
            problem = None
            if self.leader:
                try:
                    self.backup.fetch(name, self.root)  # (what this node wrote is kept when its checksum holds)
                except Exception as e:  # noqa: BLE001 - every rank skips it alike below
                    problem = f"{type(e).__name__}: {e}"
            self._wait_for_leader(2 * nbytes, f"fetch {name} from the S3 backup")  # (downloaded and verified)
            bad = self._problems(problem)
            if not bad:
                return self.root / name
            if self.rank == 0:
                log.warning("checkpoint: %s from the S3 backup is unusable, trying an older one: %s", name, bad[0])
                self.on_event({"event": "backup_invalid", "error": bad[0],
                               "message": f"remote checkpoint {name} unusable: {bad[0]}"})
        if self.rank == 0 and list_checkpoints(self.root):
            log.warning("checkpoint: node-local checkpoints exist but none is complete and valid in the S3 backup; "
                        "starting fresh (a node-local checkpoint cannot be resumed across nodes)")
        return None

    def verify(self, path: Path) -> None:
        """`verify_checkpoint(path)` hashed once, on rank 0, while the others wait with a timeout sized
        to the checkpoint; every rank raises its ValueError."""
        def check() -> None:
            verify_checkpoint(path)

        self._leader_result(lambda: listed_bytes(path), check, f"verify {path}")

    def load(self, folder: Path, tensors: dict[str, torch.Tensor]) -> dict:
        """Read the tensors this run asks for (in its own layout) from `folder`, in place; returns
        its trainer state."""
        ts_path = folder / TRAINER_STATE
        try:
            trainer_state = json.loads(ts_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{ts_path}: unreadable ({e})") from e
        dcp.load(tensors, storage_reader=SafeFileSystemReader(str(folder)), process_group=self.pg,
                 no_dist=not self.distributed)
        return trainer_state

    def close(self) -> None:
        self.wait()
        if self._stager is not None:  # (its pinned buffers are released; a later save makes a new one)
            self._stager.close()
            self._stager = None
        if self.backup is not None:
            self.backup.wait()
