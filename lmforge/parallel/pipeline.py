"""Pipeline parallelism with `torch.distributed.pipelining` (manual stage modules, no tracing).

The model is split into ``pp x v`` stages of consecutive blocks (v = ``parallel.pp_virtual_stages``
for the interleaved schedule, else 1). Pipeline rank r holds stages r, r + pp, r + 2pp, ... (the
"loop" placement ScheduleInterleaved1F1B expects). Stage 0 also holds the token (and position)
embedding; the last stage holds the final norm, the output head and the loss.

    stage_ids = split_model(model, cfg, info)       # deletes the parts this rank does not hold
    runner = PipelineRunner(model, stage_ids, cfg, info, wrap=...)   # after TP / AC / compile
    loss = runner.step(micro_batches, n_tokens, dp)  # the whole step's forward + backward

Names stay those of the full model (``blocks`` is a ModuleDict keyed by layer index), so a stage's
state dict is a slice of the full one and checkpoints / gathered weights line up.

The micro-batches of the schedule are the step's micro-batches (concatenated along the batch dim
and re-split by the schedule, so micro-batch i holds exactly the sequences of the trainer's
micro-batch i). Loss: summed token NLL / the global step's target-token count (x dp against the
data-parallel gradient averaging), as in Trainer.forward_backward; ``scale_grads=False`` so the
schedule does not divide by the micro-batch count again. The loss lives on the last stage and is
all-reduced so every rank logs the same number.

Bubble fraction (idle share of each rank per step): (p - 1) / (m + p - 1) for GPipe and 1F1B,
(p - 1) / (v m + p - 1) for interleaved 1F1B with v chunks per rank (m micro-batches, p ranks).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmforge.config import Config

log = logging.getLogger("lmforge.parallel")


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(v m + p-1): the planner's formula (lmforge.plan.flops.pipeline_bubble), one definition."""
    from lmforge.plan.flops import pipeline_bubble

    return pipeline_bubble(pp, microbatches, virtual_stages)


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    per = n_layers // n_stages
    return list(range(stage * per, (stage + 1) * per))


def split_model(model: nn.Module, cfg: Config, pp_rank: int) -> list[int]:
    """Keep only this pipeline rank's stages in `model` (in place); returns its stage indices."""
    p = cfg.parallel
    v = p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1
    n_stages = p.pp * v
    stage_ids = [pp_rank + i * p.pp for i in range(v)]
    keep = {str(i) for s in stage_ids for i in stage_layers(cfg.model.n_layers, n_stages, s)}
    for name in [n for n in model.blocks if n not in keep]:
        del model.blocks[name]
    if 0 not in stage_ids:
        model.tok_emb = None
        model.pos_emb = None
    if n_stages - 1 not in stage_ids:
        model.norm = None
        model.lm_head = None
    return stage_ids


class StageChunk(nn.Module):
    """One pipeline stage: [embedding] -> its blocks -> [norm -> head]. Holds the full model's modules
    (not copies), under the full model's names."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.emb_dropout = model.emb_dropout
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self._rope = (model.rope_cos, model.rope_sin) if model.cfg.pos_emb == "rope" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            seq = x.shape[1]
            h = self.tok_emb(x)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(seq, device=x.device))
            x = self.emb_dropout(h)
        for block in self.blocks.values():
            x = block(x, self._rope)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


class PipelineRunner:
    """The stages of this rank and their schedule; `step` runs one optimizer step's forward/backward."""

    def __init__(self, model: nn.Module, stage_ids: list[int], cfg: Config, info, wrap, autocast):
        """`wrap(chunk) -> module`: data-parallel wrapping of a stage (DDP / fully_shard / identity)."""
        from torch.distributed import pipelining

        p = cfg.parallel
        self.cfg, self.info, self.autocast = cfg, info, autocast
        self.v = len(stage_ids)
        n_stages = p.pp * self.v
        self.microbatches = cfg.grad_accum_steps
        self.first = 0 in stage_ids
        self.last = n_stages - 1 in stage_ids
        pp_group = info.group("pp")
        self.chunks, self.stages = [], []
        for s in stage_ids:
            chunk = StageChunk(model, stage_layers(cfg.model.n_layers, n_stages, s), s == 0, s == n_stages - 1)
            chunk = wrap(chunk)
            self.chunks.append(chunk)
            self.stages.append(pipelining.PipelineStage(chunk, s, n_stages, info.device, group=pp_group))
        cls = getattr(pipelining, SCHEDULES[p.pp_schedule])
        stages = self.stages if p.pp_schedule == "interleaved" else self.stages[0]
        self.schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
        self.tp = p.tp
        self.bubble = bubble_fraction(p.pp, self.microbatches, self.v)
        self._n_tokens = torch.ones(())
        self._dp = 1
        if info.rank == 0:
            log.info("pipeline: %s schedule, %d ranks x %d stage(s) each = %d stages, %d micro-batches per step; "
                     "bubble fraction (p-1)/(%sm+p-1) = %.3f", p.pp_schedule, p.pp, self.v, n_stages, self.microbatches,
                     "v" if self.v > 1 else "", self.bubble)

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        loss = nll / self._n_tokens
        return loss * self._dp if self._dp > 1 else loss

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], n_tokens: torch.Tensor,
             dp: int) -> torch.Tensor:
        """Forward + backward of the step's micro-batches through the pipeline; returns the step's mean
        token loss (the same value on every rank)."""
        from lmforge.parallel.tensor_parallel import loss_parallel_context, to_local_value

        assert len(micro_batches) == self.microbatches, (len(micro_batches), self.microbatches)
        self._n_tokens, self._dp = n_tokens, dp
        losses: list[torch.Tensor] = []  # the schedule's per-micro-batch loss_fn outputs (last stage)
        x = torch.cat([mb[0] for mb in micro_batches])
        y = torch.cat([mb[1] for mb in micro_batches])
        with loss_parallel_context(self.tp), self.autocast():
            if self.first:
                self.schedule.step(x, target=y if self.last else None, losses=losses if self.last else None)
            elif self.last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        total = torch.zeros((), device=self.info.device)
        if self.last:
            for loss in losses:  # (not counted inside loss_fn: the first step also runs it for shape inference)
                total += to_local_value(loss.detach()).to(total.device) / dp
            if self.info.tp_rank != 0:  # every TP rank of the last stage holds the same value: count it once
                total.zero_()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # over dp (partial sums) and pp (only the last stage)
        return total
