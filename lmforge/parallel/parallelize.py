"""The one parallelize step: a built model in, a `Layout` out.

The parallel layout is applied in one fixed order, each step on what the previous one left:

  1. pipeline split   this rank keeps only its stages' modules (before anything renames or wraps
                      them: a stage's state dict is a slice of the full model's, by name)
  2. tensor parallel  DTensor column/row sharding of what is kept (+ sequence parallel); the plan
                      addresses plain module names, so it runs before any wrapper renames them
     expert parallel  MoE experts split over parallel.ep (DTensor Shard(0) on the "ep" dim), tokens
                      sent by all-to-all (lmforge.parallel.expert_parallel); FSDP2 in step 5 then
                      shards them over the ranks holding the same experts
  3. activation ckpt  wraps blocks (after TP: checkpointing recomputes the sharded modules)
  4. compile          per block (after AC: the compiled region includes the checkpoint wrapper, as
                      in torchtitan)
  5. data parallel    FSDP2 `fully_shard` per block then the root (after TP: FSDP shards the TP
                      DTensors over the dp sub-mesh; last of the per-block wrappers, so it wraps
                      what actually runs) or DDP (wraps the whole module, so it comes last); done by
                      the Layout chosen below, which pipelines stage chunks first (step 1's stages)
  6. materialise      only now does any parameter get memory: each rank allocates its own part (its
                      stages, its TP and FSDP shards) and fills it from the source
                      (lmforge.model.materialise), so no rank ever holds the whole model; under
                      DDP (whole replicas by design) just before the wrapper, which needs real tensors

Steps 1-5 run on the meta device: splitting, DTensor sharding and fully_shard only record shapes and
placements there.

Context parallelism (parallel.cp) changes no module: the CP ranks hold the same parameters, so step
5 runs over dp x cp (DDP over "dp_cp", FSDP2 over "dp_shard_cp"; CP alone is DDP over the cp
ranks), and every Layout cuts each step's sequences into the rank's chunks and runs them inside
the model's sequence-sharding hook (lmforge.parallel.context_parallel).

Layers that change the model's modules (LoRA adapters, FP8 linears) are applied by the caller
before this step.
"""

from __future__ import annotations

import logging

import torch

from lmforge.config import Config
from lmforge.config.rules import resolve_compile
from lmforge.model.materialise import Source, materialise
from lmforge.parallel.expert_parallel import wire_moe
from lmforge.model.transformer import Transformer
from lmforge.parallel.activation_ckpt import apply_activation_checkpointing
from lmforge.parallel.data_parallel import DataParallel
from lmforge.parallel.fsdp import FullyShard
from lmforge.parallel.layout import Layout
from lmforge.parallel.mesh import DistInfo
from lmforge.parallel.pipeline import Pipelined, split_model
from lmforge.parallel.tensor_parallel import TensorParallel, apply_tensor_parallel

log = logging.getLogger("lmforge.parallel")


def parallelize(model: Transformer, cfg: Config, dist_info: DistInfo, precision: str, source: Source) -> Layout:
    """Apply `cfg.parallel` (and train.activation_checkpoint / train.compile, the latter resolved by
    lmforge.config.rules.resolve_compile) to `model`, built on the meta device, in place, in the
    order of the module docstring, and materialise this rank's part of it from `source`
    (lmforge.model.init's initialisation, or pre-trained weights); returns the Layout the trainer
    drives. `precision` is the resolved train.precision (FSDP2 gathers parameters in it)."""
    p, t = cfg.parallel, cfg.train
    if p.async_sgd:
        raise ValueError("parallel.async_sgd = true is not a layout of one synchronous step: it runs in "
                         "lmforge.train.async_sgd.AsyncSGDTrainer (lmforge.train.trainer_for(cfg) picks it).")
    stage_ids = split_model(model, cfg, dist_info.pp_rank) if p.pp > 1 else None  # 1
    if p.tp > 1:
        apply_tensor_parallel(model, dist_info.sub_mesh("tp"), p.sequence_parallel)  # 2
    wire_moe(model, cfg, dist_info)  # 2b: MoE layers' groups; experts split over parallel.ep (expert_parallel)
    apply_activation_checkpointing(model.blocks, t.activation_checkpoint, t.ac_every)  # 3
    compiled, why = compile_choice(cfg, dist_info.device)
    if compiled:  # 4
        for block in model.blocks.values():
            block.compile()
    if stage_ids is not None:  # 5
        kind, extra = Pipelined, (stage_ids,)
    elif p.tp > 1:
        kind, extra = TensorParallel, ()
    elif p.fsdp:
        kind, extra = FullyShard, ()
    elif p.dp > 1 or p.cp > 1 or dist_info.distributed:  # CP ranks average like dp ones; under torchrun
        kind, extra = DataParallel, ()  # one process too: DDP at world size 1
    else:
        kind, extra = Layout, ()
    if not kind.shards_parameters:  # 6 (DDP broadcasts rank 0's real parameters as it wraps them)
        materialise(model, dist_info.device, source)
    layout = kind(model, cfg, dist_info, precision, *extra)
    if kind.shards_parameters:  # 6 (FSDP2 / TP / PP have split and sharded the model on meta)
        materialise(model, dist_info.device, source)
    lines = [f"compile: per-block torch.compile {'on' if compiled else 'off'} ({why})"] + list(layout.describe())
    if p.ep > 1:
        e = cfg.model.moe.num_experts
        replicas = f", replicated over dp_replicate = {p.dp_replicate} replica groups" if p.dp_replicate > 1 else ""
        lines.append(f"expert parallel: {e} experts per MoE layer over ep = {p.ep} ranks ({e // p.ep} each), "
                     f"all-to-all dispatch; experts FSDP2-sharded over dp_shard / ep = {p.dp_shard // p.ep} ranks"
                     f"{replicas}")
    if layout.cp is not None:  # context parallelism runs inside every layout (lmforge.parallel.layout)
        layout.name += "+cp"
        lines += layout.cp.describe(cfg, 2 if precision in ("bf16", "fp16") else 4)
    for line in lines:
        log.info("%s", line)
    return layout


def compile_choice(cfg: Config, device: torch.device) -> tuple[bool, str]:
    """Whether step 4 compiles the blocks on `device`, and why: train.compile resolved by
    lmforge.config.rules.resolve_compile (with the CUDA GPU's compute capability for "auto")."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return resolve_compile(cfg, device.type, capability)
