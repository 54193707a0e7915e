"""Context parallelism (CP): long sequences split over the "cp" mesh dim, as Llama 3 trained at 128k.

Chunking. Each sequence of T tokens is cut into 2 cp chunks of c = T / (2 cp) tokens; CP rank i
keeps chunks i and 2cp-1-i (its "low" and "high" chunk), so under the causal mask every rank does
the same attention work: (i + 1) + (2cp - i) = 2cp + 1 chunk pairs. The layout cuts the loader's
whole sequences (tokens and targets alike) with `SequenceSharding.local`; the loader is unaware of
CP, and its state stays the global sample position, so a run resumes at any CP degree.

Attention (`SequenceSharding.attention`, called by the model's attention through the
`lmforge.model.layers.sequence_sharded` hook):

* K and V of the rank's 2c tokens (after RoPE at the rank's positions) are stacked and all-gathered
  over the CP group in one collective, then put in sequence order (`_GatherSequence`, an autograd
  function: its backward reduce-scatters the gradient, so each rank receives the sum over all
  ranks' queries of the gradient with respect to its own keys and values).
* The rank's low chunk j = i attends to the first (j + 1) c keys, its high chunk j = 2cp-1-i to
  the first (2cp - i) c keys, each with an additive mask (0 / -inf) that lets query position
  p see key positions <= p ("causal, aligned bottom-right": `tril(diagonal=j c)`). The two masks
  are built once per sequence length and dtype and shared by every layer and micro-batch (autograd
  saves the same tensor each time). Keys past a chunk's end are never touched, so the work is
  balanced, not just masked.
* GQA: the all-gather moves the KV heads as they are (kv_heads / tp per rank); SDPA expands them to
  the query heads locally (enable_gqa). Gathering along the sequence puts every KV head of the whole
  sequence on every CP rank, replicated across the cp ranks, so cp needs no relation to the number
  of KV heads (a head-scattering design such as Ulysses needs kv_heads >= cp, or replicates heads).

Memory per rank and layer: 1/cp of the tokens' activations, plus the K/V of the whole sequence
(`lmforge.parallel.formulas.cp_kv_bytes`: 2 b T kv_heads head_dim x dtype bytes), which replaces
the rank's own 1/cp share: (A - KV) / cp + KV (`formulas.cp_activation_bytes`).

Traffic per step and rank: one all-gather and one reduce-scatter of `cp_kv_bytes` per layer and
micro-batch (one more all-gather where activation checkpointing recomputes a layer); counted in
`SequenceSharding.comm` as the collectives run (`formulas.cp_comm_bytes` is the closed form).

Everything else is data parallelism over dp x cp: the CP ranks hold the same parameters, so their
gradients are averaged together with the data-parallel ones (DDP over "dp_cp", FSDP2 over
"dp_shard_cp"), and the step's target count and loss are summed over "dp_cp"
(lmforge.parallel.layout). Evaluation and generation run outside the hook, on whole sequences.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.model.layers import sequence_sharded
from lmforge.parallel.formulas import cp_comm_bytes, cp_kv_bytes, recomputed_layers

# torch 2.13 renamed the single-tensor collectives (the old names warn); GPU images may be older
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """(2, b, h, 2c, d) stacked K/V of this rank's two chunks -> (2, b, h, T, d) in sequence order,
    gathered over the CP group; backward reduce-scatters the gradient back to the rank's chunks."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sharding: "SequenceSharding") -> torch.Tensor:
        ctx.sharding = sharding
        cp = sharding.size
        gathered = local.new_empty((cp * local.shape[0], *local.shape[1:]))  # (gloo: the ranks' tensors concatenated)
        _all_gather(gathered, local.contiguous(), group=sharding.group)
        sharding.count("all_gather_bytes", gathered)
        halves = gathered.view(cp, *local.shape).unflatten(-2, (2, -1))  # (cp, 2, b, h, 2 halves, c, d)
        return torch.cat([halves[r, :, :, :, h] for r, h in sharding.owners], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sharding = ctx.sharding
        chunks = grad.unflatten(-2, (2 * sharding.size, -1))  # (2, b, h, 2cp chunks, c, d)
        send = torch.cat([torch.cat((chunks[:, :, :, lo], chunks[:, :, :, hi]), dim=-2)
                          for lo, hi in sharding.chunks_of])  # rank r's chunks at [2r, 2r + 2)
        out = grad.new_empty((grad.shape[0], *send.shape[1:]))
        _reduce_scatter(out, send, op=dist.ReduceOp.SUM, group=sharding.group)
        sharding.count("reduce_scatter_bytes", send)
        return out, None


class SequenceSharding:
    """One CP rank's view of the sequence (the model's `SequenceShard` while a step runs)."""

    def __init__(self, group, rank: int, size: int, device: torch.device):
        self.group, self.rank, self.size, self.device = group, rank, size, device
        self.chunks_of = [(r, 2 * size - 1 - r) for r in range(size)]  # chunks each rank holds (low, high)
        # (rank, half) holding chunk j of the sequence: rank j's low half, then rank 2cp-1-j's high half
        self.owners = [(j, 0) if j < size else (2 * size - 1 - j, 1) for j in range(2 * size)]
        self.comm = {"all_gather_bytes": 0, "reduce_scatter_bytes": 0, "all_gather_calls": 0,
                     "reduce_scatter_calls": 0}
        self.positions = torch.empty(0, dtype=torch.int64, device=device)
        self._seq_len = 0
        self._masks: dict[tuple, list[torch.Tensor]] = {}

    # ---- the step's sequences -----------------------------------------------------------------

    def local(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of `t`'s whole sequences (along `dim`), low chunk first."""
        lo, hi = self.chunks_of[self.rank]
        parts = t.chunk(2 * self.size, dim=dim)
        return torch.cat((parts[lo], parts[hi]), dim=dim)

    def sharded(self, seq_len: int):
        """Context in which the model sees this rank's chunks of `seq_len`-token sequences (held around
        forward and backward of the step's micro-batches)."""
        if seq_len % (2 * self.size):
            raise ValueError(f"context parallelism: a sequence of {seq_len} tokens does not split into "
                             f"2 x cp = {2 * self.size} equal chunks")
        if seq_len != self._seq_len:
            self._seq_len = seq_len
            self.positions = self.local(torch.arange(seq_len, device=self.device), dim=0)
        return sequence_sharded(self)

    # ---- attention ------------------------------------------------------------------------------

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """q (b, heads, 2c, d) of this rank's chunks; k, v (b, kv heads, 2c, d) -> (b, heads, 2c, d)."""
        kv = _GatherSequence.apply(torch.stack((k, v)), self)  # (2, b, kv heads, T, d)
        c = q.shape[2] // 2
        outs = []
        for half, (chunk, mask) in enumerate(zip(self.chunks_of[self.rank], self.masks(c, q.dtype))):
            keys = (chunk + 1) * c  # this chunk's queries see the keys of chunks 0 .. chunk
            outs.append(F.scaled_dot_product_attention(
                q[:, :, half * c:(half + 1) * c], kv[0, :, :, :keys], kv[1, :, :, :keys], attn_mask=mask,
                dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1]))
        return torch.cat(outs, dim=2)

    def masks(self, c: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Additive causal masks (c, (j + 1) c) of the rank's chunks j, aligned bottom-right; cached."""
        key = (c, dtype)
        if key not in self._masks:
            self._masks[key] = []
            for chunk in self.chunks_of[self.rank]:
                visible = torch.ones(c, (chunk + 1) * c, dtype=torch.bool, device=self.device).tril(chunk * c)
                mask = torch.zeros(visible.shape, dtype=dtype, device=self.device)
                self._masks[key].append(mask.masked_fill_(~visible, float("-inf")))
        return self._masks[key]

    # ---- accounting -----------------------------------------------------------------------------

    def count(self, what: str, t: torch.Tensor) -> None:
        self.comm[what] += t.numel() * t.element_size()
        self.comm[what.replace("bytes", "calls")] += 1

    def describe(self, cfg, dtype_bytes: int) -> Iterator[str]:
        """A log line: the chunks, and the step's traffic by the closed form (lmforge.parallel.formulas)."""
        m, t = cfg.model, cfg.train
        kv = cp_kv_bytes(t.micro_batch_size, cfg.data.seq_len, m.kv_heads, m.head_dim, dtype_bytes, cfg.parallel.tp)
        comm = cp_comm_bytes(kv, self.size, m.n_layers, cfg.grad_accum_steps,
                             recomputed_layers(t.activation_checkpoint, m.n_layers, t.ac_every))
        yield (f"context parallel: {self.size} ranks, rank i holds chunks i and {2 * self.size - 1}-i of "
               f"{cfg.data.seq_len // (2 * self.size)} tokens of every {cfg.data.seq_len}-token sequence; K/V "
               f"all-gathered per layer ({kv / 2**20:.2f} MiB per micro-batch), their gradients reduce-scattered: "
               f"{comm['collective_bytes'] / 2**20:.1f} MiB through the collectives per step and rank, "
               f"{comm['wire_bytes'] / 2**20:.1f} MiB sent by a ring")
