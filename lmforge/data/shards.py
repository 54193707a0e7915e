"""Token shards on disk: fixed-size raw little-endian files plus a ``manifest.json``.

Layout of a shard directory::

    manifest.json      format, version, dtype, vocab_size, total_tokens, shards[], meta, unigram
    shard_00000.bin    shard_tokens tokens, raw uint16 (vocab <= 65536) or uint32, little-endian
    shard_00001.bin    ... the last shard may be shorter
    unigram_counts.bin how often each token id occurs, vocab_size little-endian int64

The token counts are written with the shards (their entropy, the unigram baseline of a training
run, goes into the manifest's ``unigram`` entry), so that nothing reads the corpus for them later.
Folders written before had neither; :attr:`TokenShards.recorded_entropy` is then None.

Corruption is caught on the way in. Opening checks every shard's size; every read range-checks the
ids it returns against the manifest's vocabulary (one max over the array: a corrupt id is a
ValueError naming the shard file, the token offset, the id and the vocabulary, not an embedding
IndexError or a numpy broadcast error later). Checksums (``verify_checksums``, the run's
``data.verify_checksums``):

* ``"first_open"``: a shard is re-hashed (sha256, and its recorded largest id) the first time this
  process reads from it, once per shard per process (a module-level record keyed by the file's path,
  size and mtime), so a resumed run checks again and a shard never read is never hashed;
* ``"always"``: every shard is re-hashed when the folder is opened (start-up);
* ``"never"``: no hashing (sizes and the per-read range check still apply).

``True`` / ``False`` (the option's old boolean form) mean ``"always"`` / ``"never"``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.folders import (MANIFEST, SHARD_FORMAT, SHARD_FORMAT_VERSION, UNIGRAM_COUNTS, atomic_dir,
                             build_manifest, sha256_bytes, sha256_file, shard_record, unigram_record)


VERIFY_MODES = ("first_open", "always", "never")
_VERIFIED: set[tuple[str, int, int, str]] = set()  # shards this process has hashed: (path, size, mtime_ns, sha256)


def verify_mode(value: str | bool) -> str:
    """`verify_checksums` as one of VERIFY_MODES (True = "always", False = "never", the old boolean form)."""
    if isinstance(value, bool):
        return "always" if value else "never"
    if value not in VERIFY_MODES:
        raise ValueError(f"verify_checksums = {value!r} is not one of {', '.join(map(repr, VERIFY_MODES))} "
                         f"(or true = 'always', false = 'never').")
    return value


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest little-endian unsigned dtype holding ids ``0 .. vocab_size-1``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def count_entropy(counts: np.ndarray) -> float:
    """Entropy (nats) of the distribution counts / their sum (ids never seen contribute nothing)."""
    counts = np.asarray(counts)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_file(counts: np.ndarray) -> tuple[bytes, dict[str, Any]]:
    """A shard folder's token counts as the bytes of its UNIGRAM_COUNTS file and the manifest's
    ``unigram`` entry (file, sha256, entropy)."""
    data = np.asarray(counts, dtype="<i8").tobytes()
    return data, unigram_record(data, count_entropy(counts))


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
    counts = np.zeros(vocab_size, dtype=np.int64)
    with atomic_dir(out_dir) as tmp:
        shards = _write_shards(token_arrays, tmp, shard_tokens, vocab_size, dtype, counts)
        if not shards:
            raise ValueError(f"no tokens to write to {out_dir}: the input is empty")
        data, unigram = unigram_file(counts)
        (tmp / UNIGRAM_COUNTS).write_bytes(data)
        manifest = build_manifest(dtype.name, vocab_size, shard_tokens, shards, meta_json, unigram)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _write_shards(token_arrays: Iterable[np.ndarray], tmp: Path, shard_tokens: int,
                  vocab_size: int, dtype: np.dtype, counts: np.ndarray) -> list[dict[str, Any]]:
    """Stream arrays through a one-shard buffer; return the per-shard records. Each token id's
    occurrences are added to `counts`."""
    shards: list[dict[str, Any]] = []
    buf = np.empty(shard_tokens, dtype=dtype)
    fill = 0

    def flush() -> None:
        nonlocal fill
        data = buf[:fill].tobytes()
        counts[:] += np.bincount(buf[:fill], minlength=vocab_size)
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

    def __init__(self, dir: Path, verify_checksums: str | bool = "never") -> None:
        self.dir = Path(dir)
        self.verify = verify_mode(verify_checksums)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise ValueError(f"{path} not found: {self.dir} is not a token-shard directory "
                             f"(create one with `lmforge prepare`)")
        try:
            self.manifest: dict[str, Any] = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from e
        m = self.manifest
        if not isinstance(m, dict):
            raise ValueError(f"{path}: a JSON {type(m).__name__}, not a token-shard manifest "
                             f"(a JSON object with \"shards\"); re-run prepare")
        if m.get("format") != SHARD_FORMAT or m.get("version") != SHARD_FORMAT_VERSION:
            raise ValueError(f"{path}: format {m.get('format')!r} version {m.get('version')!r}"
                             f" is not {SHARD_FORMAT!r} version {SHARD_FORMAT_VERSION}; re-run prepare")
        missing = [k for k in ("dtype", "vocab_size", "total_tokens", "shards") if k not in m]
        if missing:
            raise ValueError(f"{path}: no {', '.join(repr(k) for k in missing)} in the manifest; "
                             f"the dataset is incomplete, re-run prepare")
        shards = m["shards"]
        if not isinstance(shards, list) or not all(
                isinstance(r, dict) and isinstance(r.get("file"), str)
                and isinstance(r.get("tokens"), int) for r in shards):
            raise ValueError(f"{path}: \"shards\" must be a list of {{\"file\", \"tokens\", "
                             f"...}} entries; the manifest is damaged, re-run prepare")
        try:
            self.dtype = np.dtype(m["dtype"]).newbyteorder("<")
        except TypeError as e:
            raise ValueError(f"{path}: dtype {m['dtype']!r} is not a numpy dtype; re-run "
                             f"prepare") from e
        self._maps: list[np.memmap] = []
        self._max_id: int | None = None
        for rec in shards:
            f = self.dir / rec["file"]
            want = rec["tokens"] * self.dtype.itemsize
            if not f.is_file():
                raise ValueError(f"shard {f} listed in {path} is missing; re-run prepare")
            if f.stat().st_size != want:
                raise ValueError(f"shard {f} has {f.stat().st_size} bytes, manifest says "
                                 f"{want}; the dataset is corrupted, re-run prepare")
            mm = np.memmap(f, dtype=self.dtype, mode="r") if want else np.zeros(0, self.dtype)
            self._maps.append(mm)
        self._checked = [self.verify == "never"] * len(shards)  # shard k hashed (or not to be)
        if self.verify == "always":
            for k in range(len(shards)):
                self._check_shard(k, force=True)
        sizes = np.array([len(mm) for mm in self._maps], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])  # shard k covers [s_k, s_k+1)
        self._len = int(self._starts[-1])
        if self._len != m["total_tokens"]:  # (user data: never an assert, which -O removes)
            raise ValueError(f"{path}: total_tokens = {m['total_tokens']} but its shards hold "
                             f"{self._len} tokens; the manifest is damaged, re-run prepare")

    def _check_shard(self, k: int, force: bool = False) -> None:
        """Re-hash shard `k` against the manifest (sha256 and recorded largest id): at open
        ("always", `force`) or before its first read in this process ("first_open")."""
        rec, mm = self.manifest["shards"][k], self._maps[k]
        f = self.dir / rec["file"]
        st = f.stat()
        key = (str(f.resolve()), st.st_size, st.st_mtime_ns, str(rec.get("sha256")))
        if force or key not in _VERIFIED:
            path = self.dir / MANIFEST
            if sha256_file(f) != rec.get("sha256"):
                raise ValueError(f"shard {f} is corrupted: sha256 differs from {path}; "
                                 f"delete {self.dir} and re-run prepare")
            if "max_id" in rec and len(mm) and int(mm.max()) != rec["max_id"]:
                raise ValueError(f"shard {f} is corrupted: its largest token id is "
                                 f"{int(mm.max())}, {path} says {rec['max_id']}; delete "
                                 f"{self.dir} and re-run prepare")
            _VERIFIED.add(key)
        self._checked[k] = True

    def _before_reading(self, shards: Iterable[int]) -> None:
        for k in shards:
            if not self._checked[k]:
                self._check_shard(int(k))

    def _check_ids(self, tokens: np.ndarray, offsets: Callable[[int], int]) -> None:
        """ValueError naming the shard and offset when `tokens` (just read) hold an id outside the
        vocabulary; `offsets(i)` is the stream position of tokens.flat[i]."""
        if not tokens.size or int(tokens.max()) < self.vocab_size:
            return
        i = int(np.argmax(tokens.reshape(-1) >= self.vocab_size))
        pos = offsets(i)
        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        local = pos - int(self._starts[k])
        f = self.dir / self.manifest["shards"][k]["file"]
        raise ValueError(f"token shard {f} is corrupt: the token at offset {local:,} (byte "
                         f"{local * self.dtype.itemsize:,}) is id {int(tokens.reshape(-1)[i])}, outside the "
                         f"vocabulary (vocab_size {self.vocab_size} in {self.dir / MANIFEST}); delete {self.dir} and "
                         f"re-run `lmforge prepare` (data.verify_checksums 'first_open' or 'always' hashes each shard "
                         f"before use)")

    @property
    def max_id(self) -> int:
        """Largest token id in the shards (-1 if none): the manifest's ``max_id``, or, for
        manifests written before that field existed, computed from the data once. Compare it
        with the model's vocabulary before training; ``verify_checksums=True`` also checks
        every shard's bytes (and recorded max id) against the manifest."""
        if self._max_id is None:
            v = self.manifest.get("max_id")
            if isinstance(v, int) and not isinstance(v, bool):
                self._max_id = v
            else:
                self._max_id = max((int(mm.max()) for mm in self._maps if len(mm)), default=-1)
        return self._max_id

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def recorded_entropy(self) -> float | None:
        """The unigram entropy (nats) `lmforge prepare` recorded in the manifest, or None for a
        folder written before it did (see :func:`lmforge.data.prepare.unigram_entropy`)."""
        rec = self.manifest.get("unigram")
        value = rec.get("entropy") if isinstance(rec, dict) else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def recorded_counts(self) -> np.ndarray | None:
        """How often each token id occurs (int64, vocab_size long), as recorded beside the shards,
        checked against the manifest's sha256; None for a folder written before it was recorded."""
        if self.recorded_entropy is None:
            return None
        path = self.dir / UNIGRAM_COUNTS
        if not path.is_file():
            raise ValueError(f"{path}, listed in {self.dir / MANIFEST}, is missing; re-run prepare")
        data = path.read_bytes()
        if len(data) != 8 * self.vocab_size or sha256_bytes(data) != self.manifest["unigram"].get("sha256"):
            raise ValueError(f"{path} is corrupted (its size or sha256 differs from {self.dir / MANIFEST}); "
                             f"delete {self.dir} and re-run prepare")
        return np.frombuffer(data, dtype="<i8")

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
            self._before_reading([k])
            out[done:done + take] = self._maps[k][lo:lo + take]
            done += take
            k += 1
        self._check_ids(out, lambda i: start + i)
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
            self._before_reading([k])
            rows = np.flatnonzero(inside & (shard == k))
            local = starts[rows] - self._starts[k]
            out[rows] = self._maps[k][local[:, None] + offsets]
        for row in np.flatnonzero(~inside):
            out[row] = self.read(starts[row], length)
        self._check_ids(out, lambda i: int(starts[i // length]) + i % length)
        return out

    def iter_chunks(self, chunk_tokens: int = 1 << 22, start: int = 0,
                    stop: int | None = None) -> Iterator[np.ndarray]:
        """Tokens ``[start, stop)`` of the stream (default: all) in order, as views of at most
        ``chunk_tokens`` (native dtype)."""
        stop = self._len if stop is None else stop
        for k, mm in enumerate(self._maps):
            lo, hi = max(start - int(self._starts[k]), 0), min(stop - int(self._starts[k]), len(mm))
            if lo < hi:
                self._before_reading([k])
            for a in range(lo, hi, chunk_tokens):
                chunk = mm[a:min(a + chunk_tokens, hi)]
                self._check_ids(chunk, lambda i, a=a, k=k: int(self._starts[k]) + a + i)
                yield chunk

    def __repr__(self) -> str:
        return (f"TokenShards({str(self.dir)!r}, tokens={self._len}, "
                f"shards={len(self._maps)}, dtype={self.dtype.name})")


class TokenSlice:
    """Tokens [start, start + length) of a `TokenShards` stream, read as a stream of its own: one
    source's held-out documents inside the validation shards of a prepared mixture (their ranges are
    recorded by `lmforge prepare` in the val manifest's meta.sources). Offers what the loader reads."""

    def __init__(self, shards: TokenShards, start: int, length: int, name: str = "") -> None:
        if start < 0 or length < 0 or start + length > len(shards):
            raise ValueError(f"{shards.dir}: tokens [{start}, {start + length}) of source {name!r} lie outside its "
                             f"{len(shards)} tokens; the manifest is damaged, re-run prepare")
        self.shards, self.start, self.length, self.name = shards, int(start), int(length), name
        self.dir, self.manifest = shards.dir, shards.manifest

    @property
    def vocab_size(self) -> int:
        return self.shards.vocab_size

    def __len__(self) -> int:
        return self.length

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > self.length:
            raise IndexError(f"read({start}, {length}) outside the {self.length} tokens of {self.name!r}")
        return self.shards.read(self.start + start, length)

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() + length > self.length):
            raise IndexError(f"gather of length {length} outside the {self.length} tokens of {self.name!r}")
        return self.shards.gather(starts + self.start, length)

    def iter_chunks(self, chunk_tokens: int = 1 << 22, start: int = 0, stop: int | None = None) -> Iterator[np.ndarray]:
        stop = self.length if stop is None else stop
        return self.shards.iter_chunks(chunk_tokens, self.start + start, self.start + stop)

    def __repr__(self) -> str:
        return f"TokenSlice({self.name!r} of {self.shards!r}, [{self.start}, {self.start + self.length}))"


def source_slices(shards: TokenShards) -> list[TokenSlice]:
    """The per-source parts of a validation shard set, from its manifest's meta.sources ([name, tokens,
    documents] in stream order, written by `lmforge prepare`); [] for a set without them (one source, or
    prepared before they were recorded)."""
    sources = shards.manifest.get("meta", {}).get("sources") or []
    out, at = [], 0
    for entry in sources:
        name, tokens = str(entry[0]), int(entry[1])
        out.append(TokenSlice(shards, at, tokens, name))
        at += tokens
    if out and at != len(shards):
        raise ValueError(f"{shards.dir / MANIFEST}: meta.sources cover {at} tokens, the shards hold {len(shards)}; "
                         f"the manifest is damaged, re-run prepare")
    return out
