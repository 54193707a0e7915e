"""Layout search: enumerate (dp, ZeRO stage, cp, tp, pp, schedule, micro-batch, AC) for a model on a
cluster and a global batch, keep those that fit in memory, rank them by estimated throughput.

Placement is lmforge's DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"; torchtitan's order,
Megatron's default with CP), and what the time model assumes: TP innermost (inside a node, over
NVLink: it communicates at every layer), CP next (a K/V all-gather and reduce-scatter per layer),
DP next (its gradient reduction, over dp x cp, overlaps with the backward pass), PP outermost
(point-to-point activations only, the cheapest traffic to send across nodes). TP is therefore
limited to the GPUs of one node; every candidate uses all GPUs of the cluster
(dp = GPUs / (cp x tp x pp)). Context parallelism is tried for long sequences only: degrees that
leave each rank at least `CP_MIN_TOKENS_PER_RANK` (4096) tokens of a sequence (`cp_degrees`).

Fit test: the estimated bytes per GPU (worst pipeline stage), in the convention the search
fit-checks with, <= `usable_fraction` (default 0.9) x device memory, leaving room for the CUDA
context, allocator fragmentation and workspaces. With CPU offload, the host memory the GPUs of one
node offload to must also fit in `usable_fraction` x the node's host RAM.

When the plan is for an lmforge run (`weights="lmforge"` and the run's `config` given), layouts that
lmforge's config validation refuses for this model and batch (e.g. ZeRO-1 with TP or PP, SP with
learned positions, PP with tied embeddings) are left out, and `SearchResult.refused` says why.

Ranking: fastest first, except that the simplest layout within `margin` (default 3%) of the
fastest goes first: the time model is first-order, and differences that small are below its
resolution, while every added mechanism (CPU offload, pipeline, interleaving, the zero-bubble
schedules' split backward and V placement, CP, TP, a higher ZeRO stage, recompute) costs
engineering and risk. Simplicity is judged in that order.

Pipeline schedules: 1F1B, interleaved 1F1B (v = 2) and the zero-bubble ZB-H1 (interleaved-zb, v =
1), ZB-V (zbv) and DualPipeV, each with its bubble and the activations it keeps in flight
(`lmforge.spec.parallel`), the V schedules' head on rank 0 with the embedding, and without
torch.compile or selective recompute (which their split backward rules out).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lmforge.config import Config, ModelConfig
from lmforge.config.layout_rules import pipeline_micro_batches_ok
from lmforge.config.sections import zero1_through_fsdp
from lmforge.spec.parallel import SPLIT_BACKWARD, ulysses_splits
from lmforge.plan.flops import StepEstimate, estimate_step
from lmforge.plan.hardware import Cluster
from lmforge.plan.conventions import check_convention
from lmforge.plan.documents import corpus_document_tokens
from lmforge.plan.layout import Layout, lmforge_refusals, planned_compile, planned_documents, planned_loss_chunk
from lmforge.plan.memory import MemoryBreakdown, estimate_memory

SIMPLER_MARGIN = 0.03
CP_MIN_TOKENS_PER_RANK = 4096  # the search tries context parallelism down to this many tokens per rank
_AC_RANK = {"none": 0, "selective": 1, "every_k": 2, "full": 3}
# pipeline schedules, simplest first: interleaving, then the split backward, then the V placement
_SCHEDULE_RANK = {"1f1b": 0, "gpipe": 0, "interleaved": 1, "interleaved-zb": 2, "zbv": 3, "dualpipev": 4}


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryBreakdown          # in the convention the search fit-checked with
    step: StepEstimate
    fits: bool
    reason: str = ""
    rank: int = 0
    memories: dict[str, MemoryBreakdown] = field(default_factory=dict)  # every convention asked for
    host_bytes_per_node: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "layout": self.layout.to_dict(), "layout_str": self.layout.short(),
                "fits": self.fits, "reason": self.reason, "fit_convention": self.memory.convention,
                "memory_gb_per_gpu": self.memory.total / 1e9,
                "memory_gb_per_gpu_by_convention": {k: m.total / 1e9 for k, m in self.memories.items()},
                "host_gb_per_node": self.host_bytes_per_node / 1e9,
                "memory": self.memory.as_dict(), "step": self.step.as_dict()}


class SearchResult(list):
    """The ranked candidates (a list), plus what the search did: the convention it fit-checked
    with, the conventions shown, how many layouts it tried, the layouts lmforge would refuse
    (reason -> count), and a note on what it assumed."""

    def __init__(self, cands: list[Candidate], fit_convention: str, conventions: tuple[str, ...],
                 tried: int, refused: dict[str, int], margin: float, note: str = "", offload_tried: bool = False):
        super().__init__(cands)
        self.note = note
        self.offload_tried = offload_tried
        self.fit_convention = fit_convention
        self.conventions = conventions
        self.tried = tried
        self.refused = refused
        self.margin = margin


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def cp_degrees(seq_len: int | None, world: int, min_tokens: int = CP_MIN_TOKENS_PER_RANK) -> list[int]:
    """Context-parallel degrees the search tries: 1, and the powers of two that cut `seq_len` into
    2 x cp equal chunks while leaving each rank at least `min_tokens` tokens of every sequence (CP
    is for sequences whose activations crowd a GPU; shorter slices make small matmuls and a K/V
    all-gather per layer that costs more than it saves)."""
    if seq_len is None:
        return [1]
    return [cp for cp in _pow2_upto(world) if cp == 1 or (seq_len % (2 * cp) == 0 and seq_len // cp >= min_tokens)]


def ep_degrees(model_cfg: ModelConfig, dp: int, cp: int = 1) -> list[int]:
    """Expert-parallel degrees to try: 1, and for an MoE model the powers of two dividing both dp and
    the routed experts (lmforge: not with cp > 1 yet)."""
    m = model_cfg.moe
    if not m.enabled or cp > 1:
        return [1]
    return [e for e in _pow2_upto(dp) if dp % e == 0 and m.num_experts % e == 0]


def enumerate_layouts(model_cfg: ModelConfig, cluster: Cluster, global_batch: int, *,
                      zero_stages: tuple[int, ...] = (0, 1, 2, 3), ac_modes: tuple[str, ...] = ("none", "selective", "full"),
                      precision: str = "bf16", max_micro_batch: int = 16, allow_offload: bool = False,
                      interleaved: bool = True, zero_bubble: bool = True, seq_len: int | None = None,
                      cp_min_tokens: int = CP_MIN_TOKENS_PER_RANK, reduce_every: bool = False,
                      loss_chunk: int = 0) -> list[Layout]:
    """Every layout that uses all GPUs and divides the global batch (in sequences) exactly; with
    `seq_len`, context-parallel degrees too (`cp_degrees`); with pp > 1 the schedules 1f1b, interleaved
    (v = 2, `interleaved`) and the zero-bubble ZB-H1, zbv and dualpipev (`zero_bubble`), each where the
    layers and the micro-batches allow it; with `reduce_every`, FSDP layouts that
    accumulate (grad_accum > 1, no pipeline) also with fsdp_reduce_every_micro_batch (sharded
    gradients between micro-batches, at grad_accum x the reduce-scatter traffic). `loss_chunk`
    (train.loss_chunk as resolved) goes to the layouts with tp = pp = 1, which run the chunked loss."""
    world = cluster.world_size
    out: list[Layout] = []
    for tp, cp in ((tp, cp) for tp in _pow2_upto(cluster.gpus_per_node) for cp in cp_degrees(seq_len, world, cp_min_tokens)):
        if model_cfg.n_heads % tp or model_cfg.kv_heads % tp or world % (tp * cp):
            continue
        for pp in _divisors(model_cfg.n_layers):
            if (world // (tp * cp)) % pp:
                continue
            dp = world // (tp * cp * pp)
            # CP's two attentions: K/V all-gathered, or Ulysses' all-to-all of heads where they split over cp
            cp_modes = ("allgather",) + (("ulysses",) if cp > 1 and ulysses_splits(
                model_cfg.n_heads // tp, model_cfg.kv_heads // tp, cp) else ())
            if global_batch % dp:
                continue
            per_dp = global_batch // dp
            schedules: list[tuple[str, int]] = [("1f1b", 1)]
            if pp > 1 and interleaved and model_cfg.n_layers % (pp * 2) == 0:
                schedules.append(("interleaved", 2))
            if pp > 1 and zero_bubble:  # ZB-H1 (interleaved-zb at v = 1); the V schedules: 2 stages per rank
                schedules += [("interleaved-zb", 1)] + ([("zbv", 2), ("dualpipev", 2)]
                                                        if model_cfg.n_layers % (pp * 2) == 0 else [])
            for mb in _pow2_upto(min(per_dp, max_micro_batch)):
                if per_dp % mb:
                    continue
                ga = per_dp // mb
                if pp > 1 and ga < pp:
                    continue  # fewer micro-batches than stages: most of the pipeline idles
                for zero in zero_stages:
                    if zero and dp * cp == 1:
                        continue
                    if zero == 1 and zero1_through_fsdp(tp, pp):
                        continue  # (under tp / pp lmforge runs ZeRO-1 as zero 2: the same layout, listed once)
                    # CPU offload is FSDP's (CPUOffloadPolicy): sharded layouts only
                    for offload in ((False, True) if allow_offload and zero >= 2 else (False,)):
                        for ac in ac_modes:
                            for sched, v in schedules:
                                if pp > 1 and not pipeline_micro_batches_ok(ga, pp, sched):
                                    continue  # (e.g. zbv / dualpipev: >= 2 pp micro-batches)
                                if ac == "selective" and sched in SPLIT_BACKWARD:
                                    continue  # (one backward per selectively checkpointed region: config rule)
                                # SP splits a CP rank's seq_len / cp tokens over the TP ranks
                                sp_ok = tp > 1 and (seq_len is None or (seq_len // cp) % tp == 0)
                                every = reduce_every and zero >= 2 and ga > 1 and pp == 1
                                # expert parallelism (MoE): EP degrees dividing dp and the experts, with FSDP
                                # (lmforge borrows the EP ranks from dp_shard: parallel.ep)
                                eps = ep_degrees(model_cfg, dp, cp) if zero >= 2 else [1]
                                for sp, re, ep, cpm in itertools.product((True, False) if sp_ok else (False,),
                                                                         (False, True) if every else (False,), eps,
                                                                         cp_modes):
                                    out.append(Layout(dp=dp, zero=zero, cp=cp, cp_mode=cpm, tp=tp, sp=sp, pp=pp,
                                                      pp_schedule=sched,
                                                      virtual_stages=v, micro_batch=mb, grad_accum=ga, ac=ac,
                                                      cpu_offload=offload, precision=precision,
                                                      fsdp_reduce_every_micro_batch=re, ep=ep,
                                                      loss_chunk=loss_chunk if tp == pp == 1 else 0))
    return out


def rampup_note(config: Config | None) -> str:
    """What the search assumes about the config's batch ramp-up ('' when it has none)."""
    if config is None or not config.schedule.batch_rampup_start:
        return ""
    return (f"The config ramps the batch up from {config.schedule.batch_rampup_start} sequences; the search plans "
            f"the full batch. lmforge needs the ramp-up's start and increment to be multiples of micro-batch x dp, "
            f"and refuses a ramp-up with pp > 1.")


