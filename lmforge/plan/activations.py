"""Activation bytes: per layer in each convention (Korthikanti et al., Megatron's estimator, what
lmforge's autograd saves), outside the blocks, under context parallelism, and the micro-batches a
pipeline stage holds in flight (lmforge.plan.memory's docstring states the formulas)."""

from __future__ import annotations

import dataclasses

from lmforge.config import ModelConfig
from lmforge.model.accounting import mlp_activation_width
from lmforge.spec.parallel import (cp_activation_bytes, cp_kv_bytes, cp_latent_bytes, cp_score_elements,
                                   pipeline_in_flight, rank_stages, recomputed_layers, stage_layers,
                                   ulysses_activation_bytes, ulysses_kv_heads)
from lmforge.plan.conventions import LITERATURE, check_convention
from lmforge.plan.layout import Layout
from lmforge.plan.loss_memory import lmforge_loss_bytes


def micro_batches_in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at its peak
    (lmforge.spec.parallel.pipeline_in_flight)."""
    return pipeline_in_flight(layout.pp_schedule, layout.pp, layout.grad_accum, stage, layout.virtual_stages)


def _literature_activation_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, ac: str,
                                     fused_attention: bool) -> float:
    """Korthikanti et al.'s per-layer bytes, generalised to GQA and the MLP type (module docstring)."""
    s, b, h, a, t = seq_len, layout.micro_batch, cfg.dim, cfg.n_heads, layout.tp
    sbh = s * b * h
    sp_div = t if layout.sp else 1
    if ac == "full":
        return 2 * sbh / sp_div
    r = cfg.kv_heads / cfg.n_heads
    k_mlp = 6 if cfg.gated_mlp else 4
    replicated = 10.0
    split = 4 + 4 * r + k_mlp * mlp_activation_width(cfg) / h
    core = 0.0 if (fused_attention or ac == "selective") else 5 * a * s / h
    if layout.sp or t == 1:
        return sbh / t * (replicated + split + core)
    return sbh * (replicated + (split + core) / t)


def megatron_sp_formula(layout: Layout, ac: str | None = None) -> bool:
    """Whether Megatron's report uses its sequence-parallel activation formula: only with SP and
    selective recompute (`ac`: the layer's mode, default the layout's); any other layout gets its
    formula "without SP"."""
    return layout.sp and (layout.ac if ac is None else ac) == "selective"


def _megatron_activation_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, ac: str,
                                   fused_attention: bool) -> float:
    """Megatron-LM's per-layer bytes as its `theoretical_memory_usage.py` computes them (module
    docstring): sbh(18 + 4 ffn/h)/t with SP and selective recompute, else sbh(10 + 24/t), whatever
    the MLP type or the query groups; a fully recomputed layer keeps its input, 2sbh (/t with SP)."""
    s, b, h, a, t = seq_len, layout.micro_batch, cfg.dim, cfg.n_heads, layout.tp
    sbh = s * b * h
    if ac == "full":
        return 2 * sbh / (t if layout.sp else 1)
    if megatron_sp_formula(layout, ac):
        return sbh * (18 + 4 * mlp_activation_width(cfg) / h) / t
    scores = 0.0 if (fused_attention or ac == "selective") else 5 * a * s * s * b / t
    return sbh * (10 + 24 / t) + scores


def residual_bytes(layout: Layout) -> int:
    """Bytes of a residual-stream element: fp32 under autocast (fp32 weights) and in fp32 runs, bf16 in
    bf16-pure runs (bf16 weights and activations)."""
    return 2 if layout.precision == "bf16-pure" else 4


def compiled_blocks(cfg: ModelConfig, layout: Layout) -> bool:
    """Whether the plan counts what a torch.compile'd block saves (`lmforge_activation_per_layer`):
    layout.compile (train.compile as resolved), for the dense multi-head / grouped-query blocks it was
    measured on. Multi-head latent attention and Mixture-of-Experts blocks keep the eager count (not
    measured compiled; train.compile = auto leaves MoE blocks uncompiled), as do QK-norm blocks
    (model.qk_norm: neither count models its norms yet)."""
    return layout.compile and not (cfg.mla.enabled or cfg.moe.enabled or cfg.qk_norm)


