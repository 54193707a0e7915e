"""Device time of one optimizer step on one rank, per op kind: the kernels a step launches, each
timed by what bounds it (lmforge.plan.flops adds the pipeline bubble and the communication).

Each kernel group is (kind, name, kernels per step, device seconds per kernel):

- ``matmul``: every GEMM of the step, one per weight per micro-batch for the forward, the input
  gradient and the weight gradient (the output head's per chunk of the chunked loss; a recomputed
  forward again). A GEMM of f FLOPs takes f / P + t0: P the device's practical dense rate, t0 a
  fixed cost per GEMM kernel (ramp-up, the last partial wave): a size-dependent efficiency
  P f / (f + P t0), half of P at f = P t0.
- ``attention``: the fused attention kernels (SDPA: flash / cuDNN), forward and backward per layer
  and micro-batch, at the PaLM count of their FLOPs (12 L h s per token: 4 forward, 8 backward, not
  halved for the causal mask) over a rate fitted on the device.
- ``elementwise``: the memory-bound kernels of the blocks (norms, activations, residual adds,
  RoPE, the casts between them) and outside them (embedding, final norm), each moving the bytes
  counted below at the device's elementwise bandwidth.
- ``loss``: the cross-entropy's elementwise passes over the logits (bytes per logit below).
- ``casts``: autocast's one 16-bit copy of each matmul weight per step, the gradients' cast to
  fp32 and their accumulation over micro-batches, the chunked loss's fp32 weight-gradient sums, the
  embedding's dense gradient; under FSDP2 the copy of each all-gather's output into the parameters
  (2 x 2 bytes a parameter per gather; ZeRO-3 gathers twice a micro-batch) and of the gradients into
  each reduce-scatter's fp32 input (2 x 4 bytes).
- ``optimizer``: the optimizer step and the gradient clipping over the parameters this rank
  updates, at the bandwidth fused optimizer kernels reach.

The host launches every kernel; where a kernel is shorter than the host's time per launch the
device waits the difference (``host`` gaps): per kernel max(0, t_host - its device time). Long
kernels (large models) hide the host entirely; GPT-2's short ones do not.

Elementwise bytes, per token and layer (h the width, q / kv the query / key-value widths, F the
MLP hidden width (SwiGLU: each of gate and up), a the activation bytes (2 in 16-bit runs), r the
residual stream's (4 under autocast, whose residual stream is fp32; 2 in bf16-pure runs; 4 in
fp32)). TP divides every term but the h-sized ones (by t with SP too); CP divides the tokens.

- compiled blocks (train.compile: Inductor fuses every pointwise op between two GEMM / attention
  kernels, and compiles each block apart): a kernel reads its inputs and writes its outputs once.
  Forward: norm 1 (+ the cast to a) r + a; RoPE on q, k 2(q + kv)a; residual + norm 2 2r + 2a;
  activation 2Fa (SwiGLU 3Fa); residual r + a + r. Backward: the residual gradient's cast for the
  down projection r + a (none when r = a); the activation's backward 3Fa (SwiGLU 5Fa); norm 2's
  backward with the residual sum and the cast, n a + 3r + a (n = the projections reading the norm's
  output, their gradients summed); RoPE 2(q + kv)a (a fused q/k/v projection: the cat of dq, dk,
  dv 2(q + 2kv)a); norm 1's n a + 3r.
- eager (train.compile off: each op its own kernel): under autocast each norm writes fp32 and each
  projection casts its input to 16 bits (n x (4 + a)); RoPE in fp32 (4 kernels); SwiGLU silu and
  the product apart; in backward the casts' gradients back to fp32, their sum, each norm's weight
  gradient in a kernel of its own, each bias gradient a pass over its output gradient, the
  residual gradients' sum.
- recompute: full recompute runs a block's forward kernels again; selective recompute (lmforge
  saves the matmul and attention outputs) re-makes the two norms' outputs, r + a each.

Loss bytes per logit (a = 2 under autocast): compiled chunk (CUDA with Triton: one kernel reads the
16-bit logits twice, writes the gradient once) 3a; eager chunk (fp32 cast, log_softmax, exp_,
cast back) (a + 4) + 12 + 8 + (4 + a); plain logits (fp32 copy, log_softmax, nll_loss's dense
gradient, log_softmax's backward, the cast back) (a + 4) + 12 + 4 + 16 + (4 + a) (fp32 runs: no
casts).

The constants (practical matmul rate, t0, attention rate, bandwidths, host time per launch) are
the device's `Calibration` (lmforge.plan.hardware), each with its source measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lmforge.config import ModelConfig
from lmforge.model.accounting import mlp_activation_width
from lmforge.spec.fp8 import converts
from lmforge.spec.parallel import recomputed_layers
from lmforge.plan.hardware import Device, Rates
from lmforge.plan.documents import attention_work_factor, bias_pass_bytes
from lmforge.plan.layout import Layout
from lmforge.plan.params import stage_specs, tp_shape

KINDS = ("matmul", "attention", "elementwise", "loss", "casts", "optimizer")


@dataclass(frozen=True)
class KernelGroup:
    """`count` kernels per optimizer step on one rank, `seconds` of device time each."""

    kind: str
    name: str
    count: float
    seconds: float

    @property
    def total(self) -> float:
        return self.count * self.seconds


@dataclass
class OpTimes:
    """The step's kernels on one rank and the host's time per launch (the gaps it leaves)."""

    groups: list[KernelGroup] = field(default_factory=list)
    host_launch_s: float = 0.0

    @property
    def device_s(self) -> float:
        return sum(g.total for g in self.groups)

    @property
    def host_gaps_s(self) -> float:
        return sum(g.count * max(0.0, self.host_launch_s - g.seconds) for g in self.groups)

    @property
    def total_s(self) -> float:
        return self.device_s + self.host_gaps_s

    @property
    def launches(self) -> float:
        return sum(g.count for g in self.groups)

    def by_kind(self) -> dict[str, float]:
        """Device seconds per kind (KINDS order), plus "host" gaps."""
        out = dict.fromkeys(KINDS, 0.0)
        for g in self.groups:
            out[g.kind] += g.total
        out["host"] = self.host_gaps_s
        return out


@dataclass(frozen=True)
class _Widths:
    """Per token and layer: the widths and byte sizes the elementwise counts use, and the TP split."""

    h: float      # the residual stream (divided by t only under SP)
    q: float      # query width on this rank
    kv: float     # key / value width on this rank
    F: float      # MLP hidden width on this rank (SwiGLU: each of gate, up)
    a: int        # activation bytes
    r: int        # residual-stream bytes
    autocast: bool


def _widths(cfg: ModelConfig, layout: Layout) -> _Widths:
    t = layout.tp
    a = 4 if layout.precision == "fp32" else 2
    r = 2 if layout.precision == "bf16-pure" else 4
    return _Widths(h=cfg.dim / (t if layout.sp else 1), q=cfg.n_heads * cfg.head_dim / t,
                   kv=cfg.kv_heads * cfg.head_dim / t, F=mlp_activation_width(cfg) / t, a=a, r=r,
                   autocast=layout.precision not in ("fp32", "bf16-pure"))


def _projections(cfg: ModelConfig) -> tuple[int, int]:
    """How many projections read norm 1's and norm 2's outputs."""
    return (1 if cfg.fused_qkv else 3), (2 if cfg.gated_mlp else 1)


def compiled_block_kernels(cfg: ModelConfig, w: _Widths) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(forward, backward) elementwise kernels of one compiled block: (name, bytes per token)."""
    h, q, kv, F, a, r = w.h, w.q, w.kv, w.F, w.a, w.r
    swiglu, rope = cfg.gated_mlp, cfg.pos_emb == "rope"
    n1, n2 = _projections(cfg)
    fwd = [("norm1", r * h + a * h)]
    if rope or cfg.qk_norm:
        fwd.append(("rope", 2 * (q + kv) * a + (2 * kv * a if cfg.fused_qkv and rope else 0.0)))
    fwd += [("residual+norm2", 2 * r * h + 2 * a * h), ("activation", (3 if swiglu else 2) * F * a),
            ("residual", 2 * r * h + a * h)]
    cast = (r + a) * h if r != a else 0.0
    bwd = [("residual grad cast", cast)] if cast else []
    bwd += [("activation backward", (5 if swiglu else 3) * F * a),
            ("norm2 backward", n2 * a * h + 3 * r * h + (a * h if r != a else 0.0))]
    if cfg.fused_qkv:
        bwd.append(("q/k/v gradient cat", 2 * (q + 2 * kv) * a))
    elif rope or cfg.qk_norm:
        bwd.append(("rope backward", 2 * (q + kv) * a))
    bwd.append(("norm1 backward", n1 * a * h + 3 * r * h))
    return fwd, bwd


