"""Compute, time and cost: FLOPs per token, step time, training time, GPU-hours, pipeline bubble,
and a first-order communication estimate.

Conventions:

- FLOPs per token (training, forward + backward) follow PaLM: 6N + 12*L*h*s, where N counts the
  weights that take part in a matmul (blocks + output projection; embedding lookups excluded) and
  the 12*L*h*s term is the attention scores and values (`lmforge.model.accounting.flops_per_token`,
  the trainer's own torch-free function); `convention="6N"` gives the plain 6 x (all parameters)
  figure used by back-of-envelope estimates (e.g. GPT-3: 6 * 175e9 * 300e9 = 3.15e23 FLOPs).
- MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022) = model FLOPs per second /
  (GPUs x dense peak); recomputation is *not* model work. HFU (hardware FLOPs utilisation) counts
  the FLOPs the GPUs really execute, recomputation included: HFU = MFU x recompute factor (full
  recompute re-runs the forward: 4/3; selective ~1.03, a documented estimate; every_k in
  proportion to the blocks checkpointed). The planner prints both.
- Step time (the layout model, used by the search; `lmforge.plan.op_time`): the device time of the
  kernels one rank runs in a step, per op kind (matmuls by their FLOPs and a fixed cost per GEMM,
  attention at its measured rate, elementwise, loss, cast and optimizer bytes at the device's
  bandwidth), plus the host gaps between kernels shorter than the host's time per launch; the
  constants are the device's calibration (`lmforge.plan.hardware.H100_CALIBRATION`, fitted to an
  H100's profile; other devices: the same fractions of their spec sheets). Recomputation runs its
  kernels again; the pipeline bubble and exposed communication stretch the step. The layout's
  resulting end-to-end MFU and HFU are reported, with the time per op kind.
- `ideal=True` (`--ideal`, with `mfu=` / `--mfu`): the back-of-envelope estimate instead, the run's
  end-to-end MFU applied as is: training time = D x FLOPs/token / (GPUs x peak x MFU). Bubble,
  communication and recompute are inside it (a run with full recompute at this MFU has HFU = 4/3
  MFU, which must not exceed 1).
- Training time = D / tokens per second. GPU-hours = time x GPUs; cost = GPU-hours x price.
- Pipeline bubble (fraction of the step spent idle): each schedule's published formula in the
  times F, B, W of a micro-batch's forward, input-gradient and weight-gradient passes, with
  F = B = W and the recomputed forward added to B (`lmforge.spec.parallel.pipeline_bubble`):
  (p-1)/v / (m + (p-1)/v) for p stages, m micro-batches, v virtual stages per rank (interleaved
  1F1B; v = 1 otherwise: (p-1)/(m+p-1)); ZB-H1 / interleaved-zb (p-1)(F+B-W)/v, ZB-V (p-1)B/2,
  DualPipeV (p-1)(F+2B-W)/2 idle per m(F+B+W) of work.
- Communication: each collective costs a latency plus its bytes on the wire over the link
  bandwidth (ring algorithms, bytes per GPU, n ranks: all-reduce 2(n-1)/n x S, all-gather /
  reduce-scatter (n-1)/n x S; a send S). Latency: `ceil(log2 n)` steps of 5 us over NVLink or
  10 us over the network (tree / recursive-halving depth; order of NCCL's small-message
  latency), one step for a send. So a 1 MB collective reaches well under its link bandwidth, and
  many small collectives (TP's per layer, PP's per micro-batch) cost what they cost on a real
  cluster. Ranks are placed as lmforge's DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp", "tp")
  and Megatron's default order place them: TP innermost, then CP, DP, PP outermost; a group whose
  span fits in a node uses `intra_node_gbps`, otherwise `inter_node_gbps` (per GPU, one NIC each).
  Under context parallelism a rank holds s/cp tokens of each sequence: s below is s/cp for the
  TP and PP traffic and for the matmul shapes.
  - CP: `lmforge.spec.parallel.cp_comm_bytes` per step and rank: per layer and micro-batch one
    all-gather of the whole sequence's K/V (`cp_kv_bytes`, attention dtype) and one reduce-scatter of
    their gradients, one more all-gather per recomputed layer; a ring moves (cp-1)/cp of it per
    rank, over the tp x cp span. Exposed (the collectives sit between the layer's matmuls).
    The compute needs no CP term: every rank computes the same c^2 (2cp + 1) (query, key) scores
    per head (`cp_score_elements`; two chunks per rank balance the causal work), so the step's
    FLOPs divide evenly over all GPUs as without CP.
  - TP: per layer per micro-batch, two all-reduces of s*b*h 16-bit activations in forward and two
    in backward (one more pair with full recompute); with SP the same bytes as all-gathers +
    reduce-scatters (twice the calls). Exposed.
  - PP: one send forward and one backward of s*b*h/t 16-bit values per micro-batch and virtual
    stage. Exposed.
  - DP (over dp x cp ranks), bytes by the memory convention (what each framework sends): "lmforge" all-reduces fp32
    gradients once per step (DDP buckets of 25 MB; ZeRO-1's ZeroRedundancyOptimizer then
    broadcasts the updated fp32 parameters, one call per tensor); FSDP2 all-gathers 16-bit
    weights per block and micro-batch (ZeRO-3: two all-gathers, forward and backward; ZeRO-2:
    one) and reduce-scatters the fp32 gradients once per step, in the last micro-batch's backward
    (per micro-batch with `fsdp_reduce_every_micro_batch`). "megatron" reduces fp32 main gradients and
    gathers bf16 weights (distributed optimizer: reduce-scatter + all-gather once per step);
    "zero-paper" sends 16-bit gradients and weights. ZeRO-2 reduce-scatters per micro-batch and
    gathers once per step; ZeRO-3 gathers twice and reduce-scatters per micro-batch (fp32 runs:
    4-byte everything). Traffic once per step overlaps with the last micro-batch's backward
    (2/3 of its compute), traffic per micro-batch with all the compute; the rest is exposed.
  - CPU offload: 8 bytes/param of the rank's shard over PCIe (25 GB/s) plus a host optimizer step
    streaming 16 bytes/param at 50 GB/s, exposed.
  These are first-order estimates for ranking layouts, not a network simulator.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lmforge.config import Config, ModelConfig
from lmforge.model.accounting import flops_per_token as model_flops_per_token
from lmforge.spec.fp8 import converts
from lmforge.spec.parallel import (cp_comm_bytes, pipeline_bubble, recomputed_layers,  # noqa: F401 (re-exported)
                                   ulysses_bytes, ulysses_comm_bytes)
from lmforge.plan.hardware import Cluster, Device
from lmforge.plan.activations import attention_dtype_bytes, cp_kv_layer_bytes
from lmforge.plan.conventions import check_convention
from lmforge.plan.layout import Layout
from lmforge.plan.model_states import literature_state_bytes_per_param
from lmforge.plan.op_time import op_times
from lmforge.plan.params import cfg_key, stage_specs, total_params, tp_shape

_CACHE: dict[tuple, tuple[float, int]] = {}

SECONDS_PER_YEAR = 365.25 * 24 * 3600
OFFLOAD_PCIE_BPS = 25e9   # host <-> GPU, per GPU, one direction (PCIe Gen4 x16 effective)
OFFLOAD_HOST_BPS = 50e9   # host memory bandwidth available to one GPU's CPU optimizer step
RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.03, "full": 4.0 / 3.0}
LATENCY_STEP_S = {"intra": 5e-6, "inter": 10e-6}  # one latency step of a collective, NVLink / network
DDP_BUCKET_BYTES = 25 * 2**20                      # torch DDP's default bucket_cap_mb = 25


def flops_per_token(model_cfg: ModelConfig, seq_len: int, convention: str = "palm") -> float:
    """Training FLOPs per token: "palm" = 6 N_matmul + 12 L h s; "6N" = 6 x all parameters."""
    if convention == "6N":
        return 6.0 * total_params(model_cfg)
    if convention != "palm":
        raise ValueError(f"FLOPs convention {convention!r} must be 'palm' or '6N'")
    # The trainer's own formula (torch-free module), so plan and the training log agree.
    return model_flops_per_token(model_cfg, seq_len)


def _stage0_params(model_cfg: ModelConfig, pp: int, tp: int, ep: int = 1, last_rank: int | None = None
                   ) -> tuple[float, int]:
    """(parameters, parameter tensors) one rank of pipeline stage 0 holds under TP degree `tp` (and
    EP degree `ep`: E / ep of each MoE layer's routed experts; `last_rank` 0: the head too, as in a
    V-shaped schedule). The data-parallel traffic counts them all over the dp group; an expert's
    gradient is in fact reduced over the dp / ep ranks holding it, a smaller group (a slight
    overestimate of the ring's (n-1)/n)."""
    key = ("stage0", cfg_key(model_cfg), pp, tp, ep, last_rank)
    if key not in _CACHE:
        specs = stage_specs(model_cfg, pp, 0, last_rank)
        _CACHE[key] = (sum(math.prod(tp_shape(sp, tp, ep)) for sp in specs), len(specs))
    return _CACHE[key]


def _stage0_fp8_params(model_cfg: ModelConfig, layout: Layout) -> float:
    """Of `_stage0_params`, the weights train.fp8 converts (lmforge.spec.fp8.converts; 0 unless fp8)."""
    if layout.precision != "fp8":
        return 0.0
    specs = stage_specs(model_cfg, layout.pp, 0, layout.last_rank)
    return float(sum(math.prod(tp_shape(sp, layout.tp, layout.ep)) for sp in specs
                     if sp.matmul and converts(sp.name, sp.shape)))  # (routed experts: 3-D, never)


def ep_comm(model_cfg: ModelConfig, layout: Layout, seq_len: int) -> dict[str, float]:
    """All-to-all traffic of one optimizer step on one rank under expert parallelism
    (lmforge.parallel.expert_parallel): per MoE layer of the rank's stage and per micro-batch, a
    dispatch and a combine in forward and the two in backward (and again in a recomputed forward),
    each moving the rank's tokens x top_k rows of dim 16-bit values, of which (ep - 1) / ep leave
    the rank (balanced routing)."""
    m = model_cfg.moe
    if layout.ep <= 1 or not m.enabled:
        return {"calls": 0.0, "wire_bytes": 0.0}
    per = model_cfg.n_layers // layout.pp
    moe_layers = sum(m.is_moe_layer(i) for i in range(per))  # (stage 0's blocks)
    rows = (seq_len // layout.cp) * layout.micro_batch * m.top_k
    half = 4 if layout.precision == "fp32" else 2
    recomputed = recomputed_layers(layout.ac, moe_layers, layout.ac_every)
    calls = layout.grad_accum * (4 * moe_layers + 2 * recomputed)
    return {"calls": calls, "wire_bytes": calls * rows * model_cfg.dim * half * (layout.ep - 1) / layout.ep}


def recompute_factor(layout: Layout, n_layers: int) -> float:
    """Hardware work / model work for the activation-checkpointing mode."""
    if layout.ac == "every_k":
        frac = len(range(0, n_layers // layout.pp, layout.ac_every)) / (n_layers // layout.pp)
        return 1.0 + frac / 3.0
    return RECOMPUTE_FACTOR[layout.ac]


def training_time_seconds(total_flops: float, n_gpus: int, peak_flops: float, mfu: float) -> float:
    """total_flops / (GPUs x peak x MFU)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu = {mfu} must be in (0, 1]")
    if n_gpus < 1:
        raise ValueError(f"GPU count {n_gpus} must be >= 1")
    return total_flops / (n_gpus * peak_flops * mfu)


@dataclass(frozen=True)
class _Link:
    """The link a group of `size` ranks spread over `span` consecutive ranks communicates over."""

    bytes_per_s: float
    latency_step_s: float
    size: int

    @classmethod
    def of(cls, cluster: Cluster, span: int, size: int) -> "_Link":
        dev = cluster.device
        inside = span <= cluster.gpus_per_node
        gbps = dev.intra_node_gbps if inside else dev.inter_node_gbps
        return cls(gbps * 1e9, LATENCY_STEP_S["intra" if inside else "inter"], size)

    def collective(self, calls: float, wire_bytes: float) -> float:
        """`calls` collectives over the group moving `wire_bytes` per GPU in all."""
        if self.size <= 1:
            return 0.0
        return calls * self.latency_step_s * math.ceil(math.log2(self.size)) + wire_bytes / self.bytes_per_s

    def sends(self, calls: float, wire_bytes: float) -> float:
        return calls * self.latency_step_s + wire_bytes / self.bytes_per_s


def _dp_traffic(layout: Layout, convention: str, params: float, tensors: int, m: int, layers: int,
                fp8_params: float = 0.0) -> tuple[float, float, float, float]:
    """(calls once per step, bytes once per step, calls per step made per micro-batch, their bytes)
    of one data-parallel rank, ring bytes per GPU (see the module docstring). `fp8_params`: of `params`,
    the FP8 layers' weights, which lmforge's FSDP2 gathers in FP8 (train.fp8_all_gather, the default
    with the default tensorwise recipe)."""
    n = layout.shard_ranks
    ring = (n - 1) / n
    full = layout.precision == "fp32"
    grad_b = 4 if (full or convention != "zero-paper") else 2  # gradient element on the wire
    weight_b = 4 if full else 2                                  # 16-bit weight gathers
    if layout.precision == "fp8" and convention == "lmforge" and layout.fsdp and params:
        weight_b -= fp8_params / params                          # (1 byte a gathered FP8 weight element)
    if layout.zero == 0:
        calls = math.ceil(grad_b * params / DDP_BUCKET_BYTES)
        return calls, 2 * ring * grad_b * params, 0.0, 0.0
    if layout.zero == 1 and not (convention == "lmforge" and layout.fsdp):  # (lmforge under tp / pp: FSDP2, below)
        if convention == "lmforge":  # DDP all-reduce + ZeroRedundancyOptimizer's per-tensor broadcasts
            calls = math.ceil(4 * params / DDP_BUCKET_BYTES) + tensors
            return calls, 2 * ring * 4 * params + ring * 4 * params, 0.0, 0.0
        calls = 2 * math.ceil(grad_b * params / DDP_BUCKET_BYTES)  # reduce-scatter + all-gather
        return calls, ring * (grad_b + weight_b) * params, 0.0, 0.0
    gathers = 2 if layout.zero == 3 else 1
    if convention == "lmforge" and layout.pp > 1 and gathers == 1:
        # a pipeline stage's FSDP2 chunks (ZeRO-1/2: parameters kept after forward) stay gathered from the
        # first micro-batch to the step's reduce-scatter: torch's schedule turns the reshard after backward
        # off until its last (PipelineStage.backward_maybe_with_nosync / perform_reduce_grad)
        return layers, ring * (grad_b + weight_b) * params, 0.0, 0.0
    if convention == "lmforge" and not layout.fsdp_reduce_every_micro_batch:
        # FSDP2: gather every micro-batch, reduce-scatter once per step (lmforge.parallel.fsdp)
        return layers, ring * grad_b * params, m * layers * gathers, m * ring * gathers * weight_b * params
    if convention == "lmforge" or layout.zero == 3:  # gather and reduce-scatter every micro-batch
        per_mb_calls = m * layers * (gathers + 1)
        return 0.0, 0.0, per_mb_calls, m * ring * (gathers * weight_b + grad_b) * params
    # literature ZeRO-2: reduce-scatter per micro-batch, one all-gather per step
    return layers, ring * weight_b * params, m * layers, m * ring * grad_b * params


def cp_comm(model_cfg: ModelConfig, layout: Layout, seq_len: int) -> dict[str, int]:
    """Context-parallel traffic of one optimizer step on one rank (`spec.parallel.cp_comm_bytes`) for the
    layers of the rank's pipeline stage, with one more K/V all-gather per layer that activation
    checkpointing re-runs in backward (`spec.parallel.recomputed_layers`); under Ulysses
    (cp_mode = "ulysses") the all-to-alls of q, k, v and the output instead (`spec.parallel.ulysses_comm_bytes`:
    each sends (cp - 1) / cp of the rank's tensor, so a rank's bytes do not grow with cp)."""
    layers = model_cfg.n_layers // layout.pp
    recomputed = recomputed_layers(layout.ac, layers, layout.ac_every)
    if layout.cp_mode == "ulysses":  # two all-to-alls per layer each way (spec.parallel.ulysses_comm_bytes)
        m = model_cfg
        qkv, out = ulysses_bytes(layout.micro_batch, seq_len, m.n_heads, m.kv_heads, m.head_dim,
                                 attention_dtype_bytes(layout), layout.tp, layout.cp)
        return ulysses_comm_bytes(qkv, out, layout.cp, layers, layout.grad_accum, recomputed)
    return cp_comm_bytes(cp_kv_layer_bytes(model_cfg, layout, seq_len, gathered=True), layout.cp, layers, layout.grad_accum,
                         recomputed)


def _cp_comm_seconds(model_cfg: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int) -> float:
    """Seconds of the step's CP collectives on one rank: the CP group spans tp x cp consecutive ranks
    (the mesh puts CP just outside TP); the gathers and scatters sit between the layer's matmuls,
    so none of it overlaps."""
    traffic = cp_comm(model_cfg, layout, seq_len)
    return _Link.of(cluster, layout.tp * layout.cp, layout.cp).collective(traffic["calls"], traffic["wire_bytes"])


@dataclass
class StepEstimate:
    """Time per optimizer step and derived throughput, utilisation, cost and training time."""

    tokens_per_step: int
    flops_per_token: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    compute_s: float
    bubble_fraction: float
    comm_s: dict[str, float] = field(default_factory=dict)
    exposed_comm_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    time_by_kind: dict[str, float] = field(default_factory=dict)  # device seconds per op kind, "host" gaps
    launches: float = 0.0             # kernels one rank launches per step
    mfu: float = 0.0                  # model FLOPs utilisation (PaLM): recompute not counted
    hfu: float = 0.0                  # hardware FLOPs utilisation: recompute counted
    recompute_factor: float = 1.0
    ideal: bool = False
    n_gpus: int = 1
    train_tokens: float | None = None
    train_s: float | None = None
    gpu_hours: float | None = None
    cost: float | None = None
    price_per_gpu_hour: float | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.train_s is not None:
            d["train_days"] = self.train_s / 86400
            d["train_years"] = self.train_s / SECONDS_PER_YEAR
        return d


def estimate_step(model_cfg: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int, mfu: float | None = None,
                  train_tokens: float | None = None, price_per_gpu_hour: float | None = None,
                  flops_convention: str = "palm", ideal: bool = False, convention: str = "lmforge",
                  optimizer: str = "adamw", chunk_loss_compiled: bool = True) -> StepEstimate:
    """Step time of `layout` on `cluster`: the kernels of one rank's step per op kind
    (`lmforge.plan.op_time`; `optimizer` sets the optimizer step's bytes, `chunk_loss_compiled` whether
    the chunked loss's elementwise part is one compiled kernel, as lmforge runs it on CUDA GPUs with
    Triton), stretched by the pipeline bubble and the exposed communication (DP bytes as
    `convention` sends them). `ideal`: `mfu` is the run's end-to-end MFU, applied as is. The
    returned `mfu` / `hfu` are the resulting end-to-end figures."""
    layout.validate(model_cfg, seq_len)
    check_convention(convention)
    if ideal and mfu is None:
        raise ValueError("ideal=True applies an end-to-end MFU as is: give mfu")
    if mfu is not None and not ideal:
        raise ValueError(f"mfu = {mfu} is the end-to-end MFU of the back-of-envelope estimate (ideal=True); the "
                         f"layout model times each op kind from the device's calibration")
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"mfu = {mfu} must be in (0, 1]")
    if layout.world_size > cluster.world_size:
        raise ValueError(f"layout needs {layout.world_size} GPUs (dp x cp x tp x pp) but the cluster "
                         f"{cluster} has {cluster.world_size}")
    dev: Device = cluster.device
    peak = dev.peak_flops(layout.precision)
    n_gpus = layout.world_size
    tokens = layout.sequences_per_step * seq_len
    fpt = flops_per_token(model_cfg, seq_len, flops_convention)
    model_flops = tokens * fpt
    rf = recompute_factor(layout, model_cfg.n_layers)
    hardware_flops = model_flops * rf
    if ideal:
        if mfu * rf > 1:
            raise ValueError(f"MFU {mfu:g} with {layout.ac} recompute means hardware FLOPs utilisation "
                             f"{mfu * rf:.0%} > 100%; lower --mfu (at most {1 / rf:.3g}) or change ac=")
        step = model_flops / (n_gpus * peak * mfu)
        est = StepEstimate(tokens_per_step=tokens, flops_per_token=fpt, model_flops_per_step=model_flops,
                           hardware_flops_per_step=hardware_flops, compute_s=step, bubble_fraction=0.0,
                           step_s=step, tokens_per_s=tokens / step, tokens_per_s_per_gpu=tokens / step / n_gpus,
                           mfu=mfu, hfu=mfu * rf, recompute_factor=rf, ideal=True, n_gpus=n_gpus)
        return _with_totals(est, train_tokens, price_per_gpu_hour)
    ops = op_times(model_cfg, layout, seq_len, dev, optimizer_state_bytes=literature_state_bytes_per_param(optimizer),
                   chunk_loss_compiled=chunk_loss_compiled)
    compute = ops.total_s  # one rank's kernels (CP ranks' attention work is balanced: docstring)
    m = layout.grad_accum
    # (the bubble: the schedule's published formula, the recomputed forward counted in the input gradient)
    bubble = pipeline_bubble(layout.pp, m, layout.virtual_stages, layout.pp_schedule, recompute=3 * (rf - 1)) \
        if layout.pp > 1 else 0.0
    busy = compute / (1 - bubble)

    # Communication (placement: TP innermost, then CP, DP, PP outermost). A rank holds seq_len / cp
    # tokens of each sequence: its TP and PP traffic shrink with cp.
    s, b, h = seq_len // layout.cp, layout.micro_batch, model_cfg.dim
    act_bytes = 2 * s * b * h
    layers = model_cfg.n_layers // layout.pp
    t, v = layout.tp, layout.stages_per_rank
    comm: dict[str, float] = {}
    if t > 1:
        per_layer = 6 if layout.ac == "full" else 4  # all-reduces; SP: as many all-gather + reduce-scatter pairs
        calls = per_layer * layers * m * (2 if layout.sp else 1)
        comm["tp"] = _Link.of(cluster, t, t).collective(calls, per_layer * layers * m * 2 * (t - 1) / t * act_bytes)
    if layout.cp > 1:
        comm["cp"] = _cp_comm_seconds(model_cfg, layout, cluster, seq_len)
    if layout.pp > 1:
        comm["pp"] = _Link.of(cluster, n_gpus, layout.pp).sends(2 * m * v, 2 * m * v * act_bytes / t)
    if layout.ep > 1:  # the EP group: ep data-parallel neighbours, tp x cp ranks apart (not overlapped)
        traffic = ep_comm(model_cfg, layout, seq_len)
        comm["ep"] = _Link.of(cluster, t * layout.cp * layout.ep, layout.ep).collective(traffic["calls"],
                                                                                        traffic["wire_bytes"])
    dp_overlap = 0.0
    if layout.shard_ranks > 1:  # gradients averaged over dp x cp
        params, tensors = _stage0_params(model_cfg, layout.pp, t, layout.ep, layout.last_rank)
        once_calls, once_bytes, mb_calls, mb_bytes = _dp_traffic(
            layout, convention, params, tensors, m, layers, _stage0_fp8_params(model_cfg, layout))
        link = _Link.of(cluster, t * layout.shard_ranks, layout.shard_ranks)
        once, per_mb = link.collective(once_calls, once_bytes), link.collective(mb_calls, mb_bytes)
        comm["dp"] = once + per_mb
        backward = compute * 2 / 3
        dp_overlap = min(once, backward / m) + min(per_mb, compute)
        dp_overlap = min(dp_overlap, comm["dp"], compute)
    if layout.cpu_offload:
        shard = _stage0_params(model_cfg, layout.pp, t, last_rank=layout.last_rank)[0] / (
            layout.shard_ranks if layout.zero else 1)
        # gradients down and weights up over PCIe (4 + 4 bytes), and the optimizer update on the
        # host streaming ~16 bytes/param through host memory; not overlapped.
        comm["offload"] = shard * (8 / OFFLOAD_PCIE_BPS + 16 / OFFLOAD_HOST_BPS)
    exposed = sum(comm.values()) - dp_overlap
    step = busy + exposed
    est = StepEstimate(tokens_per_step=tokens, flops_per_token=fpt, model_flops_per_step=model_flops,
                       hardware_flops_per_step=hardware_flops, compute_s=compute, bubble_fraction=bubble,
                       comm_s=comm, exposed_comm_s=exposed, step_s=step, tokens_per_s=tokens / step,
                       tokens_per_s_per_gpu=tokens / step / n_gpus, mfu=model_flops / (step * n_gpus * peak),
                       hfu=hardware_flops / (step * n_gpus * peak), recompute_factor=rf, n_gpus=n_gpus,
                       time_by_kind=ops.by_kind(), launches=ops.launches)
    return _with_totals(est, train_tokens, price_per_gpu_hour)


def _with_totals(est: StepEstimate, train_tokens: float | None, price_per_gpu_hour: float | None) -> StepEstimate:
    if train_tokens:
        est.train_tokens = float(train_tokens)
        est.train_s = train_tokens / est.tokens_per_s
        est.gpu_hours = est.train_s * est.n_gpus / 3600
        if price_per_gpu_hour is not None:
            est.price_per_gpu_hour = price_per_gpu_hour
            est.cost = est.gpu_hours * price_per_gpu_hour
    return est


def config_train_tokens(config: Config, micro_batch: int | None = None) -> int:
    """Tokens the config's run trains on: `train.steps` optimizer steps of `train.global_batch_size`
    sequences of `data.seq_len` tokens, the batch ramp-up (`schedule.batch_rampup_*`) included as
    the trainer applies it (`lmforge.optim.schedules.BatchRampup`, restated here without torch: the
    batch grows from the start batch in whole increments, linearly in the tokens seen). `micro_batch`:
    the run's micro-batch where train.micro_batch_size is "auto" (the ramp-up's default increment)."""
    t, s, seq = config.train, config.schedule, config.data.seq_len
    full = t.global_batch_size * seq
    if not s.batch_rampup_start or s.batch_rampup_tokens <= 0:
        return t.steps * full
    micro = micro_batch if micro_batch is not None else t.micro_batch_size
    assert micro != "auto", "train.micro_batch_size = 'auto': pass the run's micro_batch"
    increment = s.batch_rampup_increment or micro * config.parallel.dp
    n_increments = (t.global_batch_size - s.batch_rampup_start) // increment
    seen = steps = 0
    while steps < t.steps and seen < s.batch_rampup_tokens:
        seen += (s.batch_rampup_start + increment * (n_increments * seen // s.batch_rampup_tokens)) * seq
        steps += 1
    return seen + (t.steps - steps) * full


def simple_training_estimate(n_params: float, tokens: float, device: Device, n_gpus: int = 1, mfu: float = 0.4,
                             precision: str = "bf16", price_per_gpu_hour: float | None = None) -> dict[str, float]:
    """The back-of-envelope 6ND / (GPUs x peak x MFU) estimate (time, GPU-hours, cost)."""
    flops = 6.0 * n_params * tokens
    secs = training_time_seconds(flops, n_gpus, device.peak_flops(precision), mfu)
    out = {"flops": flops, "seconds": secs, "days": secs / 86400, "years": secs / SECONDS_PER_YEAR,
           "gpu_hours": secs * n_gpus / 3600}
    if price_per_gpu_hour is not None:
        out["cost"] = out["gpu_hours"] * price_per_gpu_hour
    return out