def lmforge_activation_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, ac: str,
                                 linear: bool = False) -> float:
    """Bytes autograd saves per layer under 16-bit autocast with SDPA (module docstring). `linear`: a
    Gated DeltaNet block (model.layer_types' 'linear_attention'): the same norms and MLP, its token
    mixer's bytes (`deltanet_mixer_bytes`) in place of attention's, its input cast once per projection
    (q, k, v, z, beta, decay) under autocast; counted eager whatever layout.compile. bf16-pure
    (an estimate, not yet measured: the mode is built apart): the residual stream, the norms' inputs and
    outputs are bf16, and each norm's output feeds its projections as it is (no casts).

    Compiled blocks (`compiled_blocks`: per-block torch.compile, Inductor's min-cut partitioner decides
    what the forward saves; measured on the CPU, where the same partitioner runs, with
    tests/test_plan_compiled_block.py, and on an H100: benchmarks/RESULTS.md) save less than eager:
    - the residual after attention (res bytes) is not kept: backward recomputes it from the block
      input and the attention projection's 16-bit output, which is kept instead (half bytes);
    - RMSNorm's normalised output (the weight gradient's input) is recomputed from its input and rstd;
    - each norm's output is cast to 16 bits once, whatever the projections that read it (eager
      autocast casts it once per projection: q, k, v, gate, up);
    - SwiGLU's silu(gate) is recomputed from gate (kept are gate, up and their product); GELU's
      output is kept as in eager;
    - under selective recompute the down / fc2 projection's output, which backward never reads, is
      not kept (eager's policy saves every matmul output).
    Per token and layer that is (12 + 2F) h bytes fewer than eager for a Llama block under bf16
    autocast (F = ffn / h; 20 h at F = 4: 40 KB for llama-1b), 2 h fewer for GPT-2's, 2 h fewer for
    either under selective recompute; fp32 (8 + 4F) h and 0."""
    s, b, h, a, t = seq_len, layout.micro_batch, cfg.dim, cfg.n_heads, layout.tp
    sbh = s * b * h
    half = 4 if layout.precision == "fp32" else 2
    res = residual_bytes(layout)
    r = cfg.kv_heads / cfg.n_heads
    F = mlp_activation_width(cfg) / h  # (MoE: the routed and shared experts' width per token)
    if ac == "full":
        return res * sbh  # the residual-stream input of the block
    # model.norm_placement = "sandwich" (Gemma 3): two more norms, on the sublayers' outputs; each keeps its
    # input and normalised output at the residual's width and its per-token statistics (measured eager)
    extra_norms = 2 if cfg.norm_placement == "sandwich" else 0
    norm_stats = (4 if cfg.norm == "rmsnorm" else 8) * s * b * (2 + extra_norms)
    lse = 4 * b * a * s / t
    compiled = compiled_blocks(cfg, layout) and not linear  # (DeltaNet blocks: not measured compiled)
    if ac == "selective":  # outputs of the matmuls and attention, plus the block input
        mlp_out = (2 * F if cfg.gated_mlp else F) + (0 if compiled else 1)  # (+1: down / fc2's)
        if linear:
            return sbh * (res + half * mlp_out / t) + deltanet_mixer_bytes(cfg, layout, seq_len, selective=True)
        return sbh * (res + half * ((1 + 2 * r + 1 + 1) / t + mlp_out / t)) + lse
    resid = 2 * res + 2 * res * extra_norms     # the inputs of the two norms (block in, mid); sandwich's others
    normed = 2 * res if cfg.norm == "rmsnorm" else 0  # RMSNorm saves its output for the weight grad
    if layout.precision in ("fp32", "bf16-pure"):  # each norm's output feeds its projections as it is: 2 tensors
        casts = 2 * res
    else:  # autocast casts the norm output once per projection: q, k, v (one fused wqkv: once) and fc1 (gate and up)
        qkv_casts = 6 if linear else 2 if cfg.mla.enabled else (1 if cfg.fused_qkv else 3)  # (MLA: wq_a / wq, wkv_a)
        casts = half * (qkv_casts + (2 if cfg.gated_mlp else 1))
    mlp = half * (4 * F if cfg.gated_mlp else 2 * F) / t
    if compiled:  # (the docstring's list)
        resid, normed = res + half, 0
        casts = casts if layout.precision in ("fp32", "bf16-pure") else 2 * half
        mlp = half * (3 * F if cfg.gated_mlp else 2 * F) / t
    if linear:
        return sbh * (resid + normed + casts + mlp) + norm_stats + deltanet_mixer_bytes(cfg, layout, seq_len)
    if cfg.mla.enabled:
        return sbh * (resid + normed + casts + mlp) + norm_stats + s * b * mla_attention_bytes(cfg, layout)
    attn = half * (1 + 2 * r + 1) / t           # q, k, v, attention output
    wo_in = half / t if cfg.pos_emb == "rope" else 0.0
    return sbh * (resid + normed + casts + attn + wo_in + mlp) + norm_stats + lse


