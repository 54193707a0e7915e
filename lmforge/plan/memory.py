"""Memory per GPU for a model config, an optimizer and a parallel layout.

Three conventions, chosen with `weights=`, each named for what it counts:

``"zero-paper"`` (Rajbhandari et al. 2020, the ZeRO paper)
    Mixed precision (bf16/fp16/fp8) keeps 16-bit weights (2 B/param), 16-bit gradients (2), and
    fp32 master weights (4) plus the optimizer state in fp32 (Adam/AdamW: m and v, 8):
    2 + 2 + 12 = 16 bytes/param. fp32 training: 4 + 4 + state. With N data-parallel ranks ZeRO
    shards flat buffers exactly (numel/N): ZeRO-1 (master + state) 4 + 12/N, ZeRO-2
    (+ gradients) 2 + 14/N, ZeRO-3 (+ weights) 16/N.

``"megatron"`` (Megatron-LM's own estimate: `megatron/training/theoretical_memory_usage.py`, read
at NVIDIA/Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553, and its
distributed-optimizer table; DeepSpeed's ZeRO estimators count the same 18 for the states they
shard)
    Model states: bf16/fp8 runs keep bf16 weights (2), fp32 "main" gradients (4) and fp32 master
    weights + Adam moments (12): 18 bytes/param; the distributed optimizer (ZeRO-1 here) shards
    the 12: 6 + 12/d. fp16 runs keep fp16 gradients (2) and shard an fp32 copy of them with the
    optimizer: 20, or 4 + 16/d. fp32 runs: 16, or 8 + 8/d. Megatron has no ZeRO-2/3; this
    convention extends its breakdown the ZeRO way: ZeRO-2 also shards the fp32 gradients
    (2 + 16/d), ZeRO-3 everything (18/d). The bytes/param are Megatron's, the parameters the
    model's own tensors: Megatron's formula leaves out linear biases and a learned position
    table, pads the vocabulary to a multiple of 128 t, and spreads the final norm over the
    pipeline stages (benchmarks/plan_conventions.py pins the difference).
    Activations, as that file computes them (16-bit tensors, 1-byte dropout masks; s seq, b
    micro-batch, h hidden, t TP, p PP), whatever the MLP type or the number of query groups
    (Korthikanti et al.'s Table 2 for a 4h GELU MLP and multi-head attention, with flash
    attention's absence of [s, s] scores):
    - with SP and selective recompute: per layer sbh(18 + 4 ffn/h)/t (GPT: 34/t); token ids and
      the embedding's dropout mask (8sb + sbh)/t; the output layer's inputs 4sbh(1 + V/h)/t;
    - any other layout (SP without selective recompute included), its formula "without SP":
      per layer sbh(10 + 24/t); (8sb + sbh); output 2(sbV/t + sbh); everything x 1.05 for
      temporaries (`MEGATRON_ALLOWANCE`, in the breakdown's detail).
    Micro-batches in flight as for the other conventions (1F1B: min(p, m) on the first stage,
    which is Megatron's L layers x min(1, m/p); interleaved: its penalty 1 + (p-1)/(pv), here
    capped at m). What the file does not model is extended, not copied: a layer under full
    recompute keeps its input, 2sbh (2sbh/t with SP), as in Korthikanti et al. (the file counts
    such layers in full: Llama-2-70B at 4096 tokens without TP / PP, 96.2 GB instead of 6.0);
    `fused_attention=False` adds the 5as/h score term where no selective recompute drops it;
    context parallelism and the last pipeline stage follow the rules below.

``"zero-paper"`` counts activations as Korthikanti et al. (2022) do, generalised to GQA and the MLP
type: 16-bit tensors and 1-byte dropout masks (F = MLP hidden / h, a heads, r = kv heads /
heads). Per layer, without TP:

    sbh (10 + 4 + 4r + kF) [+ 5as/h without fused attention],  k = 4 (GELU), 6 (SwiGLU)

where 10 = the two norm inputs (4) + q/k/v input (2) + fc1 input (2) + two dropout masks (2);
4 + 4r = q (2), k and v (2r each) and the attention output / out-projection input (2); and the
MLP keeps, per element of F, 2 + 2 bytes for GELU (fc1 output = GELU input, fc2 input) or
2 + 2 + 2 for SwiGLU (gate output, up output, and their product = down input). For GPT
(r = 1, GELU, F = 4) this is the paper's 34 = 18 + 4F; Megatron's estimator writes 18 + 4F for
every MLP, which undercounts a SwiGLU MLP by 2F (the second fc1 half). With TP the 10 stays
replicated and the rest is divided by t (GPT: 10 + 24/t); with TP + SP everything is divided by t.
The 5as/h term is the softmax output, its dropout mask and output (2 + 1 + 2 bytes per score):
lmforge runs `scaled_dot_product_attention` (flash / memory-efficient kernels), which keeps no
[s, s] matrix, so the term is off by default (`fused_attention=True`) and only the unfused,
published formula keeps it. Selective recompute drops that term (so under fused attention it
saves nothing in these conventions); full recompute keeps the layer input, 2sbh (2sbh/t with SP).
Outside the blocks: the embedding's dropout mask sbh, the final norm's and the head's inputs
4sbh, and fp32 logits 4sbV/t (sbh terms / t with SP).

``"lmforge"`` (what lmforge allocates; the trainer runs each optimizer step's forward and backward
passes over all its micro-batches inside one `Precision.step` (lmforge.train.precision), which
holds one 16-bit copy of each weight for the step, and FSDP2 runs with
`MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)`)
    Parameters are fp32 and are the master weights (4 B/param, no separate copy), gradients are
    fp32 (4), optimizer state is whatever `lmforge.optim` keeps per tensor (AdamW: m, v fp32 plus
    a 4-byte `step` tensor per parameter tensor). Sharding follows the layout lmforge builds:
    ZeRO-1 is DDP + `ZeroRedundancyOptimizer` (optimizer state sharded), ZeRO-2 and ZeRO-3 are
    FSDP2 `fully_shard` without / with resharding after forward: parameters, gradients and
    optimizer state are all sharded, each tensor chunked along dim 0 into N pieces of
    ceil(dim0/N) rows (the worst rank holds ceil(dim0/N) x (other dims) elements). Buffers:
    - layouts whose parameters are not FSDP-sharded (single device, DDP, ZeRO-1, TP or PP without
      FSDP): the step holds one 16-bit cast of every Linear weight and bias of the stage (a tied
      embedding too, through the head; `autocast_weight_copies`) from its start to its end, so
      the copies are counted once per step, not per micro-batch in flight, and activation
      recompute does not free them (the recompute in backward reuses them);
    - DDP and ZeRO-1: DDP runs with `gradient_as_bucket_view=True`, so the gradients are views
      into its fp32 all-reduce buckets (no copy; torch's default False kept a second fp32 copy,
      4 B/param), and the trainer zeroes them in place between steps (`DataParallel.zero_grad`),
      so the no_sync micro-batches of an accumulating step accumulate into the buckets too: no
      second copy whatever the accumulation;
    - FSDP2 (ZeRO-2/3): parameters are all-gathered directly in 16-bit, so nothing is cast.
      ZeRO-3 holds the gathered 16-bit weights of the current and the prefetched block, ZeRO-2
      the whole stage's; both hold the root module's gathered weights (embedding, final norm,
      head: the root spans the whole forward and backward), the head's 16-bit unsharded gradient
      (computed first in backward, reduce-scattered with the root's at the end), and one block's
      unsharded 16-bit gradients with their fp32 reduce-scatter input. With grad_accum > 1 the
      gradients are reduced at the step's last micro-batch only (lmforge.parallel.fsdp), so every
      rank holds the unsharded fp32 gradients of its stage between micro-batches, 4 B/param
      (`fsdp_accumulated_gradients`), unless `fsdp_reduce_every_micro_batch` (the layout key
      reduce_every=1; not with pp > 1) reduce-scatters after every micro-batch. Under a pipeline
      torch's schedule also keeps each stage's gathered 16-bit weights from one micro-batch's
      backward to the next forward, so ZeRO-3 holds the whole stage's there, as ZeRO-2 does;
    - fp32 runs: no 16-bit copies (FSDP2 gathers fp32 weights instead).
    Activations are counted tensor by tensor from what autograd saves under bf16 autocast with
    `scaled_dot_product_attention` (no s^2 term, no dropout): per layer
    sbh(8 [fp32 inputs of the two norms] + 6 [16-bit copies fed to q/k/v; 2 for a fused wqkv] + 4 + 4r [q, k, v,
    attention output] + 8 if RMSNorm [its fp32 outputs] + 2 if RoPE [wo input copy] + MLP),
    (fp32 runs: every 2 is a 4, and the casts fed to the projections are the two norm outputs
    themselves, 8 in all),
    MLP = 8F + 4 (SwiGLU) or 4F + 2 (GELU), plus norm statistics and the attention log-sum-exp
    (4bas); full recompute keeps the fp32 block input, 4sbh. Outside the blocks: token ids, the
    final norm, and the output head + loss below. These are byte-exact against autograd's saved
    tensors on CPU (tests); CUDA kernels may differ slightly. Per-block torch.compile (layout
    compile, train.compile) saves less: Inductor's partitioner recomputes the RMSNorm outputs,
    SwiGLU's silu(gate) and the residual after attention and casts each norm output once, (12 + 2F)
    h bytes fewer per token for a Llama block under autocast, 2h for GPT-2's
    (`lmforge.plan.activations.lmforge_activation_per_layer` states the rule; byte-exact on the CPU:
    tests/test_plan_compiled_block.py).
    Gated DeltaNet blocks (model.layer_types' 'linear_attention', hybrid models) keep the same norms and
    MLP, their input cast once per projection (q, k, v, z, beta, decay) and, in place of attention's, what
    the chunked delta rule keeps (`lmforge.plan.activations.deltanet_mixer_bytes`: the padded q, k, v,
    per chunk C x C decays, products and the triangular system, each chunk's state, the 16-bit casts of
    its matmuls' operands; byte-exact on the CPU in fp32 and bf16, eager, without and with selective
    recompute); a stage sums its blocks of each kind (`layer_kinds`).

    The output head and the loss (`lmforge_loss_bytes`; n = sb tokens of the micro-batch, V the
    vocabulary, d the width, c = min(train.loss_chunk, n), `half` = 2, 4 in fp32 runs; what is
    kept for backward goes into the activations, the loss's worst moment on top of it into the
    buffer `loss_transient`, once per step whatever the micro-batches in flight). The layout's
    `loss_chunk` is train.loss_chunk as lmforge resolves it on CUDA (`planned_loss_chunk`):
    - plain logits (loss_chunk = 0; every layout with tp or pp > 1): the head's matmul keeps its
      16-bit input (half sbh), F.cross_entropy keeps the fp32 log-softmax, 4nV (/t under TP), and
      nll_loss a 4-byte total weight. Forward holds the 16-bit logits and their fp32 copy briefly
      (half + 4 bytes a logit), but backward holds more: nll_loss's backward makes a dense fp32
      gradient of the log-softmax, and log_softmax's backward the fp32 gradient of the logits,
      both while the kept log-softmax is alive: transient 8nV (/t);
    - chunked (loss_chunk = c > 0; `lmforge.model.loss.linear_cross_entropy_sum`, on CUDA with
      its compiled per-chunk elementwise part, no fp32 [c, V] buffer): no logits are kept and the
      head's input is not copied; kept are grad_hidden, the size of the head's fp32 input (4nd),
      and grad_weight in fp32 (4Vd). Transient: the worst of (a) a chunk's 16-bit logits and
      gradient, c(2 half V + half d) (half d: its hidden rows cast to 16 bits; a view in fp32; a
      chunk's buffers are freed before the next chunk's logits are made); and in 16-bit runs (b)
      the weight-gradient product g^T h made in 16 bits before it is added to the fp32
      grad_weight, c(half V + 2 half d) + half Vd, and (c) backward's 16-bit weight gradient
      (the head's 16-bit copy) beside its fp32 cast, 2Vd. The fp32 eager path that CPUs run
      holds the same buffers (tests/test_plan_loss_chunk.py measures them); CPU bf16 runs hold
      fp32 [c, V] buffers the planner does not plan for.
    Under TP only the tensor-parallel parts are divided by t: SP's sharding of the norms' inputs
    is not credited yet (an overestimate). ZeRO-1 without FSDP2 (plain data parallelism) is torch's
    ZeroRedundancyOptimizer, which gives each rank whole tensors' state: the planner replays its
    partition (lmforge.plan.model_states.zero1_state_per_rank) and plans the fullest rank (on a small
    model the embedding alone can outweigh an even share).

Precision "bf16-pure" (`Layout.precision`, lmforge.train.precision): bf16 weights and activations over
fp32 master weights and fp32 "main" gradients. In the lmforge convention, as lmforge allocates it (and
`lmforge plan --verify` measures it): the fp32 parameters are the master weights (4 B/param, sharded as
in autocast: FSDP2 shards them, ZeRO-1 shards the optimizer state only), gradients 4, the optimizer state;
the bf16 weights are the step's copy of every parameter but the embeddings' (`bf16_pure_weight_copies`,
2 B/param, held for the step, not under FSDP2, which gathers in bf16 itself): 4 + 4 + 2 + Adam's 8 =
Megatron's 18 B/param without sharding; the residual stream and the norms' inputs and outputs in bf16
(2 bytes where autocast keeps 4; a norm's output feeds its projections as it is, no casts). The
literature conventions count it as bf16 (Megatron's 18 B/param is this mode, its master weights
sharded with the optimizer state by the distributed optimizer).

Context parallelism (`cp`, lmforge.parallel.context_parallel; all conventions): a CP rank holds
seq_len / cp tokens of every sequence (chunks i and 2cp-1-i) and all-gathers the K and V of the
whole sequence in every layer, saving them for backward. Per layer it keeps (A - KV) / cp + KV
(`lmforge.spec.parallel.cp_activation_bytes`; A the layer's bytes for whole sequences, KV
their K/V, `cp_kv_bytes`: 2 b s (kv heads / t) head_dim x 2 bytes, 4 in fp32); full recompute
A / cp. Outside the blocks everything is per rank (s / cp tokens); in lmforge the rank's token
ids and targets are separate tensors (its chunks) and each stage indexes its rows of the RoPE
tables. The attention builds no mask and keeps no score matrix (flash attention on CUDA, flash
attention for CPU over each chunk's prefix and diagonal block: output and log-sum-exp, as without
CP; CUDA's fallbacks, K/V expanded to the query heads for fp32 GQA or the math kernel, are not
counted). Byte-exact against what autograd saves on a CP rank (the probe of
tests/test_parallel_cp.py, reproduced in tests/test_plan_cp.py). The CP ranks hold the same
parameters and average gradients with the data-parallel ones, so ZeRO / FSDP shard over dp x cp
(Megatron's distributed optimizer shards over its dp x cp group too).

Document masking (`Layout.documents`, data.attention = "document"; lmforge convention only):
lmforge.plan.documents. The dense SDPA mask (B T^2 bytes per micro-batch in flight) and, per block
whose attention is not recomputed, SDPA's additive copy of it saved for backward (a B T^2, a the
attention dtype's bytes; under CP each rank's (2cp + 1) c^2 pairs); FlexAttention's block mask is a
few int32 tensors of blocks. Byte-exact against SDPA's saved tensors on CPU (tests/test_plan_documents.py).

Common to all: tied embeddings count once (a pipeline's last stage keeps its own copy of a tied
embedding, as Megatron does); TP shards q/k/v/gate/up/fc by rows (dim 0, biases too),
wo/down/proj by columns (dim 1, bias replicated), the embedding and output head by vocabulary
rows, and replicates norms and a learned position table. PP puts the embedding on stage 0 and
the final norm + head on the last stage; the report is for the worst stage. In flight on stage 0:
GPipe all m micro-batches, 1F1B min(p, m), interleaved 1F1B p(1 + (p-1)/(pv)) micro-batches of
its layers. CPU offload moves master weights and optimizer states (and, with ZeRO-3 or lmforge's
FSDP2, the sharded weights and gradients, as FSDP2's CPUOffloadPolicy does) to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.config import ModelConfig
from lmforge.plan.activations import (activation_bytes_per_layer, layer_kinds, megatron_sp_formula,
                                      micro_batches_in_flight, outside_blocks)
from lmforge.plan.buffers import literature_buffers, lmforge_buffers, phase_peaks
from lmforge.plan.conventions import COMPONENTS, CONVENTIONS, MEGATRON_ALLOWANCE, MODEL_STATES, check_convention
from lmforge.plan.documents import document_bias_bytes_per_layer, document_mask_bytes
from lmforge.plan.layout import Layout, planned_loss_chunk
from lmforge.plan.loss_memory import lmforge_loss_bytes
from lmforge.plan.model_states import lmforge_state_bytes, model_state_bytes_per_param, normalise_optimizer, stage_states
from lmforge.plan.params import fsdp_shard_shape, is_hidden_matrix, param_specs, stage_specs, total_params, tp_shape

# The estimator's parts live one concern a module (conventions, layout, params, model_states, activations,
# loss_memory, buffers); the names its callers use are re-exported here.
__all__ = [
    "CONVENTIONS", "Layout", "MemoryBreakdown", "activation_bytes_per_layer", "check_convention", "estimate_memory",
    "fsdp_shard_shape", "is_hidden_matrix", "lmforge_loss_bytes", "lmforge_state_bytes", "model_state_bytes_per_param",
    "param_specs", "phase_peaks", "planned_loss_chunk", "stage_specs", "total_params", "tp_shape",
]


@dataclass
class MemoryBreakdown:
    """Bytes per GPU (the worst pipeline stage) by component, and bytes kept in host memory."""

    model: str
    layout: Layout
    optimizer: str
    seq_len: int
    convention: str
    params_total: int                      # unique parameters of the model
    params_per_rank: float                 # parameters held (unsharded by ZeRO) on this rank
    stage: int
    weights: float = 0.0
    gradients: float = 0.0
    master_weights: float = 0.0
    optimizer_states: float = 0.0
    ema: float = 0.0                       # the EMA of the weights (layout.ema), fp32, held like the weights
    activations: float = 0.0
    buffers: float = 0.0
    cpu_bytes: float = 0.0
    fused_attention: bool = True
    detail: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # lmforge: peak per GPU outside the step (`phase_peaks`)

    @property
    def model_states(self) -> float:
        return sum(getattr(self, c) for c in MODEL_STATES)

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "convention": self.convention, "optimizer": self.optimizer,
            "seq_len": self.seq_len, "layout": self.layout.to_dict(), "stage": self.stage,
            "fused_attention": self.fused_attention,
            "params_total": self.params_total, "params_per_rank": self.params_per_rank,
            "bytes": {c: getattr(self, c) for c in COMPONENTS} | {"model_states": self.model_states,
                                                                   "total": self.total, "cpu": self.cpu_bytes},
            "bytes_per_param": {c: getattr(self, c) / self.params_total for c in MODEL_STATES}
            | {"model_states": self.model_states / self.params_total},
            "detail": dict(self.detail), "phases": dict(self.phases),
        }

    def table(self) -> str:
        """A table like the ones in the ZeRO / Korthikanti papers: GB and bytes/param per component."""
        n = self.params_total
        rows = [("component", "GB/GPU", "bytes/param")]
        for c in COMPONENTS:
            v = getattr(self, c)
            if c == "ema" and not v:
                continue
            rows.append((c.replace("_", " "), f"{v / 1e9:,.2f}", f"{v / n:.3f}" if c in MODEL_STATES else ""))
        rows.append(("model states", f"{self.model_states / 1e9:,.2f}", f"{self.model_states / n:.3f}"))
        rows.append(("TOTAL per GPU", f"{self.total / 1e9:,.2f}", ""))
        if self.cpu_bytes:
            rows.append(("host (CPU offload)", f"{self.cpu_bytes / 1e9:,.2f}", ""))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        head = (f"{self.model}: {n / 1e9:.3f}B params, {self.optimizer}, {self.layout.precision}, "
                f"seq {self.seq_len}, {self.layout.short()}, convention={self.convention}, stage {self.stage}")
        lines = [head]
        for i, r in enumerate(rows):
            lines.append(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}")
            if i == 0 or r[0] == "buffers":
                lines.append("  " + "-" * (w[0] + w[1] + w[2] + 4))
        return "\n".join(lines)


def _stage_breakdown(cfg: ModelConfig, layout: Layout, opt: str, seq_len: int, convention: str, stage: int,
                     fused_attention: bool) -> tuple[dict[str, float], float, float, dict[str, float]]:
    states = stage_states(cfg, layout, opt, convention, stage)
    comp = dict.fromkeys(COMPONENTS, 0.0)
    for c, v in states.comp:
        comp[c] += v
    detail: dict[str, float] = {}
    cpu = 0.0
    if layout.cpu_offload:  # host offload (lmforge: FSDP2's CPUOffloadPolicy moves every sharded state)
        sharded_too = layout.zero == 3 or (convention == "lmforge" and layout.fsdp)
        moved = ["master_weights", "optimizer_states"] + (["weights", "gradients"] if sharded_too else [])
        for c in moved:
            cpu += comp[c]
            comp[c] = 0.0
    # Activations: the stage's blocks by kind (recomputed or not; attention or Gated DeltaNet), each kind's
    # per-layer bytes times its count
    kinds = layer_kinds(cfg, layout, stage)
    fixed = layout.ac in ("full", "every_k")  # (else the layout's own mode for every block: none or selective)
    blocks = sum(count * activation_bytes_per_layer(cfg, layout, seq_len, convention, checkpointed if fixed else None,
                                                    fused_attention, linear)
                 for (checkpointed, linear), count in kinds.items())
    extras = outside_blocks(cfg, layout, seq_len, convention, stage)
    in_flight = micro_batches_in_flight(layout, stage)
    if convention == "lmforge" and layout.documents != "none":  # data.attention = "document" (plan/documents.py)
        # SDPA's additive copy of the mask, saved by each attention block that is not recomputed
        saving = sum(count for (checkpointed, linear), count in kinds.items() if not (checkpointed or linear))
        detail["document_mask_bias"] = in_flight * saving * document_bias_bytes_per_layer(layout, seq_len)
        detail["document_mask"] = in_flight * document_mask_bytes(layout, seq_len)
        blocks += saving * document_bias_bytes_per_layer(layout, seq_len)
        extras["document_mask"] = document_mask_bytes(layout, seq_len)
    # the head's activations: one micro-batch's (1F1B runs its backward at once), but all of GPipe's, and
    # a zero-bubble schedule keeps every micro-batch's graph until its weight-gradient pass
    last_in_flight = in_flight if layout.pp > 1 and (layout.pp_schedule == "gpipe" or layout.split_backward) else 1.0
    comp["activations"] = (in_flight * (blocks + extras.get("embedding", 0.0) + extras.get("positions", 0.0)
                                        + extras.get("document_mask", 0.0))
                           + last_in_flight * extras.get("output", 0.0))
    detail["activations_blocks"] = in_flight * blocks
    detail["activations_outside_blocks"] = comp["activations"] - detail["activations_blocks"]
    if convention == "megatron" and not megatron_sp_formula(layout):
        # Megatron's formula "without SP" adds 5% of the activations for temporaries
        detail["activations_temporaries_allowance"] = (MEGATRON_ALLOWANCE - 1) * comp["activations"]
        comp["activations"] *= MEGATRON_ALLOWANCE
    detail["micro_batches_in_flight"] = in_flight
    # Buffers.
    if convention == "lmforge":
        buffers = lmforge_buffers(cfg, layout, states, seq_len)
        if layout.holds_last(stage):
            buffers["loss_transient"] = lmforge_loss_bytes(cfg, layout, seq_len)[1]
    else:
        buffers = literature_buffers(layout, states, convention)
    detail.update(buffers)
    comp["buffers"] = sum(buffers.values())
    if convention == "lmforge":
        detail.update({f"phase_{k}": v for k, v in phase_peaks(cfg, layout, seq_len, stage, comp, buffers).items()})
    return comp, cpu, states.params, detail


def estimate_memory(model_cfg: ModelConfig, layout: Layout, optimizer: str = "adamw", seq_len: int | None = None,
                    weights: str = "lmforge", model_name: str = "model", fused_attention: bool = True
                    ) -> MemoryBreakdown:
    """Bytes per GPU for `model_cfg` trained with `optimizer` under `layout`, worst pipeline stage.

    `weights` picks the convention: "lmforge" (what lmforge allocates), "megatron" (Megatron-LM's
    estimator: 18 B/param for bf16 Adam, its activation formula) or "zero-paper" (the ZeRO paper's
    16 B/param, Korthikanti's activations). `fused_attention`
    (the literature conventions only; lmforge always uses SDPA): False keeps Korthikanti's
    [s, s] score term. See the module docstring for every formula.
    """
    check_convention(weights)
    opt = normalise_optimizer(optimizer)
    seq_len = model_cfg.max_seq_len if seq_len is None else int(seq_len)
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} must be >= 1")
    layout.validate(model_cfg, seq_len)
    n_total = total_params(model_cfg)
    best = None
    for stage in sorted({0, layout.pp - 1}):
        comp, cpu, params_here, detail = _stage_breakdown(model_cfg, layout, opt, seq_len, weights, stage,
                                                          fused_attention)
        total = sum(comp.values())
        if best is None or total > best[0]:
            best = (total, stage, comp, cpu, params_here, detail)
    _, stage, comp, cpu, params_here, detail = best
    phases = {k.removeprefix("phase_"): detail.pop(k) for k in list(detail) if k.startswith("phase_")}
    return MemoryBreakdown(model=model_name, layout=layout, optimizer=opt, seq_len=seq_len, convention=weights,
                           params_total=n_total, params_per_rank=params_here, stage=stage, cpu_bytes=cpu,
                           fused_attention=fused_attention or weights == "lmforge", detail=detail, phases=phases,
                           **comp)
