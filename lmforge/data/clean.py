"""Document cleaning, filtering and deduplication, with counts of everything removed.

Order per document: Unicode normalisation -> control characters dropped -> whitespace tidied
(:func:`lmforge.data.corpus.clean_text`: LF line endings, no trailing spaces, at most two blank
lines, one final newline) -> optional lowercasing -> empty / length filters -> exact dedup
(blake2b-128 of the cleaned text; first occurrence kept) -> optional MinHash-LSH near-dedup
(``datasketch``; word n-gram shingles; first occurrence kept).

The exact-dedup set costs about 100 bytes of memory per kept document.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

from lmforge.data.corpus import clean_text
from lmforge.data.prepare_config import PrepareConfig

# C0 and C1 controls except TAB (09), LF (0a), CR (0d: handled as a line ending).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_WORD = re.compile(r"\w+")


@dataclass
class CleanStats:
    """What cleaning read, changed and removed (documents unless said otherwise)."""

    documents_read: int = 0
    bad_utf8: int = 0  # skipped with on_bad_utf8="skip" (counted in documents_read)
    empty: int = 0
    too_short: int = 0
    too_long: int = 0
    duplicates: int = 0
    near_duplicates: int = 0
    kept: int = 0
    control_chars_removed: int = 0  # characters
    bytes_read: int = 0  # UTF-8 bytes of the raw documents
    bytes_kept: int = 0  # UTF-8 bytes of the kept, cleaned documents
    per_source: dict = field(default_factory=dict)  # name -> {"read": n, "kept": n}

    @property
    def removed(self) -> int:
        return (self.bad_utf8 + self.empty + self.too_short + self.too_long + self.duplicates
                + self.near_duplicates)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["removed"] = self.removed
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CleanStats":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class Cleaner:
    """Stateful cleaner: :meth:`__call__` returns the cleaned text or None if removed."""

    def __init__(self, cfg: PrepareConfig) -> None:
        self.cfg = cfg
        self.stats = CleanStats()
        self._seen: set[bytes] = set()
        self._lsh = None
        if cfg.near_dedup:
            try:
                from datasketch import MinHashLSH
            except ImportError as e:
                raise ValueError("prepare.near_dedup = true needs the package datasketch "
                                 "(pip install datasketch)") from e
            self._lsh = MinHashLSH(threshold=cfg.near_dedup_threshold,
                                   num_perm=cfg.near_dedup_num_perm)
            self._n_lsh = 0

    def count_bad_utf8(self, source: str) -> None:
        self.stats.documents_read += 1
        self.stats.bad_utf8 += 1
        self._src(source)["read"] += 1

    def _src(self, source: str) -> dict:
        return self.stats.per_source.setdefault(source, {"read": 0, "kept": 0})

    def normalize(self, text: str) -> str:
        """The text transformations only (no filters, no dedup state)."""
        cfg = self.cfg
        if cfg.normalize != "none":
            text = unicodedata.normalize(cfg.normalize, text)
        if cfg.remove_control_chars:
            text, n = _CONTROL.subn("", text)
            self.stats.control_chars_removed += n
        text = clean_text(text)
        if cfg.lowercase:
            text = text.lower()
        return text

    def filter(self, raw: str, source: str = "") -> str | None:
        """Normalise ``raw`` and apply the per-document filters (empty, length): the cleaned
        text, or None if a filter removed it. No dedup (see :meth:`__call__`; the prepare
        stages deduplicate globally, across workers)."""
        st, cfg = self.stats, self.cfg
        st.documents_read += 1
        st.bytes_read += len(raw.encode("utf-8", "surrogatepass"))
        self._src(source)["read"] += 1
        text = self.normalize(raw)
        if not text.strip():
            st.empty += 1
            return None
        n = len(text)
        if n < cfg.min_chars:
            st.too_short += 1
            return None
        if cfg.max_chars and n > cfg.max_chars:
            st.too_long += 1
            return None
        return text

    def __call__(self, raw: str, source: str = "") -> str | None:
        """:meth:`filter`, then exact and near dedup against the documents this cleaner kept
        before (one process, in order: the reference the prepare stages reproduce)."""
        st, cfg = self.stats, self.cfg
        text = self.filter(raw, source)
        if text is None:
            return None
        data = text.encode("utf-8")
        if cfg.dedup:
            digest = hashlib.blake2b(data, digest_size=16).digest()
            if digest in self._seen:
                st.duplicates += 1
                return None
            self._seen.add(digest)
        if self._lsh is not None and self._is_near_duplicate(text):
            st.near_duplicates += 1
            return None
        st.kept += 1
        st.bytes_kept += len(data)
        self._src(source)["kept"] += 1
        return text

    def _is_near_duplicate(self, text: str) -> bool:
        m = minhash(text, self.cfg.near_dedup_ngram, self.cfg.near_dedup_num_perm)
        if self._lsh.query(m):
            return True
        self._lsh.insert(str(self._n_lsh), m)
        self._n_lsh += 1
        return False


_PERMUTATIONS: dict[int, tuple] = {}


def minhash(text: str, ngram: int, num_perm: int, permutations=None):
    """datasketch MinHash (seed 1) of the word ``ngram``-shingles of ``text``."""
    from datasketch import MinHash
    words = _WORD.findall(text)
    shingles = {" ".join(words[i:i + ngram]) for i in range(max(1, len(words) - ngram + 1))}
    if num_perm not in _PERMUTATIONS:  # (generating them costs more than hashing a document)
        ref = MinHash(num_perm=num_perm, seed=1)
        _PERMUTATIONS[num_perm] = (ref.permutations, ref.scheme)
    perms, scheme = _PERMUTATIONS[num_perm]
    m = MinHash(num_perm=num_perm, seed=1, permutations=perms, scheme=scheme)
    m.update_batch([s.encode("utf-8") for s in shingles])
    return m


@functools.lru_cache(maxsize=None)
def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band) that datasketch's MinHashLSH picks for ``threshold`` (a
    numerical optimisation: ~0.1 s, hence cached)."""
    from datasketch.lsh import _optimal_param
    return _optimal_param(threshold, num_perm, 0.5, 0.5)


__all__ = ["Cleaner", "CleanStats", "minhash", "lsh_bands"]