def lmforge_refusal(config: Config, layout: Layout, seq_len: int) -> str | None:
    """None if lmforge's config validation accepts `layout` for this run, else its first reason (the
    error `lmforge train` would stop with; all of them: `lmforge.plan.layout.lmforge_refusals`)."""
    refusals = lmforge_refusals(config, layout, seq_len)
    return refusals[0].message if refusals else None


def complexity(layout: Layout) -> tuple:
    """Sort key of how much machinery a layout needs (smaller = simpler). Context parallelism, the
    newest mechanism (a K/V all-gather in every layer, chunked sequences, tested on CPU only), ranks
    after pipelining and before TP, a smaller degree first."""
    return (layout.cpu_offload, layout.pp > 1, _SCHEDULE_RANK[layout.pp_schedule] if layout.pp > 1 else 0, layout.cp,
            layout.cp_mode != "allgather",
            layout.tp > 1, layout.sp, layout.zero, layout.fsdp_reduce_every_micro_batch, _AC_RANK[layout.ac], layout.ep)


def _rank(cands: list[Candidate], margin: float) -> list[Candidate]:
    """Fastest first, but the simplest fitting layout within `margin` of the fastest leads."""
    fitting = sorted((c for c in cands if c.fits), key=lambda c: (-c.step.tokens_per_s, c.memory.total))
    rest = sorted((c for c in cands if not c.fits), key=lambda c: (-c.step.tokens_per_s, c.memory.total))
    if fitting:
        best = fitting[0].step.tokens_per_s
        near = [c for c in fitting if c.step.tokens_per_s >= (1 - margin) * best]
        near.sort(key=lambda c: (complexity(c.layout), -c.step.tokens_per_s, c.memory.total))
        fitting = near + [c for c in fitting if c.step.tokens_per_s < (1 - margin) * best]
    return fitting + rest