def mla_attention_bytes(cfg: ModelConfig, layout: Layout) -> float:
    """Bytes per token that multi-head latent attention (lmforge.model.mla) saves, besides the casts of
    its input (measured on the CPU with tests/test_plan_mla_mtp.py): each latent (the query one if
    model.mla.q_lora_rank, the K/V one) through its RMSNorm, which runs in fp32 under autocast (its
    input upcast, its output kept for the weight's gradient, the rstd) and whose output is cast to 16
    bits for the up-projection; SDPA's q, k, v and output over n_heads / t heads of the padded width
    max(qk, v) and its log-sum-exp; the output projection's input (n_heads / t x v_head_dim). (The
    literature's and Megatron's conventions keep their multi-head attention formulas.)"""
    m, heads = cfg.mla, cfg.n_heads / layout.tp
    half, res = (4 if layout.precision == "fp32" else 2), residual_bytes(layout)
    autocast = layout.precision not in ("fp32", "bf16-pure")
    latents = m.kv_lora_rank + m.q_lora_rank
    norms = latents * (2 * res + (half if autocast else 0)) + 4 * (2 if m.q_lora_rank else 1)
    width = max(m.qk_head_dim, m.v_head_dim)
    # v: zero-padded to the width (a tensor of its own) where it is narrower than q / k, else a view of
    # the K/V up-projection's output, whose storage (k^C and v of every head) SDPA's saved v keeps
    v = width if m.v_head_dim < m.qk_head_dim else m.qk_nope_head_dim + m.v_head_dim
    return norms + heads * (half * (3 * width + v) + 4 + half * m.v_head_dim)