def eager_block_kernels(cfg: ModelConfig, w: _Widths) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(forward, backward) elementwise kernels of one eager block: (name, bytes per token)."""
    h, q, kv, F, a, r = w.h, w.q, w.kv, w.F, w.a, w.r
    swiglu, rope, bias = cfg.gated_mlp, cfg.pos_emb == "rope", cfg.bias
    n1, n2 = _projections(cfg)
    norm_out = 4 if w.autocast else a  # autocast runs the norms in fp32
    fwd: list[tuple[str, float]] = []
    bwd: list[tuple[str, float]] = []
    for i, n in ((1, n1), (2, n2)):
        fwd.append((f"norm{i}", r * h + norm_out * h))
        if w.autocast:
            fwd += [(f"norm{i} cast", (4 + a) * h)] * n
    if rope:  # in fp32: the cast, the two products and their sum, the cat, the cast back, for q and k
        fwd += [("rope", 2 * (q + kv) * 4)] * 4
    fwd.append(("residual", 2 * r * h + a * h))
    fwd += [("silu", 2 * F * a), ("product", 3 * F * a)] if swiglu else [("gelu", 2 * F * a)]
    fwd.append(("residual", 2 * r * h + a * h))
    if r != a:
        bwd.append(("residual grad cast", (r + a) * h))
    if bias:
        bwd += [("bias grads", (q + 2 * kv + h + F + h) * a)]
    bwd += [("product backward", 6 * F * a), ("silu backward", 3 * F * a)] if swiglu else [("gelu backward", 3 * F * a)]
    if rope:
        bwd += [("rope backward", 2 * (q + kv) * 4)] * 4
    if cfg.fused_qkv:
        bwd.append(("q/k/v gradient cat", 2 * (q + 2 * kv) * a))
    for i, n in ((2, n2), (1, n1)):
        if w.autocast:
            bwd += [(f"norm{i} cast backward", (a + 4) * h)] * n
        bwd += [(f"norm{i} input grads sum", 3 * norm_out * h)] * (n - 1)
        bwd += [(f"norm{i} backward", norm_out * h + 2 * r * h), (f"norm{i} weight grad", norm_out * h + r * h),
                ("residual grads sum", 3 * r * h)]
    return fwd, bwd


def _block_elementwise(cfg: ModelConfig, layout: Layout, rates: Rates, tokens: float, layers: int
                       ) -> list[KernelGroup]:
    """The blocks' elementwise kernels for `tokens` tokens per micro-batch and `layers` layers."""
    w = _widths(cfg, layout)
    fwd, bwd = (compiled_block_kernels if layout.compile else eager_block_kernels)(cfg, w)
    m = layout.grad_accum
    recomputed = recomputed_layers(layout.ac, layers, layout.ac_every) if layout.ac != "selective" else 0
    groups = []
    for name, nbytes in fwd:
        groups.append(KernelGroup("elementwise", name, m * (layers + recomputed), nbytes * tokens / rates.elementwise_bps))
    for name, nbytes in bwd:
        groups.append(KernelGroup("elementwise", name, m * layers, nbytes * tokens / rates.elementwise_bps))
    if layout.ac == "selective":  # the norms' outputs, re-made for the projections' weight gradients
        groups.append(KernelGroup("elementwise", "selective recompute (norms)", 2 * m * layers,
                                  (w.r + w.a) * w.h * tokens / rates.elementwise_bps))
    return groups


