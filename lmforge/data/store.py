"""Where `lmforge prepare` reads and writes: local paths or any fsspec URL (``s3://`` included).

* :func:`filesystem` maps a path or URL to an fsspec filesystem. ``s3://`` goes to
  :class:`BotoS3FileSystem`, a small fsspec filesystem on boto3 (s3fs, fsspec's usual S3
  backend, pins a botocore older than the boto3 this project installs for checkpoint backups;
  this one needs nothing beyond boto3). Other protocols (``gs://``, ``memory://``, ...) go to
  fsspec's own registry.
* :class:`Store` is a folder (local or URL) with the few operations the prepare stages need:
  whole-object writes that are atomic (local: :func:`lmforge.folders.atomic_write`; object
  stores: one PUT), whole and ranged reads, listing, removal.
* Sectioned files: one file holding several numpy arrays ("sections") behind an offset table,
  so that a reader fetches one section with a ranged read (one request on S3). The stages use
  them to hand each hash range / each work unit its part of another worker's output without
  one file per pair.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.folders import atomic_write, is_temp_name

S3_PROTOCOLS = ("s3", "s3a")


def is_url(path: str | Path) -> bool:
    """True for ``proto://...`` other than ``file://``."""
    s = str(path)
    return "://" in s and not s.startswith("file://")


def _local(path: str | Path) -> Path:
    s = str(path)
    return Path(s[len("file://"):] if s.startswith("file://") else s)


def filesystem(url: str, s3_endpoint: str = ""):
    """(fsspec filesystem, path within it) for a URL."""
    proto = url.split("://", 1)[0]
    if proto in S3_PROTOCOLS:
        fs = BotoS3FileSystem(endpoint_url=s3_endpoint)
        return fs, fs._strip_protocol(url)
    try:
        import fsspec
    except ImportError as e:
        raise ValueError(f"{url}: URLs need the package fsspec (pip install fsspec)") from e
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{url}: no fsspec filesystem for {proto!r} ({e})") from e


def open_input(path: str, s3_endpoint: str = ""):
    """A binary, seekable file object for a local path or a URL."""
    if not is_url(path):
        return open(_local(path), "rb")
    fs, p = filesystem(path, s3_endpoint)
    return fs.open(p, "rb")


# ---------------------------------------------------------------------------------------
# a folder, local or remote
# ---------------------------------------------------------------------------------------

