"""Evaluation and sampling on a tensor- or pipeline-parallel model, where it lies: no rank gathers
the weights or builds a second, whole model.

`ShardedInference` answers the calls lmforge's evaluation and sampling make of a model
(`model(tokens, kv_caches)` -> logits, `model(tokens, targets=y)` -> summed token NLL, `.cfg`,
`.parameters()`, `.eval()` / `.train()`) with the rank's own part of the training model, the same
answer on every rank:

* **Tensor parallel**: the forward runs on the DTensor-sharded blocks as in training. Logits stay
  sharded over the vocabulary: the NLL is computed by `loss_parallel()` (nothing gathered), and
  logits asked for are gathered (`full_tensor`) for the positions asked only. Sequence parallelism
  needs the sequence to divide by tp: a call whose length does not is padded on the right with
  copies of its last token, which the causal mask keeps from changing any real position, and the
  KV caches are cut back to the real tokens afterwards (so cached decoding of one token at a time
  works: one real token and tp - 1 discarded ones per step). `.cfg.max_seq_len` is lowered by
  tp - 1 so that padding never runs past the position tables.
* **Pipeline parallel**: the stages run in order, each on the rank that holds it (interleaved
  and V schedules: several per rank, lmforge.spec.parallel.rank_stages), the activations sent
  point to point over the pp group with a small header (dtype, shape) first, as the training
  schedule does; each rank keeps the KV caches of its own blocks. The last stage's answer (fp32
  logits or the NLL) is broadcast over the pp group from the rank holding it (rank 0 in a V).

Within one tensor-parallel group every rank computes the same thing (collectives inside the
forward); every data-parallel replica evaluates the same batches, as in the other layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lmforge.model.layers import KVCache
from lmforge.model.loss import token_nll_sum
from lmforge.spec.parallel import stage_rank

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64]
_HEADER = 8  # int64 words: dtype code, ndim, up to 6 sizes


class ShardedInference:
    """A TP / PP layout's model as evaluation and sampling see it (module docstring)."""

    def __init__(self, layout):
        self.layout = layout
        self.model = layout.model
        p = layout.cfg.parallel
        self.tp, self.pp = p.tp, p.pp
        self.pad_multiple = p.tp if p.tp > 1 and p.sequence_parallel else 1
        cfg = layout.cfg.model
        self.cfg = dataclasses.replace(cfg, max_seq_len=cfg.max_seq_len - (self.pad_multiple - 1))
        self.chunks = getattr(layout, "chunks", None)  # pipeline: this rank's stage chunks, in stage order

    # ---- the nn.Module surface evaluation and sampling use -----------------------------------------

    @property
    def training(self) -> bool:
        return self.model.training

    def parameters(self):
        return self.model.parameters()

    def eval(self) -> "ShardedInference":
        self.model.eval()
        return self

    def train(self, mode: bool = True) -> "ShardedInference":
        self.model.train(mode)
        return self

    # ---- the forward --------------------------------------------------------------------------------

    def __call__(self, tokens: torch.Tensor, kv_caches: list[KVCache] | None = None,
                 targets: torch.Tensor | None = None, **docs: torch.Tensor) -> torch.Tensor:
        """logits (batch, seq, vocab) as plain tensors, or with `targets` the summed token NLL (fp32
        scalar); equal on every rank. `docs`: the document arguments (doc_ids, positions) of
        `Transformer.forward`, padded like the tokens (the padding joins the last document)."""
        n = tokens.shape[1]
        start = kv_caches[0].length if kv_caches else 0
        if kv_caches and self.pp > 1:  # (the first layer may live on another rank; a Gated DeltaNet cache counts too)
            start = next((c.length for c in kv_caches if c.length), 0)
        pad = -n % self.pad_multiple
        if pad:
            tokens = _pad_right(tokens, pad)
            docs = {k: _pad_right(t, pad) for k, t in docs.items()}
        last = self.pp == 1 or self.layout.last
        out = None
        with torch.no_grad():
            logits = self.model(tokens, kv_caches, **docs) if self.pp == 1 else self._pipeline(tokens, kv_caches, docs)
            if last:
                logits = logits[:, :n]
                if targets is not None:
                    with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
                        out = token_nll_sum(logits, targets)
                else:
                    out = logits.float()
                out = out.full_tensor() if isinstance(out, DTensor) else out
        if kv_caches and pad:
            for cache in kv_caches:  # (padding comes with TP + SP, which linear-attention blocks do not run under)
                if isinstance(cache, KVCache) and cache.k is not None:
                    cache.k, cache.v = cache.k[:, :, :start + n], cache.v[:, :, :start + n]
        if self.pp > 1:
            out = self._from_last_stage(out, (tokens.shape[0], n, self.cfg.vocab_size) if targets is None else ())
        return out

    def _pipeline(self, tokens: torch.Tensor, kv_caches: list[KVCache] | None, docs: dict) -> torch.Tensor | None:
        """Run the stages in order: this rank's chunks on their inputs, the others' elsewhere."""
        info, group = self.layout.dist, self.layout.dist.group("pp")
        n_stages = self.pp * len(self.chunks)
        mine = dict(zip(self.layout.stage_ids, self.chunks))
        sched = self.layout.cfg.parallel.pp_schedule  # (a V keeps stages pp-1 and pp on one rank)
        owner = [stage_rank(sched, self.pp, s) for s in range(n_stages)]
        x = tokens
        for s in range(n_stages):
            if owner[s] != info.pp_rank:
                continue
            if s > 0 and owner[s - 1] != owner[s]:
                x = _recv(owner[s - 1], group, info.device)
            x = mine[s](x, kv_caches, **docs)
            if s < n_stages - 1 and owner[s + 1] != owner[s]:
                _send(x, owner[s + 1], group)
        return x if self.layout.last else None

    def _from_last_stage(self, out: torch.Tensor | None, shape: tuple) -> torch.Tensor:
        """The last stage's result on every rank of the pp group."""
        info, group = self.layout.dist, self.layout.dist.group("pp")
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=info.device)
        dist.broadcast(out, src=dist.get_global_rank(group, self.layout.last_rank), group=group)
        return out


def _pad_right(t: torch.Tensor, pad: int) -> torch.Tensor:
    """(batch, seq) `t` with `pad` copies of its last column appended."""
    return torch.cat([t, t[:, -1:].expand(-1, pad)], dim=1)


def _send(t: torch.Tensor, dst: int, group) -> None:
    t = t.contiguous()
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.ndim
    header[2:2 + t.ndim] = torch.tensor(t.shape)
    dist.send(header.to(t.device), dst=dist.get_global_rank(group, dst), group=group)
    dist.send(t, dst=dist.get_global_rank(group, dst), group=group)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src=dist.get_global_rank(group, src), group=group)
    code, ndim, *sizes = header.tolist()
    t = torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(t, src=dist.get_global_rank(group, src), group=group)
    return t
