"""Building blocks of the transformer: normalisation, rotary embeddings, attention, MLPs."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model import mup
from lmforge.model.documents import document_mask, masked_attention


def make_norm(cfg: ModelConfig) -> nn.Module:
    """RMSNorm (Llama) or LayerNorm (GPT-2), both PyTorch's own fused-friendly modules."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None,
                cfg: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq_len, head_dim // 2) for rotary position embeddings, with
    `cfg`'s RoPE scaling (model.rope_scaling) when given: its frequencies, and for YaRN the attention
    factor both tables are multiplied by (as transformers applies it)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if cfg is not None:
        inv_freq = scaled_inv_freq(inv_freq, cfg)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    factor = rope_attention_factor(cfg) if cfg is not None else 1.0
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def scaled_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """RoPE frequencies under model.rope_scaling, as Hugging Face's `rope_type` 'linear', 'llama3' and
    'yarn' compute them: 'linear' divides every frequency by the factor (positions / factor); 'llama3'
    divides the low frequencies (wavelength > original context / low_freq_factor), keeps the high
    ones (wavelength < original context / high_freq_factor) and interpolates smoothly in between;
    'yarn': `yarn_inv_freq`."""
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_scaling == "yarn":
        return yarn_inv_freq(inv_freq, cfg)
    if cfg.rope_scaling != "llama3":
        return inv_freq
    factor, low, high, old = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                              cfg.rope_original_max_seq_len)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023, arXiv 2309.00071; DeepSeek-V3's context extension): pair i of the
    rope_dim dimensions turns original_max_seq_len * inv_freq_i / 2 pi times over the original
    context. Pairs below the one turning rope_beta_fast times keep their frequency (extrapolation),
    pairs past the one turning rope_beta_slow times are divided by rope_factor (interpolation), with a
    linear ramp between; the two boundaries are rounded outwards (floor / ceil: transformers' default
    `truncate`)."""
    dim, base, old = 2 * inv_freq.shape[0], cfg.rope_theta, cfg.rope_original_max_seq_len

    def pair_turning(turns: float) -> float:  # the (fractional) dimension that turns `turns` times
        return dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(pair_turning(cfg.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # (as transformers: no division by zero)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / cfg.rope_factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 m ln(s) + 1 (1 for s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN multiplies the cos / sin tables by (so q.k by its square): mscale(factor,
    rope_mscale) / mscale(factor, rope_mscale_all_dim) when both are set (DeepSeek-V3: 1), else
    mscale(factor); 1 without YaRN."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor)


def window_mask(q_start: int, q_len: int, k_len: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (q_len, k_len) mask of causal attention for queries at positions q_start .. q_start +
    q_len - 1 over keys 0 .. k_len - 1, limited to a sliding window of `window` keys (the query's own
    and the window - 1 before it; 0 = unlimited). None where plain causal attention (SDPA's
    `is_causal`, top-left aligned) or no mask is the same thing, the window covering every key: no
    cache offset (is_causal), or one new token after cached ones (no mask)."""
    if window == 0 or window >= k_len:
        if q_start == 0 and q_len == k_len:
            return None  # is_causal
        if q_len == 1:
            return None  # one new token sees every cached key
    q = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1)
    k = torch.arange(k_len, device=device).unsqueeze(0)
    mask = k <= q
    return mask & (k > q - window) if window else mask


class SequenceShard(Protocol):
    """This rank's share of every sequence under context parallelism (implemented by
    lmforge.parallel.context_parallel): its tokens' positions, and attention of its queries over the
    keys/values of the whole sequence (`attention`: from this rank's k and v, under a document mask with
    `document_masks`' per-chunk masks; or, for attention that gathers something smaller than K/V, such
    as multi-head latent attention's latent, `gather` of any per-token tensor and `attend` over K/V made
    from the gathered sequence). `group` / `size`: the CP ranks that share each sequence (sequence-wise
    statistics sum over them)."""

    positions: torch.Tensor  # (local seq,) int64: positions of this rank's tokens in the sequence
    group: object
    size: int

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                  window: int = 0, masks=None) -> torch.Tensor: ...

    def document_masks(self, doc_ids: torch.Tensor, window: int, dropout_p: float): ...

    def gather(self, t: torch.Tensor) -> torch.Tensor: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               window: int = 0) -> torch.Tensor: ...


