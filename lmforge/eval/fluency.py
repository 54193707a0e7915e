"""Fluency of generated text: how repetitive, how varied (on whitespace-separated words).

* distinct-n (Li et al., 2016): distinct n-grams / all n-grams, pooled over all samples.
* repetition rate: per sample, the fraction of its n-grams (n = 4 by default, "rep-4" of
  Welleck et al., 2019) that repeat an earlier n-gram of the same sample; averaged over samples
  that have at least one n-gram. A model stuck in a loop scores near 1, varied text near 0.
"""

from __future__ import annotations

from collections.abc import Sequence


def ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct n-grams over all n-grams of all texts (0.0 when there is none)."""
    grams = [g for t in texts for g in ngrams(t.split(), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repetition_rate(texts: Sequence[str], n: int = 4) -> float:
    """Mean over texts of 1 - distinct/total of the text's own n-grams (0.0 when no text has one)."""
    rates = []
    for t in texts:
        grams = ngrams(t.split(), n)
        if grams:
            rates.append(1.0 - len(set(grams)) / len(grams))
    return sum(rates) / len(rates) if rates else 0.0


def fluency_report(texts: Sequence[str], rep_n: int = 4) -> dict[str, float]:
    """repetition rate and distinct-1/2/3 of the samples, with their count and mean length in words."""
    words = [len(t.split()) for t in texts]
    return {"samples": len(texts), "mean_words": sum(words) / max(1, len(words)),
            f"repetition_rate_{rep_n}gram": repetition_rate(texts, rep_n),
            **{f"distinct_{n}": distinct_n(texts, n) for n in (1, 2, 3)}}
