"""Which folder a run trains in, and one trainer at a time in it. Torch-free: the command line
chooses the folder and refuses one in use before the heavy imports."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from lmforge.config import Config, ConfigError, TrainConfig
from lmforge.folders import CONFIG, RUN_FILES, TRAIN_LOCK, check_target

log = logging.getLogger("lmforge.train")


def check_out_dir(out_dir: Path) -> None:
    """Refuse a run folder that is another kind of lmforge/transformers folder: a run writes
    config.toml, tokenizer.json and model.safetensors there, which would clobber its files."""
    try:
        check_target(out_dir, "run", RUN_FILES, "train.out_dir")
    except ValueError as e:
        raise ConfigError(str(e)) from None


# Keys that do not change what a run computes (where and how it runs, what it prints): two configs
# that differ only here are the same run. Everything else (model, data, optimizer, schedule, batch,
# steps, seed, precision, ...) defines the run.
_OPERATIONAL = ("preset", "description", "train.out_dir", "train.progress", "train.tensorboard", "train.wandb",
                "train.plot", "train.threads", "train.log_every", "train.profile_steps", "train.device",
                "train.micro_batch_size", "train.eval_every", "train.sample_tokens", "train.sample_prompt",
                "train.ema_decay", "train.ema_start_step", "train.ema_every", "train.eval_tasks",
                "train.eval_tasks_every", "train.eval_tasks_max_examples",  # (measure the run, never change it)
                "parallel.", "checkpoint.", "guard.")


def config_differences(a: dict, b: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, value in a, value in b) for every run-defining key that differs."""
    out = []
    for key in sorted(set(a) | set(b)):
        full = f"{prefix}{key}"
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_differences(va, vb, f"{full}.")
        elif va != vb and not any(full == op or (op.endswith(".") and full.startswith(op)) for op in _OPERATIONAL):
            out.append((full, va, vb))
    return out


# Command-line keys that do not name the auto run folder: how a run prints, where it writes, and
# whether it resumes (`--checkpoint.resume none` starts the same folder over).
_NOT_IN_NAME = ("description", "train.out_dir", "train.progress", "train.threads", "train.log_every", "train.plot",
                "train.tensorboard", "train.wandb", "checkpoint.resume")


def auto_folder_name(base: str, named_by: tuple[tuple[str, object], ...]) -> str:
    """`base` (e.g. 'tiny') followed by every command-line override as the last part of its key and
    its value, in the order typed: ('parallel.dp_replicate', 2) -> 'tiny-dp_replicate2'. A suffix
    longer than 80 characters keeps its first 70 and a digest of all of them."""
    parts = [f"{key.rsplit('.', 1)[-1]}{_short(value)}" for key, value in named_by if key not in _NOT_IN_NAME]
    suffix = "-".join(parts)
    if len(suffix) > 80:
        suffix = f"{suffix[:70]}-{_digest(dict(named_by))}"
    return f"{base}-{suffix}" if suffix else base


def run_folder(cfg: Config, say: bool = True) -> Path:
    """The run folder: train.out_dir with '{preset}', '~' and $VARS expanded. When that is the default
    folder, its name also carries every command-line override (`cfg.named_by`, set by `lmforge
    train`), layout keys included: `--parallel.dp_replicate 2` trains in runs/tiny-dp_replicate2, so
    each changed command trains its own run and the same command continues it. When that folder
    holds a run of another config (a changed TOML file; a Trainer built without a command line), a
    sibling named after the differences (e.g. runs/tiny-lr0.003-n_layers6) instead: a changed
    command never continues or overwrites another run by accident. A folder given explicitly is
    continued as given (a compatible checkpoint resumes, resharded to the new layout; changed keys
    are listed in the log)."""
    default = TrainConfig().out_dir
    folder = Path(os.path.expandvars(cfg.train.out_dir.format(preset=cfg.preset))).expanduser()
    if cfg.train.out_dir != default:
        return folder
    folder = folder.with_name(auto_folder_name(folder.name, cfg.named_by))
    mine = cfg.to_dict()
    candidate = folder
    for attempt in range(3):
        existing = _folder_config(candidate)
        diffs = [] if existing is None else config_differences(existing, mine)
        if existing is None or not diffs:
            if candidate != folder and say:
                log.info("run folder: %s holds a run of another config; this one goes to %s", folder, candidate)
            return candidate
        if attempt == 0:
            named = [(k.rsplit(".", 1)[-1], v) for k, _, v in diffs]
            suffix = "-".join(f"{k}{_short(v)}" for k, v in named)
            candidate = folder.with_name(f"{folder.name}-{suffix}" if len(suffix) <= 60 else
                                         f"{folder.name}-{_digest(mine)}")
        else:
            candidate = folder.with_name(f"{candidate.name}-{_digest(mine)}")
    raise ConfigError(f"train.out_dir: {folder} and its alternatives hold runs of other configs; set "
                      f"--train.out_dir to a new folder.")


