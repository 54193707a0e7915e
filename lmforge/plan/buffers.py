"""Buffers besides parameters, gradients, optimizer states and activations (16-bit weight copies,
FSDP2's gathered weights and unsharded gradients, ZeRO-3's gather buffers, RoPE tables), and the
memory of the phases outside the training step."""

from __future__ import annotations

import dataclasses
import math

from lmforge.config import ModelConfig
from lmforge.plan.activations import lmforge_activation_per_layer
from lmforge.plan.layout import Layout
from lmforge.plan.model_states import StageStates, literature_parts
from lmforge.plan.params import stage_specs


def literature_buffers(layout: Layout, states: StageStates, convention: str) -> dict[str, float]:
    """ZeRO-3: the gathered 16-bit weights of the current and the prefetched layer, and one
    layer's unsharded gradients before the reduce-scatter."""
    if not (layout.zero == 3 and layout.shard_ranks > 1):
        return {}
    parts = literature_parts(convention, layout.precision, 0.0)
    w = sum(b for c, b, _ in parts if c == "weights")
    g = sum(b for c, b, stage in parts if c == "gradients" and stage >= 2)
    return {"zero3_gather_buffers": (2 * w + g) * states.layer_params}


def lmforge_buffers(cfg: ModelConfig, layout: Layout, states: StageStates, seq_len: int) -> dict[str, float]:
    """What lmforge allocates besides parameters, gradients, optimizer state and activations."""
    mixed = layout.precision != "fp32"
    out: dict[str, float] = {}
    if not layout.fsdp:
        # (DDP and ZeRO-1: the gradients are the fp32 all-reduce buckets, through accumulation too)
        if mixed:  # the step's 16-bit copy of the weights (lmforge.train.precision): autocast's of each matmul
            # weight, bf16-pure's of every parameter but the embeddings' (its bf16 weights)
            out["bf16_pure_weight_copies" if layout.precision == "bf16-pure" else "autocast_weight_copies"] = \
                states.matmul_16bit
    else:
        half = 2 if mixed else 4  # FSDP2 gathers in param_dtype (16-bit), fp32 runs in fp32
        accumulating = layout.grad_accum > 1
        # ZeRO-2, and any pipeline stage (torch's schedule keeps the gathered weights between micro-batches)
        whole_stage = layout.zero == 2 or (layout.pp > 1 and accumulating)
        held = states.params if whole_stage else 2 * states.layer_params + states.root_params
        out["fsdp_gathered_weights"] = half * held
        reduce_input = 4 if mixed else 0  # the fp32 reduce-scatter input (reduce_dtype = fp32)
        out["fsdp_unsharded_gradients"] = (half + reduce_input) * states.layer_params + half * states.head_params
        if accumulating and not layout.fsdp_reduce_every_micro_batch:
            # reduced at the step's last micro-batch only: every parameter's unsharded gradient,
            # accumulated in fp32 (reduce_dtype), is held from the first micro-batch's backward on
            out["fsdp_accumulated_gradients"] = 4 * states.params
    if cfg.pos_emb == "rope":
        # (MLA: its RoPE part; model.layer_types' sliding blocks: their own pair of tables, model.rope_local_theta)
        out["rope_tables"] = (2 if cfg.has_local_layers else 1) * 2 * cfg.max_seq_len * (cfg.rope_dim // 2) * 4
    return out


def phase_peaks(cfg: ModelConfig, layout: Layout, seq_len: int, stage: int, comp: dict[str, float],
                buffers: dict[str, float]) -> dict[str, float]:
    """Bytes per GPU outside the training step (lmforge convention), where no rank holds the whole
    model (lmforge.model.materialise, lmforge.parallel.inference, Layout.full_weights):

    - ``startup``: the rank's own fp32 weights once materialised (DDP and ZeRO-1 also allocate their
      fp32 gradient buckets as they wrap the model); the initial values are drawn on the host, one
      parameter's rows at a time (``startup_host``: twice the largest parameter, an upper bound);
    - ``validation``: what persists between steps (weights, optimizer state; gradients only where
      they are DDP's buckets: elsewhere the step frees them), the FSDP2 blocks gathered at a time
      (weights gathered in the run's precision), and a forward without autograd: one layer's
      temporaries (at most what the layer saves for backward) and the cross-entropy of one
      micro-batch: its logits in 16 bits, their fp32 copy and the fp32 log-softmax, 10 bytes a logit
      (fp32 runs: 8), split over the vocabulary under TP; with the chunked loss (layout loss_chunk =
      c, as training runs it: lmforge.eval.perplexity) only c tokens' logits at a time, plus the
      chunk's hidden rows cast to 16 bits;
    - ``final_save``: what persists, plus one whole parameter gathered on every rank of its shard
      group (the largest, fp32; rank 0's copy of it goes to host memory, then to the file)."""
    specs = stage_specs(cfg, layout.pp, stage, layout.last_rank)
    largest = 4 * max(math.prod(spec.shape) for spec in specs)
    keeps_grads = not layout.fsdp and layout.shard_ranks > 1  # DDP / ZeRO-1: gradients are the buckets
    persistent = comp["weights"] + comp["master_weights"] + comp["optimizer_states"] + comp.get("ema", 0.0) + \
        (comp["gradients"] if keeps_grads else 0.0) + buffers.get("rope_tables", 0.0)
    half = 4 if layout.precision == "fp32" else 2
    # evaluation's loss (lmforge.eval.perplexity): the 16-bit logits, their fp32 copy (fp32 runs: the
    # logits themselves) and the fp32 log-softmax, all alive at once, of the micro-batch's tokens or,
    # with the chunked loss, of one chunk's (and the chunk's hidden rows cast to the compute dtype)
    per_logit = half + (4 if half == 2 else 0) + 4
    n = layout.micro_batch * (seq_len // layout.cp)
    rows = min(layout.loss_chunk, n) if layout.loss_chunk else n
    cast = rows * half * cfg.dim if layout.loss_chunk and half == 2 else 0
    logits = per_logit * rows * cfg.vocab_size / layout.tp + cast if layout.holds_last(stage) else 0.0
    # (the eager count, an upper bound for a compiled block's forward without autograd too; a hybrid's
    # larger kind of block: attention or Gated DeltaNet)
    eager = dataclasses.replace(layout, compile=False)
    layer = max(lmforge_activation_per_layer(cfg, eager, seq_len // layout.cp, "none", linear)
                for linear in {False, cfg.has_linear_layers})
    working = buffers.get("fsdp_gathered_weights", 0.0) + layer + logits
    return {"startup": comp["weights"] + (comp["gradients"] if keeps_grads else 0.0), "startup_host": 2 * largest,
            "validation": persistent + working, "validation_working_set": working,
            "final_save": persistent + largest, "final_save_working_set": largest}
