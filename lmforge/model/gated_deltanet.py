"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024), the linear-attention token mixer of Qwen3-Next /
Qwen3.5, with the semantics of transformers' `Qwen3NextGatedDeltaNet` (its PyTorch path), so that
its weights can be mapped one to one.

Per token t, from the block's normalised input x_t:

* q, k, v: projections of x_t, each through a short causal depthwise convolution (model.deltanet.
  conv_kernel taps over this and the previous tokens) and SiLU; q and k L2-normalised per head
  (x / sqrt(sum x^2 + 1e-6)), q also scaled by 1 / sqrt(key head dim);
* the gates: beta_t = sigmoid(x_t W_b) (the write strength) and the log decay
  g_t = -exp(A_log) softplus(x_t W_a + dt_bias) <= 0, one of each per value head;
* the state S (per value head, key dim x value dim; a key head serves value_heads / key_heads
  consecutive value heads), from S = 0:

      S <- exp(g_t) S                          (decay)
      S <- S + beta_t k_t (v_t - S^T k_t)^T     (the delta rule: move S's answer to k_t towards v_t)
      o_t = S^T q_t

* the output: per value head RMSNorm(o_t) x weight x SiLU(z_t), z_t = x_t W_z (the output gate),
  then the output projection.

Two forms compute the recurrence. `chunked_delta_rule` (training and prefill) cuts the sequence
into chunks of model.deltanet.chunk_size: inside a chunk the sequential updates become a unit
lower-triangular solve and matmuls (the WY form of products of (I - beta k k^T)), and only the
state passes from chunk to chunk. `recurrent_delta_rule` walks the tokens one at a time (generation,
one new token per step). Both run in fp32 and in pure PyTorch (any device); they agree to
rounding, whatever the chunk size. A `DeltaNetCache` carries a sequence on: the convolution's last
conv_kernel - 1 inputs and the state.

On CUDA the chunked form can run as the flash-linear-attention package's Triton kernels instead
(model.deltanet.kernel: `fla_chunked`, the same recurrence with its own chunks of 64; `auto` takes
them where the package imports): q and k arrive normalised and scaled as above, in the activations'
dtype with v; the state stays fp32. tests/test_gated_deltanet.py checks them against the PyTorch form
on a GPU.

Under tensor parallelism (lmforge.parallel.tensor_parallel) each rank holds whole key heads and the
value heads they serve: the input projections split by rows, the convolutions' channels, A_log and
dt_bias with them (DTensors sharded on dim 0, used here as their local shards), the output
projection by columns; so the forward counts heads from its tensors' shapes, never from the config.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.sharded import local_part

L2_EPS = 1e-6  # (as the flash-linear-attention kernels and transformers normalise q and k)


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """(batch, seq, heads[, dim]) -> (batch, heads, seq[, dim]) in fp32."""
    return [t.transpose(1, 2).float() for t in tensors]


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time. q, k (batch, seq, heads, key dim), already
    normalised and scaled; v (batch, seq, heads, value dim); g, beta (batch, seq, heads); `state`
    (batch, heads, key dim, value dim) or None (zeros). Returns (o, shaped like v; the final state),
    both fp32."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, seq, dk = k.shape
    s = k.new_zeros(b, h, dk, v.shape[-1]) if state is None else state.float()
    out = []
    for t in range(seq):
        s = s * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        error = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, :, t, None] * error)
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    o = torch.stack(out, dim=2) if out else torch.zeros_like(v)
    return o.transpose(1, 2), s


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       chunk: int, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_delta_rule`'s result, a chunk of `chunk` tokens at a time.

    Within a chunk starting from state S0, with G_i the cumulative log decay up to position i, the
    state's corrections d_i = beta_i (v_i - (state before i's write)^T k_i) satisfy the unit
    lower-triangular system

        d_i + sum_{j<i} beta_i (k_i . k_j) e^{G_i - G_j} d_j = beta_i v_i - beta_i e^{G_i} S0^T k_i,

    so D = U - W S0 with U, W the solves of beta v and beta e^G k (no dependence on S0: done for
    every chunk at once); then o_i = e^{G_i} S0^T q_i + sum_{j<=i} (q_i . k_j) e^{G_i - G_j} d_j and
    the next chunk's S0 is e^{G_last} S0 + sum_j e^{G_last - G_j} k_j d_j^T. The tail is padded with
    k = v = beta = g = 0 tokens, which leave the state as it is."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, seq, dk = k.shape
    dv = v.shape[-1]
    pad = (-seq) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (seq + pad) // chunk
    q, k, v = (t.reshape(b, h, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(b, h, n, chunk) for t in (g, beta))
    cum = g.cumsum(-1)  # G_i within each chunk
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    # e^{G_i - G_j} for j <= i (0 above the diagonal: masked before exp, which would overflow there)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~causal, 0.0)
    # (solve_triangular with unitriangular=True reads only the strictly lower part: I + that)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    u = solve(beta[..., None] * v)
    w = solve((beta * cum.exp())[..., None] * k)
    scores = (q @ k.transpose(-1, -2)) * decay  # (q_i . k_j) e^{G_i - G_j}, j <= i
    q_start = q * cum.exp()[..., None]  # reads S0 through e^{G_i}
    k_end = k * (cum[..., -1:] - cum).exp()[..., None]  # writes to the next S0 through e^{G_last - G_j}
    s = k.new_zeros(b, h, dk, dv) if state is None else state.float()
    out = []
    for c in range(n):
        d = u[:, :, c] - w[:, :, c] @ s
        out.append(q_start[:, :, c] @ s + scores[:, :, c] @ d)
        s = s * cum[:, :, c, -1].exp()[..., None, None] + k_end[:, :, c].transpose(-1, -2) @ d
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :seq]
    return o.transpose(1, 2), s


_FLA: list = []  # (the kernel once imported; [None] where the package does not import)


def fla_chunked():
    """flash-linear-attention's `chunk_gated_delta_rule`, or None where the package (or Triton) does not
    import. Its arguments: q, k, v (batch, seq, heads, dim), g and beta (batch, seq, heads), `scale`,
    `initial_state` (batch, heads, key dim, value dim), `output_final_state`; it returns (o, state)."""
    if not _FLA:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except Exception:  # noqa: BLE001 - ImportError, or a Triton that cannot start: the PyTorch form then
            chunk_gated_delta_rule = None
        _FLA.append(chunk_gated_delta_rule)
    return _FLA[0]


class DeltaNetCache:
    """A Gated DeltaNet layer's generation state: the convolution's last conv_kernel - 1 inputs of
    q, k and v (each (batch, channels, conv_kernel - 1)) and the recurrent state (batch, value heads,
    key dim, value dim), fp32. Fixed size, whatever the length of the sequence so far."""

    def __init__(self) -> None:
        self.conv: dict[str, torch.Tensor] = {}
        self.state: torch.Tensor | None = None
        self.length = 0


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, times weight, times SiLU(gate): the output gate of Gated DeltaNet
    (computed in fp32, as transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer (module docstring); `forward(x, rope, cache, mask)` takes the
    place of attention in a block (`rope` and `mask` unused: positions come from the recurrence)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = cfg.deltanet_shape
        self.chunk, self.kernel = cfg.deltanet.chunk_size, cfg.deltanet.kernel
        kernel = cfg.deltanet.conv_kernel
        qk, vz = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.in_q, self.in_k = nn.Linear(cfg.dim, qk, bias=False), nn.Linear(cfg.dim, qk, bias=False)
        self.in_v, self.in_z = nn.Linear(cfg.dim, vz, bias=False), nn.Linear(cfg.dim, vz, bias=False)
        # (in_*, not attention's wq / wk / wv: the fused-q/k/v conversions of checkpoints match those names)
        self.in_b = nn.Linear(cfg.dim, self.value_heads, bias=False)  # beta, the write strength
        self.in_a = nn.Linear(cfg.dim, self.value_heads, bias=False)  # the decay's input
        # depthwise causal convolutions, one per q / k / v (a channel's taps see only that channel:
        # three convolutions are one over their concatenation, and each splits with its heads)
        self.conv_q, self.conv_k = (nn.Conv1d(qk, qk, kernel, groups=qk, bias=False) for _ in range(2))
        self.conv_v = nn.Conv1d(vz, vz, kernel, groups=vz, bias=False)
        # decay rate exp(A_log) and the softplus's bias (Mamba's discretisation), one per value head
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.norm_eps)
        self.wo = nn.Linear(vz, cfg.dim, bias=False)

    def _fla(self, q: torch.Tensor):
        """flash-linear-attention's chunked kernel where model.deltanet.kernel takes it for `q`'s device,
        else None (the PyTorch form); `fla` off CUDA or without the package is an error naming the fix."""
        if self.kernel == "torch" or (self.kernel == "auto" and not q.is_cuda):
            return None
        kernel = fla_chunked() if q.is_cuda else None
        if kernel is None and self.kernel == "fla":
            why = "the flash-linear-attention package does not import here (`pip install flash-linear-attention`)" \
                if q.is_cuda else f"its Triton kernels need CUDA, this forward runs on {q.device.type}"
            raise RuntimeError(f"model.deltanet.kernel = 'fla': {why}; set model.deltanet.kernel = 'auto' or 'torch'")
        return kernel

    def _conv(self, name: str, x: torch.Tensor, cache: DeltaNetCache | None) -> torch.Tensor:
        """Causal depthwise convolution + SiLU of x (batch, seq, channels): over the cache's last
        inputs, else zeros, before the first token; the cache keeps the new last inputs."""
        weight = local_part(getattr(self, name).weight)  # (channels here, 1, taps): this rank's channels under TP
        x = x.transpose(1, 2)
        keep = weight.shape[-1] - 1
        before = cache.conv.get(name) if cache is not None else None
        if before is None:
            before = x.new_zeros(x.shape[0], x.shape[1], keep)
        full = torch.cat([before.to(x.dtype), x], dim=-1)
        if cache is not None:
            cache.conv[name] = full[..., full.shape[-1] - keep:].detach()
        return F.silu(F.conv1d(full, weight, groups=weight.shape[0])).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope=None, cache: DeltaNetCache | None = None, mask=None) -> torch.Tensor:
        bsz, seq, _ = x.shape  # (the heads: this rank's under tensor parallelism, the same ratio)
        q = self._conv("conv_q", self.in_q(x), cache).view(bsz, seq, -1, self.key_dim)
        k = self._conv("conv_k", self.in_k(x), cache).view(bsz, seq, -1, self.key_dim)
        v = self._conv("conv_v", self.in_v(x), cache).view(bsz, seq, -1, self.value_dim)
        q = l2_normalise(q.float()) / math.sqrt(self.key_dim)
        k = l2_normalise(k.float())
        rep = self.value_heads // self.key_heads
        if rep > 1:  # key head j serves value heads j rep .. (j + 1) rep - 1 (repeated for the kernels too, as
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)  # transformers feeds them)
        beta = torch.sigmoid(self.in_b(x).float())
        g = -local_part(self.A_log).float().exp() * F.softplus(self.in_a(x).float() + local_part(self.dt_bias).float())
        state = cache.state if cache is not None else None
        if seq == 1 and cache is not None:  # one new token: the recurrence itself
            o, state = recurrent_delta_rule(q, k, v, g, beta, state)
        elif (fla := self._fla(q)) is not None:  # (q, k already normalised and scaled: scale 1)
            o, state = fla(q.to(v.dtype), k.to(v.dtype), v, g, beta.to(v.dtype), scale=1.0,
                           initial_state=None if state is None else state.float(), output_final_state=True)
        else:
            o, state = chunked_delta_rule(q, k, v, g, beta, self.chunk, state)
        if cache is not None:
            cache.state, cache.length = state.detach(), cache.length + seq
        z = self.in_z(x).view(bsz, seq, -1, self.value_dim)
        return self.wo(self.norm(o.to(x.dtype), z).reshape(bsz, seq, -1))


__all__ = ["DeltaNetCache", "GatedDeltaNet", "GatedRMSNorm", "chunked_delta_rule", "l2_normalise",
           "recurrent_delta_rule"]
