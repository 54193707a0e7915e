"""`lmforge plan`'s three memory conventions against Megatron-LM's and DeepSpeed's own estimators.

For each configuration it prints, per GPU (decimal GB):

- lmforge plan, convention "lmforge" (what lmforge allocates: model states, then buffers: autocast
  copies, DDP buckets or FSDP2's gathered weights), "megatron" (Megatron-LM's estimator: 18
  B/param and its activation formula) and "zero-paper" (16 B/param, Korthikanti's activations
  generalised to the MLP type and GQA), model states and activations;
- Megatron-LM's `megatron/training/theoretical_memory_usage.py` (commit
  d98e8a64ddf34856e74b24714e3bedb2f5a39553): weights + optimizer and activations, restated below
  from its formulas (`megatron_estimate`);
- DeepSpeed's `estimate_zero2_model_states_mem_needs` and
  `estimate_zero3_model_states_mem_needs` (commit 38327e07f6cd39b63418f60cedd1651b0be3e7c3,
  version.txt 0.16.5; GPU side, no offload), restated below (`deepspeed_zero2_gpu`,
  `deepspeed_zero3_gpu`). They are pure data-parallel estimators: for layouts with TP/PP they are
  applied to one rank's model-parallel shard with N = dp (labelled).

The restatements are this project's code, written from the formulas (not copied); tests check
them against figures derived by hand, and the planner's "megatron" convention against them
(tests/test_plan_conventions.py). Run:

    python benchmarks/plan_conventions.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

from lmforge.config import ModelConfig, load_config
from lmforge.plan.memory import Layout, estimate_memory


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    layout: str
    seq_len: int
    distributed_optimizer: bool  # Megatron's --use-distributed-optimizer
    note: str = ""


CASES = (
    Case("GPT-3 175B, t8 p8 d8 (512 GPUs), distributed optimizer, SP + selective recompute", "gpt3-175b",
         "dp=8,zero=1,tp=8,sp=1,pp=8,mb=1,ga=192,ac=selective", 2048, True,
         "lmforge refuses this layout (tied embeddings with PP, SP with learned positions, ZeRO-1 with TP/PP)"),
    Case("Llama-2-70B, t8 p4 (32 GPUs, d = 1), SP + selective recompute", "llama2-70b",
         "dp=1,tp=8,sp=1,pp=4,mb=1,ga=1024,ac=selective", 4096, False),
    Case("Llama-2-70B, ZeRO-3 on 8 GPUs, full recompute", "llama2-70b",
         "dp=8,zero=3,mb=1,ga=128,ac=full", 4096, True,
         "Megatron's estimator has no ZeRO-3: shown with its distributed optimizer over d = 8"),
    Case("Mistral-7B (7.24B), ZeRO-1 / distributed optimizer on 64 GPUs", "mistral-7b",
         "dp=64,zero=1,mb=1,ga=4,ac=full", 4096, True),
    Case("Mistral-7B (7.24B), ZeRO-3 on 64 GPUs", "mistral-7b",
         "dp=64,zero=3,mb=1,ga=4,ac=full", 4096, True,
         "Megatron's estimator has no ZeRO-3: shown with its distributed optimizer over d = 64"),
)


# ---------------------------------------------------------------------------------------------
# Megatron-LM's theoretical memory usage (dense GPT, no MoE / MLA / MTP), restated
#
# Read at NVIDIA/Megatron-LM commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22); the
# file megatron/training/theoretical_memory_usage.py was last changed there by 1bcb3b9e0b02
# (2026-06-15). The padded vocabulary is megatron/core/tokenizers/utils/build_tokenizer.py's
# `vocab_size_with_padding` with --make-vocab-size-divisible-by's default, 128.
# ---------------------------------------------------------------------------------------------

MEGATRON_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def megatron_padded_vocab(cfg: ModelConfig, tp: int, divisible_by: int = 128) -> int:
    """Megatron pads the vocabulary to a multiple of 128 x t (its `padded_vocab_size`)."""
    multiple = divisible_by * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


def megatron_params(cfg: ModelConfig, tp: int = 1) -> dict[str, float]:
    """Parameters as Megatron's formula counts them: no linear biases, no position table; norms 1
    (RMSNorm) or 2 (LayerNorm) vectors of h; SwiGLU's MLP 3/2 of a GELU one of the same ffn
    width; GQA's k and v in (1 + groups/heads). Returns the block's matrices (sharded by TP), its
    norms and the final norm (replicated), one embedding (padded vocab x h) and the total."""
    h, heads, groups = cfg.dim, cfg.n_heads, cfg.kv_heads
    norm = 1 if cfg.norm == "rmsnorm" else 2
    gated = 1.5 if cfg.activation == "swiglu" else 1.0
    q_ratio = cfg.head_dim * heads / h
    attention = 2 * h * h * (1 + groups / heads) * q_ratio
    mlp = 2 * h * cfg.ffn_dim * gated
    matrices = (attention + mlp) * cfg.n_layers
    replicated = 2 * h * norm * cfg.n_layers + norm * h
    embedding = h * megatron_padded_vocab(cfg, tp)
    total = matrices + replicated + embedding * (1 if cfg.tie_embeddings else 2)
    return {"matrices": matrices, "replicated": replicated, "embedding": embedding, "total": total}


def megatron_estimate(cfg: ModelConfig, lay: Layout, seq_len: int, distributed_optimizer: bool) -> dict[str, float]:
    """Megatron's weight+optimizer and activation bytes for its most loaded shard (the first stage)."""
    n = megatron_params(cfg, lay.tp)
    t, p, d = lay.tp, lay.pp, lay.dp
    sharded = (n["matrices"] / p + n["embedding"]) / t
    if not cfg.tie_embeddings and p == 1:
        sharded += n["embedding"] / t
    shard = sharded + n["replicated"] / p
    per_param = 6 + 12 / d if distributed_optimizer else 18
    s, b, h, V = seq_len, lay.micro_batch, cfg.dim, megatron_padded_vocab(cfg, t)
    with_sp = lay.sp and lay.ac == "selective"  # Megatron's SP formula; otherwise its "without SP" one
    per_layer = (18 + 4 * cfg.ffn_dim / h) / t if with_sp else 10 + 24 / t
    act = s * b * h * per_layer * cfg.n_layers + (8 * s * b * p + s * b * h * p) / (t if with_sp else 1)
    if lay.virtual_stages > 1:  # interleaved schedule's memory penalty
        act *= 1 + (p - 1) / (p * lay.virtual_stages)
    elif p > 1:  # fewer micro-batches than stages
        act *= min(1, lay.grad_accum / p)
    if p == 1:  # inputs of the output layer and the loss
        act += s * b * h * 4 * (1 + V / h) / t if with_sp else (s * b * V / t + s * b * h) * 2
    if not with_sp:
        act *= 1.05  # its 5% allowance for temporaries
    return {"params_on_shard": shard, "model_states": shard * per_param, "activations": act}


