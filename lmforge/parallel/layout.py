"""A `Layout`: how one optimizer step runs on this rank's part of the model. It is the one
interface between the trainer and parallelism; the trainer never asks which layout it has.

    layout = parallelize(model, cfg, dist, precision)   # lmforge.parallel.parallelize
    loss = layout.forward_backward(micro_batches, precision)
    norm = layout.clip_grad_norm(max_norm)
    layout.inference_model()  /  layout.full_weights()  /  layout.prepare_optimizer(optimizer)

This base class is the single-process layout. The others override what differs:
`DataParallel` (DDP, ZeRO-1: lmforge.parallel.data_parallel), `FullyShard` (FSDP2 / HSDP:
lmforge.parallel.fsdp), `TensorParallel` (DTensor TP/SP, with FSDP2 on the data-parallel
sub-mesh: lmforge.parallel.tensor_parallel), `Pipelined` (torch.distributed.pipelining stages:
lmforge.parallel.pipeline). A new layout is a new module with a subclass, chosen in
`parallelize`.

Loss scale: each micro-batch contributes its summed token NLL divided by the target count of the
*global* step (all-reduced over the data-parallel ranks), and data-parallel layouts multiply the
loss they backpropagate by the dp degree because DDP and FSDP average gradients: mean_r(dp * nll_r
/ N) = sum_r(nll_r) / N, the gradient of one big batch (see lmforge.model.loss).

Context parallelism (parallel.cp > 1) is not a layout of its own but a part of every one: each rank
keeps its two chunks of the step's sequences (`local_sequences`: tokens and targets, cut here, not
in the loader) and runs forward and backward inside the model's sequence-sharding hook
(lmforge.parallel.context_parallel). The CP ranks hold other targets of the same sequences and the
same parameters, so "data parallel" above means dp x cp: the target count and the loss are summed
over the dp_cp group and the loss is scaled by dp x cp against the gradient averaging over it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config
from lmforge.model.documents import DocumentAttention, document_inputs
from lmforge.model.loss import count_targets, model_nll_sum, normalise
from lmforge.model.mtp import mtp_metrics, take_mtp_stats
from lmforge.model.transformer import Transformer
from lmforge.parallel.clip import clip_grad_norm_, clip_grad_norm_sharded_
from lmforge.parallel.context_parallel import sequence_sharding
from lmforge.parallel.expert_parallel import moe_metrics, moe_step
from lmforge.parallel.mesh import DistInfo, all_reduce_sum

Batch = tuple[torch.Tensor, torch.Tensor]


class Layout:
    name = "single"
    shards_parameters = False  # True: built on the meta device, sharded there, materialised after (FSDP2, TP, PP)
    data_parallel = False  # True: gradients are averaged over the dp (x cp) ranks (the loss scales by that)

    def __init__(self, model: Transformer, cfg: Config, dist_info: DistInfo, precision: str):
        self.model = model  # this rank's model (sharded or split in place): state dicts, parameters
        self.module: nn.Module = model  # what the forward runs through (DDP: its wrapper)
        self.cfg, self.dist = cfg, dist_info
        self.dp = dist_info.dp_cp_size if self.data_parallel else 1  # ranks the gradients are averaged over
        self.cp = sequence_sharding(cfg.parallel.cp_mode, dist_info.group("cp"), dist_info.cp_rank, dist_info.cp_size,
                                    dist_info.device) if dist_info.cp_size > 1 else None
        self.moe_stats: dict = {}  # the last step's MoE statistics by block index (lmforge.model.moe.MoEStats)
        self.compiled_nll = None  # the whole training forward + loss as one compiled graph (`compile_model`)
        self.cuda_graphs = False  # (train.compile_mode = reduce-overhead: a step boundary marked per step)
        # data.attention = "document": how a batch's documents are found (set by the trainer, which knows
        # the corpus' end-of-document id); None = causal attention over the whole sequence
        self.documents: DocumentAttention | None = None
        # the target tokens of the last `forward_backward`'s micro-batches over the dp x cp ranks: what
        # its loss and gradients were normalised by (fault tolerance weighs replica groups by it)
        self.last_targets: torch.Tensor | None = None

    # ---- one step ------------------------------------------------------------------------------

    def forward_backward(self, micro_batches: list[Batch], precision) -> torch.Tensor:
        """Gradients of the step's micro-batches, accumulated; returns the global step's mean token
        loss (equal on every rank). `precision.step(module)` spans the micro-batches: the module's
        weights are cast to 16 bits once per step, not once per micro-batch (lmforge.train.precision)."""
        docs = [self.document_inputs(x) for x, _ in micro_batches]  # (of the whole sequences, before CP cuts them)
        micro_batches, sharded = self.local_sequences(micro_batches)
        n_targets = self.last_targets = self.global_targets(micro_batches)
        loss_sum = torch.zeros((), device=self.dist.device)
        last = len(micro_batches) - 1
        with precision.step(self.module), sharded, self.moe_step(len(micro_batches)):
            for i, (x, y) in enumerate(micro_batches):
                with self.micro_batch_context(i == last):
                    nll = self.nll_sum(x, y, precision, **docs[i])
                    precision.backward(normalise(nll, n_targets, self.dp))
                    loss_sum += self.local_value(normalise(nll.detach(), n_targets))
        return self.dp_sum(loss_sum)

    @contextlib.contextmanager
    def moe_step(self, micro_batches: int) -> Iterator[None]:
        """Around a step's forwards and backwards: Mixture-of-Experts layers' aux-loss scale, then their
        statistics into `self.moe_stats` (lmforge.parallel.expert_parallel; nothing for a dense model),
        and multi-token prediction's per-depth losses under "mtp" (lmforge.model.mtp)."""
        with moe_step(self.model, micro_batches, self.dp, self.moe_stats):
            yield
        mtp = take_mtp_stats(self.model)
        if mtp is not None:
            self.moe_stats["mtp"] = mtp

    def moe_metrics(self, stats: dict) -> dict:
        """A step's MoE metrics (`moe_stats`, lmforge.parallel.expert_parallel.moe_metrics) of every MoE
        layer: pipeline stages exchange theirs (a collective at log lines; every rank calls it); and
        the MTP losses, summed over the data-parallel ranks (a collective too)."""
        out = mtp_metrics(self.dp_sum(stats["mtp"].clone())) if "mtp" in stats else {}
        if not self.cfg.model.moe.enabled:
            return out
        out.update(moe_metrics({i: s for i, s in stats.items() if i != "mtp"}))
        if self.dist.pp_size > 1:
            parts: list = [None] * self.dist.pp_size
            dist.all_gather_object(parts, out, group=self.dist.group("pp"))
            out = {k: v for part in parts for k, v in part.items()}
        return out

    def loss_chunk(self, precision) -> int:
        """train.loss_chunk as this layout runs it in `precision` (training and evaluation alike): "auto"
        resolved by lmforge.config.rules.resolve_loss_chunk, 0 where the layout cannot use it (tp or
        pp > 1: `inference_model` is then not the model, and takes no targets)."""
        from lmforge.config.rules import resolve_loss_chunk

        return resolve_loss_chunk(self.cfg, self.dist.device.type, precision.name)

    def nll_sum(self, x: torch.Tensor, y: torch.Tensor, precision, **docs: torch.Tensor) -> torch.Tensor:
        """Summed token NLL (fp32) of one micro-batch. train.loss_chunk (`loss_chunk`): fused with the
        output projection inside the model's forward, chunk by chunk (no [B, T, vocab] logits). Under
        train.compile = model the forward and its loss (chunked or plain) run as one compiled graph.
        `docs`: the micro-batch's `document_inputs`."""
        if self.compiled_nll is not None:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with precision.training_forward():
                return self.compiled_nll(x, y, self.loss_chunk(precision), **docs)
        return model_nll_sum(self.module, x, y, self.loss_chunk(precision), precision.training_forward,
                             targets_in_forward=self.cfg.model.mtp_depth > 0, **docs)  # (MTP: lmforge.model.mtp)

    def document_inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's document arguments for whole sequences x (lmforge.model.documents; none under
        causal attention)."""
        return document_inputs(self.documents, x)

    def compile_model(self, mode: str | None) -> None:
        """train.compile = model: the training forward with its loss inside (`Transformer.forward`'s
        `targets`), through what this layout runs (`self.module`: DDP's wrapper, whose graph
        torch.compile splits at the buckets), compiled as one graph of static shapes. Evaluation and
        sampling (`inference_model`) stay eager: they run other shapes (KV caches grow per token)."""
        module = self.module

        def forward_with_loss(x: torch.Tensor, y: torch.Tensor, loss_chunk: int, **docs: torch.Tensor) -> torch.Tensor:
            return module(x, targets=y, loss_chunk=loss_chunk, **docs)

        # fullgraph (an error, not a silent graph break) for the model alone; DDP's wrapper leaves
        # torch.compile its breaks (at the buckets)
        self.compiled_nll = torch.compile(forward_with_loss, mode=mode, fullgraph=module is self.model, dynamic=False)
        self.cuda_graphs = mode == "reduce-overhead"

    def local_sequences(self, micro_batches: list[Batch]) -> tuple[list[Batch], contextlib.AbstractContextManager]:
        """Context parallelism: this rank's two chunks of every sequence of the step (tokens and
        targets), and the context to run their forward and backward in; else the batches as they are."""
        if self.cp is None:
            return micro_batches, contextlib.nullcontext()
        seq_len = micro_batches[0][0].shape[1]
        return [(self.cp.local(x), self.cp.local(y)) for x, y in micro_batches], self.cp.sharded(seq_len)

    def micro_batch_context(self, last: bool) -> contextlib.AbstractContextManager:
        """Around each micro-batch's forward + backward (DDP: no gradient sync but on the last)."""
        return contextlib.nullcontext()

    def local_value(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def global_targets(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Target tokens of the whole global step (this rank's, summed over the dp x cp ranks)."""
        return self.dp_sum(count_targets([y for _, y in micro_batches]).to(self.dist.device))

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place SUM over the data-parallel (x context-parallel) ranks of this rank's TP/PP coordinate."""
        return all_reduce_sum(t, self.dist.dp_cp_group) if self.dp > 1 else t

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient L2 norm (the same on every rank), gradients clipped to `max_norm`."""
        return clip_grad_norm_(self.params(), max_norm)

    def params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the step's gradients after the optimizer step (set to None: their memory is free
        until the next backward; DataParallel zeroes them in place instead)."""
        optimizer.zero_grad(set_to_none=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt the optimizer to the layout: torch's foreach kernels refuse groups that mix DTensor
        and plain parameters (TP without sequence parallelism keeps norm weights plain), so each
        group is split by kind; ZeRO-1 wraps it (DataParallel)."""
        from torch.distributed.tensor import DTensor

        mixed = any(len({isinstance(p, DTensor) for p in g["params"]}) > 1 for g in optimizer.param_groups)
        if mixed:
            groups = [{**g, "params": [p for p in g["params"] if isinstance(p, DTensor) == kind]}
                      for g in optimizer.param_groups for kind in (True, False)]
            optimizer.param_groups = []
            for g in groups:
                if g["params"]:
                    optimizer.add_param_group(g)
        return optimizer

    # ---- evaluation and weights ---------------------------------------------------------------

    def forward_roots(self) -> list[nn.Module]:
        """The modules this rank's forwards run through, every parameter of the layout under them:
        `self.module` (DDP's wrapper, FSDP2's root), or a pipeline rank's stage chunks, FSDP2 roots of
        their own that `self.model` does not hold (what must be resharded to drop every gathered copy)."""
        return [self.module]

    def inference_model(self):
        """What evaluation and sampling run on, on every rank: the training model itself (one process,
        DDP's inner module, FSDP2: a forward gathers each block's shards and frees them again), or for
        TP / PP the rank's part driven by lmforge.parallel.inference. No rank builds a whole model;
        LoRA adapters compute in place (the merged function, in eval mode)."""
        return self.model

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, full shape) of every weight of the whole model (unwrapped names, a tied weight
        once under its first name), in the order `full_weights` yields them. A collective under
        pipeline parallelism (the stages' names are exchanged): every rank calls it."""
        mine = [(name, p.dtype, tuple(p.shape)) for name, p in self._named_weights()]
        if self.dist.pp_size > 1:
            parts: list = [None] * self.dist.pp_size
            dist.all_gather_object(parts, mine, group=self.dist.group("pp"))
            # (a tied weight's two copies, first and last stage: once)
            mine = list({spec[0]: spec for part in reversed(parts) for spec in part}.values())
        return sorted(mine, key=lambda spec: _natural(spec[0]))

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, the whole tensor on rank 0's CPU, None on other ranks), one weight at a time in
        `weight_specs` order: the peak is one full parameter, never the model. Sharded weights
        (DTensors: FSDP2, TP) are all-gathered over their mesh one at a time; a pipeline stage's
        weights travel to rank 0 point to point over rank 0's pp group. A collective: every rank
        iterates to the end."""
        from torch.distributed.tensor import DTensor

        specs = self.weight_specs()
        mine = dict(self._named_weights())
        pp = self.dist.pp_size > 1
        if pp:  # which stage holds each weight: the pp rank whose names include it
            owned: list = [None] * self.dist.pp_size
            dist.all_gather_object(owned, sorted(mine), group=self.dist.group("pp"))
            owner = {name: r for r, names in reversed(list(enumerate(owned))) for name in names}  # (the first holder)
            group = self.dist.group("pp")
            rank0_row = dist.get_global_rank(group, 0) == 0  # this rank's pp group is rank 0's
        for name, dtype, shape in specs:
            t = mine.get(name)
            if t is not None:
                t = t.detach()
                with _quiet("torch.distributed.tensor._redistribute"):  # (FSDP2 over TP: "2 sequential all_gathers")
                    t = t.full_tensor() if isinstance(t, DTensor) else t
            if pp and rank0_row and owner[name] != 0:  # a later stage's weight: its peer in rank 0's row sends it
                if self.dist.pp_rank == owner[name]:
                    dist.send(t.contiguous(), dst=0, group=group)
                elif self.dist.rank == 0:
                    t = torch.empty(shape, dtype=dtype, device=self.dist.device)
                    dist.recv(t, src=dist.get_global_rank(group, owner[name]), group=group)
            yield name, (t.cpu() if self.dist.rank == 0 else None)

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's parameters and persistent buffers under unwrapped names (a tied weight once)."""
        from lmforge.model.materialise import unwrapped_name

        named = [(unwrapped_name(n), p) for n, p in self.model.named_parameters()]
        buffers = dict(self.model.named_buffers())
        named += [(unwrapped_name(n), buffers[n]) for n in self.model.state_dict() if n in buffers]
        return named

    def describe(self) -> Iterator[str]:
        """Log lines about the layout (rank 0 prints them)."""
        yield from ()


class ShardedLayout(Layout):
    """A layout whose parameters are split across ranks (FSDP2 shards, TP DTensors, pipeline
    stages): the gradient norm counts every shard once over the world."""

    shards_parameters = True
    data_parallel = True

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_sharded_(self.params(), max_norm, self.dist)



@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Silence a logger's warnings for a while (torch's notes on its own collective choices)."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _natural(name: str) -> tuple:
    """Sort key: layer numbers compared as numbers (blocks.2 before blocks.10)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))
