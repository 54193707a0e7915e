"""What a torch.compile'd block saves for backward, against the planner's per-layer count
(`lmforge.plan.activations.lmforge_activation_per_layer` with layout.compile; its docstring states the
rule): byte for byte, for a Llama-style block (RMSNorm, RoPE, SwiGLU, GQA) and a GPT-2 one (LayerNorm,
GELU), without and with selective recompute, under bf16 autocast and in fp32, as the trainer runs a
block (one 16-bit copy of the weights for the step: `Precision.step`; block.compile()).

The block is compiled with the "aot_eager_decomp_partition" backend: Inductor's decompositions and its
min-cut partitioner (`min_cut_rematerialization_partition`), which decide what the forward saves, without
Inductor's code generation (a C++ build per kernel on the CPU: minutes on this machine). Run once with
backend="inductor" at these shapes it saved the same bytes (benchmarks/RESULTS.md, 2026-11-27); the
partitioner runs before any device code exists, so the CPU's decisions are CUDA's for these ops (the
H100's measured peaks agree with the plan: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmforge.config import load_config
from lmforge.model.transformer import build_model
from lmforge.parallel.activation_ckpt import apply_activation_checkpointing
from lmforge.plan.activations import lmforge_activation_per_layer
from lmforge.plan.layout import Layout
from lmforge.train.precision import make_precision

_SMALL = {"model.dim": 64, "model.n_heads": 4, "model.n_layers": 1, "model.vocab_size": 512, "model.max_seq_len": 32,
          "data.seq_len": 32, "data.tokenizer": "bpe", "data.tokenizer_vocab_size": 512}
LLAMA = ("tiny", {**_SMALL, "model.n_kv_heads": 2, "model.ffn_hidden": 192})  # F = 3 (the rule has a 2F term)
GPT2 = ("gpt2-124m", {**_SMALL, "model.ffn_hidden": None})
B, S = 2, 32


def block_saved_bytes(preset: str, overrides: dict, precision: str, ac: str, compiled: bool) -> tuple[int, object]:
    """Bytes of the unique storages block 0's forward saves for backward (its parameters, their 16-bit
    copies and the RoPE tables left out: the planner counts those once per step, not per layer), and
    the model config."""
    cfg = load_config(preset, overrides)
    model = build_model(cfg.model, "cpu", seed=0)
    apply_activation_checkpointing(model.blocks, ac)
    block = model.blocks["0"]
    if compiled:
        torch._dynamo.reset()
        block.compile(backend="aot_eager_decomp_partition")
    rope = (model.rope_cos, model.rope_sin) if cfg.model.pos_emb == "rope" else None
    x = torch.randn(B, S, cfg.model.dim, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with make_precision(precision, torch.device("cpu")).step(block):
        skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *block.parameters(), *(rope or ())]}
        skip |= {m._parameters[n].untyped_storage().data_ptr() for m in block.modules() for n in m._parameters
                 if m._parameters[n] is not None}  # (the step's 16-bit copies, swapped in for the parameters)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            if compiled:  # compile outside the hooks
                block(x, rope).float().sum().backward()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = block(x, rope)
        out.float().sum().backward()  # (the saved tensors are real: backward runs)
    return sum(saved.values()), cfg


@pytest.mark.slow  # (5 compiles: ~45 s on 2 busy cores)
@pytest.mark.parametrize("case,precision,ac", [
    ("llama", "bf16", "none"), ("gpt2", "bf16", "none"), ("llama", "fp32", "none"), ("llama", "bf16", "selective"),
    ("gpt2", "bf16", "selective")])
def test_compiled_block_saves_what_the_plan_counts(case, precision, ac):
    preset, overrides = LLAMA if case == "llama" else GPT2
    measured, cfg = block_saved_bytes(preset, overrides, precision, ac, compiled=True)
    layout = Layout(micro_batch=B, ac=ac, precision=precision, compile=True)
    planned = lmforge_activation_per_layer(cfg.model, layout, S, ac)
    eager = lmforge_activation_per_layer(cfg.model, dataclasses.replace(layout, compile=False), S, ac)
    assert measured == planned, (measured / (B * S), planned / (B * S), eager / (B * S))
    assert planned < eager  # (a planner counting eager's tensors fails the equality above)


@pytest.mark.parametrize("case", ["llama", "gpt2"])
def test_eager_block_saves_the_eager_count(case):
    """The same harness without compile measures the eager count (the one train.compile = false plans)."""
    preset, overrides = LLAMA if case == "llama" else GPT2
    measured, cfg = block_saved_bytes(preset, overrides, "bf16", "none", compiled=False)
    assert measured == lmforge_activation_per_layer(cfg.model, Layout(micro_batch=B, compile=False), S, "none")
