"""BLEU and chrF (sacrebleu) of greedy generations against references.

The file is jsonl: ``{"prompt": str, "reference": str}`` a line, or ``"references": [str, ...]``
for several references; items may have different numbers of references (sacrebleu's way: the
shorter lists are padded with None, which sacrebleu skips).
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
        if not isinstance(ref, list) or not ref or not all(isinstance(r, str) and r.strip() for r in ref):
            raise ValueError(f"{path}: item {lineno}: 'reference' must be a non-empty string or a non-empty list "
                             f"of them.")
        prompts.append(str(rec["prompt"]))
        refs.append(ref)
    return prompts, refs


def hypothesis(generated: str, stop: str | None) -> str:
    """The text scored of one greedy generation: its leading whitespace skipped, then cut at the first
    `stop` (None or '': not cut), stripped. A prompt such as "ROMEO:" is answered on the next line:
    cut at the first newline as generated, every such hypothesis was empty (BLEU and chrF 0.0)."""
    text = generated.lstrip()
    return (text.split(stop, 1)[0] if stop else text).strip()


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Corpus BLEU and chrF (0-100) of hypotheses against per-hypothesis reference lists."""
    try:
        import sacrebleu
    except ImportError as exc:
        raise ValueError('BLEU/chrF need sacrebleu, which is not installed; install it with: '
                         'pip install "lmforge[eval]"') from exc
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists.")
    if not hypotheses:
        raise ValueError("BLEU/chrF: no items to score.")
    if any(not refs for refs in references):
        raise ValueError("every hypothesis needs at least one reference.")
    # sacrebleu takes one stream per reference position; an item with fewer references than the
    # most is padded with None there, which sacrebleu skips for that item
    most = max((len(refs) for refs in references), default=0)
    streams = [[refs[i] if i < len(refs) else None for refs in references] for i in range(most)]
    return {"bleu": sacrebleu.corpus_bleu(list(hypotheses), streams).score,
            "chrf": sacrebleu.corpus_chrf(list(hypotheses), streams).score, "n": len(hypotheses)}
