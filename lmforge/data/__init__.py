"""Data layer: default corpus, tokenizers, token shards, dataset preparation, packed loader.

Names are imported lazily (PEP 562), so that importing a light submodule (e.g. in a spawned
tokenizer worker) does not pull in torch through the loader.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DEFAULT_CORPUS": "corpus", "fetch_default_corpus": "corpus", "read_text_files": "corpus",
    "PackedLoader": "loader", "TokenMixture": "loader", "open_tokens": "loader",
    "PreparedData": "prepare", "prepare_default": "prepare", "prepare_texts": "prepare",
    "unigram_entropy": "prepare", "load_prepared": "prepare",
    "TokenShards": "shards", "write_token_shards": "shards",
    "Tokenizer": "tokenizer", "load_gpt2_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "train_bpe": "tokenizer",
    "PrepareConfig": "prepare_config", "SourceConfig": "prepare_config",
    "load_prepare_config": "prepare_config",
    "run_prepare": "pipeline", "PrepareResult": "pipeline", "run_stage": "pipeline",
    "run_distributed": "pipeline", "Store": "store",
    "Cleaner": "clean", "CleanStats": "clean",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"lmforge.data.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lmforge.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
