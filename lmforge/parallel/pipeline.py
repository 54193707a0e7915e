"""Pipeline parallelism with `torch.distributed.pipelining` (manual stage modules, no tracing).

The model is split into ``pp x v`` stages of consecutive blocks, v stages per pipeline rank
(`ParallelConfig.stages_per_rank`: ``parallel.pp_virtual_stages`` for interleaved / interleaved-zb,
2 for zbv / dualpipev, else 1), placed as the schedule expects
(lmforge.spec.parallel.rank_stages): in a loop, rank r holds stages r, r + pp, r + 2pp, ...
(ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble), or in a V, rank r holds stages r and
2pp - 1 - r (ScheduleZBVZeroBubble, ScheduleDualPipeV: rank 0 holds the first and the last stage).
Stage 0 also holds the token (and position) embedding; the last stage holds the final norm, the
output head and the loss. Tied embeddings (Megatron's embedding group): the last stage's head keeps
its own copy of the embedding, held by the embedding module as in one process (named
tok_emb.weight, so it starts from the same values, loads the same checkpoint entry and joins the
same optimizer group); after each step's backward the first- and last-stage ranks of each pipeline
sum the two copies' gradients (`reduce_tied_gradients`), the norm counts the weight once, and the
copies stay bit-equal. In a V rank 0 holds both stages and one parameter.

    stage_ids = split_model(model, cfg, pp_rank)    # parallelize step 1: drop the parts this rank does not hold
    layout = Pipelined(model, cfg, info, precision, stage_ids)   # step 5, after TP / AC / compile
    loss = layout.forward_backward(micro_batches, precision)     # the whole step through the schedule

Names stay those of the full model (``blocks`` is a ModuleDict keyed by layer index), so a stage's
state dict is a slice of the full one and checkpoints / streamed weights line up, whatever the
schedule (a checkpoint saved under one schedule resumes under another, or in one process).

The micro-batches of the schedule are the step's micro-batches (concatenated along the batch dim
and re-split by the schedule, so micro-batch i holds exactly the sequences of the trainer's
micro-batch i). Loss: summed token NLL / the global step's target-token count (x dp against the
data-parallel gradient averaging), as in `Layout.forward_backward`; ``scale_grads=False`` so the
schedule does not divide by the micro-batch count again. Each stage chunk is wrapped with FSDP2 on
the data-parallel sub-mesh when dp > 1 (pure replication is FSDP2 on a (dp_replicate, dp_shard = 1)
mesh: DDP's bucket rebuild breaks under a pipeline schedule). Evaluation and sampling run the stages
where they lie (lmforge.parallel.inference): no rank gathers the model. The loss lives on
the last stage and is all-reduced so every rank logs the same number.

Zero-bubble schedules (interleaved-zb, zbv, dualpipev) split each micro-batch's backward in two:
`stage_backward_input` (the input gradient, sent on at once) keeps the autograd graph and hooks the
nodes where the weights' paths meet it; `stage_backward_weight` later runs the weights' part from
there and adds it into ``.grad``. The stage modules need nothing special for it: a block is plain
autograd (the MoE layers' custom functions included), and full / every_k activation checkpointing
(non-reentrant) recomputes a region once for the input pass and keeps it for the weight pass.
Selective checkpointing allows a single backward through a region (torch raises "Trying to backward
an extra time") and torch.compile'd blocks are refused by torch's schedules (pytorch/pytorch#161904):
config rules say so up front (lmforge.config.rules.check_pipeline). Stage 0's input is the token ids
(no gradient), so torch runs its whole backward in the weight pass.

Bubble fraction (idle share of each rank per step) and the micro-batches of activations held:
lmforge.spec.parallel.pipeline_bubble / pipeline_in_flight, e.g. (p - 1) / (m + p - 1) for
GPipe and 1F1B, (p - 1) / (v m + p - 1) for interleaved 1F1B (m micro-batches, p ranks).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config
from lmforge.model.layers import KVCache, block_inputs, local_positions, scale_embedding, token_positions
from lmforge.model.loss import normalise, token_nll_sum
from lmforge.model.transformer import Transformer
from lmforge.spec.parallel import (PP_SCHEDULE_CLASSES, V_SHAPED, pipeline_bubble, rank_stages, stage_layers,
                                   stage_rank)
from lmforge.parallel.clip import clip_grad_norm_sharded_
from lmforge.parallel.fsdp import apply_fsdp, fsdp_description
from lmforge.parallel.inference import ShardedInference
from lmforge.parallel.layout import Batch, ShardedLayout
from lmforge.parallel.mesh import DistInfo
from lmforge.parallel.tensor_parallel import loss_parallel_context, to_local_value


def split_model(model: nn.Module, cfg: Config, pp_rank: int) -> list[int]:
    """Keep only this pipeline rank's stages in `model` (in place); returns its stage indices, in the
    order its schedule lists them (lmforge.spec.parallel.rank_stages)."""
    p = cfg.parallel
    n_stages = p.pp * p.stages_per_rank
    stage_ids = rank_stages(p.pp_schedule, p.pp, pp_rank, p.pp_virtual_stages)
    keep = {str(i) for s in stage_ids for i in stage_layers(cfg.model.n_layers, n_stages, s)}
    for name in [n for n in model.blocks if n not in keep]:
        del model.blocks[name]
    if 0 not in stage_ids:
        # a tied head keeps the embedding module as its weight's owner, so the last stage's copy goes by
        # the one-process name (tok_emb.weight: its initial values, checkpoint key, optimizer group)
        if not (cfg.model.tie_embeddings and n_stages - 1 in stage_ids):
            model.tok_emb = None
        model.pos_emb = None
    if n_stages - 1 not in stage_ids:
        model.norm = None
        model.lm_head = None
    return stage_ids


def embedding_group(info: DistInfo, last_rank: int) -> dist.ProcessGroup | None:
    """Megatron's embedding group: for each (dp, cp, tp) coordinate the 2 ranks holding the first stage
    (pp rank 0) and the last (`last_rank`) of one pipeline, which sum their tied weight's gradients;
    None in a V (rank 0 holds both) and on the ranks of neither. A collective: every rank calls it."""
    if last_rank == 0:
        return None
    names = info.mesh.mesh_dim_names
    ranks = info.mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, info.pp_size)[:, [0, last_rank]]
    group, _ = dist.new_subgroups_by_enumeration(ranks.tolist())
    return group


class StageChunk(nn.Module):
    """One pipeline stage: [embedding] -> its blocks -> [norm -> head]. Holds the full model's modules
    (not copies), under the full model's names."""

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self.first = first
        # the last stage of a tied model holds the embedding module too (unused in its forward): the head's
        # weight is the embedding's, and FSDP2 keeps a tie only between modules of one fully_shard root
        self.tok_emb = model.tok_emb if first or (last and model.cfg.tie_embeddings) else None
        self.pos_emb = model.pos_emb if first else None
        self.emb_dropout = model.emb_dropout
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self._model = [model]  # (not a submodule) its RoPE tables, read at each forward: made after materialising

    def forward(self, x: torch.Tensor, kv_caches: list[KVCache] | None = None, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """A stage's forward; `kv_caches` (sampling, lmforge.parallel.inference): one per layer of the
        whole model, this stage's blocks use theirs. `doc_ids` / `positions` (data.attention =
        "document", as `Transformer.forward` takes them): every stage receives its micro-batch's, the
        schedule's keyword arguments, so each builds the document mask of its own blocks."""
        model = self._model[0]
        caches = [kv_caches[int(name)] for name in self.blocks] if kv_caches else [None] * len(self.blocks)
        positions = local_positions(positions)
        if self.first:
            h = scale_embedding(model.cfg, self.tok_emb(x))
            if self.pos_emb is not None:
                start = caches[0].length if caches[0] is not None else 0
                h = h + self.pos_emb(token_positions(start, x.shape[1], x.device) if positions is None else positions)
            x = self.emb_dropout(h)
        ropes, masks = block_inputs(model, positions, doc_ids, model.cfg.dropout if self.training else 0.0)
        for block, cache in zip(self.blocks.values(), caches):
            x = block(x, ropes[block.local], cache, mask=masks[block.local])
        if self.lm_head is not None:
            x = self.lm_head(model.scale_output(self.norm(x)))  # (μP's logits multiplier)
        return x


class Pipelined(ShardedLayout):
    """This rank's stages and their schedule; `forward_backward` runs one optimizer step."""

    name = "pp"

    def __init__(self, model: Transformer, cfg: Config, dist_info: DistInfo, precision: str, stage_ids: list[int]):
        from torch.distributed import pipelining

        super().__init__(model, cfg, dist_info, precision)
        p = cfg.parallel
        self.v, self.stage_ids = len(stage_ids), stage_ids
        n_stages = p.pp * self.v
        self.microbatches = cfg.grad_accum_steps
        self.first, self.last = 0 in stage_ids, n_stages - 1 in stage_ids
        self.chunks, self.stages = [], []
        # a tied weight in a V: rank 0's first and last stage chunks share one parameter, which two FSDP2
        # roots cannot both shard; it stays whole (replicated over dp) and its gradient is averaged here
        self.whole_tied = cfg.model.tie_embeddings and self.first and self.last and p.dp * p.cp > 1
        for s in stage_ids:
            chunk = StageChunk(model, stage_layers(cfg.model.n_layers, n_stages, s), s == 0, s == n_stages - 1)
            if p.dp * p.cp > 1:  # (over dp_shard x cp with context parallelism)
                chunk = apply_fsdp(chunk, cfg, dist_info, precision,
                                   ignored={model.tok_emb.weight} if self.whole_tied else None)
            self.chunks.append(chunk)
            self.stages.append(pipelining.PipelineStage(chunk, s, n_stages, dist_info.device,
                                                        group=dist_info.group("pp")))
        if self.whole_tied:  # (FSDP2's mixed precision leaves it fp32: the head's 16-bit input meets it in its dtype)
            model.lm_head.register_forward_pre_hook(lambda m, args: (args[0].to(m.weight.dtype), *args[1:]))
        cls = getattr(pipelining, PP_SCHEDULE_CLASSES[p.pp_schedule])
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)  # (a list of this rank's stages)
        self.schedule = cls(self.stages if multi else self.stages[0], n_microbatches=self.microbatches,
                            loss_fn=self._loss, scale_grads=False)
        self.bubble = pipeline_bubble(p.pp, self.microbatches, p.pp_virtual_stages, p.pp_schedule)
        self.last_rank = stage_rank(p.pp_schedule, p.pp, n_stages - 1)  # (holds the loss: pp - 1, or 0 in a V)
        self._n_targets = torch.ones(())
        self.embedding_group = embedding_group(dist_info, self.last_rank) if cfg.model.tie_embeddings else None

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return normalise(token_nll_sum(logits, y), self._n_targets, self.dp)

    def forward_backward(self, micro_batches: list[Batch], precision) -> torch.Tensor:
        """Forward + backward of the step's micro-batches through the schedule (the schedule's
        micro-batch i is exactly the trainer's micro-batch i); returns the step's mean token loss,
        the same value on every rank. One autocast context (none in bf16-pure) and `precision.step` span the schedule, so
        each weight is cast to 16 bits once per step however many micro-batches are in flight."""
        assert len(micro_batches) == self.microbatches, (len(micro_batches), self.microbatches)
        docs = self.document_inputs(torch.cat([mb[0] for mb in micro_batches]))  # (whole sequences: before CP cuts)
        micro_batches, sharded = self.local_sequences(micro_batches)  # (context parallel: this rank's chunks)
        self._n_targets = self.last_targets = self.global_targets(micro_batches)
        losses: list[torch.Tensor] = []  # the schedule's per-micro-batch loss_fn outputs (last stage)
        x = torch.cat([mb[0] for mb in micro_batches])
        y = torch.cat([mb[1] for mb in micro_batches])
        with loss_parallel_context(self.cfg.parallel.tp), precision.step(*self.chunks), precision.training_forward(), sharded, \
                self.moe_step(len(micro_batches)):
            # (the document ids reach every stage: keyword arguments of the schedule, split like x)
            if self.first:
                self.schedule.step(x, target=y if self.last else None, losses=losses if self.last else None, **docs)
            elif self.last:
                self.schedule.step(target=y, losses=losses, **docs)
            else:
                self.schedule.step(**docs)
        self.reduce_tied_gradients()
        total = torch.zeros((), device=self.dist.device)
        if self.last:
            for loss in losses:  # (not counted inside loss_fn: the first step also runs it for shape inference)
                total += to_local_value(loss.detach()).to(total.device) / self.dp
            if self.dist.tp_rank != 0:  # every TP rank of the last stage holds the same value: count it once
                total.zero_()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # over dp x cp (partial sums) and pp (only the last stage)
        return total

    def reduce_tied_gradients(self) -> None:
        """Tied embeddings (Megatron's embedding group): the first stage's embedding and the last stage's
        head are two copies of one weight, each with its stage's part of the gradient; summing the two
        (over this rank's 2-rank embedding group, before clipping and the optimizer step) gives both the
        one-process gradient, so the copies stay bit-equal. FSDP2 / TP shards line up (both copies are
        sharded alike), so the local shards are summed. In a V (zbv, dualpipev) rank 0 holds both stages
        and one parameter: autograd has summed the two uses already; with dp > 1 it is outside FSDP2
        (`whole_tied`), so its gradient is averaged over the data-parallel ranks here, as FSDP2 would."""
        if self.whole_tied:
            grad = self.model.tok_emb.weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=self.dist.dp_cp_group)
            local.div_(self.dp)
        if self.embedding_group is None or not (self.first or self.last):
            return
        weight = self.model.tok_emb.weight
        grad = weight.grad
        if grad is None:  # (a stage that ran no micro-batch: nothing to add, but its peer waits for the sum)
            grad = weight.grad = torch.zeros_like(weight)
        if hasattr(grad, "placements") and grad.placements != weight.placements:
            # (TP's embedding backward leaves its gradient replicated, the head's is vocab-sharded like the weight)
            grad = weight.grad = grad.redistribute(placements=weight.placements)
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.embedding_group)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The sharded global norm, with a tied weight's last-stage copy scaled but not counted (its
        gradient equals the first stage's: the one-process norm counts the weight once)."""
        copy = [self.model.tok_emb.weight] if self.embedding_group is not None and self.last and not self.first else []
        return clip_grad_norm_sharded_(self.params(), max_norm, self.dist, uncounted=copy)

    def forward_roots(self) -> list[nn.Module]:
        return list(self.chunks)  # (with dp > 1 each is an FSDP2 root: the model holds its blocks, not it)

    def inference_model(self) -> ShardedInference:
        """Evaluation and sampling through the stages where they lie (lmforge.parallel.inference)."""
        return ShardedInference(self)

    def compile_model(self, mode: str | None) -> None:
        """train.compile = model under a pipeline: each of this rank's stages (its embedding, blocks,
        norm and head) compiled as one graph of static shapes, what the schedule calls per micro-batch
        (the loss is the schedule's, outside). Evaluation and sampling run the stages' eager modules
        (`self.chunks`: other shapes, KV caches that grow per token)."""
        for stage, chunk in zip(self.stages, self.chunks):
            stage.submod = torch.compile(chunk, mode=mode, fullgraph=True, dynamic=False)

    def describe(self) -> Iterator[str]:
        p = self.cfg.parallel
        where = ""
        if self.v > 1:
            where = (" (in a V: rank r holds stages r and 2pp-1-r)" if p.pp_schedule in V_SHAPED else
                     " (in a loop: rank r holds stages r, r+pp, ...)")
        yield (f"pipeline: {p.pp_schedule} schedule, {p.pp} ranks x {self.v} stage(s) each = {p.pp * self.v} "
               f"stages{where}, {self.microbatches} micro-batches per step; planned bubble fraction "
               f"{self.bubble:.3f} (lmforge.spec.parallel.pipeline_bubble)")
        if p.dp * p.cp > 1:  # (each stage's chunks are FSDP2's, over dp x cp)
            yield fsdp_description(self.cfg)
