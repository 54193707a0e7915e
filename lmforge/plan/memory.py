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
    tensors on CPU (tests); CUDA kernels may differ slightly, and per-block torch.compile saves
    less than eager autograd (benchmarks/plan_activation_check.py measures it).

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
    is not credited yet (an overestimate), and ZeRO-1's optimizer shard is taken as FSDP's even
    chunk (ZeroRedundancyOptimizer assigns whole tensors, so its worst rank may hold slightly more).

Context parallelism (`cp`, lmforge.parallel.context_parallel; all conventions): a CP rank holds
seq_len / cp tokens of every sequence (chunks i and 2cp-1-i) and all-gathers the K and V of the
whole sequence in every layer, saving them for backward. Per layer it keeps (A - KV) / cp + KV
(`lmforge.parallel.formulas.cp_activation_bytes`; A the layer's bytes for whole sequences, KV
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

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lmforge.config import ModelConfig
from lmforge.config.base import divisors
from lmforge.config.rules import resolve_loss_chunk
from lmforge.model.accounting import mlp_activation_width
from lmforge.optim.registry import REGISTRY
from lmforge.optim.state_memory import OPTIMIZER_NAMES, optimizer_state_bytes_per_param
from lmforge.parallel.formulas import cp_activation_bytes, cp_kv_bytes, cp_score_elements, recomputed_layers

AC_MODES = ("none", "full", "every_k", "selective")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
CONVENTIONS = ("lmforge", "megatron", "zero-paper")
LITERATURE = ("megatron", "zero-paper")
COMPONENTS = ("weights", "gradients", "master_weights", "optimizer_states", "activations", "buffers")
MEGATRON_ALLOWANCE = 1.05  # Megatron's activation formula "without SP": x 1.05 for temporaries

# Optimizer spelling accepted by the planner -> lmforge.optim name.
_OPT_ALIASES = {"8bit-adam": "adam8bit", "adam-8bit": "adam8bit", "adamw8bit": "adam8bit", "sgdm": "momentum"}


def normalise_optimizer(name: str) -> str:
    key = name.strip().lower()
    key = _OPT_ALIASES.get(key, key)
    if key not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    return key


def check_convention(name: str) -> str:
    """`name` if it is a memory convention, else a ValueError listing them."""
    if name not in CONVENTIONS:
        raise ValueError(f"memory convention {name!r} is not one of {', '.join(CONVENTIONS)}")
    return name


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """A parallel layout. world size = dp x cp x tp x pp; global batch = micro_batch x grad_accum x dp
    sequences (with pipelining, grad_accum is the number of micro-batches m per step). The cp ranks
    of a context-parallel layout share each sequence (2 chunks each) and average their gradients
    with the dp ones, so ZeRO / FSDP shard over dp x cp (`shard_ranks`)."""

    dp: int = 1
    zero: int = 0                 # 0 = DDP (replicated), 1, 2, 3 (= FSDP full sharding)
    cp: int = 1                   # context parallelism (lmforge.parallel.context_parallel)
    tp: int = 1
    sp: bool = False              # sequence parallelism (with tp > 1)
    pp: int = 1
    pp_schedule: str = "1f1b"     # gpipe | 1f1b | interleaved
    virtual_stages: int = 1       # interleaved: model chunks per pipeline rank (v)
    micro_batch: int = 1
    grad_accum: int = 1
    ac: str = "none"              # none | full | every_k | selective
    ac_every: int = 2
    cpu_offload: bool = False
    precision: str = "bf16"       # bf16 | fp16 | fp32 | fp8
    fsdp_reduce_every_micro_batch: bool = False  # FSDP2: reduce-scatter after every micro-batch (not pp > 1)
    ep: int = 1                   # expert parallelism (MoE): experts split over ep of the dp ranks
    loss_chunk: int = 0           # train.loss_chunk as resolved (`planned_loss_chunk`): 0 = plain logits +
    #                               F.cross_entropy, N = the head fused with the loss over N-token chunks

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def shard_ranks(self) -> int:
        """The ranks that average gradients, and that ZeRO / FSDP shard over: dp x cp."""
        return self.dp * self.cp

    @property
    def fsdp(self) -> bool:
        """Parameters sharded over dp x cp (ZeRO-2/3 = FSDP2 `fully_shard` in lmforge)."""
        return self.zero >= 2 and self.shard_ranks > 1

    def validate(self, model_cfg: ModelConfig | None = None, seq_len: int | None = None) -> "Layout":
        """Check the values, then (given) against the model and the sequence length: the rules of
        lmforge's config (tp divides the heads, pp x v the layers, cp divides seq_len / 2, and with
        SP tp divides seq_len / cp)."""
        for key in ("dp", "cp", "tp", "pp", "virtual_stages", "micro_batch", "grad_accum", "ac_every", "ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {key} = {value!r} must be an integer >= 1")
        if not isinstance(self.loss_chunk, int) or isinstance(self.loss_chunk, bool) or self.loss_chunk < 0:
            raise ValueError(f"layout loss_chunk = {self.loss_chunk!r} must be an integer >= 0 (0 = the plain "
                             f"logits; N = the cross-entropy fused with the head over N-token chunks)")
        if self.loss_chunk and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"layout loss_chunk = {self.loss_chunk} needs tp = pp = 1 (lmforge runs the chunked "
                             f"loss only there, as train.loss_chunk does); set loss_chunk=0 with tp = {self.tp}, "
                             f"pp = {self.pp}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"layout zero = {self.zero!r} must be 0, 1, 2 or 3")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"layout pp_schedule = {self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        if self.ac not in AC_MODES:
            raise ValueError(f"layout ac = {self.ac!r} is not one of {', '.join(AC_MODES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"layout precision = {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.sp and self.tp < 2:
            raise ValueError(f"layout sp = 1 needs tp >= 2 (sequence parallelism shards activations over the "
                             f"tensor-parallel ranks), got tp = {self.tp}; set tp= or drop sp=1")
        if self.virtual_stages > 1 and self.pp_schedule != "interleaved":
            raise ValueError(f"layout virtual_stages = {self.virtual_stages} needs pp_schedule = interleaved")
        if self.fsdp_reduce_every_micro_batch and self.pp > 1:
            raise ValueError("layout reduce_every = 1 needs pp = 1: torch's pipeline schedule reduces FSDP2's "
                             "gradients once per step; drop reduce_every=1")
        if self.ep > 1 and self.dp % self.ep:
            raise ValueError(f"layout ep = {self.ep} must divide dp = {self.dp} (expert parallelism borrows "
                             f"data-parallel ranks)")
        if model_cfg is not None:
            if self.ep > 1 and (not model_cfg.moe.enabled or model_cfg.moe.num_experts % self.ep):
                raise ValueError(f"layout ep = {self.ep} must divide the model's routed experts "
                                 f"({model_cfg.moe.num_experts}); a dense model takes ep = 1")
            if model_cfg.n_heads % self.tp or model_cfg.kv_heads % self.tp:
                raise ValueError(f"layout tp = {self.tp} must divide n_heads = {model_cfg.n_heads} "
                                 f"and kv heads = {model_cfg.kv_heads}")
            if model_cfg.n_layers % (self.pp * self.virtual_stages):
                raise ValueError(f"layout pp = {self.pp} (x virtual stages {self.virtual_stages}) must divide "
                                 f"n_layers = {model_cfg.n_layers}")
        if seq_len is not None and self.cp > 1:
            if seq_len % (2 * self.cp):
                ok = [k for k in divisors(seq_len // 2) if k > 1][:6] if seq_len % 2 == 0 else []
                hint = f"choose cp among {ok}" if ok else "use an even sequence length"
                raise ValueError(f"layout cp = {self.cp} must divide seq_len / 2 = {seq_len / 2:g}: context "
                                 f"parallelism cuts each sequence into 2 x cp = {2 * self.cp} equal chunks (rank i "
                                 f"keeps chunks i and 2cp-1-i); {hint}, or change --seq-len")
            if self.sp and (seq_len // self.cp) % self.tp:
                raise ValueError(f"layout sp = 1 with cp = {self.cp}: each CP rank's {seq_len // self.cp} tokens "
                                 f"(seq_len / cp) must be divisible by tp = {self.tp}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def short(self) -> str:
        cp = f",cp={self.cp}" if self.cp > 1 else ""
        s = (f"dp={self.dp},zero={self.zero}{cp},tp={self.tp},pp={self.pp},mb={self.micro_batch},ga={self.grad_accum},"
             f"ac={self.ac}")
        if self.sp:
            s += ",sp=1"
        if self.pp > 1:
            s += f",sched={self.pp_schedule}"
            if self.virtual_stages > 1:
                s += f",v={self.virtual_stages}"
        if self.cpu_offload:
            s += ",offload=1"
        if self.fsdp_reduce_every_micro_batch:
            s += ",reduce_every=1"
        if self.ep > 1:
            s += f",ep={self.ep}"
        if self.loss_chunk:
            s += f",loss_chunk={self.loss_chunk}"
        return s

    _KEYS = {"dp": "dp", "zero": "zero", "cp": "cp", "tp": "tp", "sp": "sp", "pp": "pp", "sched": "pp_schedule",
             "pp_schedule": "pp_schedule", "schedule": "pp_schedule", "v": "virtual_stages",
             "virtual_stages": "virtual_stages", "mb": "micro_batch", "micro_batch": "micro_batch",
             "ga": "grad_accum", "grad_accum": "grad_accum", "m": "grad_accum", "ac": "ac",
             "ac_every": "ac_every", "offload": "cpu_offload", "cpu_offload": "cpu_offload",
             "precision": "precision", "dtype": "precision", "reduce_every": "fsdp_reduce_every_micro_batch",
             "fsdp_reduce_every_micro_batch": "fsdp_reduce_every_micro_batch", "ep": "ep",
             "loss_chunk": "loss_chunk"}

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> "Layout":
        """Parse "dp=8,zero=3,cp=1,tp=1,pp=1,mb=1,ac=full" (keys: dp zero cp tp sp pp sched v mb ga ac
        ac_every offload precision reduce_every ep loss_chunk); unknown keys or bad values raise
        ValueError naming them."""
        kw: dict[str, Any] = dict(defaults)
        for item in filter(None, (p.strip() for p in (text or "").split(","))):
            if "=" not in item:
                raise ValueError(f"layout item {item!r} must be key=value (e.g. dp=8)")
            key, value = (s.strip() for s in item.split("=", 1))
            field_name = cls._KEYS.get(key.lower())
            if field_name is None:
                raise ValueError(f"unknown layout key {key!r}; valid: {', '.join(sorted(set(cls._KEYS)))}")
            if field_name in ("sp", "cpu_offload", "fsdp_reduce_every_micro_batch"):
                if value.lower() not in ("0", "1", "true", "false", "yes", "no"):
                    raise ValueError(f"layout {key} = {value!r} must be 0/1/true/false")
                kw[field_name] = value.lower() in ("1", "true", "yes")
            elif field_name in ("pp_schedule", "ac", "precision"):
                kw[field_name] = value.lower()
            else:
                try:
                    kw[field_name] = int(value)
                except ValueError:
                    raise ValueError(f"layout {key} = {value!r} must be an integer") from None
        return cls(**kw).validate()


def planned_loss_chunk(config, precision: str, tp: int = 1, pp: int = 1) -> int:
    """`Layout.loss_chunk` for a run of `config` (a `lmforge.config.Config`) on GPUs in `precision`
    under tp / pp: train.loss_chunk as lmforge resolves it on CUDA
    (`lmforge.config.rules.resolve_loss_chunk`: "auto" = 4096-token chunks for a vocabulary of at
    least 8192), and 0 where the layout has tp > 1 or pp > 1 (lmforge runs the plain logits there)."""
    if tp > 1 or pp > 1:
        return 0
    return resolve_loss_chunk(config, "cuda", precision)


# --------------------------------------------------------------------------------------------
# Parameter tensors from the config (no torch)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model: name (as in `named_parameters`), shape, where it lives
    (stage "first"/"last"/"block"), its block index, how TP splits it (None, 0 or 1)."""

    name: str
    shape: tuple[int, ...]
    where: str
    layer: int = -1
    tp_dim: int | None = None
    is_embedding: bool = False
    matmul: bool = False          # an input of a Linear (weight or bias): the step casts it to 16-bit
    expert: bool = False          # routed experts (MoE; experts along dim 0): split over layout.ep

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_SPEC_CACHE: dict[tuple, tuple[ParamSpec, ...]] = {}
_TOTAL_CACHE: dict[tuple, int] = {}


def cfg_key(cfg) -> tuple:
    """A hashable key of a model config (for the planner's caches; nested sections such as model.moe
    as tuples too)."""
    return tuple(cfg_key(v) if dataclasses.is_dataclass(v) else v
                 for v in (getattr(cfg, f.name) for f in dataclasses.fields(cfg)))


def total_params(cfg: ModelConfig) -> int:
    """Unique parameters (tied embedding once), from the config."""
    key = cfg_key(cfg)
    if key not in _TOTAL_CACHE:
        _TOTAL_CACHE[key] = sum(s.numel for s in param_specs(cfg))
    return _TOTAL_CACHE[key]


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """The model's parameter tensors, in `named_parameters()` order, tied embeddings once."""
    key = cfg_key(cfg)
    if key not in _SPEC_CACHE:
        if len(_SPEC_CACHE) > 64:
            _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = tuple(_param_specs(cfg))
    return list(_SPEC_CACHE[key])


def _param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    out: list[ParamSpec] = [ParamSpec("tok_emb.weight", (cfg.vocab_size, d), "first", tp_dim=0, is_embedding=True)]
    if cfg.pos_emb == "learned":
        out.append(ParamSpec("pos_emb.weight", (cfg.max_seq_len, d), "first", is_embedding=True))

    def norm(prefix: str, where: str, layer: int = -1) -> list[ParamSpec]:
        specs = [ParamSpec(f"{prefix}.weight", (d,), where, layer)]
        if cfg.norm == "layernorm" and cfg.bias:
            specs.append(ParamSpec(f"{prefix}.bias", (d,), where, layer))
        return specs

    def linear(prefix: str, n_in: int, n_out: int, tp_dim: int, layer: int, bias: bool | None = None) -> list[ParamSpec]:
        specs = [ParamSpec(f"{prefix}.weight", (n_out, n_in), "block", layer, tp_dim, matmul=True)]
        if cfg.bias if bias is None else bias:
            specs.append(ParamSpec(f"{prefix}.bias", (n_out,), "block", layer, 0 if tp_dim == 0 else None,
                                   matmul=True))
        return specs

    for i in range(cfg.n_layers):
        p = f"blocks.{i}"
        out += norm(f"{p}.attn_norm", "block", i)
        if cfg.fused_qkv:  # one attn.wqkv (lmforge.model.layers.qkv_layout), column-split like the three
            out += linear(f"{p}.attn.wqkv", d, (cfg.n_heads + 2 * cfg.kv_heads) * hd, 0, i, cfg.attn_qkv_bias)
        else:
            out += linear(f"{p}.attn.wq", d, cfg.n_heads * hd, 0, i, cfg.attn_qkv_bias)
            out += linear(f"{p}.attn.wk", d, cfg.kv_heads * hd, 0, i, cfg.attn_qkv_bias)
            out += linear(f"{p}.attn.wv", d, cfg.kv_heads * hd, 0, i, cfg.attn_qkv_bias)
        out += linear(f"{p}.attn.wo", cfg.n_heads * hd, d, 1, i)
        if cfg.qk_norm:  # (head_dim each, replicated under TP)
            out += [ParamSpec(f"{p}.attn.{n}.weight", (hd,), "block", i) for n in ("q_norm", "k_norm")]
        out += norm(f"{p}.mlp_norm", "block", i)
        if cfg.moe.is_moe_layer(i):  # lmforge.model.moe: router, stacked experts, shared experts; no TP split
            m, he = cfg.moe, cfg.moe.expert_hidden or f
            out.append(ParamSpec(f"{p}.mlp.router.weight", (m.num_experts, d), "block", i, matmul=True))
            for name, shape in (("w_gate", (d, he)), ("w_up", (d, he)), ("w_down", (he, d))):
                out.append(ParamSpec(f"{p}.mlp.experts.{name}", (m.num_experts, *shape), "block", i, matmul=True,
                                     expert=True))
            if m.shared_experts:
                hs = m.shared_experts * he
                out += [ParamSpec(f"{p}.mlp.shared.{n}.weight", sh, "block", i, matmul=True)
                        for n, sh in (("gate", (hs, d)), ("up", (hs, d)), ("down", (d, hs)))]
        elif cfg.activation == "swiglu":
            out += linear(f"{p}.mlp.gate", d, f, 0, i)
            out += linear(f"{p}.mlp.up", d, f, 0, i)
            out += linear(f"{p}.mlp.down", f, d, 1, i)
        else:
            out += linear(f"{p}.mlp.fc", d, f, 0, i)
            out += linear(f"{p}.mlp.proj", f, d, 1, i)
    out += norm("norm", "last")
    if not cfg.tie_embeddings:
        out.append(ParamSpec("lm_head.weight", (cfg.vocab_size, d), "last", tp_dim=0, matmul=True))
    return out


_STAGE_CACHE: dict[tuple, tuple[ParamSpec, ...]] = {}


def stage_specs(cfg: ModelConfig, pp: int, stage: int) -> list[ParamSpec]:
    """Parameters held by pipeline `stage` of `pp` (contiguous blocks; tied head copied to the last)."""
    key = (cfg_key(cfg), pp, stage)
    if key not in _STAGE_CACHE:
        if len(_STAGE_CACHE) > 1024:
            _STAGE_CACHE.clear()
        _STAGE_CACHE[key] = tuple(_stage_specs(cfg, pp, stage))
    return list(_STAGE_CACHE[key])


def _stage_specs(cfg: ModelConfig, pp: int, stage: int) -> list[ParamSpec]:
    per = cfg.n_layers // pp
    lo, hi = stage * per, (stage + 1) * per
    specs = []
    for s in param_specs(cfg):
        if s.where == "block" and lo <= s.layer < hi:
            specs.append(s)
        elif s.where == "first" and stage == 0:
            specs.append(s)
        elif s.where == "last" and stage == pp - 1:
            specs.append(s)
    if cfg.tie_embeddings and stage == pp - 1:
        head = ParamSpec("lm_head.weight", (cfg.vocab_size, cfg.dim), "last", tp_dim=0, is_embedding=True, matmul=True)
        if pp > 1:
            specs.append(head)  # the last stage's own copy of the tied embedding
    return specs


def tp_shape(spec: ParamSpec, tp: int, ep: int = 1) -> tuple[int, ...]:
    """A rank's part of `spec` under TP degree `tp` (and, for routed experts, EP degree `ep`)."""
    if spec.expert and ep > 1:
        return (math.ceil(spec.shape[0] / ep), *spec.shape[1:])
    if tp == 1 or spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] = math.ceil(shape[spec.tp_dim] / tp)
    return tuple(shape)


def fsdp_shard_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The padded per-rank shard of FSDP2 `fully_shard`: dim 0 chunked into ceil(dim0/n) rows."""
    if n == 1:
        return shape
    return (math.ceil(shape[0] / n), *shape[1:])


# --------------------------------------------------------------------------------------------
# Optimizer state per tensor
# --------------------------------------------------------------------------------------------


def is_hidden_matrix(spec: ParamSpec) -> bool:
    """A matrix that optimizers with a rule of their own for hidden matrices (Muon) treat as one:
    2-D, not an embedding, not the output head (lmforge.optim.muon's grouping)."""
    return len(spec.shape) >= 2 and not spec.is_embedding and "lm_head" not in spec.name


def lmforge_state_bytes(optimizer: str, spec: ParamSpec, shape: tuple[int, ...], *, block_size: int = 256,
                        min_8bit_size: int = 4096) -> int:
    """Exact bytes `lmforge.optim` keeps in `optimizer.state[p]` for a fp32 tensor of `shape`: the
    optimizer's `StateSize` in `lmforge.optim.registry` (state tensors, per-tensor `step` tensors,
    8-bit block padding and scales), as the implementations allocate them."""
    state = REGISTRY[normalise_optimizer(optimizer)].state
    return state.tensor_bytes(shape, hidden_matrix=is_hidden_matrix(spec), block_size=block_size,
                              min_8bit_size=min_8bit_size)


def literature_state_bytes_per_param(optimizer: str, shape: tuple[int, ...] | None = None) -> float:
    """fp32 optimizer state bytes per parameter (the literature convention; no per-tensor scalars;
    `shape` matters for factored state only; an optimizer with its own rule for hidden matrices
    is counted at its matrix figure)."""
    return optimizer_state_bytes_per_param(normalise_optimizer(optimizer), shape=shape)


def literature_parts(convention: str, precision: str, state_bytes: float) -> tuple[tuple[str, float, int], ...]:
    """Model-state bytes per parameter of a literature convention, as (component, bytes, the
    lowest ZeRO stage that shards it); `state_bytes` = the optimizer's fp32 state per parameter
    (Adam: 8). See the module docstring."""
    if precision == "fp32":  # no 16-bit copy, no separate master: 4 + 4 + state in both
        return (("weights", 4, 3), ("gradients", 4, 2), ("optimizer_states", state_bytes, 1))
    if convention == "zero-paper":
        return (("weights", 2, 3), ("gradients", 2, 2), ("master_weights", 4, 1), ("optimizer_states", state_bytes, 1))
    assert convention == "megatron", convention
    if precision == "fp16":  # fp16 gradients, plus an fp32 copy of them that the optimizer shards
        return (("weights", 2, 3), ("gradients", 2, 2), ("gradients", 4, 1), ("master_weights", 4, 1),
                ("optimizer_states", state_bytes, 1))
    return (("weights", 2, 3), ("gradients", 4, 2), ("master_weights", 4, 1), ("optimizer_states", state_bytes, 1))


def model_state_bytes_per_param(optimizer: str = "adamw", zero: int = 0, dp: int = 1, precision: str = "bf16",
                                convention: str = "zero-paper") -> float:
    """Bytes/param of weights + gradients + master + optimizer state per GPU for large matrices,
    in a literature convention (N = dp). zero-paper, mixed-precision Adam: 2 + 2 + 12 = 16;
    ZeRO-1 4 + 12/N; ZeRO-2 2 + 14/N; ZeRO-3 16/N. megatron, bf16 Adam: 2 + 4 + 12 = 18;
    distributed optimizer (ZeRO-1) 6 + 12/N; ZeRO-2 2 + 16/N; ZeRO-3 18/N. Other optimizers
    replace the 8 bytes of Adam's m and v by their own state."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero = {zero!r} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp = {dp} must be >= 1")
    if convention not in LITERATURE:
        raise ValueError(f"convention {convention!r} must be one of {', '.join(LITERATURE)} (lmforge's bytes "
                         f"depend on the tensor shapes: use estimate_memory)")
    parts = literature_parts(convention, precision, literature_state_bytes_per_param(optimizer))
    n = dp if zero else 1
    return sum(b / n if zero >= stage else b for _, b, stage in parts)


# --------------------------------------------------------------------------------------------
# Breakdown
# --------------------------------------------------------------------------------------------


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
    activations: float = 0.0
    buffers: float = 0.0
    cpu_bytes: float = 0.0
    fused_attention: bool = True
    detail: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # lmforge: peak per GPU outside the step (`phase_peaks`)

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.master_weights + self.optimizer_states

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
            "bytes_per_param": {c: getattr(self, c) / self.params_total for c in COMPONENTS[:4]}
            | {"model_states": self.model_states / self.params_total},
            "detail": dict(self.detail), "phases": dict(self.phases),
        }

    def table(self) -> str:
        """A table like the ones in the ZeRO / Korthikanti papers: GB and bytes/param per component."""
        n = self.params_total
        rows = [("component", "GB/GPU", "bytes/param")]
        for c in COMPONENTS:
            v = getattr(self, c)
            rows.append((c.replace("_", " "), f"{v / 1e9:,.2f}", f"{v / n:.3f}" if c in COMPONENTS[:4] else ""))
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


def _in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak."""
    p, m = layout.pp, layout.grad_accum
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    k = min(p - stage, m)  # 1F1B: stage i warms up with p - i forwards
    if layout.pp_schedule == "interleaved":
        return min(p * (1 + (p - 1) / (p * layout.virtual_stages)), float(m)) if stage == 0 else float(k)
    return float(k)


def _literature_activation_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, ac: str,
                                     fused_attention: bool) -> float:
    """Korthikanti et al.'s per-layer bytes, generalised to GQA and the MLP type (module docstring)."""
    s, b, h, a, t = seq_len, layout.micro_batch, cfg.dim, cfg.n_heads, layout.tp
    sbh = s * b * h
    sp_div = t if layout.sp else 1
    if ac == "full":
        return 2 * sbh / sp_div
    r = cfg.kv_heads / cfg.n_heads
    k_mlp = 6 if cfg.activation == "swiglu" else 4
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


def _lmforge_activation_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, ac: str) -> float:
    """Bytes autograd saves per layer under 16-bit autocast with SDPA (module docstring)."""
    s, b, h, a, t = seq_len, layout.micro_batch, cfg.dim, cfg.n_heads, layout.tp
    sbh = s * b * h
    half = 4 if layout.precision == "fp32" else 2
    r = cfg.kv_heads / cfg.n_heads
    F = mlp_activation_width(cfg) / h  # (MoE: the routed and shared experts' width per token)
    if ac == "full":
        return 4 * sbh  # the fp32 residual-stream input of the block
    norm_stats = (4 if cfg.norm == "rmsnorm" else 8) * s * b * 2
    lse = 4 * b * a * s / t
    if ac == "selective":  # outputs of the matmuls and attention, plus the block input
        mlp_out = (2 * F + 1) if cfg.activation == "swiglu" else (F + 1)
        return sbh * (4 + half * ((1 + 2 * r + 1 + 1) / t + mlp_out / t)) + lse
    resid = 8                                   # fp32 inputs of the two norms (block in, mid)
    normed = 8 if cfg.norm == "rmsnorm" else 0  # RMSNorm saves its fp32 output for the weight grad
    if layout.precision == "fp32":  # each norm's output feeds its projections as it is: 2 tensors
        casts = 8
    else:  # autocast casts the norm output once per projection: q, k, v (one fused wqkv: once) and fc1 (gate and up)
        casts = half * ((1 if cfg.fused_qkv else 3) + (2 if cfg.activation == "swiglu" else 1))
    attn = half * (1 + 2 * r + 1) / t           # q, k, v, attention output
    wo_in = half / t if cfg.pos_emb == "rope" else 0.0
    mlp = half * (4 * F if cfg.activation == "swiglu" else 2 * F) / t
    return sbh * (resid + normed + casts + attn + wo_in + mlp) + norm_stats + lse


def attention_dtype_bytes(layout: Layout) -> int:
    """Bytes of an element of q, k, v in lmforge's attention: 16-bit under autocast (fp8 runs keep
    attention in bf16), 4 in fp32 runs."""
    return 4 if layout.precision == "fp32" else 2


def cp_kv_layer_bytes(cfg: ModelConfig, layout: Layout, seq_len: int) -> int:
    """The K and V of one layer for the whole sequences of a micro-batch, on one (TP) rank: what a
    context-parallel rank all-gathers and saves (`lmforge.parallel.formulas.cp_kv_bytes`)."""
    return cp_kv_bytes(layout.micro_batch, seq_len, cfg.kv_heads, cfg.head_dim, attention_dtype_bytes(layout),
                       layout.tp)


def activation_bytes_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, convention: str,
                               checkpointed: bool | None = None, fused_attention: bool = True) -> float:
    """Activation bytes of one transformer layer for one micro-batch on one GPU. `checkpointed`
    overrides the layout's mode (True = full recompute, False = none); `fused_attention=False`
    gives the literature's unfused formula (with the 5as/h score term).

    Context parallelism (cp > 1): the rank holds 1/cp of every sequence's tokens but the K and V of
    the whole sequence (all-gathered, saved for backward): (A - KV) / cp + KV with A the layer's
    bytes for the whole sequence and KV its K/V (`lmforge.parallel.formulas.cp_activation_bytes`;
    every term of A is linear in the sequence length once attention is fused). Full recompute keeps
    only the block input of the rank's tokens, A / cp. The literature conventions count the same
    all-gather design (Llama 3's, Megatron's `--cp-comm-type allgather`) with their 16-bit K/V; their
    unfused [s, s] score term becomes the rank's c^2 (2cp + 1) scores per head (`cp_score_elements`)."""
    ac = layout.ac if checkpointed is None else ("full" if checkpointed else "none")
    if check_convention(convention) == "lmforge":
        whole = _lmforge_activation_per_layer(cfg, layout, seq_len, ac)
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
    return cp_activation_bytes(whole, kv, layout.cp) + scores * cp_score_elements(seq_len, layout.cp) / seq_len**2


def _extras(cfg: ModelConfig, layout: Layout, seq_len: int, convention: str, stage: int) -> dict[str, float]:
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
        if stage == layout.pp - 1:
            out["output"] = 4 * (sbh + s * b * V) / t if sp else 2 * (s * b * V / t + sbh)
        return out
    if convention in LITERATURE:
        sp_div = t if layout.sp else 1
        if stage == 0:
            out["embedding"] = sbh / sp_div  # dropout mask
        if stage == layout.pp - 1:
            out["output"] = 4 * sbh / sp_div + 4 * s * b * V / t  # final norm + head input, fp32 logits
        return out
    half = 4 if layout.precision == "fp32" else 2
    if stage == 0:
        out["embedding"] = 8 * s * b + (8 * s if cfg.pos_emb == "learned" else 0)  # int64 ids, positions
    layers = cfg.n_layers // layout.pp
    if layout.cp > 1 and cfg.pos_emb == "rope" and _checkpointed_layers(layout, layers) < layers:
        out["positions"] = 2 * s * (cfg.head_dim // 2) * 4  # this rank's rows of the cos / sin tables
    if stage == layout.pp - 1:
        normed = 4 if cfg.norm == "rmsnorm" else 0
        stats = (4 if cfg.norm == "rmsnorm" else 8) * s * b
        targets = 8 * s * b if layout.cp > 1 else 0  # (one process: a view of the ids' storage)
        kept, _ = lmforge_loss_bytes(cfg, layout, seq_len)
        if layout.loss_chunk:  # the head's input is read by the loss itself: no 16-bit copy saved
            out["output"] = sbh * (4 + normed) + stats + kept + targets
        else:  # + the head input's 16-bit copy, the fp32 log-softmax (kept) and nll_loss's fp32 total weight
            out["output"] = sbh * (4 + normed + half) + stats + kept + 4 + targets
    return out


def lmforge_loss_bytes(cfg: ModelConfig, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(kept, transient): bytes of the last stage's output head + cross-entropy for one micro-batch
    (lmforge convention): what it keeps for backward, and what it allocates on top of that at its
    worst moment (a peak of the step, counted once as the buffer `loss_transient`, whatever the
    micro-batches in flight). n = b s / cp tokens, V the vocabulary (/ t under TP), d the model
    width, c the chunk, `half` the compute dtype's bytes (4 in fp32 runs). Module docstring:
    "The output head and the loss"."""
    n = (seq_len // layout.cp) * layout.micro_batch
    V, d, t = cfg.vocab_size, cfg.dim, layout.tp
    half = 4 if layout.precision == "fp32" else 2
    if not layout.loss_chunk:
        # kept: the fp32 log-softmax; backward: nll_loss's dense fp32 gradient of it and log_softmax's
        # fp32 gradient of the logits, both alive with the kept one (more than the forward's 16-bit
        # logits + fp32 copy)
        return 4 * n * V / t, 8 * n * V / t
    c = min(layout.loss_chunk, n)
    kept = 4 * n * d + 4 * V * d  # grad_hidden (the fp32 norm output's size) and the fp32 grad_weight
    cast = half * d if half == 2 else 0  # a chunk's hidden rows in the compute dtype (fp32: a view)
    moments = [c * (2 * half * V + cast)]  # a chunk: its logits + its gradient (softmax - one_hot)
    if half == 2:
        # g.T @ hidden in 16 bits before it is added into the fp32 grad_weight; and in backward the
        # weight gradient returned in 16 bits (the head's 16-bit copy) beside its fp32 cast
        moments += [c * (half * V + cast + half * d) + half * V * d, 2 * V * d]
    return kept, max(moments)


@dataclass(frozen=True)
class _StageStates:
    """Model-state bytes of one pipeline stage on one rank, and the parameter counts (after TP,
    before ZeRO) that the buffers depend on."""

    comp: tuple[tuple[str, float], ...]
    params: float          # parameters of the stage on this TP rank
    matmul_16bit: float    # bytes of one 16-bit copy of its matmul weights (a tied head's included)
    layer_params: float    # one transformer block
    root_params: float     # outside the blocks: embedding, positions, final norm, head
    head_params: float     # the output projection (last stage), tied or not


_STATE_CACHE: dict[tuple, _StageStates] = {}


def _stage_states(cfg: ModelConfig, layout: Layout, opt: str, convention: str, stage: int) -> _StageStates:
    n_dp = layout.shard_ranks if layout.zero > 0 else 1  # (context parallel: dp x cp)
    key = (cfg_key(cfg), n_dp, layout.zero, layout.tp, layout.pp, layout.precision, opt, convention, stage, layout.ep)
    hit = _STATE_CACHE.get(key)
    if hit is not None:
        return hit
    comp = dict.fromkeys(COMPONENTS[:4], 0.0)
    params = matmul = layer = root = head = 0.0
    specs = stage_specs(cfg, layout.pp, stage)
    first_layer = stage * (cfg.n_layers // layout.pp)
    all_dp = n_dp
    for spec in specs:
        local = tp_shape(spec, layout.tp, layout.ep)
        full_n = math.prod(local)
        # routed experts under EP: E / ep of them per rank, sharded (ZeRO / FSDP2) over the dp / ep
        # ranks holding the same experts (lmforge.parallel.expert_parallel)
        n_dp = max(all_dp // layout.ep, 1) if spec.expert else all_dp
        params += full_n
        if spec.where == "block":
            layer += full_n if spec.layer == first_layer else 0
        else:
            root += full_n
        if "lm_head" in spec.name:
            head += full_n
        if spec.matmul:
            matmul += 2 * full_n
        if convention in LITERATURE:  # flat buffers sharded exactly
            state = literature_state_bytes_per_param(opt, local)
            for c, nbytes, zero_stage in literature_parts(convention, layout.precision, state):
                shard = n_dp if (layout.zero >= zero_stage and n_dp > 1) else 1
                comp[c] += nbytes * full_n / shard
            continue
        # lmforge: FSDP2 shards every tensor along dim 0; ZeroRedundancyOptimizer the state only
        shard_n = math.prod(fsdp_shard_shape(local, n_dp))
        comp["weights"] += 4 * (shard_n if layout.fsdp else full_n)
        comp["gradients"] += 4 * (shard_n if layout.fsdp else full_n)
        state_shape = fsdp_shard_shape(local, n_dp) if (layout.zero >= 1 and n_dp > 1) else local
        comp["optimizer_states"] += lmforge_state_bytes(opt, spec, state_shape)
    if cfg.tie_embeddings and layout.pp == 1:
        # the tied embedding is also the head: its matmul uses a 16-bit cast of the embedding
        emb = math.prod(tp_shape(specs[0], layout.tp))
        matmul += 2 * emb
        head += emb
    if len(_STATE_CACHE) > 4096:
        _STATE_CACHE.clear()
    hit = _StageStates(tuple(comp.items()), params, matmul, layer, root, head)
    _STATE_CACHE[key] = hit
    return hit


def _literature_buffers(layout: Layout, states: _StageStates, convention: str) -> dict[str, float]:
    """ZeRO-3: the gathered 16-bit weights of the current and the prefetched layer, and one
    layer's unsharded gradients before the reduce-scatter."""
    if not (layout.zero == 3 and layout.shard_ranks > 1):
        return {}
    parts = literature_parts(convention, layout.precision, 0.0)
    w = sum(b for c, b, _ in parts if c == "weights")
    g = sum(b for c, b, stage in parts if c == "gradients" and stage >= 2)
    return {"zero3_gather_buffers": (2 * w + g) * states.layer_params}


def _lmforge_buffers(cfg: ModelConfig, layout: Layout, states: _StageStates, seq_len: int) -> dict[str, float]:
    """What lmforge allocates besides parameters, gradients, optimizer state and activations."""
    mixed = layout.precision != "fp32"
    out: dict[str, float] = {}
    if not layout.fsdp:
        # (DDP and ZeRO-1: the gradients are the fp32 all-reduce buckets, through accumulation too)
        if mixed:  # the step's 16-bit copy of each matmul weight (lmforge.train.precision)
            out["autocast_weight_copies"] = states.matmul_16bit
    else:
        half = 2 if mixed else 4  # FSDP2 gathers in param_dtype (16-bit), fp32 runs in fp32
        accumulating = layout.grad_accum > 1
        # ZeRO-2, and any pipeline stage (torch's schedule keeps the gathered weights between micro-batches)
        whole_stage = layout.zero == 2 or (layout.pp > 1 and accumulating)
        held = states.params if whole_stage else 2 * states.layer_params + states.root_params
        out["fsdp_gathered_weights"] = half * held
        reduce_input = 4 if mixed else 0  # the fp32 reduce-scatter input (reduce_dtype = fp32)
        out["fsdp_unsharded_gradients"] = (half + reduce_input) * states.layer_params + half * states.head_params
        if accumulating and not layout.fsdp_reduce_every_micro_batch:
            # reduced at the step's last micro-batch only: every parameter's unsharded gradient,
            # accumulated in fp32 (reduce_dtype), is held from the first micro-batch's backward on
            out["fsdp_accumulated_gradients"] = 4 * states.params
    if cfg.pos_emb == "rope":
        out["rope_tables"] = 2 * cfg.max_seq_len * (cfg.head_dim // 2) * 4
    return out


def phase_peaks(cfg: ModelConfig, layout: Layout, seq_len: int, stage: int, comp: dict[str, float],
                buffers: dict[str, float]) -> dict[str, float]:
    """Bytes per GPU outside the training step (lmforge convention), where no rank holds the whole
    model (lmforge.model.materialise, lmforge.parallel.inference, Layout.full_weights):

    - ``startup``: the rank's own fp32 weights once materialised (DDP and ZeRO-1 also allocate their
      fp32 gradient buckets as they wrap the model); the initial values are drawn on the host, one
      parameter's rows at a time (``startup_host``: twice the largest parameter, an upper bound);
    - ``validation``: what persists between steps (weights, optimizer state; gradients only where
      they are DDP's buckets: elsewhere the step frees them), the FSDP2 blocks gathered at a time
      (weights gathered in the run's precision), and a forward without autograd: one layer's
      temporaries (at most what the layer saves for backward) and the cross-entropy of one
      micro-batch: its logits in 16 bits, their fp32 copy and the fp32 log-softmax, 10 bytes a logit
      (fp32 runs: 8), split over the vocabulary under TP; with the chunked loss (layout loss_chunk =
      c, as training runs it: lmforge.eval.perplexity) only c tokens' logits at a time, plus the
      chunk's hidden rows cast to 16 bits;
    - ``final_save``: what persists, plus one whole parameter gathered on every rank of its shard
      group (the largest, fp32; rank 0's copy of it goes to host memory, then to the file)."""
    specs = stage_specs(cfg, layout.pp, stage)
    largest = 4 * max(math.prod(spec.shape) for spec in specs)
    keeps_grads = not layout.fsdp and layout.shard_ranks > 1  # DDP / ZeRO-1: gradients are the buckets
    persistent = comp["weights"] + comp["master_weights"] + comp["optimizer_states"] + \
        (comp["gradients"] if keeps_grads else 0.0) + buffers.get("rope_tables", 0.0)
    half = 4 if layout.precision == "fp32" else 2
    # evaluation's loss (lmforge.eval.perplexity): the 16-bit logits, their fp32 copy (fp32 runs: the
    # logits themselves) and the fp32 log-softmax, all alive at once, of the micro-batch's tokens or,
    # with the chunked loss, of one chunk's (and the chunk's hidden rows cast to the compute dtype)
    per_logit = half + (4 if half == 2 else 0) + 4
    n = layout.micro_batch * (seq_len // layout.cp)
    rows = min(layout.loss_chunk, n) if layout.loss_chunk else n
    cast = rows * half * cfg.dim if layout.loss_chunk and half == 2 else 0
    logits = per_logit * rows * cfg.vocab_size / layout.tp + cast if stage == layout.pp - 1 else 0.0
    layer = _lmforge_activation_per_layer(cfg, layout, seq_len // layout.cp, "none")
    working = buffers.get("fsdp_gathered_weights", 0.0) + layer + logits
    return {"startup": comp["weights"] + (comp["gradients"] if keeps_grads else 0.0), "startup_host": 2 * largest,
            "validation": persistent + working, "validation_working_set": working,
            "final_save": persistent + largest, "final_save_working_set": largest}


def _checkpointed_layers(layout: Layout, layers: int) -> int:
    """Layers that keep only their input (selective recompute keeps more: its own per-layer formula)."""
    return 0 if layout.ac == "selective" else recomputed_layers(layout.ac, layers, layout.ac_every)


def _stage_breakdown(cfg: ModelConfig, layout: Layout, opt: str, seq_len: int, convention: str, stage: int,
                     fused_attention: bool) -> tuple[dict[str, float], float, float, dict[str, float]]:
    states = _stage_states(cfg, layout, opt, convention, stage)
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
    # Activations.
    layers = cfg.n_layers // layout.pp
    n_ckpt = _checkpointed_layers(layout, layers)

    def per_layer(checkpointed: bool | None) -> float:
        return activation_bytes_per_layer(cfg, layout, seq_len, convention, checkpointed, fused_attention)

    if layout.ac in ("full", "every_k"):
        blocks = n_ckpt * per_layer(True) + (layers - n_ckpt) * per_layer(False)
    else:
        blocks = layers * per_layer(None)
    extras = _extras(cfg, layout, seq_len, convention, stage)
    in_flight = _in_flight(layout, stage)
    last_in_flight = float(layout.grad_accum) if layout.pp_schedule == "gpipe" and layout.pp > 1 else 1.0
    comp["activations"] = (in_flight * (blocks + extras.get("embedding", 0.0) + extras.get("positions", 0.0))
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
        buffers = _lmforge_buffers(cfg, layout, states, seq_len)
        if stage == layout.pp - 1:
            buffers["loss_transient"] = lmforge_loss_bytes(cfg, layout, seq_len)[1]
    else:
        buffers = _literature_buffers(layout, states, convention)
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