class Store:
    """A folder given as a local path or a URL; every name is relative to it."""

    def __init__(self, root: str | Path, s3_endpoint: str = "") -> None:
        self.root = str(root).rstrip("/") or "/"
        self.local = not is_url(self.root)
        self.s3_endpoint = s3_endpoint
        if self.local:
            self._path = _local(self.root)
        else:
            self.fs, self._base = filesystem(self.root, s3_endpoint)

    def check(self) -> None:
        """For a URL: ValueError naming it (and what to check) unless the store answers and,
        for s3://, the bucket exists."""
        if self.local:
            return
        try:
            if hasattr(self.fs, "check_bucket"):
                self.fs.check_bucket(self._base)
            else:
                self.fs.exists(self._base)
        except ValueError:
            raise
        except Exception as e:  # botocore / aiohttp / ... errors: unreachable, denied
            raise ValueError(f"{self.root}: cannot reach it ({type(e).__name__}: {e}). Check the "
                             f"URL, prepare.s3_endpoint (or $AWS_ENDPOINT_URL) and the "
                             f"credentials") from e

    def url(self, rel: str = "") -> str:
        """The full path or URL of ``rel``."""
        return f"{self.root}/{rel}" if rel else self.root

    def sub(self, rel: str) -> "Store":
        return Store(self.url(rel), self.s3_endpoint)

    def _p(self, rel: str) -> str:
        return f"{self._base}/{rel}" if rel else self._base

    # -- reads ----------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        try:
            if self.local:
                return (self._path / rel).read_bytes()
            return self.fs.cat_file(self._p(rel))
        except (FileNotFoundError, OSError) as e:
            raise ValueError(f"{self.url(rel)}: cannot read ({e})") from e

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``rel``."""
        if end <= start:
            return b""
        if self.local:
            with open(self._path / rel, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        return self.fs.cat_file(self._p(rel), start=start, end=end)

    def read_json(self, rel: str) -> Any | None:
        """The JSON in ``rel``, or None if it is missing or not JSON."""
        try:
            return json.loads(self.read(rel))
        except (ValueError, OSError):
            return None

    def exists(self, rel: str) -> bool:
        if self.local:
            return (self._path / rel).exists()
        return self.fs.exists(self._p(rel))

    def list(self, rel: str = "") -> list[str]:
        """Names (not paths) of the files directly in folder ``rel``, sorted; [] if none."""
        if self.local:
            d = self._path / rel
            if not d.is_dir():
                return []
            return sorted(p.name for p in d.iterdir() if p.is_file() and not is_temp_name(p.name))
        try:
            entries = self.fs.ls(self._p(rel), detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries
                      if e.get("type") == "file")

    def find(self, rel: str = "") -> list[str]:
        """Paths relative to the root of every file below folder ``rel``, sorted."""
        if self.local:
            d = self._path / rel
            if not d.is_dir():
                return []
            return sorted(str(p.relative_to(self._path)) for p in d.rglob("*")
                          if p.is_file() and not is_temp_name(p.name))
        try:
            found = self.fs.find(self._p(rel))
        except FileNotFoundError:
            return []
        base = self._base.rstrip("/") + "/"
        return sorted(f[len(base):] for f in found if f.startswith(base))

    def is_empty(self) -> bool:
        """No files at all under the root (a missing root is empty)."""
        if self.local:
            return not self._path.exists() or not any(self._path.iterdir())
        return not self.find()

    # -- writes ---------------------------------------------------------------------------
    def write(self, rel: str, data: bytes | str) -> None:
        """Replace ``rel`` with ``data`` atomically (readers see the old or the new file)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        if self.local:
            path = self._path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data)
        else:
            self.fs.pipe_file(self._p(rel), data)  # object stores: one PUT, atomic

    def write_json(self, rel: str, obj: Any) -> None:
        self.write(rel, json.dumps(obj, indent=1) + "\n")

    def remove(self, rel: str) -> None:
        if self.local:
            (self._path / rel).unlink(missing_ok=True)
        elif self.fs.exists(self._p(rel)):
            self.fs.rm_file(self._p(rel))

    def remove_tree(self, rel: str) -> None:
        if self.local:
            shutil.rmtree(self._path / rel, ignore_errors=True)
            return
        try:
            self.fs.rm(self._p(rel), recursive=True)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"Store({self.root!r})"


# ---------------------------------------------------------------------------------------
# sectioned files
# ---------------------------------------------------------------------------------------

_MAGIC = b"LMFSECT1"


def pack_sections(arrays: list[np.ndarray | bytes]) -> bytes:
    """``magic, n (int64), offsets (int64 x n+1), data``: section k is bytes
    ``[offsets[k], offsets[k+1])`` of data."""
    blobs = [a if isinstance(a, bytes) else np.ascontiguousarray(a).tobytes() for a in arrays]
    offsets = np.zeros(len(blobs) + 1, dtype="<i8")
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return b"".join([_MAGIC, np.array([len(blobs)], dtype="<i8").tobytes(), offsets.tobytes(),
                     *blobs])


class SectionedFile:
    """Ranged reads of one section of a :func:`pack_sections` file (header read once)."""

    def __init__(self, store: Store, rel: str, n: int) -> None:
        self.store, self.rel, self.n = store, rel, n
        head = store.read_range(rel, 0, 16 + 8 * (n + 1))
        if head[:8] != _MAGIC or int(np.frombuffer(head[8:16], "<i8")[0]) != n:
            raise ValueError(f"{store.url(rel)}: not a sectioned file with {n} sections; delete "
                             f"the work folder and re-run prepare")
        self.offsets = np.frombuffer(head[16:], dtype="<i8")
        self.data_start = 16 + 8 * (n + 1)

    def read(self, k: int, dtype: Any = np.uint8, first: int = 0, count: int | None = None
             ) -> np.ndarray:
        """Section ``k`` as an array of ``dtype`` (items ``[first, first+count)``)."""
        dt = np.dtype(dtype)
        lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
        lo += first * dt.itemsize
        if count is not None:
            hi = min(hi, lo + count * dt.itemsize)
        data = self.store.read_range(self.rel, self.data_start + lo, self.data_start + hi)
        return np.frombuffer(data, dtype=dt)


