"""Instruction (prompt -> response) data for supervised fine-tuning, with the loss on the
response only.

A file is jsonl, one ``{"prompt": str, "response": str}`` a line. Each example is tokenized as
``prompt + response + <eos>`` (prompt and response encoded separately, so the boundary is
exact); its targets are -100 (ignored by the loss) on every position whose *target* is a prompt
token, so only response tokens and the closing end-of-text are learned. Examples longer than
``seq_len + 1`` tokens keep their prompt and lose the end of the response (counted and logged);
an example whose prompt leaves no room for a response token is an error naming its line.

Rows: ``pack = False`` puts one example per row; ``pack = True`` fills each row with whole
consecutive examples (in file order) while they fit, which wastes far fewer padded positions.
Packed examples attend to the earlier examples of their row, but never learn to predict across
them: the first target of the next example is a prompt token, hence -100. Rows are padded to
``seq_len`` (inputs with the pad token or end-of-text, targets with -100).

:class:`InstructLoader` has :class:`~lmforge.data.loader.PackedLoader`'s interface and the same
sample order rule: global sample ``g`` is row ``perm_e[g % n]`` with ``e = g // n`` and
``perm_e = default_rng((seed, e)).permutation(n)``; rank r of W takes global samples
``position + r + W * i``. The state is the global position, so resuming (also at another world
size) continues exactly where the checkpoint stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.data.jsonl import read_records
from lmforge.model.loss import IGNORE_INDEX

log = logging.getLogger("lmforge.data")


@dataclass
class InstructRows:
    """Token rows (each <= seq_len + 1 tokens) and, per token, whether it is a learned target."""

    tokens: list[np.ndarray]
    learn: list[np.ndarray]
    n_examples: int
    truncated: int


def tokenize_examples(path: str | Path, tokenizer, seq_len: int, pack: bool = False,
                      add_eos: bool = True) -> InstructRows:
    """Read and tokenize a prompt/response jsonl file into rows for :class:`InstructLoader`."""
    records = read_records(path, ["prompt", "response"])
    examples, truncated = [], 0
    limit = seq_len + 1
    for lineno, rec in enumerate(records, 1):
        if not isinstance(rec["prompt"], str) or not isinstance(rec["response"], str):
            raise ValueError(f"{path}: record {lineno}: 'prompt' and 'response' must be strings.")
        prompt = tokenizer.encode(rec["prompt"])
        response = tokenizer.encode(rec["response"]) + ([tokenizer.eos_id] if add_eos else [])
        if not response:
            raise ValueError(f"{path}: record {lineno}: empty response (and add_eos is off): nothing to learn.")
        if len(prompt) >= limit:
            raise ValueError(f"{path}: record {lineno}: the prompt has {len(prompt)} tokens, leaving no room for "
                             f"the response in seq_len = {seq_len}; shorten the prompt or raise data.seq_len.")
        if len(prompt) + len(response) > limit:
            truncated += 1
            response = response[:limit - len(prompt)]
        ids = np.asarray(prompt + response, dtype=np.int64)
        learn = np.zeros(len(ids), dtype=bool)
        learn[len(prompt):] = True
        examples.append((ids, learn))
    if truncated:
        log.warning("data: %d of %d examples in %s were longer than seq_len + 1 = %d tokens; their responses "
                    "were cut", truncated, len(examples), path, limit)
    if not pack:
        return InstructRows([e[0] for e in examples], [e[1] for e in examples], len(examples), truncated)
    tokens, learn, cur_t, cur_l, used = [], [], [], [], 0
    for ids, lrn in examples:
        if used + len(ids) > limit and cur_t:
            tokens.append(np.concatenate(cur_t))
            learn.append(np.concatenate(cur_l))
            cur_t, cur_l, used = [], [], 0
        cur_t.append(ids)
        cur_l.append(lrn)
        used += len(ids)
    tokens.append(np.concatenate(cur_t))
    learn.append(np.concatenate(cur_l))
    return InstructRows(tokens, learn, len(examples), truncated)


class InstructLoader:
    """Batches ``(x, y)`` of int64 tensors of shape ``(batch_size, seq_len)`` from instruction data,
    ``y = -100`` on prompt tokens and padding. Same interface as ``PackedLoader``."""

    def __init__(self, path: str | Path, tokenizer, seq_len: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, pack: bool = False, add_eos: bool = True, holdout: float = 0.0,
                 split: str = "train") -> None:
        """`holdout`: the share of rows set aside for validation (a fixed pseudo-random choice);
        `split` "train" yields the others, "val" those."""
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.path = Path(path)
        self.rows = tokenize_examples(path, tokenizer, seq_len, pack, add_eos)
        if holdout:
            n = len(self.rows.tokens)
            held = set(np.random.default_rng(0).permutation(n)[:max(1, round(holdout * n))].tolist())
            keep = [i for i in range(n) if (i in held) == (split == "val")]
            if not keep:
                raise ValueError(f"{path}: {n} rows leave none for the {split} split at finetune.val_fraction = "
                                 f"{holdout}; add examples or change finetune.val_fraction.")
            self.rows = InstructRows([self.rows.tokens[i] for i in keep], [self.rows.learn[i] for i in keep],
                                     self.rows.n_examples, self.rows.truncated)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, int(seed)
        self.rank, self.world_size = rank, world_size
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.num_rows = len(self.rows.tokens)
        self.position = 0  # global samples consumed (all ranks)
        self._perm_cache: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.position // self.num_rows

    def _perm(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, np.random.default_rng((self.seed, epoch)).permutation(self.num_rows))
        return self._perm_cache[1]

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `index` as (x, y) of length seq_len, padded."""
        ids, learn = self.rows.tokens[index], self.rows.learn[index]
        x = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        y = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        n = len(ids) - 1
        x[:n] = torch.from_numpy(ids[:-1])
        targets = torch.from_numpy(ids[1:].copy())
        targets[~torch.from_numpy(learn[1:])] = IGNORE_INDEX
        y[:n] = targets
        return x, y

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next batch; advances the global position by batch_size * world_size."""
        g = self.position + self.rank + self.world_size * np.arange(self.batch_size, dtype=np.int64)
        self.position += self.batch_size * self.world_size
        rows = [self.row(int(self._perm(int(e))[i])) for e, i in zip(*np.divmod(g, self.num_rows))]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def iter_eval_batches(self, max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Rows in file order (unshuffled) for validation; rank r takes rows r, r+W, ... of the
        first (n // W) * W rows, so every rank yields the same number of batches."""
        usable = (self.num_rows // self.world_size) * self.world_size
        mine = list(range(self.rank, usable, self.world_size))
        if not mine:
            raise ValueError(f"{self.path}: {self.num_rows} rows cannot feed {self.world_size} ranks; add examples.")
        for b, lo in enumerate(range(0, len(mine), self.batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            rows = [self.row(i) for i in mine[lo:lo + self.batch_size]]
            yield torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rows": self.num_rows}

    def load_state_dict(self, sd: dict) -> None:
        """Resume so that the next batch is the one that followed ``sd``'s last batch (any world size)."""
        try:
            position, seed, rows = int(sd["position"]), int(sd["seed"]), int(sd["rows"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"instruct loader state {sd!r} needs integer 'position', 'seed', 'rows' ({e})") from e
        if rows != self.num_rows:
            raise ValueError(f"instruct loader state has {rows} rows but {self.path} now gives {self.num_rows} "
                             f"(seq_len {self.seq_len}): the data, seq_len or packing changed since the checkpoint.")
        if position < 0:
            raise ValueError(f"instruct loader state position={position} must be >= 0")
        self.seed, self.position = seed, position
        self._perm_cache = None
