"""Token shards on disk: fixed-size raw little-endian files plus a ``manifest.json``.

Layout of a shard directory::

    manifest.json      format, version, dtype, vocab_size, total_tokens, shards[], meta
    shard_00000.bin    shard_tokens tokens, raw uint16 (vocab <= 65536) or uint32, little-endian
    shard_00001.bin    ... the last shard may be shorter
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.folders import (MANIFEST, SHARD_FORMAT, SHARD_FORMAT_VERSION, build_manifest, sha256_file,
                             shard_record)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype holding ids ``0 .. vocab_size-1``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def write_token_shards(token_arrays: Iterable[np.ndarray], out_dir: Path, shard_tokens: int,
                       vocab_size: int, meta: dict) -> dict:
    """Concatenate ``token_arrays`` into shard files under ``out_dir``; return the manifest.

    Everything is written into a sibling temp directory and renamed into place at the end,
    so ``out_dir`` either does not exist or is complete. ``out_dir`` must not exist yet.
    """
    out_dir = Path(out_dir)
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
    if out_dir.exists():
        raise ValueError(f"{out_dir} already exists; delete it or choose another directory")
    dtype = dtype_for_vocab(vocab_size)
    try:
        meta_json = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serializable: {e}") from e
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".tmp-{out_dir.name}-"))
    try:
        shards = _write_shards(token_arrays, tmp, shard_tokens, vocab_size, dtype)
        manifest = build_manifest(dtype.name, vocab_size, shard_tokens, shards, meta_json)
        if manifest["total_tokens"] == 0:
            raise ValueError(f"no tokens to write to {out_dir}: the input is empty")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.rename(tmp, out_dir)  # (the folder appears whole: its files need no atomic writes of their own)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_shards(token_arrays: Iterable[np.ndarray], tmp: Path, shard_tokens: int,
                  vocab_size: int, dtype: np.dtype) -> list[dict[str, Any]]:
    """Stream arrays through a one-shard buffer; return the per-shard records."""
    shards: list[dict[str, Any]] = []
    buf = np.empty(shard_tokens, dtype=dtype)
    fill = 0

    def flush() -> None:
        nonlocal fill
        data = buf[:fill].tobytes()
        rec = shard_record(len(shards), data, fill, int(buf[:fill].max()))
        (tmp / rec["file"]).write_bytes(data)
        shards.append(rec)
        fill = 0

    for i, arr in enumerate(token_arrays):
        arr = np.asarray(arr)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"token array #{i} must be 1-D integers, got "
                             f"shape {arr.shape} dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
            raise ValueError(f"token array #{i} has ids in [{arr.min()}, {arr.max()}], "
                             f"outside [0, {vocab_size}); is vocab_size={vocab_size} right?")
        pos = 0
        while pos < arr.size:
            take = min(shard_tokens - fill, arr.size - pos)
            buf[fill:fill + take] = arr[pos:pos + take]
            fill += take
            pos += take
            if fill == shard_tokens:
                flush()
    if fill:
        flush()
    return shards


class TokenShards:
    """Read-only, memory-mapped view of a shard directory as one long token stream."""

    def __init__(self, dir: Path, verify_checksums: bool = False) -> None:
        self.dir = Path(dir)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise ValueError(f"{path} not found: {self.dir} is not a token-shard directory "
                             f"(create one with `lmforge prepare`)")
        try:
            self.manifest: dict[str, Any] = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from e
        m = self.manifest
        if m.get("format") != SHARD_FORMAT or m.get("version") != SHARD_FORMAT_VERSION:
            raise ValueError(f"{path}: format {m.get('format')!r} version {m.get('version')!r}"
                             f" is not {SHARD_FORMAT!r} version {SHARD_FORMAT_VERSION}; re-run prepare")
        self.dtype = np.dtype(m["dtype"]).newbyteorder("<")
        self._maps: list[np.memmap] = []
        for rec in m["shards"]:
            f = self.dir / rec["file"]
            want = rec["tokens"] * self.dtype.itemsize
            if not f.is_file():
                raise ValueError(f"shard {f} listed in {path} is missing; re-run prepare")
            if f.stat().st_size != want:
                raise ValueError(f"shard {f} has {f.stat().st_size} bytes, manifest says "
                                 f"{want}; the dataset is corrupted, re-run prepare")
            if verify_checksums:
                if sha256_file(f) != rec["sha256"]:
                    raise ValueError(f"shard {f} is corrupted: sha256 differs from {path}; "
                                     f"delete {self.dir} and re-run prepare")
            self._maps.append(np.memmap(f, dtype=self.dtype, mode="r"))
        sizes = np.array([len(mm) for mm in self._maps], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])  # shard k covers [s_k, s_k+1)
        self._len = int(self._starts[-1])
        assert self._len == m["total_tokens"], (self._len, m["total_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    def __len__(self) -> int:
        return self._len

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start+length)`` as int64, spanning shard boundaries if needed."""
        start, length = int(start), int(length)
        if start < 0 or length < 0 or start + length > self._len:
            raise IndexError(f"read({start}, {length}) outside the {self._len} tokens "
                             f"of {self.dir}")
        out = np.empty(length, dtype=np.int64)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < length:
            lo = start + done - int(self._starts[k])
            take = min(length - done, len(self._maps[k]) - lo)
            out[done:done + take] = self._maps[k][lo:lo + take]
            done += take
            k += 1
        return out

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``read(s, length)`` for each ``s`` in ``starts``, shape (n, length), int64.

        Rows inside one shard are fetched with one fancy-index per shard; the rare rows that
        cross a shard boundary fall back to :meth:`read`.
        """
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() + length > self._len):
            raise IndexError(f"gather of length {length} outside the {self._len} tokens "
                             f"of {self.dir}")
        out = np.empty((starts.size, length), dtype=np.int64)
        shard = np.searchsorted(self._starts, starts, side="right") - 1
        inside = starts + length <= self._starts[shard + 1]
        offsets = np.arange(length, dtype=np.int64)
        for k in np.unique(shard[inside]):
            rows = np.flatnonzero(inside & (shard == k))
            local = starts[rows] - self._starts[k]
            out[rows] = self._maps[k][local[:, None] + offsets]
        for row in np.flatnonzero(~inside):
            out[row] = self.read(starts[row], length)
        return out

    def iter_chunks(self, chunk_tokens: int = 1 << 22) -> Iterator[np.ndarray]:
        """The whole stream in order, as views of at most ``chunk_tokens`` (native dtype)."""
        for mm in self._maps:
            for lo in range(0, len(mm), chunk_tokens):
                yield mm[lo:lo + chunk_tokens]

    def __repr__(self) -> str:
        return (f"TokenShards({str(self.dir)!r}, tokens={self._len}, "
                f"shards={len(self._maps)}, dtype={self.dtype.name})")
