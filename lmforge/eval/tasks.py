"""Zero-shot multiple-choice tasks (HellaSwag / PIQA / ARC style) scored by log-likelihood.

A task file is jsonl, one item a line: ``{"context": str, "choices": [str, ...], "label": int}``
(the lm-evaluation-harness names ``query`` / ``gold`` are accepted too). Each choice is scored
by the log-probability of its tokens after the context; ``acc`` picks the highest sum,
``acc_norm`` the highest sum per UTF-8 byte of the choice (lm-evaluation-harness's definition),
which removes the bias towards short answers. Choices usually start with a space (" Paris").

A task is a file, or the name of one shipped with lmforge (lmforge.folders.BUILTIN_TASKS; `resolve_task`):
``shakespeare-cloze`` is a 4-way cloze built from the default corpus's validation text (the part
`data.val_fraction` holds out, never trained on; lmforge/data/tasks/README.md says how).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.data.jsonl import read_records
from lmforge.folders import BUILTIN_TASKS
from lmforge.model.loss import IGNORE_INDEX, token_nll_sum


def resolve_task(name_or_path: str) -> Path:
    """The file of a task: a shipped task's name (lmforge.folders.BUILTIN_TASKS) or a path; ValueError
    when neither."""
    if name_or_path in BUILTIN_TASKS:
        return Path(__file__).resolve().parents[1] / BUILTIN_TASKS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"task {name_or_path!r} is neither a file nor a task shipped with lmforge "
                         f"({', '.join(BUILTIN_TASKS)}).")
    return path


@torch.no_grad()
def continuation_logprobs(model: torch.nn.Module, requests: Sequence[tuple[Sequence[int], Sequence[int]]],
                          batch_size: int = 8, autocast=contextlib.nullcontext) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): (sum of log p(continuation | context), whether
    the continuation is the greedy argmax at every position). Inputs longer than the model's
    context keep their last max_seq_len + 1 tokens (the context is cut from the left). `autocast`:
    a callable giving the precision's context, entered around each forward (a training run's)."""
    max_len = model.cfg.max_seq_len
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = []
    for i, (ctx, cont) in enumerate(requests):
        if not ctx:
            raise ValueError(f"request {i}: the context is empty; give at least one token (e.g. end-of-text).")
        if not cont:
            raise ValueError(f"request {i}: the continuation is empty.")
        if len(cont) > max_len:
            raise ValueError(f"request {i}: continuation of {len(cont)} tokens exceeds model.max_seq_len = {max_len}.")
        full = (list(ctx) + list(cont))[-(max_len + 1):]
        rows.append((full[:-1], full[1:], len(cont)))
    out: list[tuple[float, bool]] = []
    for lo in range(0, len(rows), batch_size):
        group = rows[lo:lo + batch_size]
        width = max(len(x) for x, _, _ in group)
        x = torch.zeros(len(group), width, dtype=torch.long)
        y = torch.full_like(x, IGNORE_INDEX)  # only the continuation's tokens are scored
        for r, (inp, tgt, n) in enumerate(group):
            x[r, :len(inp)] = torch.tensor(inp)  # right padding: causal, so it never affects real positions
            y[r, len(inp) - n:len(inp)] = torch.tensor(tgt[-n:])
        with autocast():
            logits = model(x.to(device))
        logits, y = logits.float(), y.to(device)
        greedy = ((logits.argmax(-1) == y) | (y == IGNORE_INDEX)).all(-1).tolist()
        out += [(-float(token_nll_sum(logits[r], y[r])), greedy[r]) for r in range(len(group))]
    model.train(was_training)
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of context and continuation as they appear together: trailing whitespace of the
    context moves to the continuation, the pair is encoded as one text and split where the
    context's own tokens end (so the continuation is tokenized as the model saw it in text). An
    empty context becomes end-of-text."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    if not stripped:
        return [tokenizer.eos_id], tokenizer.encode(continuation)
    ctx = tokenizer.encode(stripped)
    whole = tokenizer.encode(stripped + continuation)
    if whole[:len(ctx)] != ctx:  # merge across the boundary: encode the parts separately
        return ctx, tokenizer.encode(continuation)
    return ctx, whole[len(ctx):]


@dataclass
class MCItem:
    context: str
    choices: list[str]
    label: int


def load_mc_items(path: str | Path) -> list[MCItem]:
    """Items of a multiple-choice jsonl file; ValueError names the file and line of a bad item."""
    items = []
    records = read_records(path, [("context", "query"), "choices", ("label", "gold")])
    for lineno, rec in enumerate(records, 1):
        choices, label = rec["choices"], rec["label"]
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"{path}: item {lineno}: 'choices' must be a list of at least 2 strings.")
        if not isinstance(label, int) or not 0 <= label < len(choices):
            raise ValueError(f"{path}: item {lineno}: 'label' = {label!r} must be an index into the "
                             f"{len(choices)} choices.")
        items.append(MCItem(str(rec["context"]), choices, label))
    return items


def evaluate_mc(model: torch.nn.Module, tokenizer, items: Sequence[MCItem], batch_size: int = 8) -> dict[str, float]:
    """acc and acc_norm (byte-length-normalised) over the items, and how many there were."""
    scores = [lp for lp, _ in continuation_logprobs(model, mc_requests(tokenizer, items), batch_size)]
    return score_mc(items, scores)


def mc_requests(tokenizer, items: Sequence[MCItem]) -> list[tuple[list[int], list[int]]]:
    """The (context, continuation) token ids of every choice of every item, in order."""
    return [encode_pair(tokenizer, item.context, choice) for item in items for choice in item.choices]


def score_mc(items: Sequence[MCItem], scores: Sequence[float]) -> dict[str, float]:
    """acc, acc_norm and n of `items` from the log-likelihood of each choice (`mc_requests`' order)."""
    correct = correct_norm = 0
    k = 0
    for item in items:
        s = scores[k:k + len(item.choices)]
        k += len(item.choices)
        norm = [v / max(1, len(c.encode("utf-8"))) for v, c in zip(s, item.choices)]
        correct += int(max(range(len(s)), key=s.__getitem__) == item.label)
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == item.label)
    n = len(items)
    return {"acc": correct / n, "acc_norm": correct_norm / n, "n": n}
