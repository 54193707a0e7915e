"""Layout search: enumerate (dp, ZeRO stage, tp, pp, schedule, micro-batch, AC) for a model on a
cluster and a global batch, keep those that fit in memory, rank them by estimated throughput.

Placement follows the usual rule and is what the time model assumes: TP innermost (inside a
node, over NVLink: it communicates every layer), PP next (point-to-point activations only, the
cheapest traffic to send across nodes), DP outermost (one gradient reduction per step that
overlaps with the backward pass). TP is therefore limited to the GPUs of one node; every
candidate uses all GPUs of the cluster (dp = GPUs / (tp x pp)).

Fit test: the estimated bytes per GPU (worst pipeline stage) <= `usable_fraction` (default 0.9)
x device memory, leaving room for the CUDA context, allocator fragmentation and workspaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmforge.config import ModelConfig
from lmforge.plan.flops import StepEstimate, estimate_step
from lmforge.plan.hardware import Cluster
from lmforge.plan.memory import Layout, MemoryBreakdown, estimate_memory


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    step: StepEstimate
    fits: bool
    reason: str = ""
    rank: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "layout": self.layout.to_dict(), "layout_str": self.layout.short(),
                "fits": self.fits, "reason": self.reason,
                "memory_gb_per_gpu": self.memory.total / 1e9, "memory": self.memory.as_dict(),
                "step": self.step.as_dict()}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def enumerate_layouts(model_cfg: ModelConfig, cluster: Cluster, global_batch: int, *,
                      zero_stages: tuple[int, ...] = (0, 1, 2, 3), ac_modes: tuple[str, ...] = ("none", "selective", "full"),
                      precision: str = "bf16", max_micro_batch: int = 16, allow_offload: bool = False,
                      interleaved: bool = True) -> list[Layout]:
    """Every layout that uses all GPUs and divides the global batch (in sequences) exactly."""
    world = cluster.world_size
    out: list[Layout] = []
    for tp in _pow2_upto(cluster.gpus_per_node):
        if model_cfg.n_heads % tp or model_cfg.kv_heads % tp or world % tp:
            continue
        for pp in _divisors(model_cfg.n_layers):
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            per_dp = global_batch // dp
            schedules: list[tuple[str, int]] = [("1f1b", 1)]
            if pp > 1 and interleaved and model_cfg.n_layers % (pp * 2) == 0:
                schedules.append(("interleaved", 2))
            for mb in _pow2_upto(min(per_dp, max_micro_batch)):
                if per_dp % mb:
                    continue
                ga = per_dp // mb
                if pp > 1 and ga < pp:
                    continue  # fewer micro-batches than stages: most of the pipeline idles
                for zero in zero_stages:
                    if zero and dp == 1:
                        continue
                    for offload in ((False, True) if allow_offload else (False,)):
                        for ac in ac_modes:
                            for sched, v in schedules:
                                out.append(Layout(dp=dp, zero=zero, tp=tp, sp=tp > 1, pp=pp, pp_schedule=sched,
                                                  virtual_stages=v, micro_batch=mb, grad_accum=ga, ac=ac,
                                                  cpu_offload=offload, precision=precision))
    return out


def _reason(c: Candidate, cluster: Cluster) -> str:
    L, st, mem = c.layout, c.step, c.memory
    dev = cluster.device
    parts = []
    if L.tp > 1:
        parts.append(f"TP={L.tp} inside a node ({dev.intra_node_gbps:g} GB/s)")
    if L.pp > 1:
        where = "across nodes" if L.tp * L.pp > cluster.gpus_per_node else "inside a node"
        parts.append(f"PP={L.pp} {where} ({L.pp_schedule}, bubble {st.bubble_fraction:.0%})")
    zero = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[L.zero]
    parts.append(f"DP={L.dp} outermost ({zero})")
    parts.append(f"AC {L.ac}" + (" (no recompute)" if L.ac == "none" else ""))
    comm_share = st.exposed_comm_s / st.step_s if st.step_s else 0.0
    parts.append(f"exposed comm {comm_share:.0%}")
    parts.append(f"{mem.total / 1e9:.1f}/{dev.memory_gb:g} GB")
    return "; ".join(parts)


def search_layouts(model_cfg: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int, *,
                   optimizer: str = "adamw", mfu: float = 0.4, precision: str = "bf16",
                   weights: str = "megatron", usable_fraction: float = 0.9, top: int | None = 10,
                   include_unfit: bool = False, model_name: str = "model", **enum_kw: Any) -> list[Candidate]:
    """Rank the layouts of `model_cfg` on `cluster` for `global_batch` sequences of `seq_len`
    tokens by estimated tokens/s (fitting ones first), each with a one-line reason.

    Ties in throughput go to the layout with less memory. `top=None` returns all."""
    if global_batch < 1:
        raise ValueError(f"global batch = {global_batch} sequences must be >= 1")
    layouts = enumerate_layouts(model_cfg, cluster, global_batch, precision=precision, **enum_kw)
    if not layouts:
        raise ValueError(f"no layout of {cluster.world_size} GPUs divides the global batch of {global_batch} "
                         f"sequences; use a multiple of the GPU count")
    budget = usable_fraction * cluster.device.memory_bytes
    cands: list[Candidate] = []
    for lay in layouts:
        mem = estimate_memory(model_cfg, lay, optimizer, seq_len, weights=weights, model_name=model_name)
        fits = mem.total <= budget
        if not fits and not include_unfit:
            continue
        step = estimate_step(model_cfg, lay, cluster, seq_len, mfu=mfu)
        cands.append(Candidate(lay, mem, step, fits))
    cands.sort(key=lambda c: (not c.fits, -round(c.step.tokens_per_s, 6), c.memory.total))
    for i, c in enumerate(cands):
        c.rank = i + 1
        c.reason = _reason(c, cluster)
    if cands and cands[0].fits and len(cands) > 1:
        best = cands[0]
        for c in cands[1:top or len(cands)]:
            if c.fits:
                c.reason += f"; {best.step.tokens_per_s / c.step.tokens_per_s - 1:.1%} slower than #1"
    return cands if top is None else cands[:top]


def explain_winner(cands: list[Candidate]) -> str:
    """A few sentences on why the top layout wins (for the terminal report)."""
    if not cands:
        return "No layout fits in memory: add GPUs, use ZeRO-3 / CPU offload, full recompute, or a shorter sequence."
    best = cands[0]
    L = best.layout
    lines = [f"#1 {L.short()}: {best.step.tokens_per_s_per_gpu:,.0f} tok/s/GPU, est. MFU {best.step.mfu:.1%}."]
    lines.append("TP stays inside a node because it all-reduces activations at every layer; PP crosses nodes "
                 "because it only sends activations between neighbours; DP is outermost because its one "
                 "gradient reduction per step overlaps with the backward pass.")
    if L.ac == "none":
        lines.append("No activation recompute is needed at this micro-batch, which saves ~25% of the compute of full recompute.")
    if L.pp > 1:
        lines.append(f"Pipeline bubble {best.step.bubble_fraction:.1%} with {L.grad_accum} micro-batches over {L.pp} stages.")
    return "\n".join(lines)