def _matmuls(cfg: ModelConfig, layout: Layout, rates: Rates, tokens: float, stage: int) -> list[KernelGroup]:
    """Every GEMM of the step: per matmul weight of the stage, forward, input and weight gradient."""
    m, layers = layout.grad_accum, cfg.n_layers // layout.pp
    recomputed = recomputed_layers(layout.ac, layers, layout.ac_every) if layout.ac != "selective" else 0
    fp8 = layout.precision == "fp8"
    groups = []
    for spec in stage_specs(cfg, layout.pp, stage, layout.last_rank):
        if not spec.matmul or "lm_head" in spec.name:
            continue
        shape = tp_shape(spec, layout.tp, layout.ep)
        if len(shape) < 2:
            continue  # (a bias: the GEMM's epilogue)
        # routed experts (E, in, out): each token visits top_k of them (balanced over the EP ranks)
        per_token = 2 * math.prod(shape[1:]) * cfg.moe.top_k if spec.expert else 2 * math.prod(shape)
        # (what train.fp8 converts, lmforge.spec.fp8.converts: not the experts' 3-D grouped GEMMs, the router, ...)
        rate = rates.fp8_matmul_flops if fp8 and converts(spec.name, spec.shape) else rates.matmul_flops
        secs = per_token * tokens / rate + rates.gemm_fixed_s
        runs = 3 + (1 if spec.layer - stage * layers < recomputed else 0)  # (every_k / full: the first layers)
        groups.append(KernelGroup("matmul", spec.name.split(".", 2)[-1], m * runs, secs))
    if layout.holds_last(stage):  # the output head (16-bit even in FP8 runs), per chunk of the chunked loss
        V = math.ceil(cfg.vocab_size / layout.tp)
        chunk = min(layout.loss_chunk, tokens) if layout.loss_chunk else tokens
        chunks = math.ceil(tokens / chunk)
        secs = 2 * V * cfg.dim * chunk / rates.matmul_flops + rates.gemm_fixed_s
        groups.append(KernelGroup("matmul", "lm_head", 3 * m * chunks, secs))
    return _merged(groups)