def unpack_sections(data: bytes) -> list[bytes]:
    """All sections of a :func:`pack_sections` blob read whole."""
    if data[:8] != _MAGIC:
        raise ValueError("not a sectioned file")
    n = int(np.frombuffer(data[8:16], "<i8")[0])
    offsets = np.frombuffer(data[16:16 + 8 * (n + 1)], dtype="<i8")
    base = 16 + 8 * (n + 1)
    return [data[base + int(offsets[k]):base + int(offsets[k + 1])] for k in range(n)]


# ---------------------------------------------------------------------------------------
# s3:// on boto3
# ---------------------------------------------------------------------------------------

def _fsspec_base():
    try:
        from fsspec.spec import AbstractBufferedFile, AbstractFileSystem
    except ImportError as e:
        raise ValueError("s3:// paths need the packages fsspec and boto3 "
                         "(pip install \"lmforge[s3]\")") from e
    return AbstractFileSystem, AbstractBufferedFile


def _make_s3_classes():
    AbstractFileSystem, AbstractBufferedFile = _fsspec_base()

    class _S3File(AbstractBufferedFile):
        def _fetch_range(self, start, end):
            return self.fs.cat_file(self.path, start=start, end=end)

        def _initiate_upload(self):
            self._parts = []

        def _upload_chunk(self, final=False):
            self._parts.append(self.buffer.getvalue())
            if final:
                self.fs.pipe_file(self.path, b"".join(self._parts))
            return True

    class BotoS3FileSystem(AbstractFileSystem):
        """fsspec filesystem for ``s3://bucket/key`` on boto3 (credentials: boto3's usual
        chain; endpoint: ``endpoint_url``, else ``$AWS_ENDPOINT_URL``)."""

        protocol = S3_PROTOCOLS
        root_marker = ""
        cachable = False

        def __init__(self, endpoint_url: str = "", **kw):
            super().__init__(**kw)
            try:
                import boto3
                from botocore.exceptions import ClientError
            except ImportError as e:
                raise ValueError("s3:// paths need the package boto3 (pip install "
                                 "\"lmforge[s3]\")") from e
            self._ClientError = ClientError
            self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
            from botocore.config import Config
            self.client = boto3.client("s3", endpoint_url=self.endpoint_url, config=Config(
                retries={"max_attempts": 4, "mode": "standard"}, connect_timeout=10))

        @classmethod
        def _split(cls, path: str) -> tuple[str, str]:
            path = cls._strip_protocol(path)
            bucket, _, key = path.partition("/")
            return bucket, key

        def check_bucket(self, path: str) -> None:
            bucket, _ = self._split(path)
            try:
                self.client.head_bucket(Bucket=bucket)
            except self._ClientError as e:
                if self._missing(e):
                    raise ValueError(f"s3://{bucket}: no such bucket at "
                                     f"{self.endpoint_url or 'the default AWS endpoint'}; create "
                                     f"it or fix the URL") from e
                raise

        def _missing(self, e) -> bool:
            code = e.response.get("Error", {}).get("Code", "")
            return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")

        def _list(self, path: str, delimiter: str):
            bucket, key = self._split(path)
            prefix = key.rstrip("/") + "/" if key else ""
            kw = {"Bucket": bucket, "Prefix": prefix}
            if delimiter:
                kw["Delimiter"] = delimiter
            files, dirs = [], []
            try:
                for page in self.client.get_paginator("list_objects_v2").paginate(**kw):
                    for o in page.get("Contents", []):
                        files.append({"name": f"{bucket}/{o['Key']}", "size": o["Size"],
                                      "type": "file", "ETag": o.get("ETag", ""),
                                      "LastModified": str(o.get("LastModified", ""))})
                    for p in page.get("CommonPrefixes", []):
                        dirs.append({"name": f"{bucket}/{p['Prefix'].rstrip('/')}", "size": 0,
                                     "type": "directory"})
            except self._ClientError as e:
                if self._missing(e):
                    raise FileNotFoundError(path) from e
                raise
            return files, dirs

        def ls(self, path, detail=True, **kw):
            files, dirs = self._list(path, "/")
            if not files and not dirs:
                info = self.info(path)  # a file, or FileNotFoundError
                entries = [info]
            else:
                entries = dirs + files
            return entries if detail else [e["name"] for e in entries]

        def find(self, path, maxdepth=None, withdirs=False, detail=False, **kw):
            path = self._strip_protocol(path)
            try:
                files, _ = self._list(path, "")
            except FileNotFoundError:
                files = []
            if maxdepth is not None:
                base = path.rstrip("/").count("/")
                files = [f for f in files if f["name"].count("/") - base <= maxdepth]
            if not files:
                try:
                    info = self.info(path)
                    if info["type"] == "file":
                        files = [info]
                except FileNotFoundError:
                    pass
            out = {f["name"]: f for f in files}
            return out if detail else sorted(out)

        def info(self, path, **kw):
            bucket, key = self._split(path)
            if key:
                try:
                    h = self.client.head_object(Bucket=bucket, Key=key)
                    return {"name": f"{bucket}/{key}", "size": h["ContentLength"], "type": "file",
                            "ETag": h.get("ETag", ""), "LastModified": str(h.get("LastModified"))}
                except self._ClientError as e:
                    if not self._missing(e):
                        raise
            files, dirs = self._list(path, "/")
            if files or dirs or not key:
                return {"name": f"{bucket}/{key}".rstrip("/"), "size": 0, "type": "directory"}
            raise FileNotFoundError(path)

        def cat_file(self, path, start=None, end=None, **kw):
            bucket, key = self._split(path)
            args = {"Bucket": bucket, "Key": key}
            if start is not None or end is not None:
                if end is not None and end <= (start or 0):
                    return b""
                args["Range"] = f"bytes={start or 0}-" + ("" if end is None else str(end - 1))
            try:
                return self.client.get_object(**args)["Body"].read()
            except self._ClientError as e:
                if self._missing(e):
                    raise FileNotFoundError(path) from e
                raise

        def pipe_file(self, path, value, **kw):
            bucket, key = self._split(path)
            self.client.put_object(Bucket=bucket, Key=key, Body=value)

        def rm_file(self, path):
            bucket, key = self._split(path)
            self.client.delete_object(Bucket=bucket, Key=key)

        def rm(self, path, recursive=False, maxdepth=None):
            paths = self.find(path) if recursive else [self._strip_protocol(path)]
            for p in paths:
                self.rm_file(p)

        def mkdir(self, path, create_parents=True, **kw):
            pass

        def makedirs(self, path, exist_ok=False):
            pass

        def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None,
                  **kw):
            return _S3File(self, path, mode, block_size=block_size or 5 * 2**20,
                           cache_type="readahead", cache_options=cache_options)

    return BotoS3FileSystem


_S3_CLASS = None


def BotoS3FileSystem(endpoint_url: str = "", **kw):  # noqa: N802 (a class, built lazily)
    """An fsspec filesystem for s3:// on boto3 (the class is built on first use, so that
    importing this module needs neither fsspec nor boto3)."""
    global _S3_CLASS
    if _S3_CLASS is None:
        _S3_CLASS = _make_s3_classes()
    return _S3_CLASS(endpoint_url=endpoint_url, **kw)


__all__ = ["Store", "SectionedFile", "pack_sections", "unpack_sections", "filesystem",
           "open_input", "is_url", "BotoS3FileSystem"]
