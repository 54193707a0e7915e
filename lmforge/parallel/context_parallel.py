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
  the first (2cp - i) c keys: query position p sees key positions <= p ("causal, aligned
  bottom-right"; `chunk_attention`). Keys past a chunk's end are never touched, so the work is
  balanced, not just masked. No mask tensor is built or cached (before, each rank cached two
  additive (c, (j + 1) c) masks, which kept SDPA off the flash kernels). Per chunk, by device:

  - CUDA (any dropout): chunk 0 (square) is SDPA with `is_causal=True`, whichever kernel SDPA picks
    (flash, memory-efficient, cuDNN or math, as for attention without CP). Chunks j >= 1 pass
    torch's lower-right causal bias (`torch.nn.attention.bias.causal_lower_right`) as `attn_mask`,
    which SDPA hands to `CausalBias`: the flash kernel (fp16 / bf16, sm80+, head_dim <= 256; GQA
    native, K/V not expanded) runs it with its own bottom-right causal masking, else the
    memory-efficient kernel with its lower-right mask type (it takes no GQA: K/V are expanded to
    the query heads first, `repeat_interleave`, which the kernel also saves for backward: heads /
    kv heads times the chunk's K/V prefix per layer, e.g. fp32 runs with GQA); never cuDNN; only
    where neither kernel applies does `CausalBias` materialise a boolean (c, (j + 1) c) mask for the
    math kernel, per call. The bias is built without storage (`_lower_right`: torch's factory
    allocates an unused (2, c, (j + 1) c) float tensor on the host, 16 GiB of address space for a
    128k-token high chunk at cp = 4).
  - CPU, dropout 0 (pre-training): `_PrefixAndDiagonal` (an autograd function) runs torch's flash
    attention for CPU (`_scaled_dot_product_flash_attention_for_cpu`) twice per chunk, over the j c
    keys before the chunk without any mask and over the chunk's own c keys with `is_causal` (square:
    top-left = bottom-right alignment), and merges the two by their log-sum-exp; its backward runs
    the kernel's backward on each part with the merged output and log-sum-exp, which yields each
    part's exact gradient (as ring attention does). GQA native (no expansion). Saved for backward:
    q, the gathered K/V (views), the chunk's output and its fp32 log-sum-exp, as SDPA saves without
    CP; no [c, keys] tensor exists at any point (tests/test_parallel_cp.py records every tensor).
  - CPU with dropout > 0: CPU flash attention has no dropout, so SDPA takes the math kernel with the
    lower-right bias, which materialises a boolean (c, (j + 1) c) mask per call (the math kernel
    saves the (b, heads, c, (j + 1) c) probabilities anyway).

  Sliding window (model.sliding_window shorter than a chunk's key prefix): `window_chunk_attention`,
  SDPA over the keys inside some query's window with a boolean mask (memory-efficient or math
  kernel), exact; a window covering the prefix takes the causal paths above.

  Documents (data.attention = "document"): each chunk's queries attend to the keys of their own
  document only. The document ids of the whole sequences (lmforge.model.documents) reach the model as
  a forward argument; `document_masks` cuts from them, once per forward, each chunk's mask over its
  key prefix (causal & same document & the window), which `attention` hands to SDPA (a boolean
  (b, 1, c, keys) tensor: CPU) or to FlexAttention (a block mask: CUDA), exact on both.
  (`data.mask_doc_boundaries` alone only ignores the targets whose input is end-of-document.)
* Multi-head latent attention (lmforge.model.mla): the all-gather moves each token's latent and RoPE
  key (kv_lora_rank + qk_rope_head_dim values, the same on every TP rank; DeepSeek-V3: 576 against
  2 x 128 heads x 192 for its K/V), `gather`, and each rank expands the whole sequence's K and V from
  them before the same chunked attention (`attend`); the gradients reduce-scatter back the same way.
* GQA: the all-gather moves the KV heads as they are (kv_heads / tp per rank), and the kernels take
  them so (flash on CUDA and on the CPU: GQA native; only CUDA's memory-efficient fallback gets them
  expanded, above). Gathering along the sequence puts every KV head of the whole
  sequence on every CP rank, replicated across the cp ranks, so cp needs no relation to the number
  of KV heads (a head-scattering design such as Ulysses needs kv_heads >= cp, or replicates heads).

Memory per rank and layer: 1/cp of the tokens' activations, plus the K/V of the whole sequence
(`lmforge.spec.parallel.cp_kv_bytes`: 2 b T kv_heads head_dim x dtype bytes), which replaces
the rank's own 1/cp share: (A - KV) / cp + KV (`spec.parallel.cp_activation_bytes`). No mask and no
score matrix (the attention saves its output and log-sum-exp, as flash attention does without CP),
except in the fallbacks above (math kernel; expanded K/V for the memory-efficient kernel).

Traffic per step and rank: one all-gather and one reduce-scatter of `cp_kv_bytes` per layer and
micro-batch (one more all-gather where activation checkpointing recomputes a layer); counted in
`SequenceSharding.comm` as the collectives run (`spec.parallel.cp_comm_bytes` is the closed form).

Ulysses (parallel.cp_mode = "ulysses", DeepSpeed-Ulysses; `UlyssesSharding`): the same chunks and
positions (RoPE rotates q and k at the rank's real positions before anything moves), but before
attention one all-to-all over the CP group (`_AllToAll`, an autograd function: the all-to-all is its
own transpose, so backward is the same all-to-all of the gradient) turns q, k and v of [the rank's
2c tokens, all its heads] into [the whole sequence, heads / cp]: rank r sends each rank s the heads
s heads/cp .. (s+1) heads/cp - 1 of its two chunks, receives its own heads of every rank's chunks
and puts them in sequence order (`owners`, as the all-gather does). Attention then is one process's
(`lmforge.model.layers.dense_attention`: causal, sliding window, or the document mask of the whole
sequences, `document_masks`) on whole sequences for the rank's heads, and a second all-to-all sends
each rank its two chunks of every rank's heads back. q, k and v travel in one all-to-all (the
heads of each concatenated per destination), so a layer makes two per forward and two in backward.
Heads: cp must divide the query heads of a TP rank; with GQA, the KV heads of a TP rank must be a
multiple of cp or divide it: with fewer KV heads than cp, each KV head is replicated cp / kv heads
times (`repeat_interleave`, whose backward sums the copies' gradients), so that every rank receives
the one KV head its query heads share (query heads r heads/cp ... belong to KV head r kv / cp).
Multi-head latent attention is not run under Ulysses (its latent is per token, not per head;
lmforge.config.layout_rules). Memory per rank and layer: 1/cp of one process's activations, the
K/V of 1/cp of the heads for the whole sequence taking the place of the rank's own K/V, except the
replicated KV heads (`spec.parallel.ulysses_activation_bytes`). Traffic: each all-to-all keeps 1/cp
of its tensor on the rank and sends the rest (`spec.parallel.ulysses_comm_bytes`; counted in
`UlyssesSharding.comm` as they run).

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
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import CausalBias, CausalVariant

from lmforge.model.documents import document_mask, masked_attention
from lmforge.model.layers import dense_attention, sequence_sharded
from lmforge.spec.parallel import (cp_comm_bytes, cp_kv_bytes, cp_latent_bytes, recomputed_layers, ulysses_bytes,
                                   ulysses_comm_bytes, ulysses_kv_heads)

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


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Chunk j's queries q (b, heads, c, d) over the keys and values k, v (b, kv heads, (j + 1) c, d)
    of chunks 0 .. j: query p of the chunk sees keys 0 .. j c + p (causal, aligned bottom-right).
    No mask is built on CUDA nor, without dropout, on the CPU (module docstring: the kernels)."""
    c, keys = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if keys == c:  # chunk 0: plain causal attention
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    if q.device.type == "cpu" and dropout_p == 0.0:
        return _PrefixAndDiagonal.apply(q, k, v)
    if gqa and q.device.type == "cuda" and not can_use_flash_attention(SDPAParams(q, k, v, None, dropout_p, False, True)):
        # CausalBias's other kernel (memory-efficient) takes no GQA: expand K/V to the query heads
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_lower_right(c, keys), dropout_p=dropout_p,
                                          enable_gqa=gqa)


def window_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, window: int,
                           dropout_p: float) -> torch.Tensor:
    """Sliding-window attention of chunk queries q (b, heads, c, d) at positions first .. first + c - 1
    over the keys k, v (b, kv heads, first + c, d) of positions 0 .. first + c - 1: query p sees keys
    p - window + 1 .. p (model.sliding_window, exact). Only the keys some query sees take part (from
    first - window + 1 on), through SDPA with a boolean (c, keys) mask: the memory-efficient or math
    kernel (not flash, which takes no mask), as attention without CP with a window shorter than the
    sequence."""
    c, keys = q.shape[2], k.shape[2]
    lo = max(0, first - window + 1)
    q_pos = torch.arange(first, first + c, device=q.device).unsqueeze(1)
    k_pos = torch.arange(lo, keys, device=q.device).unsqueeze(0)
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return F.scaled_dot_product_attention(q, k[:, :, lo:], v[:, :, lo:], attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _lower_right(q_len: int, kv_len: int) -> CausalBias:
    """`torch.nn.attention.bias.causal_lower_right(q_len, kv_len)` without its storage: the factory
    constructs the tensor subclass through torch.Tensor's legacy constructor, which allocates an
    uninitialised float32 (2, q_len, kv_len) tensor on the host that nothing reads (SDPA's
    `CausalBias` dispatch reads only the variant and the two lengths)."""
    bias = torch.Tensor._make_subclass(CausalBias, torch.empty(0))
    CausalBias.__init__(bias, CausalVariant.LOWER_RIGHT, q_len, kv_len)
    return bias


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PrefixAndDiagonal(torch.autograd.Function):
    """CPU, no dropout: q (b, heads, c, d) of chunk j over k, v (b, kv heads, (j + 1) c, d), j >= 1, as
    two calls of torch's flash attention for CPU: the j c keys before the chunk (all visible: no
    mask) and the chunk's own c keys (square: `is_causal`'s top-left alignment is the bottom-right
    one), merged by their log-sum-exp. SDPA cannot do it in one call without a dense mask (its CPU
    `is_causal` aligns top-left), nor return the log-sum-exp that merging needs, hence the aten ops
    and a hand-written backward: the kernel's backward of each part, given the merged output and
    log-sum-exp, is that part's exact share of the gradient (the softmax is over all the keys)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        split = k.shape[2] - q.shape[2]
        out_p, lse_p = _flash_cpu(q, k[:, :, :split], v[:, :, :split], 0.0, False)
        out_d, lse_d = _flash_cpu(q, k[:, :, split:], v[:, :, split:], 0.0, True)
        lse = torch.logaddexp(lse_p, lse_d)  # (b, heads, c), fp32 (fp64 for fp64 inputs)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = (out_p.to(acc) * (lse_p - lse).exp().unsqueeze(-1)
               + out_d.to(acc) * (lse_d - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        split = k.shape[2] - q.shape[2]
        dq_p, dk_p, dv_p = _flash_cpu_backward(grad, q, k[:, :, :split], v[:, :, :split], out, lse, 0.0, False)
        dq_d, dk_d, dv_d = _flash_cpu_backward(grad, q, k[:, :, split:], v[:, :, split:], out, lse, 0.0, True)
        return dq_p + dq_d, torch.cat((dk_p, dk_d), dim=2), torch.cat((dv_p, dv_d), dim=2)


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

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                  window: int = 0, masks=None) -> torch.Tensor:
        """q (b, heads, 2c, d) of this rank's chunks; k, v (b, kv heads, 2c, d) -> (b, heads, 2c, d);
        `window` > 0: sliding-window attention (model.sliding_window); `masks`: the chunks' document
        masks (`document_masks`, which hold the causal and window rules too)."""
        kv = self.gather(torch.stack((k, v)))  # (2, b, kv heads, T, d)
        return self.attend(q, kv[0], kv[1], dropout_p, window, masks)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(n, b, h, 2c, d): n tensors of this rank's two chunks stacked -> (n, b, h, T, d), the whole
        sequence in order, all-gathered over the CP group (backward: reduce-scatter). K and V
        (`attention`), or multi-head latent attention's latent and RoPE key (lmforge.model.mla)."""
        return _GatherSequence.apply(t, self)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               window: int = 0, masks=None) -> torch.Tensor:
        """q (b, heads, 2c, d) of this rank's chunks over k, v (b, kv heads, T, d) of the whole sequence
        (gathered) -> (b, heads, 2c, d): each chunk's queries over the keys up to its own (causal), or
        within `masks` (`document_masks`)."""
        c = q.shape[2] // 2
        outs = []
        for half, chunk in enumerate(self.chunks_of[self.rank]):
            keys = (chunk + 1) * c  # this chunk's queries see the keys of chunks 0 .. chunk
            q_chunk, k_prefix, v_prefix = q[:, :, half * c:(half + 1) * c], k[:, :, :keys], v[:, :, :keys]
            if masks is not None:  # within each document (lmforge.model.documents)
                outs.append(masked_attention(q_chunk, k_prefix, v_prefix, masks[half], dropout_p))
            elif 0 < window < keys:  # the window leaves some of these keys out of some queries' view
                outs.append(window_chunk_attention(q_chunk, k_prefix, v_prefix, chunk * c, window, dropout_p))
            else:
                outs.append(chunk_attention(q_chunk, k_prefix, v_prefix, dropout_p))
        return torch.cat(outs, dim=2)

    def document_masks(self, doc_ids: torch.Tensor, window: int, dropout_p: float) -> list:
        """The document mask of each of this rank's two chunks over the keys of the chunks before it and
        its own (`attention`'s prefixes), from the document ids (b, T) of the whole sequences: query
        position p sees key position p' <= p of the same document (and within the window); built once
        per forward, for all layers (lmforge.model.documents: a boolean (b, 1, c, keys) tensor for SDPA,
        or a FlexAttention block mask)."""
        c = doc_ids.shape[1] // (2 * self.size)
        return [document_mask(doc_ids[:, chunk * c:(chunk + 1) * c], doc_ids[:, :(chunk + 1) * c], chunk * c, window,
                              dropout_p) for chunk in self.chunks_of[self.rank]]

    # ---- accounting -----------------------------------------------------------------------------

    def count(self, what: str, t: torch.Tensor) -> None:
        self.comm[what] += t.numel() * t.element_size()
        self.comm[what.replace("bytes", "calls")] += 1

    def held(self, seq_len: int) -> str:
        """The log lines' words for the chunks a rank holds."""
        return (f"{self.size} ranks, rank i holds chunks i and {2 * self.size - 1}-i of {seq_len // (2 * self.size)} "
                f"tokens of every {seq_len}-token sequence")

    def describe(self, cfg, dtype_bytes: int) -> Iterator[str]:
        """A log line: the chunks, and the step's traffic by the closed form (lmforge.spec.parallel)."""
        m, t = cfg.model, cfg.train
        if m.mla.enabled:  # the latent and the RoPE key are gathered, not K/V (lmforge.model.mla)
            kv = cp_latent_bytes(t.micro_batch_size, cfg.data.seq_len, m.mla.kv_lora_rank + m.mla.qk_rope_head_dim,
                                 dtype_bytes)
        else:
            kv = cp_kv_bytes(t.micro_batch_size, cfg.data.seq_len, m.kv_heads, m.head_dim, dtype_bytes, cfg.parallel.tp)
        comm = cp_comm_bytes(kv, self.size, m.n_layers, cfg.grad_accum_steps,
                             recomputed_layers(t.activation_checkpoint, m.n_layers, t.ac_every))
        yield (f"context parallel: {self.held(cfg.data.seq_len)}; "
               f"{'the MLA latent and RoPE key' if m.mla.enabled else 'K/V'} "
               f"all-gathered per layer ({kv / 2**20:.2f} MiB per micro-batch), their gradients reduce-scattered: "
               f"{comm['collective_bytes'] / 2**20:.1f} MiB through the collectives per step and rank, "
               f"{comm['wire_bytes'] / 2**20:.1f} MiB sent by a ring")