def _merged(groups: list[KernelGroup]) -> list[KernelGroup]:
    """Groups of the same kind, name and kernel time summed (the layers' identical GEMMs)."""
    out: dict[tuple, KernelGroup] = {}
    for g in groups:
        key = (g.kind, g.name.split(".", 1)[-1], g.seconds)
        prev = out.get(key)
        out[key] = g if prev is None else KernelGroup(g.kind, key[1], prev.count + g.count, g.seconds)
    return list(out.values())


def _attention(cfg: ModelConfig, layout: Layout, rates: Rates, seq_len: int, tokens: float) -> list[KernelGroup]:
    """SDPA forward and backward per layer and micro-batch (a recomputed forward again): PaLM's 4 h s
    FLOPs per token forward and 8 h s backward, this rank's heads (/ t) and tokens (s / cp each)."""
    m, layers = layout.grad_accum, cfg.n_layers // layout.pp
    width = cfg.n_heads * cfg.head_dim / layout.tp
    # (data.attention = "document": the masked kernels' work against the causal ones, lmforge.plan.documents)
    fwd = 4 * width * seq_len * tokens / rates.attention_flops * attention_work_factor(layout, seq_len)
    recomputed = recomputed_layers(layout.ac, layers, layout.ac_every) if layout.ac != "selective" else 0
    groups = [KernelGroup("attention", "attention forward", m * (layers + recomputed), fwd),
              KernelGroup("attention", "attention backward", m * layers, 2 * fwd)]
    if bias_pass_bytes(layout, seq_len):  # SDPA's additive copy of the document mask, each layer
        groups.append(KernelGroup("elementwise", "document mask (SDPA's additive copy)", m * (layers + recomputed),
                                  bias_pass_bytes(layout, seq_len) / rates.elementwise_bps))
    return groups


