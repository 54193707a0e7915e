"""Terminal tables and JSON for `lmforge plan`."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from lmforge.plan.flops import SECONDS_PER_YEAR, StepEstimate
from lmforge.plan.hardware import Cluster
from lmforge.plan.memory import MemoryBreakdown
from lmforge.plan.search import SearchResult, explain_winner


def human_bytes(n: float) -> str:
    if n == 0:
        return "0"
    if n >= 1e12:
        return f"{n / 1e12:,.2f} TB"
    if n >= 1e9:
        return f"{n / 1e9:,.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:,.2f} MB"
    return f"{n / 1e3:,.2f} kB"


def human_seconds(s: float) -> str:
    if s >= SECONDS_PER_YEAR:
        return f"{s / SECONDS_PER_YEAR:,.1f} years"
    if s >= 86400:
        return f"{s / 86400:,.1f} days"
    if s >= 3600:
        return f"{s / 3600:,.1f} h"
    if s >= 60:
        return f"{s / 60:,.1f} min"
    if s >= 1:
        return f"{s:,.2f} s"
    return f"{s * 1e3:,.1f} ms"


def _grid(rows: list[tuple[str, ...]], align: str) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        cells = [f"{c:<{w}}" if a == "<" else f"{c:>{w}}" for c, w, a in zip(r, widths, align)]
        out.append("  " + "  ".join(cells).rstrip())
        if j == 0:
            out.append("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))
    return out


def memory_table(mems: list[MemoryBreakdown], device_bytes: float | None = None, usable_fraction: float = 0.9) -> str:
    """One column per convention (lmforge, megatron, zero-paper) of bytes per GPU and bytes/param."""
    comps = ["weights", "gradients", "master_weights", "optimizer_states"] + (["ema"] if any(m.ema for m in mems) else [])
    head = ("component",) + tuple(x for m in mems for x in (f"{m.convention} /GPU", "B/param"))
    rows: list[tuple[str, ...]] = [head]
    for c in comps:
        rows.append((c.replace("_", " "),) + tuple(x for m in mems for x in (human_bytes(getattr(m, c)), f"{getattr(m, c) / m.params_total:.3f}")))
    rows.append(("= model states",) + tuple(x for m in mems for x in (human_bytes(m.model_states), f"{m.model_states / m.params_total:.3f}")))
    rows.append(("activations",) + tuple(x for m in mems for x in (human_bytes(m.activations), "")))
    rows.append(("buffers",) + tuple(x for m in mems for x in (human_bytes(m.buffers), "")))
    rows.append(("TOTAL per GPU",) + tuple(x for m in mems for x in (human_bytes(m.total), "")))
    if any(m.cpu_bytes for m in mems):
        rows.append(("host memory (offload)",) + tuple(x for m in mems for x in (human_bytes(m.cpu_bytes), "")))
    m0 = mems[0]
    lines = [f"Memory per GPU: {m0.model}, {m0.params_total / 1e9:.3f}B params ({m0.params_per_rank / 1e9:.3f}B on the worst "
             f"rank before ZeRO), {m0.optimizer}, {m0.layout.precision}, seq {m0.seq_len}, worst pipeline stage {m0.stage}"]
    lines += _grid(rows, "<" + ">>" * len(mems))
    phased = [m for m in mems if m.phases]
    if phased:
        m = phased[0]
        lines.append(f"  outside the step ({m.convention}): start-up "
                     f"{human_bytes(m.phases['startup'])} (+ {human_bytes(m.phases['startup_host'])} of host memory "
                     f"while drawing the initial values), validation {human_bytes(m.phases['validation'])}, final "
                     f"save {human_bytes(m.phases['final_save'])}")
    if device_bytes:
        budget = usable_fraction * device_bytes
        for m in mems:
            verdict = "FITS" if m.total <= budget else "DOES NOT FIT"
            lines.append(f"  {m.convention}: {verdict}: {human_bytes(m.total)} of {human_bytes(device_bytes)} "
                         f"({usable_fraction:.0%} usable = {human_bytes(budget)})")
    return "\n".join(lines)


_KIND_WORDS = {"matmul": "matmuls (FLOPs / rate + per-GEMM cost)", "attention": "attention (SDPA)",
               "elementwise": "elementwise (bytes / bandwidth)", "loss": "loss (passes over the logits)",
               "casts": "casts, copies, gradient sums", "optimizer": "optimizer step and clip",
               "host": "host gaps (short kernels)"}


def step_table(step: StepEstimate, cluster: Cluster, assumed_mfu: float | None, precision: str) -> str:
    rows = [("quantity", "value"),
            ("FLOPs per token", f"{step.flops_per_token:.4g}"),
            ("tokens per step", f"{step.tokens_per_step:,}"),
            ("model FLOPs per step", f"{step.model_flops_per_step:.4g}"),
            ("hardware FLOPs per step", f"{step.hardware_flops_per_step:.4g} (x{step.recompute_factor:.3g} recompute)"),
            (f"GPUs x peak ({precision})", f"{step.n_gpus} x {cluster.device.peak_flops(precision) / 1e12:g} TFLOP/s")]
    if step.ideal:
        rows.append(("assumed MFU (end to end, as is)", f"{assumed_mfu:.1%}"))
    else:
        rows.append((f"one rank's step, by op kind ({cluster.device.name}; {step.launches:,.0f} kernels)", ""))
        for kind, secs in step.time_by_kind.items():
            if secs:
                rows.append((f"  {_KIND_WORDS[kind]}", f"{human_seconds(secs)} ({secs / step.compute_s:.0%})"))
        rows += [("compute time per step", human_seconds(step.compute_s)),
                 ("pipeline bubble", f"{step.bubble_fraction:.1%}")]
        for k, v in step.comm_s.items():
            rows.append((f"{k.upper()} communication", human_seconds(v)))
        rows.append(("exposed communication", human_seconds(step.exposed_comm_s)))
    rows += [("step time", human_seconds(step.step_s)),
             ("tokens/s (cluster)", f"{step.tokens_per_s:,.0f}"),
             ("tokens/s per GPU", f"{step.tokens_per_s_per_gpu:,.0f}"),
             ("MFU (model FLOPs, PaLM)", f"{step.mfu:.1%}"),
             ("HFU (hardware FLOPs, with recompute)", f"{step.hfu:.1%}")]
    if step.train_s is not None:
        rows += [("training tokens", f"{step.train_tokens:.4g}"),
                 ("training time", human_seconds(step.train_s)),
                 ("GPU-hours", f"{step.gpu_hours:,.0f}")]
        if step.cost is not None:
            rows.append((f"cost at ${step.price_per_gpu_hour:g}/GPU-hour", f"${step.cost:,.0f}"))
    head = "Compute and time:" if step.ideal else (
        "Compute and time (time model per op kind, constants fitted to an H100: lmforge/plan/hardware.py):")
    return "\n".join([head] + _grid(rows, "<>"))


def _refusal_kinds(refused: dict[str, int]) -> list[tuple[str, int]]:
    """Refusal reasons grouped by kind (the message with its numbers blanked), most frequent first;
    each kind shown by its first message."""
    kinds: dict[str, list] = {}
    for why, n in refused.items():
        kind = re.sub(r"\d+", "#", why)
        entry = kinds.setdefault(kind, [why, 0])
        entry[1] += n
    return sorted(((why, n) for why, n in kinds.values()), key=lambda kv: -kv[1])


_CONVENTION_WORDS = {"lmforge": "what lmforge allocates", "megatron": "Megatron-LM's estimator, 18 B/param",
                     "zero-paper": "the ZeRO paper's 16 B/param"}


def candidates_table(cands: SearchResult, cluster: Cluster, usable_fraction: float = 0.9) -> str:
    fit = cands.fit_convention
    budget = usable_fraction * cluster.device.memory_gb
    head = (f"Layout search, fit-checked with the {fit} convention ({_CONVENTION_WORDS[fit]}): "
            f"{usable_fraction:.0%} of {cluster.device.memory_gb:g} GB = {budget:g} GB per GPU usable; "
            f"{cands.tried:,} layouts tried.")
    lines = [head]
    if cands.refused:
        lines.append(f"Left out {sum(cands.refused.values()):,} layouts that lmforge refuses with this config, e.g.:")
        lines += [f"  {n:,} x {why}" for why, n in _refusal_kinds(cands.refused)[:6]]
    if cands.note:
        lines.append(cands.note)
    if not cands:
        return "\n".join(lines + ["Search: " + explain_winner(cands, cands.offload_tried)])
    mem_cols = tuple(f"GB {c}" for c in cands.conventions)
    rows = [("#", "layout", "tok/s/GPU", "MFU", "HFU", "step", "bubble") + mem_cols + ("fits",)]
    for c in cands:
        rows.append((str(c.rank), c.layout.short(), f"{c.step.tokens_per_s_per_gpu:,.0f}", f"{c.step.mfu:.1%}",
                     f"{c.step.hfu:.1%}", human_seconds(c.step.step_s), f"{c.step.bubble_fraction:.1%}")
                    + tuple(f"{c.memories[conv].total / 1e9:.1f}" for conv in cands.conventions)
                    + ("yes" if c.fits else "no",))
    lines.append(f"Ranked by estimated throughput; the simplest layout within {cands.margin:.0%} of the fastest "
                 f"goes first. GB/GPU under each convention; 'fits' is by {fit}:")
    lines += _grid(rows, "><>>>>>" + ">" * len(mem_cols) + ">")
    lines.append("Why:")
    lines += [f"  #{c.rank}: {c.reason}" for c in cands[:5]]
    lines.append(explain_winner([c for c in cands if c.fits]))
    return "\n".join(lines)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(_clean(report), indent=2, sort_keys=False)