def deltanet_mixer_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, selective: bool = False) -> float:
    """Bytes that a Gated DeltaNet token mixer (lmforge.model.gated_deltanet: model.layer_types'
    'linear_attention' blocks) keeps for backward for one micro-batch, besides the casts of its input
    (`lmforge_activation_per_layer` counts those, and the block's norms and MLP, as for attention):
    what its forward saves, tensor by tensor, that is still referenced when the forward returns (the
    last chunk's state update goes with the final state, which training drops). Byte-exact on the CPU
    in fp32 and bf16 autocast (tests/test_plan_compiled_block.py; bf16-pure's mixer matched too when
    measured once, where the block's norms and MLP stay the attention rule's estimate). TP divides the heads
    (each rank runs its own). b micro-batch, s tokens, hk / hv key / value heads of dk / dv, K taps,
    chunks of C tokens; the rule runs over P = n C tokens (n = ceil(s / C) chunks, the tail padded),
    per value head (q and k repeated to them), in fp32:

    - each short convolution (q, k: hk dk channels; v: hv dv) its input with K - 1 zeros before it and
      its output (SiLU's input), in the projections' dtype; the L2 norms of q and k their fp32 inputs
      and per-head rstd; the gates beta (sigmoid's output) and the decay's softplus input and output
      (fp32, per value head), exp(A_log) and its negation (per layer);
    - the chunked rule: the padded q, k, v and beta (beta is sigmoid's output itself when nothing is
      padded); per chunk the C x C decays e^(G_i - G_j), beta k_i.k_j and the triangular system; the
      solves' outputs u and w; exp(G), beta exp(G), a second exp(G) (for q), exp(G_last - G) (only
      where a state passes on: n > 1); q.k^T and k.k^T in the matmuls' dtype; the causal mask twice
      (C x C bools);
    - the chunk loop: per chunk the state S (dk x dv), the correction d (C x dv) and the chunk's decay;
    - under autocast each matmul of the rule casts both operands to 16 bits (a cast per operand per
      matmul, none cached): q and k over P tokens (x 2 each), the scores; per chunk S twice, d twice,
      w, q exp(G) and (k exp(G_last - G))^T (S_0 = 0 needs no gradient: chunk 0's w and q exp(G) are not
      kept; the last chunk's update is dropped). Without autocast the matmuls save their operands:
      the scores, q exp(G) and k exp(G_last - G) whole, and the copies matmul makes where it cannot
      fold the operands' (batch, heads, chunks) dims into one (`_deltanet_fold_copies`);
    - the gated output norm: its fp32 input (a copy of the rule's output: 16-bit under autocast;
      fp32 runs keep the padded output itself), rstd, normalised output, the gate's fp32 copy (SiLU's
      input), the normalised output times the weight, SiLU's output; the output projection's input.

    `selective` (train.activation_checkpoint = selective: lmforge.parallel.activation_ckpt keeps the
    outputs of the matmuls, everything else is recomputed): the six input projections' and the output
    projection's outputs (the latter full width on every TP rank: a row-parallel matmul's partial
    sums), and the rule's matmul outputs: q.k^T and k.k^T, per chunk w S, q exp(G) S, scores d (C x dv
    each) and the state update (dk x dv), the last chunk's too (the policy's cache keeps them)."""
    t, b, s, h = layout.tp, layout.micro_batch, seq_len, cfg.dim
    hk, hv, dk, dv = cfg.deltanet_shape
    hk, hv = hk // t, hv // t
    K, C = cfg.deltanet.conv_kernel, cfg.deltanet.chunk_size
    n = -(-s // C)
    P = n * C
    qk, vz = hk * dk, hv * dv
    autocast = layout.precision not in ("fp32", "bf16-pure")
    half, res = (4 if layout.precision == "fp32" else 2), residual_bytes(layout)
    inner = 2 if autocast else 4  # the dtype of the rule's matmul outputs
    X = b * hv  # the rule runs per (sequence, value head)
    if selective:
        projections = half * b * s * (2 * qk + 2 * vz + 2 * hv + h)
        return projections + inner * X * (2 * P * C + n * (3 * C * dv + dk * dv))
    conv = half * b * (2 * s + K - 1) * (2 * qk + vz)
    l2 = 2 * 4 * b * s * (qk + hk)
    gates = 3 * 4 * b * s * hv + 2 * 4 * hv
    rule = 4 * X * P * (2 * dk + dv) + (4 * X * P if P > s else 0)  # q, k, v; beta where padded
    rule += 3 * 4 * X * P * C + 2 * C * C  # decays, beta k.k^T, the system; the masks
    rule += 4 * X * P * (dv + dk)  # u, w
    rule += 4 * X * P * (3 + (n > 1))  # exp(G), beta exp(G), exp(G) for q; exp(G_last - G)
    rule += inner * X * P * C * 2  # k.k^T, q.k^T
    rule += 4 * X * (n - 1)  # the decays of the chunks a state leaves
    if autocast:  # fp32 S (read by the decay), 16-bit casts of S (x 2), d (x 2 but the last), w, q exp(G), k exp(..)
        rule += 4 * 2 * X * P * dk + 2 * X * P * C  # the casts of q, k (x 2 each) and of the scores
        rule += X * (4 * (n - 1) * dk * dv + 2 * (2 * n * dk * dv + (2 * n - 1) * C * dv + 3 * (n - 1) * C * dk))
    else:  # S and d per chunk, the scores; the (C x dk) blocks of q, k and their decayed forms
        rule += 4 * X * (n * (dk * dv + C * dv) + P * C)
        rule += _deltanet_fold_copies(b, hv, dk, n, P == s, hv > hk) * 4 * X * C * dk
    out_in = 4 * X * P * dv if layout.precision == "fp32" else 4 * b * s * vz
    gated = out_in + 4 * b * s * hv + 2 * res * b * s * vz + 2 * 4 * b * s * vz
    return conv + l2 + gates + rule + gated + half * b * s * vz


def _deltanet_fold_copies(b: int, heads: int, dk: int, n: int, unpadded: bool, repeated: bool) -> int:
    """Without autocast, the chunked rule's (C x dk) blocks of q, k, q exp(G) and k exp(G_last - G)
    that it keeps (whole tensors or matmul's copies of them), in units of b x heads x C x dk fp32 values.
    The four operands of k.k^T and q.k^T (P / C blocks each) are kept as matmul's copies where it cannot
    view (batch, heads, chunks) as one dim, else they are q and k themselves (counted apart); q exp(G)
    and k exp(G_last - G) are whole tensors (n - 1 ... n blocks kept whole: n each where n > 1), or per
    chunk copies (n - 1 each) where the chunk loop's matmuls cannot fold (batch, heads). Padded inputs
    (`unpadded` False) are contiguous: no copies. Unpadded, q and k are views of per-token tensors:
    (b, s, heads, dk) ones where the key heads were `repeated` to the value heads, else (b, heads, dk,
    s) ones (the convolution's channels-first output, transposed)."""
    many = lambda *sizes: sum(size > 1 for size in sizes) > 1  # noqa: E731
    if not unpadded:
        operands = 0
    elif repeated:  # (batch, heads) never fold; (batch, chunks) do where heads = 1
        operands = 4 * n if heads > 1 and many(b, heads, n) else 0
    else:  # (batch, heads) fold; chunks never (dk > 1)
        operands = 4 * n if n > 1 and many(b * heads, n) else 0
    per_chunk = unpadded and repeated and b > 1 and heads > 1
    return operands + (2 * (n - 1) if per_chunk else 2 * n if n > 1 else 0)


def attention_dtype_bytes(layout: Layout) -> int:
    """Bytes of an element of q, k, v in lmforge's attention: 16-bit under autocast (fp8 runs keep
    attention in bf16), 4 in fp32 runs."""
    return 4 if layout.precision == "fp32" else 2


def cp_kv_layer_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, gathered: bool = False) -> int:
    """The K and V of one layer for the whole sequences of a micro-batch, on one (TP) rank: what a
    context-parallel rank all-gathers and saves (`lmforge.spec.parallel.cp_kv_bytes`). Multi-head
    latent attention gathers its latent and RoPE key instead (`gathered`: those bytes, what the
    collectives move: `spec.parallel.cp_latent_bytes`) and saves them with the K and V it expands from them
    (every head's, n_heads / t x the padded width, v as `mla_attention_bytes` counts it)."""
    dtype = attention_dtype_bytes(layout)
    if not cfg.mla.enabled:
        return cp_kv_bytes(layout.micro_batch, seq_len, cfg.kv_heads, cfg.head_dim, dtype, layout.tp)
    m = cfg.mla
    latent = cp_latent_bytes(layout.micro_batch, seq_len, m.kv_lora_rank + m.qk_rope_head_dim, dtype)
    if gathered:
        return latent
    width = max(m.qk_head_dim, m.v_head_dim)
    v = width if m.v_head_dim < m.qk_head_dim else m.qk_nope_head_dim + m.v_head_dim
    return latent + layout.micro_batch * seq_len * cfg.n_heads // layout.tp * (width + v) * dtype