def _reason(c: Candidate, cluster: Cluster) -> str:
    L, st, mem = c.layout, c.step, c.memory
    dev = cluster.device
    parts = []
    if L.tp > 1:
        parts.append(f"TP={L.tp} inside a node ({dev.intra_node_gbps:g} GB/s)")
    if L.cp > 1:
        cp_where = "inside a node" if L.tp * L.cp <= cluster.gpus_per_node else "across nodes"
        how = "q, k, v and the output all-to-all (Ulysses)" if L.cp_mode == "ulysses" else "K/V all-gathered"
        parts.append(f"CP={L.cp} {cp_where} ({c.memory.seq_len // L.cp:,} tokens per rank, {how} "
                     f"per layer, {st.comm_s.get('cp', 0.0) / st.step_s:.0%} of the step)")
    zero = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}[L.zero]
    dp_where = "inside a node" if L.tp * L.cp * L.dp <= cluster.gpus_per_node else "across nodes"
    over = f" over dp x cp = {L.shard_ranks} ranks" if L.cp > 1 else ""
    parts.append(f"DP={L.dp} {dp_where} ({zero}{over})")
    if L.fsdp_reduce_every_micro_batch:
        parts.append(f"gradients reduce-scattered after each of the {L.grad_accum} micro-batches (sharded between "
                     f"them: parallel.fsdp_reduce_every_micro_batch = true)")
    if L.pp > 1:
        where = "across nodes" if L.world_size > cluster.gpus_per_node else "inside a node"
        parts.append(f"PP={L.pp} outermost, {where} ({L.pp_schedule}, bubble {st.bubble_fraction:.0%})")
    parts.append(f"AC {L.ac}" + (" (no recompute)" if L.ac == "none" else ""))
    if L.cpu_offload:
        parts.append(f"CPU offload ({c.host_bytes_per_node / 1e9:,.0f} GB host RAM per node)")
    comm_share = st.exposed_comm_s / st.step_s if st.step_s else 0.0
    parts.append(f"exposed comm {comm_share:.0%}")
    parts.append(f"{mem.total / 1e9:.1f}/{dev.memory_gb:g} GB ({mem.convention})")
    return "; ".join(parts)


