"""Typed configuration of ``lmforge prepare`` (corpus -> cleaned -> tokenized shards).

Loaded from the ``[prepare]`` table of a TOML file, sources as ``[[prepare.sources]]``::

    [prepare]
    output_dir = "data/mix"
    tokenizer = "bpe"
    vocab_size = 8192
    val_fraction = 0.01

    [[prepare.sources]]
    name = "web"
    path = "raw/web/**/*.jsonl"
    text_field = "text"
    weight = 0.7

    [[prepare.sources]]
    name = "books"
    path = "raw/books"          # a folder: every .txt/.jsonl/.parquet below it
    weight = 0.3

Relative paths (source paths, ``output_dir``, a tokenizer file) are taken relative to the TOML
file's folder. Unknown keys and wrong types raise ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmforge.config import build_dataclass, describe

FORMATS = ("txt", "jsonl", "parquet", "arrow")


def _f(default: Any = dataclasses.MISSING, doc: str = "", **kw: Any) -> Any:
    if default is dataclasses.MISSING:
        return field(metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


def name_from_path(path: str, index: int) -> str:
    """A source's default name: the last part of `path` before any glob, less its extensions, in
    the characters a name allows (`raw/web/**/*.jsonl` -> web, `s3://b/books.txt.gz` -> books);
    `source<index>` where nothing is left."""
    parts = [p for p in re.split(r"[/\\]", re.sub(r"^[a-z][a-z0-9+.-]*://", "", path)) if p and p not in (".", "..")]
    for part in reversed(parts):  # (a glob part: the folder above it names the source)
        if not any(c in part for c in "*?["):
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", part.split(".", 1)[0] if not part.startswith(".") else part)
            stem = stem.strip("-.")
            return stem or f"source{index}"
    return f"source{index}"


@dataclass
class SourceConfig:
    """One input corpus: files matched by a path, folder or glob, all of one format."""

    path: str = _f(doc="A file, a folder (searched recursively for .txt/.jsonl/.parquet/"
                       ".arrow, optionally .gz for txt/jsonl) or a glob (`**` recurses); a local "
                       "path or any fsspec URL (s3://bucket/raw/*.jsonl).")
    name: str = _f("", doc="Short unique name (letters, digits, -_.): the per-source shard "
                           "folder, data.stages weights, val_loss/<name>. Empty = from the path: its "
                           "last folder or file name before any glob, less extensions (raw/web/**/*.jsonl "
                           "-> web, books.txt -> books), made unique with -<index>.")
    format: Literal["auto", "txt", "jsonl", "parquet", "arrow"] = _f(
        "auto", doc="File format; auto = by extension (.txt, .jsonl/.json, .parquet, .arrow, "
                    "+.gz).")
    reader: Literal["native", "datasets"] = _f(
        "native", doc="native = lmforge's readers (large .jsonl files split by byte range and "
                      ".parquet by row groups across workers); datasets = stream each file "
                      "with Hugging Face datasets (load_dataset(json|parquet|arrow|text, "
                      "streaming=True), offline; needs lmforge[datasets]; one file = one work "
                      "unit). Both give the same documents.")
    text_field: str = _f("text", doc="jsonl key / parquet column holding the document text.")
    weight: float = _f(1.0, doc="Mixture weight of this source in the train split (weights "
                                "are normalised to sum to 1; they act in the loader).")


@dataclass
class PrepareConfig:
    """Everything `lmforge prepare` needs to turn raw corpora into token shards."""

    sources: list[SourceConfig] = _f(doc="Input corpora ([[prepare.sources]]); at least one.",
                                     default_factory=list)
    output_dir: str = _f("data/prepared", doc="Folder for tokenizer.json, train/<source>/, "
                                              "val/ and prepare.json.")
    # --- cleaning ----------------------------------------------------------------------
    normalize: Literal["NFC", "NFKC", "NFD", "NFKD", "none"] = _f(
        "NFC", doc="Unicode normalisation form applied to every document.")
    remove_control_chars: bool = _f(True, doc="Drop C0/C1 control characters except tab and "
                                              "newline (CR/LF line endings become LF).")
    lowercase: bool = _f(False, doc="Lowercase every document.")
    min_chars: int = _f(1, doc="Drop cleaned documents shorter than this (characters).")
    max_chars: int = _f(0, doc="Drop cleaned documents longer than this; 0 = no limit.")
    dedup: bool = _f(True, doc="Remove exact duplicates (same cleaned text, by content hash); "
                               "the first occurrence is kept.")
    near_dedup: bool = _f(False, doc="Remove near-duplicates with MinHash LSH (needs the "
                                     "`datasketch` package).")
    near_dedup_threshold: float = _f(0.8, doc="Estimated Jaccard similarity of word shingles "
                                              "above which a document is a near-duplicate.")
    near_dedup_num_perm: int = _f(128, doc="MinHash permutations (more = more precise, slower).")
    near_dedup_ngram: int = _f(5, doc="Words per shingle for near-duplicate detection.")
    on_bad_utf8: Literal["fail", "skip"] = _f(
        "fail", doc="Invalid UTF-8: fail (error names file and byte offset) or skip that "
                    "document (a txt file or a jsonl line) and count it.")
    # --- tokenizer ---------------------------------------------------------------------
    tokenizer: str = _f("bpe", doc="'bpe' = train a byte-level BPE on a sample of the cleaned "
                                   "corpus; 'gpt2' = the GPT-2 vocabulary; or a path to a HF "
                                   "tokenizer.json, or to a folder holding one (a Hugging Face "
                                   "model folder or an imported run: the model's own tokenizer, "
                                   "with the EOS its tokenizer_config.json names when eos_token "
                                   "is not in its vocabulary).")
    vocab_size: int = _f(8192, doc="Vocabulary size of a trained BPE (bytes + merges + special "
                                   "tokens). Ignored for 'gpt2' / a file.")
    eos_token: str = _f("<|endoftext|>", doc="End-of-document token, appended after every "
                                             "document.")
    bos_token: str = _f("", doc="Beginning-of-document token prepended to every document; "
                                "empty = none.")
    pad_token: str = _f("<|pad|>", doc="Padding token added to a trained BPE; empty = none.")
    sample_bytes: int = _f(100_000_000, doc="About this many UTF-8 bytes of kept text train the "
                                            "BPE: every kept document when the corpus is "
                                            "smaller, else a sample drawn across all work units "
                                            "by content hash (fraction sample_bytes / kept "
                                            "bytes), taken round-robin over sources up to "
                                            "sample_bytes.")
    # --- output ------------------------------------------------------------------------
    shard_tokens: int = _f(2**26, doc="Tokens per shard file (the last one of a set may be "
                                      "shorter).")
    val_fraction: float = _f(0.01, doc="Fraction held out for validation, in [0, 1).")
    val_split: Literal["documents", "tail"] = _f(
        "documents", doc="documents = whole documents go to val, chosen by content hash; "
                         "tail = the last val_fraction of every document's tokens (for a few "
                         "long documents, e.g. books).")
    chunk_bytes: int = _f(16_000_000, doc="Input bytes per work unit: small files are packed "
                                          "and large .jsonl/.parquet files split (byte ranges "
                                          "/ row groups) into units of about this size, the "
                                          "unit of parallel work and of resuming. Does not "
                                          "change the output.")
    dedup_ranges: int = _f(16, doc="Hash ranges of the global dedup stage: each is one task "
                                   "that owns 1/dedup_ranges of the document digests (exact) "
                                   "and of the MinHash band buckets (near). More = less memory "
                                   "per task. Does not change the output.")
    workers: int = _f(0, doc="Local worker processes for parallelism = \"processes\"; 0 = one "
                             "per CPU core; 1 = everything in this process. (Many machines: "
                             "torchrun or a Slurm array: docs/data.md, section Preparing a large corpus on many machines.)")
    parallelism: Literal["processes", "threads"] = _f(
        "threads", doc="threads = one process; tokenizers' Rust thread pool encodes on all "
                       "cores, overlapped with the Python work (measured fastest on 2 cores); "
                       "processes = `workers` local single-threaded worker processes, each "
                       "taking its share of every stage's work units.")
    s3_endpoint: str = _f("", doc="Endpoint URL for s3:// inputs and outputs (MinIO, a local "
                                  "test server, ...); empty = boto3's default or "
                                  "$AWS_ENDPOINT_URL. Credentials: boto3's usual sources.")
    scratch_dir: str = _f("", doc="Node-local folder for temporary files (Python tempfiles, "
                                  "the datasets cache); never read by another worker. Empty = "
                                  "the system default.")
    seed: int = _f(0, doc="Seed for the BPE training sample order (train/val choice is by "
                          "content hash, not by seed).")

    def validate(self) -> "PrepareConfig":
        """Raise ValueError naming the key for impossible values; return self."""
        if not self.sources:
            raise ValueError("prepare.sources: at least one [[prepare.sources]] is required")
        names = []
        typed = [s.name for s in self.sources if s.name]
        derived = [name_from_path(s.path, i) if not s.name else "" for i, s in enumerate(self.sources)]
        for i, s in enumerate(self.sources):
            if not s.name:  # (a name the user typed wins; derived ones that meet step aside with their index)
                clash = derived[i] in typed or derived.count(derived[i]) > 1
                s.name = f"{derived[i]}-{i}" if clash else derived[i]
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", s.name) or s.name in (".", ".."):
                raise ValueError(f"prepare.sources[{i}].name = {s.name!r}: use letters, digits "
                                 f"and -_. only")
            if s.name in names:
                raise ValueError(f"prepare.sources[{i}].name = {s.name!r} is used twice")
            names.append(s.name)
            if not s.path:
                raise ValueError(f"prepare.sources[{i}].path must not be empty")
            if not s.weight > 0:
                raise ValueError(f"prepare.sources[{i}].weight = {s.weight} must be > 0")
            if not s.text_field:
                raise ValueError(f"prepare.sources[{i}].text_field must not be empty")
        if self.min_chars < 0 or self.max_chars < 0:
            raise ValueError("prepare.min_chars / prepare.max_chars must be >= 0")
        if self.max_chars and self.max_chars < self.min_chars:
            raise ValueError(f"prepare.max_chars = {self.max_chars} is below "
                             f"prepare.min_chars = {self.min_chars}")
        if not 0.0 < self.near_dedup_threshold < 1.0:
            raise ValueError(f"prepare.near_dedup_threshold = {self.near_dedup_threshold} must "
                             f"be in (0, 1)")
        if self.near_dedup_num_perm < 16 or self.near_dedup_ngram < 1:
            raise ValueError("prepare.near_dedup_num_perm must be >= 16 and "
                             "prepare.near_dedup_ngram >= 1")
        if not self.eos_token:
            raise ValueError("prepare.eos_token must not be empty")
        if len({t for t in self.special_tokens}) != len(self.special_tokens):
            raise ValueError("prepare.eos_token / bos_token / pad_token must differ")
        if self.tokenizer == "bpe" and self.vocab_size < 256 + len(self.special_tokens):
            raise ValueError(f"prepare.vocab_size = {self.vocab_size} must be at least "
                             f"{256 + len(self.special_tokens)} (256 bytes + special tokens)")
        if self.sample_bytes < 1:
            raise ValueError("prepare.sample_bytes must be >= 1")
        if self.shard_tokens < 1:
            raise ValueError(f"prepare.shard_tokens = {self.shard_tokens} must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"prepare.val_fraction = {self.val_fraction} must be in [0, 1)")
        if self.chunk_bytes < 1:
            raise ValueError("prepare.chunk_bytes must be >= 1")
        if self.dedup_ranges < 1:
            raise ValueError(f"prepare.dedup_ranges = {self.dedup_ranges} must be >= 1")
        if self.workers < 0:
            raise ValueError(f"prepare.workers = {self.workers} must be >= 0 (0 = all cores)")
        return self

    @property
    def special_tokens(self) -> list[str]:
        """Special tokens of a trained BPE, EOS first."""
        return [t for t in (self.eos_token, self.bos_token, self.pad_token) if t]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def prepare_config_from_dict(data: dict, base_dir: Path | None = None) -> PrepareConfig:
    """Build and validate a PrepareConfig from the contents of the ``[prepare]`` table.

    Relative paths are resolved against ``base_dir`` when given.
    """
    cfg = build_dataclass(PrepareConfig, data, "prepare.")
    if base_dir is not None:
        base = Path(base_dir)
        for s in cfg.sources:
            if not Path(s.path).is_absolute() and "://" not in s.path:
                s.path = str(base / s.path)
        if not Path(cfg.output_dir).is_absolute() and "://" not in cfg.output_dir:
            cfg.output_dir = str(base / cfg.output_dir)
        if cfg.tokenizer not in ("bpe", "gpt2") and not Path(cfg.tokenizer).is_absolute():
            cfg.tokenizer = str(base / cfg.tokenizer)
    return cfg.validate()


def load_prepare_config(path: str | Path) -> PrepareConfig:
    """Read the ``[prepare]`` table of a TOML file (ValueError names the problem)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} not found")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid TOML ({e})") from e
    if "prepare" not in data:
        raise ValueError(f"{path}: no [prepare] table (with [[prepare.sources]])")
    return prepare_config_from_dict(data["prepare"], base_dir=path.resolve().parent)


def describe_prepare_config() -> list[tuple[str, str, str]]:
    """(key, default, doc) rows for every field, for help output."""
    return describe(PrepareConfig, "prepare.")


__all__ = ["SourceConfig", "PrepareConfig", "load_prepare_config", "prepare_config_from_dict",
           "describe_prepare_config", "FORMATS"]