class _AllToAll(torch.autograd.Function):
    """(cp, ...) with block r for CP rank r -> (cp, ...) with block s from CP rank s; backward: the same
    all-to-all of the gradient (an all-to-all of equal blocks is its own transpose)."""

    @staticmethod
    def forward(ctx, send: torch.Tensor, sharding: "UlyssesSharding") -> torch.Tensor:
        ctx.sharding = sharding
        return sharding.all_to_all(send)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.sharding.all_to_all(grad), None


class UlyssesSharding(SequenceSharding):
    """Ulysses context parallelism (parallel.cp_mode = "ulysses"; the module docstring): the same chunks
    and positions as `SequenceSharding`, attention over whole sequences for heads / cp of the heads."""

    def __init__(self, group, rank: int, size: int, device: torch.device):
        super().__init__(group, rank, size, device)
        self.comm = {"all_to_all_bytes": 0, "all_to_all_calls": 0}

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        self.count("all_to_all_bytes", send)
        return received

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                  window: int = 0, masks=None) -> torch.Tensor:
        """q (b, heads, 2c, d) of this rank's chunks, k, v (b, kv heads, 2c, d) -> (b, heads, 2c, d): the
        whole sequence's attention for heads / cp heads on each rank, between two all-to-alls; `masks`:
        the whole sequences' document mask (`document_masks`)."""
        cp, heads = self.size, q.shape[1]
        kv_heads = ulysses_kv_heads(heads, k.shape[1], cp)  # (ValueError where the heads do not split)
        if kv_heads > k.shape[1]:  # fewer KV heads than ranks: each rank gets a copy of its query heads' one
            k, v = (t.repeat_interleave(kv_heads // k.shape[1], dim=1) for t in (k, v))
        # one all-to-all for q, k and v: destination rank s gets its heads of each, concatenated
        send = torch.cat([t.unflatten(1, (cp, -1)) for t in (q, k, v)], dim=2).movedim(1, 0)  # (cp, b, h', 2c, d)
        whole = self.in_sequence_order(_AllToAll.apply(send, self))  # (b, h', T, d): this rank's heads
        q, k, v = whole.split([heads // cp, kv_heads // cp, kv_heads // cp], dim=1)
        out = dense_attention(q, k, v, dropout_p, window, masks).unflatten(2, (2 * cp, -1))
        send = torch.stack([torch.cat((out[:, :, lo], out[:, :, hi]), dim=2) for lo, hi in self.chunks_of])
        return _AllToAll.apply(send, self).movedim(0, 1).flatten(1, 2)  # block s: rank s's heads of my chunks

    def in_sequence_order(self, received: torch.Tensor) -> torch.Tensor:
        """(cp, b, h, 2c, d), block s = rank s's two chunks -> (b, h, T, d) in sequence order."""
        halves = received.unflatten(-2, (2, -1))  # (cp, b, h, 2 halves, c, d)
        return torch.cat([halves[r, :, :, half] for r, half in self.owners], dim=-2)

    def document_masks(self, doc_ids: torch.Tensor, window: int, dropout_p: float):
        """The whole sequences' document mask (one process's): attention runs on whole sequences."""
        return document_mask(doc_ids, doc_ids, 0, window, dropout_p)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        raise ValueError("parallel.cp_mode = 'ulysses' does not run multi-head latent attention (model.mla); set "
                         "parallel.cp_mode = 'allgather'")

    def describe(self, cfg, dtype_bytes: int) -> Iterator[str]:
        m, t = cfg.model, cfg.train
        qkv, out = ulysses_bytes(t.micro_batch_size, cfg.data.seq_len, m.n_heads, m.kv_heads, m.head_dim, dtype_bytes,
                                 cfg.parallel.tp, self.size)
        comm = ulysses_comm_bytes(qkv, out, self.size, m.n_layers, cfg.grad_accum_steps,
                                  recomputed_layers(t.activation_checkpoint, m.n_layers, t.ac_every))
        yield (f"context parallel (Ulysses): {self.held(cfg.data.seq_len)} and attends over whole sequences "
               f"for 1/{self.size} of the heads; per layer an all-to-all of q, k, v "
               f"({qkv / 2**20:.2f} MiB per micro-batch) and one of the output ({out / 2**20:.2f} MiB), again in "
               f"backward: {comm['collective_bytes'] / 2**20:.1f} MiB through the all-to-alls per step and rank, "
               f"{comm['wire_bytes'] / 2**20:.1f} MiB sent")


def sequence_sharding(mode: str, group, rank: int, size: int, device: torch.device) -> SequenceSharding:
    """The CP rank's shard of every sequence under parallel.cp_mode: "allgather" or "ulysses"."""
    return (UlyssesSharding if mode == "ulysses" else SequenceSharding)(group, rank, size, device)
