"""Finding and reading input corpora: .txt, .jsonl, .parquet and .arrow files, folders and
globs, as local paths or any fsspec URL (``s3://bucket/raw/*.jsonl``).

Documents: a .txt file is one document; a .jsonl line is one document (its ``text_field``);
a parquet or arrow row is one document (column ``text_field``). ``.gz`` is accepted for txt and
jsonl. Invalid UTF-8 raises :class:`BadUtf8` (a ValueError naming file and byte offset) or, with
``on_bad_utf8="skip"``, is counted and the document (txt file / jsonl line / parquet row) is
skipped.

Pieces: :func:`iter_documents` reads a whole file or a piece of one: a byte range of an
uncompressed .jsonl file (a line belongs to the range its first byte is in) or a range of
parquet row groups. The pieces of a file yield exactly the documents of the whole file, in order.

``reader = "datasets"`` streams a source through Hugging Face ``datasets``
(``load_dataset(<json|parquet|arrow|text>, data_files=..., streaming=True)``, offline) instead.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from lmforge.data.prepare_config import SourceConfig
from lmforge.data.store import filesystem, is_url, open_input

_EXT = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".json": "jsonl",
        ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow"}


class BadUtf8(ValueError):
    """Invalid UTF-8 in an input file (message names the file and the byte offset, then the
    fix); ``where`` is the message without the fix (for the skip log line)."""

    def __init__(self, where: str) -> None:
        super().__init__(f"{where}. Fix: re-encode the file as UTF-8, or set "
                         f"on_bad_utf8 = \"skip\" to drop such documents")
        self.where = where


def format_of(path: Path | str) -> str | None:
    """txt / jsonl / parquet / arrow by extension (``.gz`` stripped for txt/jsonl), else None."""
    suffixes = [s.lower() for s in Path(str(path).rsplit("/", 1)[-1]).suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
        fmt = _EXT.get(suffixes[-1]) if suffixes else None
        return fmt if fmt in ("txt", "jsonl") else None
    return _EXT.get(suffixes[-1]) if suffixes else None


def source_files(src: SourceConfig, s3_endpoint: str = "") -> list[str]:
    """Sorted files (paths or URLs) of a source; ValueError if none match."""
    if src.path.startswith("file://"):
        src = dataclasses.replace(src, path=src.path[len("file://"):])
    if not is_url(src.path):
        return [str(f) for f in expand_source(src)]
    fs, path = filesystem(src.path, s3_endpoint)
    proto = src.path.split("://", 1)[0]
    try:
        if any(ch in path for ch in "*?["):
            found = fs.glob(path)
        elif fs.isdir(path):
            found = fs.find(path)
        elif fs.isfile(path):
            found = [path]
        else:
            raise ValueError(f"source {src.name!r}: path {src.path} not found")
    except (OSError, FileNotFoundError) as e:
        raise ValueError(f"source {src.name!r}: cannot list {src.path} ({e})") from e
    files = [f"{proto}://{f}" for f in found
             if (format_of(f) if src.format == "auto" else _matches(Path(f), src.format))
             and not f.rsplit("/", 1)[-1].startswith(".")]
    if not files:
        raise ValueError(f"source {src.name!r}: no input files match {src.path}")
    return sorted(files)


def expand_source(src: SourceConfig) -> list[Path]:
    """Sorted local files of a source; ValueError if none match or a format is unknown."""
    p = Path(src.path)
    if any(ch in src.path for ch in "*?["):
        files = [Path(f) for f in glob.glob(src.path, recursive=True) if os.path.isfile(f)]
        if src.format == "auto":
            files = [f for f in files if format_of(f)]
    elif p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")
                 and (format_of(f) if src.format == "auto" else _matches(f, src.format))]
    elif p.is_file():
        files = [p]
    else:
        raise ValueError(f"source {src.name!r}: path {src.path} not found")
    if not files:
        raise ValueError(f"source {src.name!r}: no input files match {src.path}")
    for f in files:
        if src.format == "auto" and format_of(f) is None:
            raise ValueError(f"source {src.name!r}: cannot tell the format of {f} from its "
                             f"extension; set format = \"txt\" | \"jsonl\" | \"parquet\"")
    return sorted(files)


def _matches(f: Path, fmt: str) -> bool:
    found = format_of(f)
    return found == fmt or found is None


def _open_binary(path: str | Path, s3_endpoint: str = ""):
    f = open_input(str(path), s3_endpoint)
    if str(path).lower().endswith(".gz"):
        return gzip.open(f, "rb")
    return f


def _decode(raw: bytes, path: Path, base_offset: int, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        off = base_offset + e.start
        raise BadUtf8(f"{path}: invalid UTF-8 at byte offset {off} (byte 0x{raw[e.start]:02x})"
                      f"{what}") from None


def iter_documents(path: Path | str, fmt: str, text_field: str,
                   on_bad: Callable[[BadUtf8], None] | None = None, start: int = 0,
                   end: int | None = None, s3_endpoint: str = "") -> Iterator[str]:
    """Yield the raw (uncleaned) documents of one file, or of the piece ``[start, end)`` of it
    (jsonl: bytes; parquet: row groups; other formats: whole files only).

    ``on_bad``: called with the error for a document with invalid UTF-8, which is skipped;
    None = raise it.
    """
    try:
        if fmt == "txt":
            yield from _iter_txt(path, on_bad, s3_endpoint)
        elif fmt == "jsonl":
            yield from _iter_jsonl(path, text_field, on_bad, start, end, s3_endpoint)
        elif fmt == "parquet":
            yield from _iter_parquet(path, text_field, on_bad, start, end, s3_endpoint)
        elif fmt == "arrow":
            yield from _iter_arrow(path, text_field, on_bad, s3_endpoint)
        else:
            raise ValueError(f"{path}: unknown format {fmt!r}")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from e


def _iter_txt(path, on_bad, s3_endpoint="") -> Iterator[str]:
    with _open_binary(path, s3_endpoint) as f:
        raw = f.read()
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    try:
        yield _decode(raw[bom:], path, bom, "")
    except BadUtf8 as e:
        if on_bad is None:
            raise
        on_bad(e)


def _iter_jsonl(path, field: str, on_bad, first: int = 0, end: int | None = None,
                s3_endpoint: str = "") -> Iterator[str]:
    with _open_binary(path, s3_endpoint) as f:
        offset = 0
        if first > 0:  # the line holding byte first-1 belongs to the previous piece
            f.seek(first - 1)
            offset = first - 1 + len(f.readline())
        lineno = 0
        while end is None or offset < end:
            raw = f.readline()
            if not raw:
                break
            lineno += 1
            start, offset = offset, offset + len(raw)
            where = f":{lineno}" if first == 0 else f" (line at byte {start})"
            if start == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw, start = raw[3:], start + 3
            if not raw.strip():
                continue
            try:
                line = _decode(raw, path, start, f" on line {lineno}" if first == 0 else "")
            except BadUtf8 as e:
                if on_bad is None:
                    raise
                on_bad(e)
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}{where}: invalid JSON ({e})") from None
            if not isinstance(rec, dict) or field not in rec:
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ValueError(f"{path}{where}: text field {field!r} absent (record has "
                                 f"{keys}); set text_field for this source")
            text = rec[field]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise ValueError(f"{path}{where}: field {field!r} is "
                                 f"{type(text).__name__}, not a string")
            yield text


def parquet_file(path, s3_endpoint: str = ""):
    """A pyarrow ParquetFile (ValueError naming the file if it is not one)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError("reading .parquet needs the package pyarrow (pip install pyarrow)"
                         ) from e
    try:
        return pq.ParquetFile(open_input(str(path), s3_endpoint))
    except Exception as e:  # pyarrow raises ArrowInvalid etc.
        raise ValueError(f"{path}: not a readable parquet file ({e})") from e


