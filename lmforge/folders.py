"""The folders lmforge reads and writes: every file name written once, what kind a folder is,
one atomic write, one checksum, one token-shard manifest.

    run folder (train.out_dir)         prepared dataset (`lmforge prepare`)   token-shard folder
      config.toml      CONFIG            prepare.json     PREPARE_RECORD       manifest.json  MANIFEST
      tokenizer.json   TOKENIZER         tokenizer.json   TOKENIZER            shard_00000.bin
      model.safetensors WEIGHTS          mixture.json     MIXTURE              ...
                                                                             unigram_counts.bin UNIGRAM_COUNTS
      metrics.jsonl    METRICS           train/<source>/  (shard folders)
      summary.json     SUMMARY           val/             (a shard folder)
      sample.txt       SAMPLE
      checkpoints/     CHECKPOINTS     cached dataset (<cache_dir>/datasets/<key>/):
      report/          REPORT            dataset.json (DATASET_RECORD), tokenizer.json, train/, val/
      tb/              TENSORBOARD
      profile/         PROFILE         transformers model folder: config.json (HF_CONFIG), model.safetensors,
      run.json         RUN_RECORD        tokenizer.json, ...
      failed.json      FAILED_RECORD
      train.lock       TRAIN_LOCK (while a trainer runs)
      model.ema.safetensors EMA_WEIGHTS (train.ema_decay > 0)
      merge.json       MERGE_RECORD (a folder `lmforge merge` wrote)

The kinds share file names (model.safetensors, tokenizer.json), so writing one kind into another
destroys it: `folder_kind` tells them apart by the one file that marks each. A folder written
as a whole (shards, a cached dataset) appears by one rename: `atomic_dir`.

This module imports only the standard library; every layer may use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# ---- run folder -----------------------------------------------------------------------------
CONFIG = "config.toml"
RESOLVED = "resolved.toml"  # every "auto" of CONFIG as the run resolved it at start (lmforge.train.auto)
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "model.ema.safetensors"  # the EMA of the weights at the end of a run with train.ema_decay
MERGE_RECORD = "merge.json"  # what `lmforge merge` averaged into a run folder's model.safetensors
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
SAMPLE = "sample.txt"
CHECKPOINTS = "checkpoints"
REPORT = "report"
TENSORBOARD = "tb"
PROFILE = "profile"
RUN_RECORD = "run.json"  # the run's identity: {"run_id": uuid4 hex, "created": ...}; its S3 backup is keyed by it
FAILED_RECORD = "failed.json"  # why the last attempt stopped without protecting its work (a full disk, ...)
TRAIN_LOCK = "train.lock"  # held (flock) by the trainer's rank 0 while a run trains; gone when it ends
RUN_FILES = (CONFIG, WEIGHTS, TOKENIZER)  # what `lmforge import` writes: a run that loads

# ---- prepared dataset / token shards -------------------------------------------------------
PREPARE_RECORD = "prepare.json"
MIXTURE = "mixture.json"
MANIFEST = "manifest.json"
UNIGRAM_COUNTS = "unigram_counts.bin"  # a shard folder's token counts: vocab_size little-endian int64
DATASET_RECORD = "dataset.json"  # a cached dataset of `prepare_texts` (its presence: complete)
SHARD_FORMAT = "lmforge-token-shards"
SHARD_FORMAT_VERSION = 1

def mixture_entries(train_dir: Path) -> list[tuple[str, str, float]]:
    """(name, folder, weight) of each source of a prepared train mixture (`lmforge prepare`'s
    <output>/train/mixture.json), in order."""
    path = Path(train_dir) / MIXTURE
    if not path.is_file():
        raise ValueError(f"{path} not found: {train_dir} is not a prepared train mixture")
    try:
        spec = json.loads(path.read_text())
        # (a manifest without names, hand-written or older: source0, source1, ... as prepare named them)
        return [(e.get("name") or f"source{i}", e["dir"], float(e["weight"])) for i, e in enumerate(spec["sources"])]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: invalid mixture file ({e})") from e


# ---- tasks shipped with lmforge (lmforge/data/tasks/, `lmforge eval --mc NAME`, train.eval_tasks) ------
BUILTIN_TASKS = {"shakespeare-cloze": "data/tasks/shakespeare_cloze.jsonl"}  # name -> file, under the package

# ---- Hugging Face transformers model folder ------------------------------------------------
HF_CONFIG = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # its special tokens (eos/bos/pad), also kept beside an imported run's tokenizer.json

# kind -> (marker file, description)
KINDS = {
    "run": (CONFIG, "an lmforge run folder"),
    "transformers": (HF_CONFIG, "a transformers model folder"),
    "prepared": (PREPARE_RECORD, "a prepared dataset (`lmforge prepare` output)"),
    "shards": (MANIFEST, "a token-shard folder"),
}


def folder_kind(folder: str | Path) -> str | None:
    """'run', 'transformers', 'prepared', 'shards' or None, by the marker file present."""
    folder = Path(folder)
    for kind, (marker, _) in KINDS.items():
        if (folder / marker).is_file():
            return kind
    return None


def describe_kind(kind: str) -> str:
    """'an lmforge run folder (config.toml)' for 'run', and so on."""
    marker, text = KINDS[kind]
    return f"{text} ({marker})"


def check_target(folder: str | Path, own_kind: str, writes: tuple[str, ...], key: str,
                 overwrite: bool = True) -> None:
    """Refuse to write `writes` into `folder` (named by `key` in the message, e.g. 'train.out_dir'
    or '--out') when it is another kind of folder than `own_kind`, whose files they would replace;
    with `overwrite` False, also when any of `writes` exists. ValueError names the folder and fix."""
    folder = Path(folder)
    kind = folder_kind(folder)
    existing = [w for w in writes if (folder / w).exists()]
    if kind is not None and kind != own_kind:
        clobbered = f" (it holds {', '.join(existing)})" if existing else ""
        raise ValueError(f"{key} = {str(folder)!r} is {describe_kind(kind)}; writing {', '.join(writes)} there "
                         f"would damage it{clobbered}. Choose another {key}.")
    if existing and not overwrite:
        raise ValueError(f"{key} = {str(folder)!r} already holds {', '.join(existing)}; choose an empty or new "
                         f"{key}, or pass --force to replace them.")


# ---- run identity ----------------------------------------------------------------------------

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def new_run_id() -> str:
    """A fresh run id (uuid4, 32 hex digits)."""
    import uuid

    return uuid.uuid4().hex


def read_run_id(folder: str | Path) -> str | None:
    """The run id recorded in run folder `folder` (RUN_RECORD), or None when it has none: a new
    folder, one written before run ids existed, or a damaged record (the run then gets a new id,
    and a backup under the old one is another run's until adopted: checkpoint.s3_adopt)."""
    try:
        rec = json.loads((Path(folder) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    rid = rec.get("run_id") if isinstance(rec, dict) else None
    return rid if isinstance(rid, str) and RUN_ID.match(rid) else None


def write_run_record(folder: str | Path, run_id: str) -> None:
    """Record `run_id` in run folder `folder` (atomically)."""
    import datetime

    atomic_write_json(Path(folder) / RUN_RECORD, {
        "run_id": run_id, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})


def record_failure(folder: str | Path, step: int, error: str) -> bool:
    """Record in run folder `folder` (FAILED_RECORD) why the run stopped without protecting its work
    at `step` (best effort: on a full disk even this may not fit; False then)."""
    import datetime

    try:
        atomic_write_json(Path(folder) / FAILED_RECORD, {
            "step": int(step), "error": error,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        return True
    except OSError:
        return False


def read_failure(folder: str | Path) -> dict | None:
    """The record `record_failure` left in run folder `folder`, or None."""
    try:
        rec = json.loads((Path(folder) / FAILED_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def check_writable(folder: str | Path, key: str) -> None:
    """Refuse, before any work, a folder (named by `key` in the message) that cannot be made or
    written: a path through a file, or a folder (or the nearest existing parent of a new one)
    without write permission. '~' and $VARS are expanded first. ValueError names the path and key."""
    path = Path(os.path.expandvars(str(folder))).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == path else f"would go inside {str(probe)!r}, which is a file"
        raise ValueError(f"{key} = {str(folder)!r} {where}; give a folder path.")
    try:  # (a real write: permission bits say nothing to root, nor about read-only mounts)
        os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".lmforge-write-check-"))
    except OSError as exc:
        where = "" if probe == path else f" (nothing can be created in {str(probe)!r})"
        raise ValueError(f"{key} = {str(folder)!r} is not writable{where}: {exc.strerror}; give a folder you "
                         f"can write.") from None


def check_run_folder(run_dir: str | Path, has_checkpoint: Callable[[Path], bool] | None = None) -> Path:
    """`run_dir` as a Path if it is an lmforge run folder (config.toml + model.safetensors), else a
    ValueError that says what the path is: missing (with close names beside it), a file, another
    kind of folder (a transformers folder: `lmforge import` it first), a folder of runs (a sweep),
    or a run that has not finished (given `has_checkpoint`: and has no checkpoint it accepts either).
    Standard library only: a command checks its folder before it imports torch."""
    run_dir = Path(run_dir)
    shown = str(run_dir)
    if not run_dir.exists():
        parent = run_dir.parent
        hint = ""
        if not parent.exists():
            hint = f" (nor does {str(parent)!r})"
        elif parent.is_dir():
            import difflib

            names = [p.name for p in parent.iterdir() if p.is_dir()]
            close = difflib.get_close_matches(run_dir.name, names, n=3, cutoff=0.6)
            if close:
                hint = " (did you mean " + " or ".join(repr(str(parent / c)) for c in close) + "?)"
        raise ValueError(f"run folder {shown!r} does not exist{hint}; give the folder `lmforge train` wrote "
                         f"(its train.out_dir, e.g. runs/tiny).")
    if run_dir.is_file():
        fix = (f"give its folder {str(run_dir.parent)!r}" if run_dir.name in (CONFIG, WEIGHTS)
               else "give the folder `lmforge train` wrote (its train.out_dir)")
        raise ValueError(f"{shown!r} is a file, not a run folder; {fix}.")
    kind = folder_kind(run_dir)
    if kind == "transformers":
        raise ValueError(f"{shown!r} is {describe_kind(kind)}, not an lmforge run folder; turn it into one with "
                         f"`lmforge import --hf {shown} --out RUN_DIR`, then use RUN_DIR.")
    if kind in ("prepared", "shards"):
        raise ValueError(f"{shown!r} is {describe_kind(kind)}, not an lmforge run folder; give the folder "
                         f"`lmforge train` wrote (its train.out_dir).")
    if kind is None:
        runs = sorted(p.parent.name for p in run_dir.glob(f"*/{CONFIG}"))
        inside = (f"; it holds run folders ({', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}): "
                  f"give one of them, e.g. {str(run_dir / runs[0])!r}" if runs else
                  "; give the folder `lmforge train` wrote (its train.out_dir)")
        raise ValueError(f"{shown!r} is not an lmforge run folder: it has no {CONFIG}{inside}.")
    if not (run_dir / WEIGHTS).is_file() and not (has_checkpoint is not None and has_checkpoint(run_dir)):
        raise ValueError(f"{shown!r} has no {WEIGHTS}: training writes it when the run finishes (or "
                         f"`lmforge import` for an imported model); finish the run with the same "
                         f"`lmforge train` command, which resumes from its newest checkpoint.")
    return run_dir



# ---- checksums --------------------------------------------------------------------------------

def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


# ---- atomic writes ----------------------------------------------------------------------------

def fsync_dir(path: str | Path) -> None:
    """fsync a directory so a rename inside it survives a power cut (best effort: some file
    systems refuse to open or sync directories)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """The hidden sibling a file is written to before its rename (per process: two writers of
    one path never share a temp file)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def is_temp_name(name: str) -> bool:
    """Whether `name` is a `temp_name` (a write in progress, or left by a crash)."""
    return re.fullmatch(r"\..+\.tmp\d+", name) is not None


@contextlib.contextmanager
def atomic_path(path: str | Path, mode: int | None = None) -> Iterator[Path]:
    """`with atomic_path(p) as tmp:` write `tmp` by any means; on success it is fsynced, renamed
    over `p` and the folder fsynced, so `p` is either the old file or the whole new one, never a
    torn one. On an exception the temp file is removed and `p` is untouched.

    `mode`: permission bits for the new file; None = what the user's umask gives a new file (some
    writers, e.g. tempfile, create 0600 files)."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, mode if mode is not None else _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _umask_mode(base: int = 0o666) -> int:
    """`base` (0o666 a file, 0o777 a folder) less the user's umask: what a plain create gives."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write `data` (str: UTF-8) to `path` atomically (see `atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def atomic_write_json(path: str | Path, obj: Any, **dump: Any) -> None:
    """`obj` as JSON (indent 1 unless given), atomically, with a trailing newline."""
    dump.setdefault("indent", 1)
    atomic_write(path, json.dumps(obj, **dump) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | Path, is_complete: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """`with atomic_dir(d) as tmp:` fill the new empty folder `tmp` (a hidden sibling of `d`,
    `.tmp-<name>-*`) by any means; on success its files and folders are fsynced, it is renamed to
    `d` and the parent fsynced, so `d` appears whole or not at all (its files need no atomic writes
    of their own). On an exception `tmp` is removed and `d` untouched.

    An existing `d`: without `is_complete` the rename fails (OSError) unless `d` is an empty folder
    (callers that refuse an existing `d` check before writing). With `is_complete`, a complete `d`
    is kept and the new folder dropped (another writer, e.g. another rank, finished first), an
    incomplete one is replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-{path.name}-"))
    try:
        yield tmp
        _fsync_tree(tmp)
        os.chmod(tmp, _umask_mode(0o777))  # mkdtemp makes it 0700
        _rename_dir(tmp, path, is_complete)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone once renamed; otherwise ours to drop
    fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every folder, deepest first."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(folder, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(folder)


def _rename_dir(tmp: Path, path: Path, is_complete: Callable[[Path], bool] | None) -> None:
    """Rename the finished `tmp` to `path`, handling an existing `path` as `atomic_dir` says."""
    if is_complete is not None and path.exists():
        if is_complete(path):
            return
        shutil.rmtree(path)
    try:
        os.rename(tmp, path)
    except OSError:  # `path` appeared meanwhile: fine if another writer completed it
        if is_complete is None or not is_complete(path):
            raise


# ---- token-shard manifest -----------------------------------------------------------------------

def shard_file_name(index: int) -> str:
    return f"shard_{index:05d}.bin"


def shard_record(index: int, data: bytes, tokens: int, max_id: int) -> dict[str, Any]:
    """One shard's entry in a manifest: file name, token count, sha256 of its bytes, largest id."""
    return {"file": shard_file_name(index), "tokens": int(tokens), "sha256": sha256_bytes(data),
            "max_id": int(max_id)}


def unigram_record(data: bytes, entropy: float) -> dict[str, Any]:
    """A manifest's `unigram` entry: the file of the folder's token counts (UNIGRAM_COUNTS, `data`
    its bytes), their sha256, and the entropy (nats) of the token distribution they give."""
    return {"file": UNIGRAM_COUNTS, "sha256": sha256_bytes(data), "entropy": float(entropy)}


def build_manifest(dtype: str, vocab_size: int, shard_tokens: int, shards: list[dict[str, Any]],
                   meta: dict[str, Any], unigram: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `manifest.json` of a token-shard folder (the one place its fields are defined).
    `max_id` is the largest token id in any shard (-1 for none), checked against the model's
    vocabulary before training. `unigram` (`unigram_record`; folders prepared before it existed
    have none): the token counts and their entropy, written once by `lmforge prepare` so that
    training reads the unigram baseline instead of the corpus."""
    max_ids = [int(s["max_id"]) for s in shards if "max_id" in s]
    manifest = {"format": SHARD_FORMAT, "version": SHARD_FORMAT_VERSION, "dtype": dtype, "byte_order": "little",
                "vocab_size": int(vocab_size), "total_tokens": int(sum(int(s["tokens"]) for s in shards)),
                "shard_tokens": int(shard_tokens), "max_id": max(max_ids, default=-1), "shards": shards,
                "meta": meta}
    if unigram is not None:
        manifest["unigram"] = unigram
    return manifest