def search_layouts(model_cfg: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int, *,
                   optimizer: str = "adamw", precision: str = "bf16",
                   weights: str = "lmforge", show: tuple[str, ...] = (), usable_fraction: float = 0.9,
                   top: int | None = 10, include_unfit: bool = False, model_name: str = "model",
                   config: Config | None = None, margin: float = SIMPLER_MARGIN,
                   host_memory_gb: float | None = None, **enum_kw: Any) -> SearchResult:
    """Rank the layouts of `model_cfg` on `cluster` for `global_batch` sequences of `seq_len`
    tokens by estimated tokens/s (fitting ones first), each with a one-line reason.

    `weights` is the convention the search fit-checks with (and whose DP traffic the time model
    uses); `show` adds conventions to compute for the fitting candidates. With `config` (the run's
    config) and `weights="lmforge"`, layouts lmforge refuses are left out. `host_memory_gb` (per
    node; default: the device's catalogue entry) bounds CPU offload. `top=None` returns all."""
    check_convention(weights)
    for conv in show:
        check_convention(conv)
    if global_batch < 1:
        raise ValueError(f"global batch = {global_batch} sequences must be >= 1")
    if top is not None and top < 1:
        raise ValueError(f"top = {top} must be >= 1 (the number of layouts to show)")
    if not 0 < usable_fraction <= 1:
        raise ValueError(f"usable fraction {usable_fraction} must be in (0, 1]")
    if not 0 <= margin < 1:
        raise ValueError(f"margin = {margin} must be in [0, 1)")
    # (reduce_every changes lmforge's FSDP memory and traffic only: the literature conventions count neither)
    enum_kw.setdefault("reduce_every", weights == "lmforge")
    if config is not None:  # the run's train.loss_chunk, as lmforge resolves it on GPUs
        enum_kw.setdefault("loss_chunk", planned_loss_chunk(config, precision))
    layouts = enumerate_layouts(model_cfg, cluster, global_batch, precision=precision, seq_len=seq_len, **enum_kw)
    run = config if config is not None else Config(model=model_cfg)
    compiles = {tp: planned_compile(run, tp) for tp in {lay.tp for lay in layouts}}
    documents = planned_documents(run)  # data.attention = "document": its kernel, the corpus' documents
    doc_tokens = corpus_document_tokens(run) if documents != "none" else 0
    for lay in layouts:  # train.compile as the run resolves it on CUDA (auto: off for MoE, under ZB)
        lay.compile = compiles[lay.tp] and not lay.split_backward
        lay.documents, lay.doc_tokens = documents, doc_tokens
    if not layouts:
        raise ValueError(f"no layout of {cluster.world_size} GPUs divides the global batch of {global_batch} "
                         f"sequences; use a multiple of the GPU count")
    host_gb = host_memory_gb if host_memory_gb is not None else cluster.device.host_memory_gb
    if any(lay.cpu_offload for lay in layouts) and not host_gb:
        raise ValueError(f"CPU offload needs the host RAM per node, which the catalogue does not list for "
                         f"{cluster.device.name}; pass --host-memory-gb (GB of RAM per node)")
    budget = usable_fraction * cluster.device.memory_bytes
    host_budget = usable_fraction * (host_gb or 0) * 1e9
    conventions = tuple(dict.fromkeys((weights, *show)))
    refused: Counter[str] = Counter()
    cands: list[Candidate] = []
    verdicts: dict[tuple, str | None] = {}
    for lay in layouts:
        if config is not None and weights == "lmforge":
            key = (lay.dp > 1, lay.zero, lay.cp, lay.cp_mode, lay.tp, lay.pp, lay.sp, lay.pp_schedule,
                   lay.virtual_stages, lay.micro_batch, lay.grad_accum, lay.cpu_offload, lay.ac,
                   lay.fsdp_reduce_every_micro_batch, lay.ep)
            if key not in verdicts:
                verdicts[key] = lmforge_refusal(config, lay, seq_len)
            if verdicts[key] is not None:
                refused[verdicts[key]] += 1
                continue
        mem = estimate_memory(model_cfg, lay, optimizer, seq_len, weights=weights, model_name=model_name)
        host = mem.cpu_bytes * cluster.gpus_per_node
        fits = mem.total <= budget and host <= host_budget
        if not fits and not include_unfit:
            continue
        step = estimate_step(model_cfg, lay, cluster, seq_len, convention=weights, optimizer=optimizer)
        cands.append(Candidate(lay, mem, step, fits, host_bytes_per_node=host))
    ranked = _rank(cands, margin)
    shown = ranked if top is None else ranked[:top]
    for i, c in enumerate(shown):
        c.rank = i + 1
        c.memories = {conv: (c.memory if conv == weights else
                             estimate_memory(model_cfg, c.layout, optimizer, seq_len, weights=conv, model_name=model_name))
                      for conv in conventions}
        c.reason = _reason(c, cluster)
    if shown and shown[0].fits:
        best = shown[0]
        fastest = max(c.step.tokens_per_s for c in shown if c.fits)
        if best.step.tokens_per_s < fastest:
            best.reason += (f"; simplest layout within {margin:.0%} of the fastest "
                            f"({fastest / best.step.tokens_per_s - 1:.1%} slower)")
        for c in shown[1:]:
            if c.fits:
                diff = best.step.tokens_per_s / c.step.tokens_per_s - 1
                c.reason += f"; {abs(diff):.1%} {'slower' if diff >= 0 else 'faster'} than #1"
    note = rampup_note(config) if weights == "lmforge" else ""
    return SearchResult(shown, weights, conventions, len(layouts), dict(refused), margin, note,
                        offload_tried=any(lay.cpu_offload for lay in layouts))