def _iter_parquet(path, field: str, on_bad, first: int = 0, end: int | None = None,
                  s3_endpoint: str = "") -> Iterator[str]:
    pf = parquet_file(path, s3_endpoint)
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"{path}: text field {field!r} absent (columns: {names}); set "
                         f"text_field for this source")
    groups = list(range(first, pf.num_row_groups if end is None else end))
    if not groups:
        return
    row = sum(pf.metadata.row_group(g).num_rows for g in range(first))
    batches = pf.iter_batches(columns=[field], batch_size=4096, row_groups=groups)
    yield from _iter_column(path, field, on_bad, (b.column(0) for b in batches), row)


def _iter_arrow(path, field: str, on_bad, s3_endpoint: str = "") -> Iterator[str]:
    """An Arrow IPC file or stream (what Hugging Face datasets caches as .arrow)."""
    import pyarrow as pa
    with open_input(str(path), s3_endpoint) as f:
        data = f.read()
    try:
        try:
            table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
    except Exception as e:  # pyarrow raises ArrowInvalid etc.
        raise ValueError(f"{path}: not a readable Arrow IPC file or stream ({e})") from e
    if field not in table.column_names:
        raise ValueError(f"{path}: text field {field!r} absent (columns: {table.column_names})"
                         f"; set text_field for this source")
    yield from _iter_column(path, field, on_bad, table.column(field).chunks, 0)


def _iter_column(path, field, on_bad, chunks, row: int) -> Iterator[str]:
    for chunk in chunks:
        for value in chunk.to_pylist():
            row += 1
            if value is None:
                value = ""
            if isinstance(value, bytes):
                try:
                    value = _decode(value, path, 0, f" in row {row - 1} of column {field!r}")
                except BadUtf8 as e:
                    if on_bad is None:
                        raise
                    on_bad(e)
                    continue
            if not isinstance(value, str):
                raise ValueError(f"{path}: column {field!r} holds {type(value).__name__}, "
                                 f"not text")
            yield value


def iter_datasets_documents(path: str, fmt: str, text_field: str) -> Iterator[str]:
    """The documents of one file streamed by Hugging Face ``datasets`` (offline: only its
    packaged json/parquet/arrow/text builders, no hub access)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        raise ValueError("reader = \"datasets\" needs the package datasets "
                         "(pip install \"lmforge[datasets]\")") from e
    builder, kw = {"jsonl": ("json", {}), "parquet": ("parquet", {}), "arrow": ("arrow", {}),
                   "txt": ("text", {"sample_by": "document"})}[fmt]
    try:
        ds = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True,
                                   **kw)
        for row in ds:
            if text_field not in row:
                raise ValueError(f"{path}: text field {text_field!r} absent (columns: "
                                 f"{sorted(row)}); set text_field for this source")
            yield row[text_field] or ""
    except ValueError:
        raise
    except Exception as e:  # datasets/pyarrow raise many kinds
        raise ValueError(f"{path}: datasets could not read it ({type(e).__name__}: {e})") from e


__all__ = ["BadUtf8", "expand_source", "source_files", "format_of", "iter_documents",
           "iter_datasets_documents", "parquet_file"]