def loss_bytes_per_logit(layout: Layout, chunk_loss_compiled: bool) -> float:
    """Elementwise bytes per logit of the cross-entropy (module docstring)."""
    a = 4 if layout.precision == "fp32" else 2
    if layout.loss_chunk:
        return 3 * a if chunk_loss_compiled else (a + 4) + 12 + 8 + (4 + a)
    if a == 4:
        return 12 + 4 + 16
    return (a + 4) + 12 + 4 + 16 + (4 + a)


def _loss_and_outside(cfg: ModelConfig, layout: Layout, rates: Rates, tokens: float, stage: int,
                      chunk_loss_compiled: bool) -> list[KernelGroup]:
    """The loss's passes over the logits, the final norm, the embedding forward and backward."""
    m, bw = layout.grad_accum, rates.elementwise_bps
    w = _widths(cfg, layout)
    V, d = cfg.vocab_size / layout.tp, cfg.dim
    groups = []
    if stage == 0:
        pos = 2 if cfg.pos_emb == "learned" else 0  # the position rows' add
        groups.append(KernelGroup("elementwise", "embedding", m * (1 + (1 if pos else 0)), 2 * w.r * d * tokens / bw))
        # its dense gradient: zeroed, then each token's row added
        groups.append(KernelGroup("casts", "embedding gradient", 2 * m, (4 * V * d + 2 * w.r * d * tokens) / 2 / bw))
    if layout.holds_last(stage):
        groups.append(KernelGroup("elementwise", "final norm", 2 * m, 2 * (w.r + w.a) * d * tokens / bw))
        chunk = min(layout.loss_chunk, tokens) if layout.loss_chunk else tokens
        chunks = math.ceil(tokens / chunk)
        per_kernel = loss_bytes_per_logit(layout, chunk_loss_compiled) * chunk * V / bw
        # the kernels it takes: one compiled; eager 5 (chunked) or 6 (plain)
        n = 1 if (layout.loss_chunk and chunk_loss_compiled) else (5 if layout.loss_chunk else 6)
        groups.append(KernelGroup("loss", "cross-entropy", m * chunks * n, per_kernel / n))
        if layout.loss_chunk:  # each chunk's 16-bit g^T h added into the fp32 weight gradient, then its scaling
            add = (w.a + 8) * V * d if w.a == 2 else 12 * V * d
            groups.append(KernelGroup("casts", "head weight-gradient sums", m * chunks, add / bw))
            groups.append(KernelGroup("casts", "head weight-gradient scale", m, 8 * V * d / bw))
    return groups


def _params_on_rank(cfg: ModelConfig, layout: Layout, stage: int) -> tuple[float, float, int]:
    """(parameters, of which the step copies in 16 bits, tensors) of the stage on this TP / EP rank: the
    matmul weights, or in bf16-pure every parameter but the embeddings' (lmforge.train.precision)."""
    specs = stage_specs(cfg, layout.pp, stage, layout.last_rank)
    params = matmul = 0.0
    pure = layout.precision == "bf16-pure"
    for spec in specs:
        n = math.prod(tp_shape(spec, layout.tp, layout.ep))
        params += n
        matmul += n if ((not spec.is_embedding) if pure else spec.matmul) else 0
    if cfg.tie_embeddings and stage == layout.last_rank == 0:  # (one process, or a V's rank 0)
        matmul += math.prod(tp_shape(specs[0], layout.tp))  # the embedding is also the head's weight
    return params, matmul, len(specs)