def _folder_config(folder: Path) -> dict | None:
    """The config.toml of a run folder as a dict (None: no run there)."""
    from lmforge.config import load_config

    path = folder / CONFIG
    if not path.is_file():
        return None
    try:
        return load_config(str(path), validate=False).to_dict()
    except ValueError:
        return {"unreadable": str(path)}  # differs from every config: never continued by default


def _short(value) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return "".join(c if c.isalnum() or c in ".+" else "_" for c in text)[:20]


def _digest(d: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:8]


class RunFolderInUse(ValueError):
    """Another trainer holds the run folder (a user error: one line, exit status 2)."""


# The run folders this process holds a lock on (real path -> the RunLock holding it).
_HELD_HERE: dict[str, "RunLock"] = {}


class RunLock:
    """One trainer per run folder: rank 0 holds an exclusive `flock` on `train.lock` in the folder
    for the run's life, and the file names the holder (pid, host, start). A second trainer on the
    folder stops at start-up with a one-line error naming the holder, before it writes anything.
    The kernel drops the lock when the holding process dies, however it dies (SIGKILL, OOM, a
    crashed node's NFS lease expiring), so a stale file never blocks: the next trainer takes the
    lock and rewrites the file. The file is removed when the run ends, with the folder if this
    trainer created it for the lock and nothing else was written (a refused run leaves nothing).

    Filesystems: a local disk, and NFS (Linux clients emulate flock with POSIX byte-range locks
    on the server, NFSv3 through lockd, v4 in the protocol, so two nodes exclude each other;
    mounted with `local_lock=all` or `nolock`, the lock only excludes trainers on the same node).
    Object stores mounted through FUSE (s3fs, gcsfuse) have no locks: flock succeeds everywhere
    there. Why hand-written: fcntl/flock is the standard library's; `filelock` would add a
    dependency for the same two calls and does not name the holder.

    Within one process: a trainer that is training (`running`, set by `Trainer.fit`) holds the
    folder against another trainer of the same process too; one that was only built and set up (a
    notebook cell run again, a test driving `train_step` by hand) hands its lock to the newer
    trainer on the same folder, which it would otherwise keep until the process ends (flock locks
    of two open files conflict even in one process)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / TRAIN_LOCK
        self._fd: int | None = None
        self._created_folder = False
        self.running = False

    def acquire(self) -> "RunLock":
        self._created_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.folder)
        prior = _HELD_HERE.get(key)
        if prior is not None and prior._fd is not None:
            if prior.running:
                raise RunFolderInUse(
                    f"train.out_dir = {str(self.folder)!r} is in use by another trainer ({_read_holder(prior._fd)}); "
                    f"wait for it to end, stop it, or train in another folder (--train.out_dir).")
            self._fd, prior._fd, self._created_folder = prior._fd, None, prior._created_folder
            _HELD_HERE[key] = self
            return self
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                self._remove_created_folder()
                raise RunFolderInUse(
                    f"train.out_dir = {str(self.folder)!r} is in use by another trainer ({holder}); wait for it "
                    f"to end, stop it, or train in another folder (--train.out_dir).") from None
            try:  # the file we locked must still be the one the path names (a holder ending removes it)
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                break
            os.close(fd)
        else:
            raise RunFolderInUse(f"train.out_dir = {str(self.folder)!r}: could not take {TRAIN_LOCK} (it kept being "
                                 f"replaced); is another trainer starting and stopping there?")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, record, 0)
        _HELD_HERE[key] = self
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        key = os.path.realpath(self.folder)
        if _HELD_HERE.get(key) is self:
            del _HELD_HERE[key]
        try:
            self.path.unlink(missing_ok=True)  # (while still held: nobody can have taken it in between)
        finally:
            os.close(self._fd)
            self._fd = None
        self._remove_created_folder()

    def _remove_created_folder(self) -> None:
        if self._created_folder:
            try:
                self.folder.rmdir()  # only if empty: a refused new run leaves no folder behind
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """'pid 123 on host h since 2026-...' from a held lock file (what its holder wrote)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']}, since {info['started']}"
    except (OSError, ValueError, KeyError):
        return "a trainer starting up"