def explain_winner(cands: list[Candidate], offload_tried: bool = False) -> str:
    """A few sentences on why the top layout wins (for the terminal report)."""
    if not cands:
        if offload_tried:
            return ("No layout fits in memory, CPU offload included (checked against the host RAM per node): add "
                    "GPUs or nodes, or shorten the sequence (ZeRO-3, full recompute and every micro-batch size "
                    "were already tried).")
        return ("No layout fits in memory: add GPUs, shorten the sequence, or let the search also try CPU "
                "offload of the optimizer states and sharded weights with --allow-offload (ZeRO-3, full "
                "recompute and every micro-batch size were already tried).")
    best = cands[0]
    L = best.layout
    lines = [f"#1 {L.short()}: {best.step.tokens_per_s_per_gpu:,.0f} tok/s/GPU, est. MFU {best.step.mfu:.1%} "
             f"(HFU {best.step.hfu:.1%})."]
    lines.append("TP stays inside a node because it communicates at every layer; DP comes next because its "
                 "gradient reduction overlaps with the backward pass; PP is outermost because it only sends "
                 "activations between neighbouring stages.")
    if L.ac == "none":
        lines.append("No activation recompute is needed at this micro-batch, which saves the extra forward "
                     "pass (1/4 of the hardware work) of full recompute.")
    if L.pp > 1:
        lines.append(f"Pipeline bubble {best.step.bubble_fraction:.1%} with {L.grad_accum} micro-batches over {L.pp} stages.")
    if L.cp > 1 and L.cp_mode == "ulysses":
        lines.append(f"Context parallelism splits each {best.memory.seq_len:,}-token sequence over {L.cp} GPUs (two "
                     f"chunks each; Ulysses) and, around attention, exchanges heads for tokens by all-to-alls: each GPU "
                     f"attends over whole sequences for 1/{L.cp} of the query heads and their KV heads, and sends no "
                     f"more per layer as cp grows.")
    elif L.cp > 1:
        lines.append(f"Context parallelism splits each {best.memory.seq_len:,}-token sequence over {L.cp} GPUs (two "
                     f"chunks each, balanced causal work): activations per GPU shrink to 1/{L.cp} plus the whole "
                     f"sequence's K/V, for a K/V all-gather and reduce-scatter in every layer; CP sits just outside "
                     f"TP, and its ranks average gradients with the data-parallel ones.")
    return "\n".join(lines)