def activation_bytes_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, convention: str,
                               checkpointed: bool | None = None, fused_attention: bool = True,
                               linear: bool = False) -> float:
    """Activation bytes of one transformer layer for one micro-batch on one GPU. `checkpointed`
    overrides the layout's mode (True = full recompute, False = none); `fused_attention=False`
    gives the literature's unfused formula (with the 5as/h score term). `linear`: a Gated DeltaNet
    block (`lmforge_activation_per_layer`); the literature conventions, which publish no formula for
    linear attention, count it as an attention block.

    Context parallelism (cp > 1): the rank holds 1/cp of every sequence's tokens but the K and V of
    the whole sequence (all-gathered, saved for backward): (A - KV) / cp + KV with A the layer's
    bytes for the whole sequence and KV its K/V (`lmforge.spec.parallel.cp_activation_bytes`;
    every term of A is linear in the sequence length once attention is fused). Full recompute keeps
    only the block input of the rank's tokens, A / cp. The literature conventions count the same
    all-gather design (Llama 3's, Megatron's `--cp-comm-type allgather`) with their 16-bit K/V; their
    unfused [s, s] score term becomes the rank's c^2 (2cp + 1) scores per head (`cp_score_elements`).
    Ulysses (cp_mode = "ulysses"): attention on whole sequences for heads / cp heads, so 1/cp of A,
    the K/V counted once per replica where KV heads are replicated up to cp
    (`lmforge.spec.parallel.ulysses_activation_bytes`), and 1/cp of the score term."""
    ac = layout.ac if checkpointed is None else ("full" if checkpointed else "none")
    if linear and layout.cp > 1 and check_convention(convention) == "lmforge":
        # lmforge refuses context parallelism over Gated DeltaNet blocks (rule linear-attention-layouts, which
        # the plan reports); a plan of such a layout still counts them, as the rank's 1/cp of the tokens with
        # nothing gathered (what a CP that passes the state between ranks would keep)
        return lmforge_activation_per_layer(cfg, dataclasses.replace(layout, cp=1), seq_len, ac,
                                            linear) / layout.cp
    if check_convention(convention) == "lmforge":
        whole = lmforge_activation_per_layer(cfg, layout, seq_len, ac, linear)
        kv = cp_kv_layer_bytes(cfg, layout, seq_len)
        scores = 0.0
    else:
        per = _megatron_activation_per_layer if convention == "megatron" else _literature_activation_per_layer
        whole = per(cfg, layout, seq_len, ac, fused_attention=True)
        kv = cp_kv_bytes(layout.micro_batch, seq_len, cfg.kv_heads, cfg.head_dim, 2, layout.tp)
        scores = per(cfg, layout, seq_len, ac, fused_attention) - whole
    if layout.cp == 1:
        return whole + scores
    if ac == "full":
        return whole / layout.cp
    if layout.cp_mode == "ulysses":  # (measured on CPU: tests/test_parallel_cp_ulysses.py's probe, within 1e-5)
        # whole sequences for 1/cp of the heads: 1/cp of everything, the K/V x the KV heads' replication
        kv_heads = cfg.kv_heads // layout.tp
        replication = ulysses_kv_heads(cfg.n_heads // layout.tp, kv_heads, layout.cp) / kv_heads
        return ulysses_activation_bytes(whole, kv, layout.cp, replication) + scores / layout.cp
    if cfg.mla.enabled and convention == "lmforge":  # (not measured yet: derived from what one process saves)
        # the whole sequence's latent (gathered) and K/V; the rank's share of everything else, without the
        # 16-bit copy of the latent a rank's own up-projection would keep (it takes the gathered one)
        autocast = layout.precision not in ("fp32", "bf16-pure")
        own = whole - (kv - cp_kv_layer_bytes(cfg, layout, seq_len, gathered=True)) \
            - (layout.micro_batch * seq_len * cfg.mla.kv_lora_rank * 2 if autocast else 0)
        return own / layout.cp + kv
    return cp_activation_bytes(whole, kv, layout.cp) + scores * cp_score_elements(seq_len, layout.cp) / seq_len**2


def outside_blocks(cfg: ModelConfig, layout: Layout, seq_len: int, convention: str, stage: int) -> dict[str, float]:
    """Activations outside the blocks: embedding output on the first stage, final norm + logits on
    the last (one micro-batch). Under context parallelism a rank holds seq_len / cp tokens of each
    sequence; in lmforge its token ids and targets are then separate tensors (the chunks, cut from
    the loader's rows), and every stage indexes the RoPE rows of its positions (fp32 cos and sin,
    shared by the blocks: 'positions', saved by the blocks that run without full recompute)."""
    s, b, h, V, t = seq_len // layout.cp, layout.micro_batch, cfg.dim, cfg.vocab_size, layout.tp
    sbh = s * b * h
    out: dict[str, float] = {}
    if convention == "megatron":  # token ids (int64) and the embedding's dropout mask; output-layer inputs
        sp = megatron_sp_formula(layout)
        if stage == 0:
            out["embedding"] = (8 * s * b + sbh) / (t if sp else 1)
        if layout.holds_last(stage):
            out["output"] = 4 * (sbh + s * b * V) / t if sp else 2 * (s * b * V / t + sbh)
            out["output"] += mtp_bytes(cfg, layout, seq_len, convention, out["output"])
        return out
    if convention in LITERATURE:
        sp_div = t if layout.sp else 1
        if stage == 0:
            out["embedding"] = sbh / sp_div  # dropout mask
        if layout.holds_last(stage):
            out["output"] = 4 * sbh / sp_div + 4 * s * b * V / t  # final norm + head input, fp32 logits
            out["output"] += mtp_bytes(cfg, layout, seq_len, convention, out["output"])
        return out
    half, res = (4 if layout.precision == "fp32" else 2), residual_bytes(layout)
    if stage == 0:
        out["embedding"] = 8 * s * b + (8 * s if cfg.pos_emb == "learned" else 0)  # int64 ids, positions
    layers = cfg.n_layers // layout.pp
    if layout.cp > 1 and cfg.pos_emb == "rope" and checkpointed_layers(layout, layers) < layers:
        out["positions"] = 2 * s * (cfg.head_dim // 2) * 4  # this rank's rows of the cos / sin tables
    if layout.holds_last(stage):
        normed = res if cfg.norm == "rmsnorm" else 0
        stats = (4 if cfg.norm == "rmsnorm" else 8) * s * b
        targets = 8 * s * b if layout.cp > 1 else 0  # (one process: a view of the ids' storage)
        kept, _ = lmforge_loss_bytes(cfg, layout, seq_len)
        if layout.loss_chunk:  # the head's input is read by the loss itself: no 16-bit copy saved
            out["output"] = sbh * (res + normed) + stats + kept + targets
        else:  # + the head input's 16-bit copy, the fp32 log-softmax (kept) and nll_loss's fp32 total weight
            copy = 0 if layout.precision == "bf16-pure" else half  # (bf16-pure: the norm output is the head input)
            out["output"] = sbh * (res + normed + copy) + stats + kept + 4 + targets
        # each MTP depth's head and loss: as the main one's, with targets of its own (shifted: a new tensor)
        out["output"] += mtp_bytes(cfg, layout, seq_len, convention, out["output"] - targets + 8 * s * b)
    return out


def mtp_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, convention: str, head: float) -> float:
    """Activations of the multi-token prediction modules (model.mtp_depth; lmforge.model.mtp), on the last
    stage with the output head (counted in outside_blocks' "output"), for one micro-batch: per depth a
    block (never activation-checkpointed: the per-layer formula without recompute), its head and loss
    (`head`: the bytes of one, as the caller counts the main one) and, in lmforge's convention, what
    the module adds before its block (measured on the CPU, tests/test_plan_mla_mtp.py): the shifted
    token ids (int64) the embedding keeps, the embedding output and the two norms' outputs (the
    residual's dtype; the hidden norm's input is already kept by the norm before the head), their
    rstds, and the 16-bit copy of the concatenation [emb; h] the projection takes."""
    if not cfg.mtp_depth:
        return 0.0
    s, b, h = seq_len // layout.cp, layout.micro_batch, cfg.dim
    # (the MTP modules' blocks are not compiled: lmforge compiles model.blocks only)
    block = activation_bytes_per_layer(cfg, dataclasses.replace(layout, compile=False), seq_len, convention,
                                       checkpointed=False)
    if convention != "lmforge":
        return cfg.mtp_depth * (block + head)
    half, res = (4 if layout.precision == "fp32" else 2), residual_bytes(layout)
    inputs = s * b * (8 + h * (3 * res + 2 * half) + 2 * 4)
    return cfg.mtp_depth * (block + head + inputs)


def rank_layers(cfg: ModelConfig, layout: Layout, stage: int) -> list[int]:
    """The blocks pipeline rank `stage` holds, ascending (lmforge.parallel.pipeline.split_model: each of
    its stages' n_layers / (pp x stages per rank) consecutive blocks; the order in which every_k
    activation checkpointing wraps the rank's blocks 0, k, 2k, ...)."""
    if layout.pp == 1:
        return list(range(cfg.n_layers))
    stages = rank_stages(layout.pp_schedule, layout.pp, stage, layout.virtual_stages)
    return sorted(i for s in stages for i in stage_layers(cfg.n_layers, layout.pp * layout.stages_per_rank, s))


def layer_kinds(cfg: ModelConfig, layout: Layout, stage: int) -> dict[tuple[bool, bool], int]:
    """How many of pipeline rank `stage`'s blocks are of each kind: (checkpointed, linear), checkpointed
    = wrapped by full / every_k activation checkpointing (keeps only its input; selective recompute is
    the per-layer formula's own mode), linear = Gated DeltaNet (model.layer_types)."""
    layers = rank_layers(cfg, layout, stage)
    wrapped = set(layers[::layout.ac_every] if layout.ac == "every_k" else layers if layout.ac == "full" else [])
    kinds: dict[tuple[bool, bool], int] = {}
    for i in layers:
        kind = (i in wrapped, cfg.is_linear_layer(i))
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def checkpointed_layers(layout: Layout, layers: int) -> int:
    """Layers that keep only their input (selective recompute keeps more: its own per-layer formula)."""
    return 0 if layout.ac == "selective" else recomputed_layers(layout.ac, layers, layout.ac_every)
