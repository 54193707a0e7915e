"""What every part of the config package shares: the error type and small helpers."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration error. The message names the key and says how to fix it."""


def doc_field(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field with its documentation attached (`describe()` and `config --docs` print it)."""
    return field(default=default, metadata={"doc": doc}, **kw)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def at_least(bound: int, section: str, **values: float) -> None:
    """ConfigError for the first `section.key` below `bound` (1: 'must be >= 1', 0: 'must be >= 0')."""
    for key, value in values.items():
        if value < bound:
            raise ConfigError(f"{section}.{key} = {value} must be >= {bound}.")
