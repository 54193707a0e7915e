"""Compute, time and cost: FLOPs per token, step time, training time, GPU-hours, pipeline bubble,
and a rough communication estimate.

Conventions:

- FLOPs per token (training, forward + backward) follow PaLM: 6N + 12*L*h*s, where N counts the
  weights that take part in a matmul (blocks + output projection; embedding lookups excluded) and
  the 12*L*h*s term is the attention scores and values (`lmforge.model.accounting.flops_per_token`,
  the trainer's own torch-free function);
  `convention="6N"` gives the plain 6 x (all parameters) figure
  used by back-of-envelope estimates (e.g. GPT-3: 6 * 175e9 * 300e9 = 3.15e23 FLOPs).
- MFU is model FLOPs (the above, recomputation *not* counted) / (GPUs x dense peak x time). Full
  activation recompute costs one extra forward (model FLOPs x 4/3 of hardware work); selective
  ~3% (documented estimate).
- Training time = D x FLOPs/token / (GPUs x peak x MFU). GPU-hours = time x GPUs; cost = GPU-hours
  x price per GPU-hour.
- Pipeline bubble (fraction of the step spent idle) = (p-1)/v / (m + (p-1)/v) for p stages, m
  micro-batches, v virtual stages per rank (interleaved 1F1B; v = 1 otherwise): (p-1)/(m+p-1).
- Communication (ring algorithms; bytes per GPU on the wire, n ranks): all-reduce 2(n-1)/n x S,
  all-gather / reduce-scatter (n-1)/n x S. Ranks are placed TP innermost, then PP, then DP
  outermost; a group whose span fits in a node uses `intra_node_gbps`, otherwise
  `inter_node_gbps` (per GPU, one NIC each). DP: DDP/ZeRO-1 one all-reduce of 16-bit gradients
  per step; ZeRO-2 a reduce-scatter per micro-batch + one all-gather; ZeRO-3 per micro-batch two
  all-gathers of the weights (forward, backward) and a reduce-scatter. DP traffic overlaps with
  the backward pass (2/3 of compute); what does not fit is exposed. TP: four all-reduces of the
  layer activations (s*b*h 16-bit) per layer per micro-batch (six with full recompute), exposed.
  PP: one send forward and one backward of s*b*h 16-bit values per micro-batch, exposed.
  CPU offload: 8 bytes/param of the rank's shard over PCIe (25 GB/s) plus a host optimizer step
  streaming 16 bytes/param at 50 GB/s, exposed.
  These are first-order estimates for ranking layouts, not a network simulator.
- `shape_efficiency` (used to rank layouts): matmuls shrink with a small micro-batch or a large
  TP degree; the assumed MFU applies to large matmuls and is scaled by
  (T/(T+128)) x ((h/t)/((h/t)+128)) / (h/(h+128)), T = micro_batch x seq_len tokens. A heuristic,
  stated so it can be checked against measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lmforge.config import ModelConfig
from lmforge.model.accounting import flops_per_token as model_flops_per_token
from lmforge.parallel.formulas import pipeline_bubble  # noqa: F401 (re-exported)
from lmforge.plan.hardware import Cluster, Device
from lmforge.plan.memory import Layout, cfg_key, stage_specs, total_params, tp_shape

_CACHE: dict[tuple, float] = {}

SECONDS_PER_YEAR = 365.25 * 24 * 3600
OFFLOAD_PCIE_BPS = 25e9   # host <-> GPU, per GPU, one direction (PCIe Gen4 x16 effective)
OFFLOAD_HOST_BPS = 50e9   # host memory bandwidth available to one GPU's CPU optimizer step
RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.03, "full": 4.0 / 3.0}


def flops_per_token(model_cfg: ModelConfig, seq_len: int, convention: str = "palm") -> float:
    """Training FLOPs per token: "palm" = 6 N_matmul + 12 L h s; "6N" = 6 x all parameters."""
    if convention == "6N":
        return 6.0 * total_params(model_cfg)
    if convention != "palm":
        raise ValueError(f"FLOPs convention {convention!r} must be 'palm' or '6N'")
    # The trainer's own formula (torch-free module), so plan and the training log agree.
    return model_flops_per_token(model_cfg, seq_len)


def _stage0_params(model_cfg: ModelConfig, pp: int, tp: int) -> float:
    """Parameters one rank of pipeline stage 0 holds under TP degree `tp` (cached)."""
    key = ("stage0", cfg_key(model_cfg), pp, tp)
    if key not in _CACHE:
        _CACHE[key] = sum(math.prod(tp_shape(sp, tp)) for sp in stage_specs(model_cfg, pp, 0))
    return _CACHE[key]


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


def shape_efficiency(model_cfg: ModelConfig, layout: Layout, seq_len: int) -> float:
    tokens = layout.micro_batch * seq_len
    h, ht = model_cfg.dim, model_cfg.dim / layout.tp
    return (tokens / (tokens + 128)) * (ht / (ht + 128)) / (h / (h + 128))


def _group_bandwidth(cluster: Cluster, span: int, size: int) -> float:
    """GB/s per GPU for a group of `size` ranks spread over `span` consecutive ranks."""
    if size <= 1:
        return math.inf
    dev = cluster.device
    gbps = dev.intra_node_gbps if span <= cluster.gpus_per_node else dev.inter_node_gbps
    return gbps * 1e9


@dataclass
class StepEstimate:
    """Time per optimizer step and derived throughput, cost and training time."""

    tokens_per_step: int
    flops_per_token: float
    model_flops_per_step: float
    compute_s: float
    bubble_fraction: float
    comm_s: dict[str, float] = field(default_factory=dict)
    exposed_comm_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
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
        return d


def estimate_step(model_cfg: ModelConfig, layout: Layout, cluster: Cluster, seq_len: int, mfu: float = 0.4,
                  train_tokens: float | None = None, price_per_gpu_hour: float | None = None,
                  flops_convention: str = "palm", use_shape_efficiency: bool = True) -> StepEstimate:
    """Step time of `layout` on `cluster`: ideal compute at `mfu` (scaled by recompute and, when
    `use_shape_efficiency`, by the matmul-shape heuristic), stretched by the pipeline bubble,
    plus exposed communication. `mfu` is what the layout would reach with no bubble and no
    exposed communication; the returned `mfu` is the resulting end-to-end estimate."""
    layout.validate(model_cfg)
    if layout.world_size > cluster.world_size:
        raise ValueError(f"layout needs {layout.world_size} GPUs (dp x tp x pp) but the cluster "
                         f"{cluster} has {cluster.world_size}")
    dev: Device = cluster.device
    peak = dev.peak_flops(layout.precision)
    n_gpus = layout.world_size
    tokens = layout.sequences_per_step * seq_len
    fpt = flops_per_token(model_cfg, seq_len, flops_convention)
    model_flops = tokens * fpt
    eff = mfu * (shape_efficiency(model_cfg, layout, seq_len) if use_shape_efficiency else 1.0)
    compute = model_flops * recompute_factor(layout, model_cfg.n_layers) / (n_gpus * peak * eff)
    m = layout.grad_accum
    bubble = pipeline_bubble(layout.pp, m, layout.virtual_stages) if layout.pp > 1 else 0.0
    busy = compute / (1 - bubble)

    # Communication.
    s, b, h = seq_len, layout.micro_batch, model_cfg.dim
    act_bytes = 2 * s * b * h
    layers = model_cfg.n_layers // layout.pp
    comm: dict[str, float] = {}
    t = layout.tp
    if t > 1:
        per_layer = 6 if layout.ac == "full" else 4
        vol = per_layer * layers * m * 2 * (t - 1) / t * act_bytes
        comm["tp"] = vol / _group_bandwidth(cluster, t, t)
    if layout.pp > 1:
        comm["pp"] = 2 * m * act_bytes / t / _group_bandwidth(cluster, t * layout.pp, layout.pp)
    if layout.dp > 1:
        n = layout.dp
        stage_params = _stage0_params(model_cfg, layout.pp, t)
        size = 2 * stage_params  # 16-bit gradients / weights
        ring = (n - 1) / n * size
        if layout.zero <= 1:
            vol = 2 * ring
        elif layout.zero == 2:
            vol = m * ring + ring
        else:
            vol = m * 3 * ring
        comm["dp"] = vol / _group_bandwidth(cluster, t * layout.pp * n, n)
    if layout.cpu_offload:
        shard = _stage0_params(model_cfg, layout.pp, t) / (layout.dp if layout.zero else 1)
        # gradients down and weights up over PCIe (4 + 4 bytes), and the optimizer update on the
        # host streaming ~16 bytes/param through host memory; not overlapped.
        comm["offload"] = shard * (8 / OFFLOAD_PCIE_BPS + 16 / OFFLOAD_HOST_BPS)
    exposed = (comm.get("tp", 0.0) + comm.get("pp", 0.0) + comm.get("offload", 0.0)
               + max(0.0, comm.get("dp", 0.0) - compute * 2 / 3))
    step = busy + exposed
    est = StepEstimate(tokens_per_step=tokens, flops_per_token=fpt, model_flops_per_step=model_flops,
                       compute_s=compute, bubble_fraction=bubble, comm_s=comm, exposed_comm_s=exposed, step_s=step,
                       tokens_per_s=tokens / step, tokens_per_s_per_gpu=tokens / step / n_gpus,
                       mfu=model_flops / (step * n_gpus * peak), n_gpus=n_gpus)
    if train_tokens:
        est.train_tokens = float(train_tokens)
        est.train_s = train_tokens / est.tokens_per_s
        est.gpu_hours = est.train_s * n_gpus / 3600
        if price_per_gpu_hour is not None:
            est.price_per_gpu_hour = price_per_gpu_hour
            est.cost = est.gpu_hours * price_per_gpu_hour
    return est


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