_shard: SequenceShard | None = None  # set while a context-parallel training step runs


@contextlib.contextmanager
def sequence_sharded(shard: SequenceShard | None) -> Iterator[None]:
    """Within this context the model's tokens are `shard`'s part of longer sequences: positions and
    attention follow it. The layout holds it around forward *and* backward (activation checkpointing
    recomputes attention in backward); evaluation and generation run outside, on whole sequences."""
    global _shard
    previous, _shard = _shard, shard
    try:
        yield
    finally:
        _shard = previous


def current_shard() -> SequenceShard | None:
    """The context-parallel shard of the step running now (None outside a sharded step)."""
    return _shard


def token_positions(start: int, seq: int, device: torch.device) -> torch.Tensor:
    """Positions of a forward's `seq` tokens: start .. start + seq - 1, or the shard's (context parallel)."""
    return _shard.positions if _shard is not None else torch.arange(start, start + seq, device=device)


def rope_rows(rope: tuple[torch.Tensor, torch.Tensor] | None,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The RoPE tables the blocks index from position 0: whole, or the shard's rows (context parallel);
    with per-token `positions` (batch, seq: data.document_positions = "restart", already this rank's
    tokens, `local_positions`) the (batch, seq, head_dim // 2) rows of each token."""
    if rope is None:
        return rope
    if positions is not None:
        return rope[0][positions], rope[1][positions]
    if _shard is None:
        return rope
    return rope[0][_shard.positions], rope[1][_shard.positions]


def local_positions(positions: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token positions (batch, seq) of whole sequences, cut to this rank's tokens under context
    parallelism (None stays None: positions from `token_positions`)."""
    if positions is None or _shard is None:
        return positions
    return positions[:, _shard.positions]


def attention_mask(doc_ids: torch.Tensor | None, window: int, dropout_p: float):
    """The document mask of one forward, built once for all its blocks from the document ids of the
    whole sequences (lmforge.model.documents): for this rank's chunks under context parallelism, else
    over the sequence; None without document ids (causal attention)."""
    if doc_ids is None:
        return None
    if _shard is not None:
        return _shard.document_masks(doc_ids, window, dropout_p)
    return document_mask(doc_ids, doc_ids, 0, window, dropout_p)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, heads, seq, head_dim) by position-dependent angles.

    Half-split convention: dimension i is paired with i + head_dim/2 (the convention of Hugging
    Face's Llama), so weights export to and import from `transformers` without permutation.
    Tables narrower than x (partial RoPE, model.rope_fraction: 2 x cos's width < head_dim) rotate the
    first dimensions that way and pass the rest through, as transformers' Qwen3-Next does.
    """
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


QKV_PARTS = ("wq", "wk", "wv")


def qkv_layout(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the rows of the separate q, k, v projections lie in the fused `attn.wqkv` (model.fused_qkv):
    (part, row), each of length (n_heads + 2 kv_heads) * head_dim: fused row r is row `row[r]` of
    projection QKV_PARTS[part[r]].

    Grouped by kv head (Megatron's layout): for each kv head g, the rows of g's n_heads / kv_heads
    query heads, then k_g's, then v_g's. A contiguous split of the rows into tp parts (tp divides
    kv_heads) gives each rank whole groups, the same heads the separate projections' column split
    gives it, whatever tp is."""
    rep, hd, groups = cfg.n_heads // cfg.kv_heads, cfg.head_dim, cfg.kv_heads
    g = torch.arange(groups).view(groups, 1, 1)
    slot = torch.arange(rep + 2).view(1, rep + 2, 1)
    d = torch.arange(hd).view(1, 1, hd)
    part = torch.clamp(slot - rep + 1, min=0).expand(groups, rep + 2, hd)  # 0 q, 1 k, 2 v
    row = torch.where(slot < rep, (g * rep + slot) * hd + d, g * hd + d)
    return part.reshape(-1), row.reshape(-1)


def fuse_qkv(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fused `attn.wqkv` weight (or bias, or any tensor shaped like them) of separate q, k, v ones."""
    part, row = qkv_layout(cfg)
    out = q.new_empty((len(part), *q.shape[1:]))
    for p, t in enumerate((q, k, v)):
        out[part == p] = t[row[part == p]]
    return out


def split_qkv(cfg: ModelConfig, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k, v tensors of a fused `attn.wqkv` weight or bias (the inverse of fuse_qkv)."""
    part, row = qkv_layout(cfg)
    out = []
    for p in range(3):
        sel = part == p
        piece = fused.new_empty((int(sel.sum()), *fused.shape[1:]))
        piece[row[sel]] = fused[sel]
        out.append(piece)
    return out[0], out[1], out[2]


def qkv_conversions(cfg: ModelConfig, names) -> Iterator[tuple[str, list[str]]]:
    """(fused name, [wq, wk, wv names]) of each q/k/v weight and bias that `names` (a checkpoint's keys)
    hold in the other layout than `cfg`'s (model.fused_qkv): the tensors to fuse, or the one to split."""
    for i in range(cfg.n_layers):
        for kind in ("weight", "bias"):
            fused, parts = f"blocks.{i}.attn.wqkv.{kind}", [f"blocks.{i}.attn.{w}.{kind}" for w in QKV_PARTS]
            if (cfg.fused_qkv and fused not in names and all(p in names for p in parts)) or (
                    not cfg.fused_qkv and fused in names and not any(p in names for p in parts)):
                yield fused, parts


def qkv_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole-tensor state dict with its q/k/v projections in `cfg`'s layout (model.fused_qkv),
    whichever layout it holds (a run folder's model.safetensors written before or with fused_qkv)."""
    out = dict(state)
    for fused, parts in list(qkv_conversions(cfg, state)):
        if cfg.fused_qkv:
            out[fused] = fuse_qkv(cfg, *(out.pop(p) for p in parts))
        else:
            out.update(zip(parts, split_qkv(cfg, out.pop(fused))))
    return out


def read_fused_qkv(cfg: ModelConfig, read, shape, index) -> torch.Tensor:
    """The part at `index` (per dim: kept indices, None for all) of a fused `attn.wqkv` weight or bias of
    full `shape`, made from its q, k, v parts: `read(p, part_shape, part_index)` gives the part at
    `part_index` of projection QKV_PARTS[p] (an initialisation, a transformers file): a tensor-parallel
    rank reads only the rows of its own kv groups."""
    part, row = qkv_layout(cfg)
    rows = torch.arange(shape[0]) if index[0] is None else index[0].to(torch.int64)
    pieces, order = [], []
    for p in range(3):
        sel = part[rows] == p
        if bool(sel.any()):
            pieces.append(read(p, (int((part == p).sum()), *shape[1:]), (row[rows[sel]], *index[1:])))
            order.append(sel.nonzero().flatten())
    out = torch.cat(pieces)
    return out[torch.argsort(torch.cat(order))]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, window: int = 0,
                    mask=None, start: int = 0) -> torch.Tensor:
    """Attention of one process's queries q (b, heads, seq, d) at positions start .. start + seq - 1 over
    the keys k, v (b, kv heads, start + seq, d): within each document under `mask` (`attention_mask`),
    else causal within the sliding `window` (0 = none). Also Ulysses context parallelism's attention
    (lmforge.parallel.context_parallel), which runs it on whole sequences for the rank's heads."""
    if mask is not None:  # within each document (lmforge.model.documents)
        return masked_attention(q, k, v, mask, dropout_p)
    seq = q.shape[2]
    mask = window_mask(start, seq, start + seq, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and start == 0 and seq > 1,
                                          dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query support, through scaled_dot_product_attention;
    optional q/k/v biases (model.qkv_bias), QK-norm (model.qk_norm), a sliding window
    (model.sliding_window), an output gate (model.attn_gate), partial RoPE (model.rope_fraction) and
    μP's 1/head_dim attention scale (model.parametrization)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        # Separate q/k/v projections, or one fused in qkv_layout's grouped rows (model.fused_qkv):
        # either way a column split over tensor-parallel ranks gives each whole kv groups.
        qkv_bias = cfg.attn_qkv_bias
        self.fused = cfg.fused_qkv
        if self.fused:
            self.wqkv = nn.Linear(cfg.dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=qkv_bias)
        else:
            self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=qkv_bias)
            self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
            self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=cfg.bias)
        # Gated attention (model.attn_gate): one sigmoid gate per output element of every head, from
        # the block's normalised input; its rows are heads in q's order, so TP splits it as q
        self.wg = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=qkv_bias) if cfg.attn_gate else None
        # QK-norm (Qwen3): one RMSNorm over head_dim shared by every head, applied before RoPE on
        # (batch, seq, heads, head_dim), so tensor parallelism can treat the heads as a sharded dim;
        # OLMo 2's (model.qk_norm_scope = "projection"): one over the whole q (and k) projection
        q_width, k_width = cfg.qk_norm_widths
        self.q_norm = nn.RMSNorm(q_width, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(k_width, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.norm_projection = cfg.qk_norm_scope == "projection"
        self.window = cfg.layer_window(layer)  # (model.layer_types: interleaved local / global blocks)
        self.dropout = cfg.dropout
        # μP (model.parametrization = "mup"): q x sqrt(base head_dim / head_dim), so that SDPA's
        # 1/sqrt(head_dim) becomes sqrt(base head_dim) / head_dim (lmforge.model.mup); 1 under SP.
        # model.attn_scale_dim (Gemma's query_pre_attn_scalar): 1/sqrt(head_dim) becomes 1/sqrt(that)
        self.q_scale = mup.attention_factor(cfg) * (
            1.0 if cfg.attn_scale_dim is None else math.sqrt(cfg.head_dim / cfg.attn_scale_dim))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x (batch, seq, dim), each (batch, heads, seq, head_dim), QK-normed if configured."""
        bsz, seq, _ = x.shape
        # -1 rather than self.n_heads: under tensor parallelism each rank holds a slice of the heads.
        if self.fused:  # (batch, seq, this rank's kv groups, rep + 2, head_dim): q heads, k, v per group
            rep = self.n_heads // self.n_kv_heads
            # (split, not indexing: its backward is one concatenation, not a zero-filled tensor per part)
            q, k, v = self.wqkv(x).view(bsz, seq, -1, rep + 2, self.head_dim).split([rep, 1, 1], dim=3)
            k, v = k.squeeze(3), v.squeeze(3)
            if self.q_norm is not None and not self.norm_projection:  # (on q's view: the norm saves the view)
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.reshape(bsz, seq, -1, self.head_dim)
        else:
            q = self.wq(x).view(bsz, seq, -1, self.head_dim)
            k = self.wk(x).view(bsz, seq, -1, self.head_dim)
            v = self.wv(x).view(bsz, seq, -1, self.head_dim)
            if self.q_norm is not None and not self.norm_projection:
                q, k = self.q_norm(q), self.k_norm(k)
        if self.norm_projection:  # (the grouped q heads of the fused layout are in q's own head order)
            q = self.q_norm(q.reshape(bsz, seq, -1)).view(bsz, seq, -1, self.head_dim)
            k = self.k_norm(k.reshape(bsz, seq, -1)).view(bsz, seq, -1, self.head_dim)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                kv_cache: "KVCache | None" = None, mask=None) -> torch.Tensor:
        """`mask`: the forward's document mask (`attention_mask`; data.attention = "document"), which
        holds the causal and sliding-window rules too; None = causal attention."""
        bsz, seq, _ = x.shape
        q, k, v = self.project(x)
        start = kv_cache.length if kv_cache is not None else 0
        if rope is not None:
            if rope[0].dim() == 3:  # per-token rows (batch, seq, head_dim / 2): positions restart per document
                cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)
            else:
                cos, sin = rope[0][start:start + seq], rope[1][start:start + seq]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.fused and self.q_norm is None and torch.is_grad_enabled():
                # q and k now live in RoPE's outputs; v alone would still be a view of the fused
                # projection's output, and the v attention saves for backward would keep all of its
                # q/k/v bytes alive ((n_heads + kv_heads) * head_dim more per token and layer than
                # the separate layout). A copy of v's own keeps v's. (With QK-norm the norms save
                # their inputs, views of the q/k/v output, as the separate layout's norms save its
                # q and k outputs; without RoPE SDPA saves q, k and v, the whole output, in both;
                # tests/test_fused_qkv.py measures it.)
                v = v.contiguous()
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        # New tokens after cached ones (a chunk of seq > 1 appended to a cache of `start`): query i
        # sees keys 0 .. start + i, an explicit offset mask; one new token sees everything cached,
        # both within the sliding window if there is one (window_mask: None = plain causal).
        dropout_p = self.dropout if self.training else 0.0
        if _shard is not None:  # context parallelism: this rank's queries over the whole sequence's keys/values
            out = _shard.attention(q, k, v, dropout_p, self.window, mask)
        else:
            out = dense_attention(q, k, v, dropout_p, self.window, mask, start)
        out = out.transpose(1, 2).reshape(bsz, seq, -1)
        if self.wg is not None:
            out = out * torch.sigmoid(self.wg(x))
        return self.wo(out)


class KVCache:
    """Per-layer cache for incremental decoding (grows along the sequence dim, 2): what the layer's
    attention needs of the tokens before: its keys and values (`Attention`: k, v of shape (batch,
    kv heads, seq, head_dim)), or for multi-head latent attention the normalised latent and the
    rotated RoPE key (`lmforge.model.mla`: (batch, 1, seq, kv_lora_rank) and (batch, 1, seq,
    qk_rope_head_dim)), from which it re-makes every head's K and V."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class GeluMLP(nn.Module):
    """GPT-2 MLP: Linear -> GELU(tanh) -> Linear."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)); GeGLU (model.activation = "geglu", Gemma) with the
    tanh-approximated GELU in place of SiLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = functools.partial(F.gelu, approximate="tanh") if cfg.activation == "geglu" else F.silu
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(self.act(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    """Transformer block, pre-norm by default: x + attn(norm(x)), then x + mlp(norm(x)); model.norm_placement
    "post" (OLMo 2 / 3): x + norm(attn(x)), "sandwich" (Gemma 3): x + norm(attn(norm(x))), the output
    norms `attn_post_norm` / `mlp_post_norm`. `attn` / `mlp`: other modules in place of the default
    attention and MLP (lmforge.model.transformer.make_block: multi-head latent attention,
    Mixture-of-Experts). `layer`: the block's index (model.layer_types: its window and RoPE base)."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module | None = None, mlp: nn.Module | None = None,
                 layer: int = 0):
        super().__init__()
        pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
        self.local = cfg.is_local_layer(layer)  # (which RoPE tables and document mask the model passes it)
        self.attn_norm = make_norm(cfg) if pre else None
        self.attn = attn if attn is not None else Attention(cfg, layer)
        self.attn_post_norm = make_norm(cfg) if post else None
        self.mlp_norm = make_norm(cfg) if pre else None
        if mlp is None:
            mlp = SwiGLU(cfg) if cfg.gated_mlp else GeluMLP(cfg)
        self.mlp = mlp
        self.mlp_post_norm = make_norm(cfg) if post else None
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: KVCache | None = None, mask=None) -> torch.Tensor:
        # (the mask as a keyword: tensor parallelism's PrepareModuleInput lays out the positional inputs)
        h = self.attn(x if self.attn_norm is None else self.attn_norm(x), rope, kv_cache, mask=mask)
        x = x + self.resid_dropout(h if self.attn_post_norm is None else self.attn_post_norm(h))
        h = self.mlp(x if self.mlp_norm is None else self.mlp_norm(x))
        return x + (h if self.mlp_post_norm is None else self.mlp_post_norm(h))


def scale_embedding(cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """The token embeddings x times sqrt(model.dim) under model.embed_scale (Gemma), the factor rounded
    to x's dtype first as transformers rounds it (bf16: 33.94 -> 34.0 for dim 1152); x otherwise. (A
    Python number, which autograd does not save, holding that rounded value: the product is the same.)"""
    return x * float(torch.tensor(cfg.dim ** 0.5, dtype=x.dtype)) if cfg.embed_scale else x


def block_inputs(model, positions: torch.Tensor | None, doc_ids: torch.Tensor | None,
                 dropout_p: float) -> tuple[dict, dict]:
    """The RoPE rows and document masks of one forward, by block kind (`Block.local`): the global ones
    under False, those of model.layer_types' 'sliding_attention' blocks (model.rope_local_theta's
    tables, model.sliding_window's mask) under True. `model`: the Transformer (its RoPE tables)."""
    cfg = model.cfg
    rope = rope_rows((model.rope_cos, model.rope_sin), positions) if cfg.pos_emb == "rope" else None
    mask = attention_mask(doc_ids, cfg.layer_window(cfg.n_layers), dropout_p)  # (a full-attention block's window)
    if not cfg.has_local_layers:
        return {False: rope, True: rope}, {False: mask, True: mask}
    local_rope = rope_rows((model.rope_local_cos, model.rope_local_sin), positions) if rope is not None else None
    return {False: rope, True: local_rope}, {False: mask, True: attention_mask(doc_ids, cfg.sliding_window, dropout_p)}
