"""The toy of a planned run that `lmforge plan --verify` trains on the CPU: the plan's layout with each
parallel degree scaled down, on a model of the same family at toy width and depth.

Scaling: every degree d > 1 of dp, cp, tp, pp and ep becomes its smallest divisor > 1 (8 -> 2, 6 -> 2,
3 -> 3), so each dimension the layout composes stays in the mesh, with the fewest processes. Expert
parallelism borrows data-parallel ranks, so dp keeps ep's share and the rest of its own. Everything
else of the layout is kept: ZeRO stage, sequence parallelism, pipeline schedule and virtual stages,
activation checkpointing, FSDP's reduce-every-micro-batch, the chunked loss.

The toy model keeps the family's options (norm, activation, positions, biases, QK-norm, fused QKV,
tied or untied embeddings, the query-to-key/value head ratio of GQA up to 4, a sliding window, MoE
routing with shared experts, dense first blocks and expert groups, multi-head latent attention with its latents at toy
width, one multi-token-prediction depth) at head width 16, one block per pipeline chunk (at least 2), and the default corpus's 4096-token BPE vocabulary (a toy needs no GPT-2 vocabulary). It
trains in the layout's precision (fp32, bf16 autocast, bf16-pure, fp16; fp8 is refused) without compile: a 16-bit
layout is checked against a band measured from perturbed one-process reruns (lmforge/verify/band.py), an fp32
one at fp32's tolerance. bf16 on a CPU without bf16 units (AVX2 only) is emulated 50-100x slower: the toy
stays small enough for minutes (the run's time is printed).

Refused, with the reason: CPU offload (CUDA only), FP8 (not emulated yet), and worlds of more than MAX_PROCESSES after
scaling.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from lmforge.config import Config, ParallelConfig
from lmforge.plan.layout import Layout, config_for_layout
from lmforge.spec.parallel import ulysses_splits

MAX_PROCESSES = 8  # gloo processes the CPU emulation runs at once
HEAD_DIM = 16
STEPS = 4  # optimizer steps of each toy run; the resumed run starts from the checkpoint at STEPS / 2
TOY_VOCAB = 4096  # the default corpus's BPE vocabulary (prepared once, cached)
TOY_LR = 1e-2  # at least: a large model's learning rate hardly moves a toy's loss in a few steps, and a check
#               of the loss needs steps that change it (the optimizer and its other settings are the run's)
TOY_EMA = 0.9  # the EMA's decay where the layout keeps one (ema=1) and the config sets none


class CannotEmulate(ValueError):
    """A layout the CPU emulation cannot run; the message says why."""


def smallest_divisor(n: int) -> int:
    """The smallest divisor > 1 of n (n itself when prime; 1 for n = 1)."""
    return next((k for k in range(2, n + 1) if n % k == 0), 1)


@dataclass
class Toy:
    layout: Layout  # the scaled-down plan layout (what estimate_memory plans for the toy)
    config: Config  # the toy run under that layout
    reference: Config  # the same run in one process
    notes: list[str] = field(default_factory=list)  # what was scaled, kept or dropped

    @property
    def world_size(self) -> int:
        return self.layout.world_size


def scale_layout(layout: Layout) -> tuple[Layout, list[str]]:
    """The layout with each degree at its smallest divisor > 1, and a note per degree changed."""
    if layout.cpu_offload:
        raise CannotEmulate("the layout offloads FSDP's shards to CPU memory (offload=1): torch's CPUOffloadPolicy "
                            "needs a CUDA GPU, so a CPU run cannot show it")
    if layout.precision == "fp8":
        raise CannotEmulate("the layout trains in FP8, which the certificate does not emulate yet (its toy's "
                            "micro-batches differ from the layout's, and FP8's scales follow them; tests/test_fp8.py "
                            "checks FP8 under TP and FSDP2 on the CPU); plan it with --precision bf16 to verify the "
                            "rest of the layout")
    ep = smallest_divisor(layout.ep)
    dp = smallest_divisor(layout.dp) if layout.ep == 1 else ep * smallest_divisor(layout.dp // layout.ep)
    scaled = {"dp": dp, "cp": smallest_divisor(layout.cp), "tp": smallest_divisor(layout.tp),
              "pp": smallest_divisor(layout.pp), "ep": ep}
    notes = [f"{k} {getattr(layout, k)} -> {v}" for k, v in scaled.items() if v != getattr(layout, k)]
    # (a document mask runs on SDPA's dense mask on the CPU: lmforge.plan.documents plans that kernel)
    toy = dataclasses.replace(layout, **scaled, cpu_offload=False, compile=False,
                              documents="sdpa" if layout.documents != "none" else "none")
    if toy.world_size > MAX_PROCESSES:
        raise CannotEmulate(f"scaled down to dp x cp x tp x pp = {toy.dp} x {toy.cp} x {toy.tp} x {toy.pp} = "
                            f"{toy.world_size} processes, more than the {MAX_PROCESSES} the CPU emulation runs")
    return toy, notes


def toy_model(model, layout: Layout):
    """The family's ModelConfig at toy size for `layout` (tp divides the heads, pp x v the layers)."""
    group = min(model.n_heads // model.kv_heads, 4)
    kv = max(layout.tp, 1)
    while kv * group < 4:  # at least 4 query heads
        kv *= 2
    if layout.cp_mode == "ulysses" and not ulysses_splits(kv * group // layout.tp, kv // layout.tp, layout.cp):
        kv = math.lcm(kv, layout.cp * layout.tp)  # (Ulysses splits each TP rank's heads over the cp ranks)
    heads = kv * group
    layers = max(2, layout.pp * layout.stages_per_rank)  # (zbv / dualpipev: 2 stages per rank, a V)
    moe = model.moe
    if moe.enabled:
        experts = max(4, 2 * layout.ep)
        moe = dataclasses.replace(moe, num_experts=experts, top_k=min(moe.top_k, experts // 2),
                                  expert_hidden=HEAD_DIM * heads, shared_experts=min(moe.shared_experts, 1),
                                  first_dense=min(moe.first_dense, layers - 1), every=min(moe.every, layers),
                                  # group-limited routing kept as 2 groups, one chosen (its top_k experts fit)
                                  n_groups=min(moe.n_groups, 2), topk_groups=1)
    mla = model.mla
    if mla.enabled:  # the latents kept (the query latent where the family has one) at toy widths
        mla = dataclasses.replace(mla, kv_lora_rank=2 * HEAD_DIM, q_lora_rank=2 * HEAD_DIM if mla.q_lora_rank else 0,
                                  qk_nope_head_dim=HEAD_DIM, qk_rope_head_dim=HEAD_DIM // 2, v_head_dim=HEAD_DIM)
    # μP kept at m = 2 (a toy-width base; the family's base width would give m << 1): its multipliers exercised
    base = dict(mup_base_width=HEAD_DIM * heads // 2, mup_base_head_dim=None) if model.parametrization == "mup" else {}
    return dataclasses.replace(
        model, **base, **_toy_layer_types(model, layers), mla=mla, mtp_depth=min(model.mtp_depth, 1),
        vocab_size=TOY_VOCAB, dim=HEAD_DIM * heads, n_layers=layers, n_heads=heads,
        n_kv_heads=None if kv == heads else kv, ffn_hidden=None, ffn_multiple_of=16, attn_head_dim=None,
        max_seq_len=_seq_len(layout), sliding_window=_seq_len(layout) // 2 if model.sliding_window else 0, moe=moe)


def _toy_layer_types(model, layers: int) -> dict:
    """model.layer_types for the toy's `layers` blocks: every kind of token mixer the family has
    (Gated DeltaNet, sliding and full attention), in the order they first appear, the first kind
    filling the front (Qwen3-Next at 2 blocks: one Gated DeltaNet block, then full attention)."""
    kinds = ["linear_attention" if model.is_linear_layer(i) else "sliding_attention" if model.is_local_layer(i)
             else "full_attention" for i in range(model.n_layers)]
    present = list(dict.fromkeys(kinds))
    if present == ["full_attention"]:
        return {}
    toy = [present[0]] * max(0, layers - len(present)) + present[:layers]
    return {"layer_types": toy, "full_attention_interval": 0}


def _seq_len(layout: Layout) -> int:
    """32 tokens, or more where cp chunks and sequence parallelism need it (2 cp tp divides it)."""
    unit = 2 * layout.cp * (layout.tp if layout.sp else 1)
    return unit * -(-32 // unit)


def toy_run(cfg: Config, layout: Layout) -> Toy:
    """The toy of `cfg` planned under `layout`: the scaled layout, its run config and the one-process
    reference (same seed, data, global batch, optimizer and micro-batches: each the union of the
    data-parallel ranks' micro-batches)."""
    toy_layout, notes = scale_layout(layout)
    seq = _seq_len(toy_layout)
    # micro-batches of one sequence (two in one process: its resume on two ranks splits each), 2 per pipeline
    # stage (>= pp, a multiple of pp for interleaved): accumulation
    toy_layout = dataclasses.replace(toy_layout, micro_batch=2 if toy_layout.world_size == 1 else 1,
                                     grad_accum=2 * toy_layout.pp)
    if toy_layout.pp > 1 and toy_layout.fsdp_reduce_every_micro_batch:
        toy_layout.fsdp_reduce_every_micro_batch = False
    model = toy_model(cfg.model, toy_layout)
    if toy_layout.loss_chunk:  # the chunked loss kept, at a chunk that splits the toy's micro-batch
        toy_layout.loss_chunk = min(toy_layout.loss_chunk, seq // 2)
    base = dataclasses.replace(
        cfg, model=model,
        data=dataclasses.replace(cfg.data, corpus="default", tokenizer="bpe", tokenizer_vocab_size=TOY_VOCAB,
                                 seq_len=seq),
        train=dataclasses.replace(cfg.train, steps=STEPS, compile=False, threads=1, eval_every=0, eval_sequences=4,
                                  sample_tokens=0, log_every=1, progress="none", plot=False, tensorboard=False,
                                  fp8=False, loss_chunk=toy_layout.loss_chunk, device="cpu", profile_steps="",
                                  wandb=False, ema_decay=(cfg.train.ema_decay or TOY_EMA) if toy_layout.ema else 0.0,
                                  ema_start_step=0, ema_every=1),
        optim=dataclasses.replace(cfg.optim, lr=max(cfg.optim.lr, TOY_LR)),
        schedule=dataclasses.replace(cfg.schedule, warmup_steps=1),
        checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=STEPS // 2, every_minutes=0.0, keep_last=2,
                                       keep_every=0, resume="auto", s3_bucket=""),
        finetune=type(cfg.finetune)())
    if cfg.finetune != type(cfg.finetune)():
        notes.append("the config's fine-tuning settings (finetune.*) are left out: the toy trains from a random "
                     "initialisation")
    run = config_for_layout(base, toy_layout, seq)
    # the one-process micro-batch is the union of the data-parallel ranks' (the loader's global sample order), so
    # what depends on the micro-batch as a whole (MoE's global-batch load-balancing loss) is the same objective
    single = dataclasses.replace(toy_layout, dp=1, cp=1, tp=1, pp=1, ep=1, zero=0, sp=False,
                                 micro_batch=toy_layout.micro_batch * toy_layout.dp,
                                 fsdp_reduce_every_micro_batch=False)
    reference = dataclasses.replace(config_for_layout(base, single, seq), parallel=ParallelConfig())
    if toy_layout.precision == "bf16-pure":  # (config_for_layout maps it to bf16, whose layout rules it shares)
        run, reference = (dataclasses.replace(c, train=dataclasses.replace(c.train, precision="bf16-pure"))
                          for c in (run, reference))
    return Toy(toy_layout, run, reference, notes)


def describe(toy: Toy) -> str:
    m, lay = toy.config.model, toy.layout
    family = [m.activation, m.norm, m.pos_emb, "tied" if m.tie_embeddings else "untied"]
    if m.n_kv_heads:
        family.append(f"GQA {m.n_heads}:{m.n_kv_heads}")
    if m.sliding_window:
        family.append(f"sliding window {m.sliding_window}")
    if m.mla.enabled:
        family.append(f"MLA latent {m.mla.kv_lora_rank}")
    if m.mtp_depth:
        family.append(f"MTP depth {m.mtp_depth}")
    if m.layer_types:
        family.append("blocks " + " / ".join(m.layer_types))
    if m.moe.enabled:
        family.append(f"MoE {m.moe.num_experts} experts top-{m.moe.top_k}"
                      + (f" + {m.moe.shared_experts} shared" if m.moe.shared_experts else ""))
    return (f"toy model: dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads ({', '.join(family)}), vocab "
            f"{m.vocab_size}, {toy.config.data.seq_len} tokens; {lay.micro_batch} x {lay.grad_accum} micro-batches "
            f"x dp {lay.dp} per step, {STEPS} steps, {toy.config.optim.name} at lr {toy.config.optim.lr:g}, "
            f"{toy.config.train.precision}, "
            f"compile off" + (f", EMA of the weights {toy.config.train.ema_decay:g}" if lay.ema else ""))
