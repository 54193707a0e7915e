"""The pipeline schedules' bubble and activation formulas (lmforge.spec.parallel) against torch's
own schedules, and their config rules.

torch.distributed.pipelining builds each multi-stage schedule as a list of actions per rank (forward
F, input gradient I, weight gradient W, full backward B, DeepSeek's overlapped F&B). `replay` runs
those lists as a list scheduler would: each rank takes its actions in order, each starting when the
rank is free and its inputs exist (F after the previous stage's F of the micro-batch, I / B after
the next stage's I and its own F, W after its I), F, I and W lasting `f`, `b`, `w` per stage (B: b +
w; stage 0's I is torch's no-op, its W the whole backward), communication free. The idle share of
the busiest-idle rank is the schedule's bubble fraction; a rank's peak count of micro-batches
forwarded but not yet through W (or B) is the activation it holds (torch keeps a micro-batch's graph
from its forward until its weight pass). No process group: the stages are stand-ins that carry the
indices the schedule classes read.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed import pipelining
from torch.distributed.pipelining.schedules import _ComputationType as Op

from lmforge.config import ConfigError, load_config
from lmforge.spec.parallel import (PP_SCHEDULE_CLASSES, V_SHAPED, pipeline_bubble, pipeline_in_flight,
                                       rank_stages, stage_rank)


class _Stage:
    """What a schedule class reads of a PipelineStage when it builds its action lists."""

    def __init__(self, index: int, n_stages: int, pp: int, rank: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.has_backward = True


def actions(schedule: str, pp: int, m: int, v: int) -> dict[int, list]:
    """torch's compute actions of every rank (rank 0's schedule object computes them all)."""
    ids = rank_stages(schedule, pp, 0, v)
    cls = getattr(pipelining, PP_SCHEDULE_CLASSES[schedule])
    order = cls([_Stage(s, pp * len(ids), pp, 0) for s in ids], n_microbatches=m).pipeline_order
    compute = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.FULL_BACKWARD, Op.OVERLAP_F_B)
    return {r: [a for a in order[r] if a is not None and a.computation_type in compute] for r in order}


GIVES = {Op.FORWARD: ("F",), Op.BACKWARD_INPUT: ("I",), Op.BACKWARD_WEIGHT: ("W",), Op.FULL_BACKWARD: ("I", "W")}


def _parts(a) -> list:
    return list(a.sub_actions) if a.computation_type == Op.OVERLAP_F_B else [a]


def replay(order: dict[int, list], n_stages: int, f: float, b: float, w: float) -> float:
    """The bubble fraction of `order` with stage times f, b, w (module docstring)."""
    def duration(a) -> float:
        op, first = a.computation_type, a.stage_index == 0
        return {Op.FORWARD: f, Op.BACKWARD_INPUT: 0.0 if first else b, Op.BACKWARD_WEIGHT: b + w if first else w,
                Op.FULL_BACKWARD: b + w}[op]

    def needs(a) -> list:
        op, s, mb = a.computation_type, a.stage_index, a.microbatch_index
        if op == Op.FORWARD:
            return [("F", s - 1, mb)] if s else []
        if op == Op.BACKWARD_WEIGHT:
            return [("I", s, mb)]
        return [("F", s, mb)] + ([("I", s + 1, mb)] if s < n_stages - 1 else [])

    def gives(a) -> list:
        return [(k, a.stage_index, a.microbatch_index) for k in GIVES[a.computation_type]]

    done: dict = {}
    clock, busy, at = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
    moved = True
    while moved:
        moved = False
        for r, acts in order.items():
            while at[r] < len(acts):
                parts = _parts(acts[at[r]])
                deps = [d for p in parts for d in needs(p)]
                if any(d not in done for d in deps):
                    break
                end = max([clock[r]] + [done[d] for d in deps]) + sum(duration(p) for p in parts)
                busy[r] += sum(duration(p) for p in parts)
                clock[r] = end
                done.update({g: end for p in parts for g in gives(p)})
                at[r] += 1
                moved = True
    assert all(at[r] == len(order[r]) for r in order), "the schedule deadlocked"
    return 1 - min(busy.values()) / max(clock.values())


def held(order: dict[int, list], rank: int, per_rank: int) -> float:
    """Peak micro-batches (of all the rank's layers) forwarded and not yet through W or B."""
    count = peak = 0
    for a in order[rank]:
        for p in _parts(a):
            count += {Op.FORWARD: 1, Op.BACKWARD_WEIGHT: -1, Op.FULL_BACKWARD: -1}.get(p.computation_type, 0)
            peak = max(peak, count)
    return peak / per_rank


CASES = [("interleaved", 2), ("interleaved-zb", 1), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("schedule, v", CASES, ids=[f"{s}-v{v}" for s, v in CASES])
def test_bubble_and_in_flight_formulas_replay_torch_schedules(schedule, v, pp, m):
    """F = B = W (the planner's times): every schedule's bubble fraction is its formula's exactly, and
    so is the activation each rank holds. With the recomputed forward in B (full checkpointing: B =
    2F) the formulas hold exactly for interleaved 1F1B, ZB-H1 / interleaved-zb and ZB-V; DualPipeV's
    (DeepSeek's F&B + B - 3W, no overlap) is an upper bound within 25% (7% at p = 4, m = 8)."""
    order = actions(schedule, pp, m, v)
    per_rank = 2 if schedule in V_SHAPED else v
    chunk = 1 / per_rank  # (a stage is 1 / per_rank of the rank's layers)
    assert replay(order, pp * per_rank, chunk, chunk, chunk) == pytest.approx(
        pipeline_bubble(pp, m, v, schedule), rel=1e-9)
    recomputed, planned = replay(order, pp * per_rank, chunk, 2 * chunk, chunk), pipeline_bubble(pp, m, v, schedule,
                                                                                                   recompute=1.0)
    if schedule == "dualpipev":
        assert 0.75 * planned <= recomputed <= planned
    else:
        assert recomputed == pytest.approx(planned, rel=1e-9)
    for rank in (0, pp - 1):
        assert held(order, rank, per_rank) == pytest.approx(pipeline_in_flight(schedule, pp, m, rank, v)) or \
            (schedule == "interleaved" and rank > 0)  # (lmforge counts interleaved's later ranks as 1F1B's warm-up)


def test_zero_bubble_formulas_rank_the_schedules_as_published():
    """At p = 4, m = 8: 1F1B 3/11; interleaved (v = 2) 1.5/9.5; ZB-H1 a third of 1F1B's idle time,
    3/27 (Qi et al.: (p-1)/3m of the work); ZB-V 1.5/25.5; DualPipeV as ZB-H1 with F = B = W. ZB-H1,
    ZB-V and interleaved-zb hold p micro-batches on every rank, DualPipeV p + 1/2, GPipe all m."""
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert pipeline_bubble(4, 8, 2, "interleaved") == pytest.approx(1.5 / 9.5)
    assert pipeline_bubble(4, 8, 1, "interleaved-zb") == pytest.approx(3 / 27)
    assert pipeline_bubble(4, 8, 1, "zbv") == pytest.approx(1.5 / 25.5)
    assert pipeline_bubble(4, 8, 1, "dualpipev") == pytest.approx(3 / 27)
    assert pipeline_bubble(1, 8, 1, "zbv") == 0.0
    assert [pipeline_in_flight(s, 4, 8, 3) for s in ("gpipe", "1f1b", "interleaved-zb", "zbv", "dualpipev")] == \
        [8, 1, 4, 4, 4.5]
    assert [rank_stages("zbv", 4, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_rank("dualpipev", 4, s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages("interleaved-zb", 4, 1, 2) == [1, 5] and stage_rank("interleaved-zb", 4, 5) == 1
    with pytest.raises(ValueError, match="is not one of"):
        pipeline_bubble(4, 8, 1, "zb-h2")


BATCH = {"train.global_batch_size": 64, "train.micro_batch_size": 4, "model.tie_embeddings": False}


@pytest.mark.parametrize("bad, message", [
    ({"parallel.pp_schedule": "zbv", "parallel.pp_virtual_stages": 3}, "places exactly 2 stages per rank"),
    ({"parallel.pp_schedule": "zbv", "parallel.pp": 2, "model.n_layers": 2}, "2 stages per rank (zbv) = 4 pipeline "
                                                                               "stages must divide model.n_layers = 2"),
    ({"parallel.pp_schedule": "dualpipev", "parallel.pp": 4, "train.global_batch_size": 24, "model.n_layers": 8},
     "must be >= 2 x parallel.pp = 8"),
    ({"parallel.pp_schedule": "interleaved-zb", "parallel.pp": 4, "train.global_batch_size": 24,
      "model.n_layers": 4}, "must be a multiple of parallel.pp = 4"),
    ({"parallel.pp_schedule": "zbv", "parallel.pp": 2, "train.compile": True}, "pytorch/pytorch#161904"),
    ({"parallel.pp_schedule": "zbv", "parallel.pp": 2, "train.compile": "model"}, "train.compile = model with"),
    ({"parallel.pp_schedule": "interleaved-zb", "parallel.pp": 2, "train.activation_checkpoint": "selective"},
     "Trying to backward an extra time"),
])
def test_zero_bubble_config_rules(bad, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", {**BATCH, **bad})


def test_zero_bubble_configs_that_run():
    """The stages per rank each schedule places, the compile choice, and the micro-batches adapted to
    fill a V (>= 2 pp)."""
    from lmforge.config.rules import resolve_compile

    cfg = load_config("tiny", {**BATCH, "parallel.pp": 2, "parallel.pp_schedule": "dualpipev"})
    assert cfg.parallel.stages_per_rank == 2 and cfg.parallel.split_backward
    assert resolve_compile(cfg, "cuda", (9, 0), gpu_compiles=True)[0] is False
    cfg = load_config("tiny", {**BATCH, "parallel.pp": 2, "parallel.pp_schedule": "interleaved-zb"})
    assert cfg.parallel.stages_per_rank == 1  # (ZB-H1)
    cfg = load_config("tiny", {"model.tie_embeddings": False, "train.global_batch_size": 16, "parallel.pp": 2,
                               "parallel.pp_schedule": "zbv", "train.activation_checkpoint": "full"})
    assert cfg.grad_accum_steps >= 4 and cfg.train.micro_batch_size <= 4  # (the preset's micro-batch adapted)