# ---------------------------------------------------------------------------------------------
# DeepSpeed's ZeRO estimators (GPU side, no offload), restated
#
# Read at microsoft/DeepSpeed commit 38327e07f6cd39b63418f60cedd1651b0be3e7c3 (2025-02-21,
# version.txt 0.16.5): estimate_zero2_model_states_mem_needs in
# deepspeed/runtime/zero/stage_1_and_2.py, estimate_zero3_model_states_mem_needs in
# deepspeed/runtime/zero/stage3.py (cpu_offload=False branches; DeepSpeed rounds down to int).
# ---------------------------------------------------------------------------------------------

DEEPSPEED_COMMIT = "38327e07f6cd39b63418f60cedd1651b0be3e7c3"


def deepspeed_zero2_gpu(params: float, gpus: int) -> float:
    """16-bit weights on every GPU (2 B) + 18 B/param sharded over the GPUs (16-bit and fp32
    gradients, fp32 weights, Adam's two moments)."""
    return 2 * params + 18 * params / gpus


def deepspeed_zero3_gpu(params: float, largest_layer_params: float, gpus: int) -> float:
    """18 B/param sharded over the GPUs + 4 B x the largest module's own parameters."""
    return 4 * largest_layer_params + 18 * params / gpus


def largest_module_params(cfg: ModelConfig) -> int:
    """The most parameters one module holds directly (DeepSpeed's `largest_layer_params`): the
    embedding, the head, or a block's widest Linear."""
    h, f = cfg.dim, cfg.ffn_dim
    linear = max(h * cfg.head_dim * cfg.n_heads, h * f)
    return max(cfg.vocab_size * h, linear + (f if cfg.bias else 0))


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def compare(case: Case) -> dict:
    cfg = load_config(case.preset).model
    lay = Layout.parse(case.layout)
    ours = {conv: estimate_memory(cfg, lay, "adamw", case.seq_len, weights=conv)
            for conv in ("lmforge", "megatron", "zero-paper")}
    meg = megatron_estimate(cfg, lay, case.seq_len, case.distributed_optimizer)
    shard = ours["megatron"].params_per_rank  # parameters on the worst rank before ZeRO
    mp = lay.tp > 1 or lay.pp > 1
    largest = largest_module_params(cfg) / (lay.tp if mp else 1)
    row = {
        "case": case.name, "layout": lay.short(), "note": case.note,
        "lmforge_states": ours["lmforge"].model_states, "lmforge_buffers": ours["lmforge"].buffers,
        "lmforge_activations": ours["lmforge"].activations,
        "megatron_conv_states": ours["megatron"].model_states, "megatron_conv_activations": ours["megatron"].activations,
        "zero_paper_states": ours["zero-paper"].model_states, "zero_paper_activations": ours["zero-paper"].activations,
        "megatron_estimator_states": meg["model_states"], "megatron_estimator_activations": meg["activations"],
        "deepspeed_zero2": deepspeed_zero2_gpu(shard, lay.dp),
        "deepspeed_zero3": deepspeed_zero3_gpu(shard, largest, lay.dp),
        "deepspeed_on_shard": mp,
        "params_on_rank": shard, "megatron_params_on_rank": meg["params_on_shard"],
    }
    return row


