"""Closed-form facts about parallel layouts, shared by the runtime (`lmforge.parallel`) and the
planner (`lmforge.plan`). Standard library only: the planner imports it without torch."""

from __future__ import annotations


def pipeline_bubble(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipelined step: (p-1)/v / (m + (p-1)/v), i.e. (p-1)/(m+p-1) for GPipe and
    1F1B and (p-1)/(v m + p-1) for interleaved 1F1B with v chunks per rank (m micro-batches, p ranks)."""
    if pp < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"pp = {pp}, micro_batches = {micro_batches}, virtual_stages = {virtual_stages} must be >= 1")
    b = (pp - 1) / virtual_stages
    return b / (micro_batches + b)
