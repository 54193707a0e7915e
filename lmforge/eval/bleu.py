"""BLEU and chrF (sacrebleu) of greedy generations against references.

The file is jsonl: ``{"prompt": str, "reference": str}`` a line, or ``"references": [str, ...]``
for several references (every item must then have the same number).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lmforge.data.jsonl import read_records


def load_bleu_items(path: str | Path) -> tuple[list[str], list[list[str]]]:
    """(prompts, references per prompt) of a prompt/reference jsonl file."""
    records = read_records(path, ["prompt", ("reference", "references")])
    prompts, refs = [], []
    for lineno, rec in enumerate(records, 1):
        ref = rec["reference"]
        ref = [ref] if isinstance(ref, str) else ref
        if not isinstance(ref, list) or not ref or not all(isinstance(r, str) for r in ref):
            raise ValueError(f"{path}: item {lineno}: 'reference' must be a string or a non-empty list of strings.")
        if refs and len(ref) != len(refs[0]):
            raise ValueError(f"{path}: item {lineno} has {len(ref)} references, item 1 has {len(refs[0])}; "
                             f"give every item the same number.")
        prompts.append(str(rec["prompt"]))
        refs.append(ref)
    return prompts, refs


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Corpus BLEU and chrF (0-100) of hypotheses against per-hypothesis reference lists."""
    try:
        import sacrebleu
    except ImportError as exc:
        raise ValueError("BLEU/chrF need sacrebleu: pip install 'sacrebleu>=2.4'.") from exc
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists.")
    streams = [list(r) for r in zip(*references)]  # sacrebleu: one stream per reference position
    return {"bleu": sacrebleu.corpus_bleu(list(hypotheses), streams).score,
            "chrf": sacrebleu.corpus_chrf(list(hypotheses), streams).score, "n": len(hypotheses)}