def check_folder_free(folder: str | Path) -> None:
    """Refuse at once a folder another trainer holds (the command line's early check, before the
    heavy imports; the trainer then takes the lock itself)."""
    if (Path(folder) / TRAIN_LOCK).is_file():
        with RunLock(folder):
            pass


class RunRecords:
    """A running trainer's run folder: its lock (held by rank 0 for the run's life), its identity
    (run.json), what the run writes into it at start (CONFIG as given, RESOLVED, the tokenizer) and
    its metrics (metrics.jsonl + TensorBoard / W&B, rank 0), with the events logged before the folder
    was open kept until it is (`log_event`). `step()`: the trainer's step, stamped on each event."""

    def __init__(self, out_dir: Path, rank0: bool, step, node_leader: bool = False):
        self.out_dir, self.rank0, self.step, self.node_leader = out_dir, rank0, step, node_leader
        self.lock = RunLock(out_dir)
        self.metrics = None  # opened once the run really starts (events before that wait in `early`)
        self.early: list[dict] = []

    def hold(self, decides) -> None:
        """Rank 0 takes the folder's lock (RunLock): a second trainer on the folder stops here, every
        rank with the same one-line error (`decides`: rank 0's value on every rank)."""
        refused = None
        if self.rank0:
            try:
                self.lock.acquire()
            except RunFolderInUse as e:
                refused = str(e)
        refused = decides(refused)
        if refused:
            raise RunFolderInUse(refused)

    def start(self, cfg: Config, run_id: str, tokenizer_path: Path, resolved: str) -> None:
        """Every check passed and the run starts (or continues): write its config, the values it
        resolved and its tokenizer, open the metrics, log what waited, and a failed earlier attempt."""
        import shutil

        from lmforge.config import to_toml
        from lmforge.folders import (METRICS, RESOLVED, TOKENIZER, atomic_path, atomic_write, read_failure,
                                     read_run_id, write_run_record)
        from lmforge.train.metrics import MetricsWriter, make_sinks

        t = cfg.train
        if self.rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.out_dir / CONFIG, to_toml(cfg))
            atomic_write(self.out_dir / RESOLVED, resolved)
            if read_run_id(self.out_dir) != run_id:
                write_run_record(self.out_dir, run_id)
            with atomic_path(self.out_dir / TOKENIZER) as tmp:
                shutil.copyfile(tokenizer_path, tmp)
        elif self.node_leader and read_run_id(self.out_dir) != run_id:
            # run folders on node-local disks: every node's copy records the run's id, so that a restart whose
            # rendezvous puts rank 0 on another node (c10d numbers the nodes by address, then agent pid, not by
            # --node-rank) continues this run and its S3 backup instead of starting a new id there (on a shared
            # folder: the same record, again)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_run_record(self.out_dir, run_id)
        self.metrics = MetricsWriter(self.out_dir / METRICS, make_sinks(
            self.out_dir, t.tensorboard and self.rank0, t.wandb and self.rank0, cfg.to_dict(), self.out_dir.name),
            enabled=self.rank0)
        for event in self.early:
            self.log_event(event)
        self.early.clear()
        failed = read_failure(self.out_dir) if self.rank0 else None
        if failed:  # (the record goes once the run completes)
            self.log_event({"event": "previous_attempt_failed", **failed, "message": (
                f"the previous attempt in {self.out_dir} stopped at step {failed.get('step')} ({failed.get('time')}) "
                f"without protecting its work: {failed.get('error')}")})

    def log_event(self, event: dict) -> None:
        """An event (skipped update, rollback, checkpoint, ...) into metrics.jsonl and the log (rank 0)."""
        if not self.rank0:
            return
        if self.metrics is None:  # (the run folder is not open yet)
            self.early.append(event)
            return
        self.metrics.write({"step": self.step(), **event})
        self.metrics.flush()
        if event.get("event") not in ("checkpoint", "backup", "checkpoint_failed"):  # (those log their own line)
            log.warning("%s", event.get("message", event.get("event")))