def _casts_and_optimizer(cfg: ModelConfig, layout: Layout, rates: Rates, stage: int,
                         optimizer_state_bytes: float) -> list[KernelGroup]:
    """Autocast's weight copies, the gradients' casts and accumulation, the optimizer and the clip."""
    params, matmul, tensors = _params_on_rank(cfg, layout, stage)
    m, bw = layout.grad_accum, rates.elementwise_bps
    groups = []
    if layout.precision != "fp32" and not layout.fsdp:
        groups.append(KernelGroup("casts", "16-bit weight copies", tensors, 6 * matmul / tensors / bw))
    if layout.precision == "fp32":
        first, later = 0.0, 12.0                    # accumulated in place
    elif layout.precision == "bf16-pure":
        first, later = 6.0, 10.0                    # the 16-bit gradient into the fp32 main gradient
    else:
        first, later = 6.0, 6.0 + 12.0              # cast to fp32, then accumulated
    grad_bytes = (first + later * (m - 1)) * matmul
    if grad_bytes:
        groups.append(KernelGroup("casts", "gradient casts and accumulation", m * tensors, grad_bytes / (m * tensors) / bw))
    if layout.fsdp:  # FSDP2's copies around its collectives, per block
        w = 4 if layout.precision == "fp32" else 2
        gathers = m * (2 if layout.zero == 3 else 1)  # (lmforge's ZeRO-2 keeps the gathered weights until backward)
        reductions = m if layout.fsdp_reduce_every_micro_batch else 1
        blocks = cfg.n_layers // layout.pp + 1
        # each all-gather's output copied out into the parameters (read + write), each reduce-scatter's
        # fp32 input copied in from the gradients (read + write)
        groups.append(KernelGroup("casts", "FSDP copy-out", gathers * blocks, 2 * w * params / blocks / bw))
        groups.append(KernelGroup("casts", "FSDP copy-in", reductions * blocks, 8 * params / blocks / bw))
    shard = layout.shard_ranks if layout.zero >= 1 else 1
    updated = params / shard
    # AdamW-style: read p, g and the state, write p and the state; bf16-pure also writes the 16-bit
    # copy; the clip reads every gradient for the norm, then scales it
    step_bytes = (12 + 2 * optimizer_state_bytes + (2 if layout.precision == "bf16-pure" else 0) + 12) * updated
    launches = max(1.0, math.ceil(tensors / 64))  # (fused / foreach kernels take many tensors each)
    groups.append(KernelGroup("optimizer", "optimizer step and clip", 3 * launches,
                              step_bytes / (3 * launches) / rates.optimizer_bps))
    return groups


def op_times(cfg: ModelConfig, layout: Layout, seq_len: int, device: Device, *, optimizer_state_bytes: float = 8.0,
             chunk_loss_compiled: bool = True) -> OpTimes:
    """The kernels of one optimizer step on the worst pipeline stage's rank (module docstring).
    `optimizer_state_bytes`: the optimizer's state per parameter (AdamW 8). `chunk_loss_compiled`:
    the chunked loss's elementwise part as one compiled kernel (lmforge on a CUDA GPU with Triton) or
    eager."""
    rates = device.rates(layout.precision)
    tokens = layout.micro_batch * seq_len / layout.cp
    layers = cfg.n_layers // layout.pp
    best = None
    for stage in sorted({0, layout.pp - 1}):
        groups = (_matmuls(cfg, layout, rates, tokens, stage) + _attention(cfg, layout, rates, seq_len, tokens)
                  + _block_elementwise(cfg, layout, rates, tokens, layers)
                  + _loss_and_outside(cfg, layout, rates, tokens, stage, chunk_loss_compiled)
                  + _casts_and_optimizer(cfg, layout, rates, stage, optimizer_state_bytes))
        times = OpTimes(groups, rates.host_launch_s)
        if best is None or times.total_s > best.total_s:
            best = times
    return best
