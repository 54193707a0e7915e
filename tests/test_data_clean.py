"""Cleaner: normalisation, control characters, filters, exact and near dedup, counts."""

from __future__ import annotations

import random

import pytest

from lmforge.data.clean import Cleaner
from lmforge.data.prepare_config import PrepareConfig, SourceConfig


def _cfg(**kw) -> PrepareConfig:
    return PrepareConfig(sources=[SourceConfig(path="x")], **kw).validate()


def test_transformations():
    c = Cleaner(_cfg(normalize="NFKC", lowercase=True))
    assert c("Ｆｕｌｌ\u00a0Width ﬁ\r\nLine  \r\n\r\n\r\n\r\n\r\nEnd\x00\x1b\x7f\x85") == \
        "full width fi\nline\n\n\nend\n"
    assert c.stats.control_chars_removed == 4
    nfc = Cleaner(_cfg())
    assert nfc("e\u0301") == "\u00e9\n"  # NFC composes
    assert nfc("\u00e9") is None and nfc.stats.duplicates == 1  # same text after NFC
    raw = Cleaner(_cfg(normalize="none", remove_control_chars=False, dedup=False))
    assert raw("e\u0301\x07") == "e\u0301\x07\n" and raw("e\u0301\x07") is not None


def test_filters_and_counts():
    c = Cleaner(_cfg(min_chars=5, max_chars=20))
    docs = ["", "  \n\t ", "abc", "abcd", "abcde" * 5, "hello world", "hello world  ",
            "Hello world", "\x01\x02"]
    kept = [c(d, "s") for d in docs]
    assert kept == [None, None, None, "abcd\n", None, "hello world\n", None, "Hello world\n",
                    None]
    s = c.stats
    assert (s.empty, s.too_short, s.too_long, s.duplicates, s.kept) == (3, 1, 1, 1, 3)
    assert s.documents_read == len(docs) and s.removed == len(docs) - s.kept
    assert s.per_source == {"s": {"read": 9, "kept": 3}}


def test_near_dedup_finds_edited_copies_only():
    pytest.importorskip("datasketch")
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(3000)]
    base = [" ".join(rng.choice(vocab) for _ in range(300)) for _ in range(20)]
    c = Cleaner(_cfg(near_dedup=True, near_dedup_threshold=0.8))
    assert all(c(d) is not None for d in base)
    for d in base[:5]:
        w = d.split()
        w[100] = "EDITED"
        assert c(" ".join(w)) is None
    other = [" ".join(rng.choice(vocab) for _ in range(300)) for _ in range(10)]
    assert all(c(d) is not None for d in other)
    assert (c.stats.near_duplicates, c.stats.kept) == (5, 30)


def test_near_dedup_without_datasketch_is_a_clear_error(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_datasketch(name, *a, **k):
        if name.startswith("datasketch"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_datasketch)
    with pytest.raises(ValueError, match="needs the package datasketch"):
        Cleaner(_cfg(near_dedup=True))