def markdown(rows: list[dict]) -> str:
    gb = lambda v: f"{v / 1e9:,.1f}"  # noqa: E731
    out = ["| configuration | lmforge: states + buffers | megatron conv. | Megatron's estimator | zero-paper conv. "
           "| DeepSpeed ZeRO-2 est. | DeepSpeed ZeRO-3 est. |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        ds = " (shard, N = dp)" if r["deepspeed_on_shard"] else ""
        out.append(f"| {r['case']} | {gb(r['lmforge_states'])} + {gb(r['lmforge_buffers'])} | "
                   f"{gb(r['megatron_conv_states'])} | {gb(r['megatron_estimator_states'])} | "
                   f"{gb(r['zero_paper_states'])} | {gb(r['deepspeed_zero2'])}{ds} | {gb(r['deepspeed_zero3'])}{ds} |")
    out += ["", "| configuration | lmforge activations | megatron conv. | Megatron's estimator "
            "| zero-paper conv. (Korthikanti, fused, MLP type + GQA) |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['case']} | {gb(r['lmforge_activations'])} | {gb(r['megatron_conv_activations'])} | "
                   f"{gb(r['megatron_estimator_activations'])} | {gb(r['zero_paper_activations'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = [compare(c) for c in CASES]
    print("Model states per GPU (GB); lmforge adds its buffers after the +:")
    print(markdown(rows))
    for r in rows:
        if r["note"]:
            print(f"- {r['case']}: {r['note']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
