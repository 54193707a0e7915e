"""Finding and reading input corpora: .txt, .jsonl and .parquet files, folders and globs.

Documents: a .txt file is one document; a .jsonl line is one document (its ``text_field``);
a parquet row is one document (column ``text_field``). ``.gz`` is accepted for txt and jsonl.
Invalid UTF-8 raises :class:`BadUtf8` (a ValueError naming file and byte offset) or, with
``on_bad_utf8="skip"``, is counted and the document (txt file / jsonl line / parquet row) is
skipped.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from lmforge.data.prepare_config import SourceConfig

_EXT = {".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".json": "jsonl",
        ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


class BadUtf8(ValueError):
    """Invalid UTF-8 in an input file (message names the file and the byte offset)."""


def format_of(path: Path) -> str | None:
    """txt / jsonl / parquet by extension (``.gz`` stripped for txt/jsonl), else None."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
        fmt = _EXT.get(suffixes[-1]) if suffixes else None
        return fmt if fmt in ("txt", "jsonl") else None
    return _EXT.get(suffixes[-1]) if suffixes else None


def expand_source(src: SourceConfig) -> list[Path]:
    """Sorted files of a source; ValueError if none match or a format is unknown."""
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


def _open_binary(path: Path):
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def _decode(raw: bytes, path: Path, base_offset: int, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        off = base_offset + e.start
        raise BadUtf8(f"{path}: invalid UTF-8 at byte offset {off} (byte 0x{raw[e.start]:02x})"
                      f"{what}. Fix: re-encode the file as UTF-8, or set "
                      f"on_bad_utf8 = \"skip\" to drop such documents") from None


def iter_documents(path: Path, fmt: str, text_field: str,
                   on_bad: Callable[[BadUtf8], None] | None = None) -> Iterator[str]:
    """Yield the raw (uncleaned) documents of one file.

    ``on_bad``: called with the error for a document with invalid UTF-8, which is skipped;
    None = raise it.
    """
    try:
        if fmt == "txt":
            yield from _iter_txt(path, on_bad)
        elif fmt == "jsonl":
            yield from _iter_jsonl(path, text_field, on_bad)
        elif fmt == "parquet":
            yield from _iter_parquet(path, text_field, on_bad)
        else:
            raise ValueError(f"{path}: unknown format {fmt!r}")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from e


def _iter_txt(path: Path, on_bad) -> Iterator[str]:
    with _open_binary(path) as f:
        raw = f.read()
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0
    try:
        yield _decode(raw[bom:], path, bom, "")
    except BadUtf8 as e:
        if on_bad is None:
            raise
        on_bad(e)


def _iter_jsonl(path: Path, field: str, on_bad) -> Iterator[str]:
    offset = 0
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw, start = raw[3:], start + 3
            if not raw.strip():
                continue
            try:
                line = _decode(raw, path, start, f" on line {lineno}")
            except BadUtf8 as e:
                if on_bad is None:
                    raise
                on_bad(e)
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e})") from None
            if not isinstance(rec, dict) or field not in rec:
                keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ValueError(f"{path}:{lineno}: text field {field!r} absent (record has "
                                 f"{keys}); set text_field for this source")
            text = rec[field]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {field!r} is "
                                 f"{type(text).__name__}, not a string")
            yield text


def _iter_parquet(path: Path, field: str, on_bad) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ValueError("reading .parquet needs the package pyarrow (pip install pyarrow)"
                         ) from e
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid etc.
        raise ValueError(f"{path}: not a readable parquet file ({e})") from e
    names = pf.schema_arrow.names
    if field not in names:
        raise ValueError(f"{path}: text field {field!r} absent (columns: {names}); set "
                         f"text_field for this source")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        for value in batch.column(0).to_pylist():
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


__all__ = ["BadUtf8", "expand_source", "format_of", "iter_documents"]
