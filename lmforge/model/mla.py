"""Multi-head latent attention (MLA; DeepSeek-V2 arXiv 2405.04434 section 2.1, DeepSeek-V3 arXiv
2412.19437 section 2.1.1), selected by `model.mla.kv_lora_rank > 0` (lmforge.config.sections.MLAConfig).

For a token with hidden state h (dim), n heads, the paper's equations (its matrices are the rows of
this module's `nn.Linear` weights named on the right):

    c_KV  = RMSNorm(W^DKV h)                      (kv_lora_rank)    wkv_a rows [0, kv_lora_rank), kv_norm
    k^R   = RoPE(W^KR h)                          (qk_rope_head_dim, one for all heads)
                                                                    wkv_a rows [kv_lora_rank, +rope)
    k^C_i = W^UK_i c_KV,  v_i = W^UV_i c_KV       (qk_nope / v_head_dim per head i)
                                                                    wkv_b rows of head i: its k^C then its v
    c_Q   = RMSNorm(W^DQ h)                       (q_lora_rank)     wq_a, q_norm   (q_lora_rank = 0: c_Q = h)
    q^C_i = W^UQ_i c_Q,  q^R_i = RoPE(W^QR_i c_Q)                   wq_b (or wq) rows of head i: q^C then q^R
    q_i = [q^C_i; q^R_i],  k_i = [k^C_i; k^R]
    o_i = sum_j softmax_j(q_i . k_i,j * scale) v_i,j  (causal),  u = W^O [o_1; ..; o_n]      wo

scale = 1 / sqrt(qk_nope + qk_rope), times mscale(rope_factor, rope_mscale_all_dim)^2 under YaRN RoPE
scaling (model.rope_scaling = 'yarn': DeepSeek-V3's long-context setting; the cos / sin tables carry
YaRN's attention factor: lmforge.model.layers.rope_tables). The per-head layouts (each head's rows
contiguous: nope part then rope part for q, k^C part then v for wkv_b; latent then rope key in
wkv_a) are those of DeepSeek's released checkpoints and transformers' DeepseekV3Attention, so the
weights map one to one (lmforge.interop.hf_deepseek; RoPE pairs: lmforge rotates dimension i with
i + rope/2, DeepSeek's checkpoints pair neighbours, a permutation of the rope rows on import/export).

Computation. K and V are made from the latent for the keys attended to ("naive" MLA: the K/V
up-projection W^UK is not absorbed into the query, which would save the expansion at decode time but
makes attention run over the latent width: a kernel question, not one of the equations), then one
`scaled_dot_product_attention`. The value head is zero-padded to the query/key width where they
differ (DeepSeek-V3: 128 vs 192), so SDPA's flash kernels (which want one head width) apply, and the
padded columns of the output are dropped; the softmax scale goes to SDPA as `scale` (to the query,
under context parallelism, whose kernels use 1 / sqrt(width)).

What is kept per token is the latent and the RoPE key: kv_lora_rank + qk_rope_head_dim numbers
(DeepSeek-V3: 576, against 2 x 128 x 128 = 32768 for multi-head attention of its width):

* the KV cache of generation (lmforge.model.layers.KVCache) holds (c_KV, k^R), and each decoding step
  re-expands every head's K and V from them;
* context parallelism (lmforge.parallel.context_parallel) all-gathers (c_KV, k^R) of the rank's
  chunks, not K and V (its backward reduce-scatters their gradients), then expands them locally and
  runs the same chunked causal attention as for multi-head attention (`SequenceShard.attend`).

Tensor parallelism (lmforge.parallel.tensor_parallel) splits the heads: wq / wq_b and wkv_b
column-parallel (each head's rows are contiguous, so a row split gives whole heads), wo row-parallel.
The RoPE key k^R is shared by every head but reaches a rank's heads without a column-parallel layer
(whose backward sums the input gradient over the TP ranks), so its gradient is summed over them
here (`tp_group`, set by the TP layout: Megatron's copy-to-tensor-parallel-region).
The down-projections wq_a and wkv_a and the two norms are replicated: the latent is shared by all
heads, so splitting W^DKV's rows would leave every rank with part of a latent that each of its heads
needs whole (an all-gather per layer to undo), while computing them on every TP rank costs dim x
(q_lora_rank + kv_lora_rank + rope) per token (DeepSeek-V3: 15.1M of the layer's 187M weights, 8%)
and no communication. Megatron-LM keeps them replicated too (its `linear_q_down_proj` /
`linear_kv_down_proj`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.layers import KVCache, apply_rope, current_shard, window_mask, yarn_mscale


# the latents' RMSNorm epsilon: DeepSeek's reference code and transformers' DeepseekV3Attention build
# them with the norm's default 1e-6 whatever the model's rms_norm_eps (DeepSeek-V3's is 1e-6 too)
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
    """MLA's attention scale: 1 / sqrt(qk head width), times mscale(factor, rope_mscale_all_dim)^2 under
    YaRN (DeepSeek-V3 and transformers' DeepseekV3Attention)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


class _SumGradient(torch.autograd.Function):
    """Identity whose backward all-reduces (sums) the gradient over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        import torch.distributed as dist

        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class MLAttention(nn.Module):
    """Causal multi-head latent attention (module docstring); input and output (batch, seq, dim)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.mla
        self.nope, self.rope, self.v_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        self.qk_dim = m.qk_head_dim
        heads = cfg.n_heads
        if m.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, m.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(m.q_lora_rank, heads * self.qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.rank + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, cfg.dim, bias=False)
        self.scale = softmax_scale(cfg)
        self.width = max(self.qk_dim, self.v_dim)  # the head width SDPA sees (the narrower side zero-padded)
        self.dropout = cfg.dropout
        self.tp_group = None  # tensor parallelism: the RoPE key's gradient is summed over this group

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> the queries (batch, seq, this rank's heads, qk head width)."""
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        return q.view(*x.shape[:2], -1, self.qk_dim)  # (-1: under tensor parallelism a slice of the heads)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, seq, dim) -> the normalised latent c_KV (batch, 1, seq, kv_lora_rank) and the rotated
        RoPE key k^R (batch, 1, seq, qk_rope_head_dim): what a token keeps (cache, CP all-gather)."""
        c, k_rope = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        if self.tp_group is not None:  # (each TP rank's heads give part of its gradient)
            k_rope = _SumGradient.apply(k_rope, self.tp_group)
        return self.kv_norm(c).unsqueeze(1), apply_rope(k_rope.unsqueeze(1), cos, sin)

    def expand(self, c: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (batch, 1, keys, rank) and RoPE keys (batch, 1, keys, rope) -> every (local) head's K
        and V, (batch, heads, keys, width): [k^C_i; k^R] and v_i, the narrower one zero-padded to `width`."""
        kv = self.wkv_b(c.squeeze(1))
        kv = kv.view(*kv.shape[:2], -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return self._pad(k, self.qk_dim), self._pad(v, self.v_dim)

    def _pad(self, t: torch.Tensor, width: int) -> torch.Tensor:
        return t if width == self.width else F.pad(t, (0, self.width - width))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache | None = None, mask=None) -> torch.Tensor:
        # (`mask`: the Block's document mask, which data.attention = "document" would give; the config
        # refuses it with MLA: lmforge.config.rules.check_data_recipes)
        assert mask is None, "multi-head latent attention takes no document mask"
        bsz, seq, _ = x.shape
        start = kv_cache.length if kv_cache is not None else 0
        cos, sin = rope[0][start:start + seq], rope[1][start:start + seq]
        q_nope, q_rope = self.query(x).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        q = self._pad(torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1), self.qk_dim)
        c, k_rope = self.latent(x, cos, sin)
        if kv_cache is not None:  # the cache keeps the latent and the RoPE key, not K and V
            c, k_rope = kv_cache.update(c, k_rope)
        dropout_p = self.dropout if self.training else 0.0
        shard = current_shard()
        if shard is not None:  # context parallelism: gather the latents of the whole sequence, not K/V
            # (in the compute dtype: under autocast the latent's norm ran in fp32, the up-projection takes 16 bits)
            gathered = shard.gather(torch.cat((c.to(k_rope.dtype), k_rope), dim=-1).unsqueeze(0))[0]
            k, v = self.expand(*gathered.split([self.rank, self.rope], dim=-1))
            scaled = self.scale * math.sqrt(self.width)  # (the CP kernels scale by 1 / sqrt(width))
            out = shard.attend(q if math.isclose(scaled, 1.0, rel_tol=1e-12) else q * scaled, k, v, dropout_p)
        else:
            k, v = self.expand(c, k_rope)
            mask = window_mask(start, seq, start + seq, 0, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=self.scale,
                                                 is_causal=mask is None and start == 0 and seq > 1)
        out = out[..., :self.v_dim] if self.v_dim != self.width else out
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
