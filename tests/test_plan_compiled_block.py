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
import gc

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


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet blocks (model.layer_types' 'linear_attention'): eager, as lmforge runs them
# ---------------------------------------------------------------------------------------------

HYBRID = ("tiny-hybrid", {})  # block 0: 2 key heads and 4 value heads of 48, 4 taps, chunks of 64
# another shape: as many key as value heads (q and k not repeated), narrower key than value heads, 3 taps,
# chunks of 16 (several chunks, so states pass from chunk to chunk)
HYBRID_ALT = ("tiny-hybrid", {"model.deltanet.key_heads": 3, "model.deltanet.value_heads": 3,
                              "model.deltanet.key_head_dim": 16, "model.deltanet.value_head_dim": 24,
                              "model.deltanet.conv_kernel": 3, "model.deltanet.chunk_size": 16})


def block_held_bytes(preset: str, overrides: dict, precision: str, ac: str, seq: int, batch: int = B) -> tuple[int, object]:
    """Bytes block 0's forward leaves referenced for backward, as the trainer runs a block (the step's
    16-bit weight copies, autocast or bf16-pure's plain forward): the storages made during the forward
    that are still alive once it returned, and the block input (the block's output, the parameters,
    their 16-bit copies (the step's, and autocast's cached ones of the convolutions' weights, counted
    once per step by the planner) and the RoPE tables left out). Liveness rather than saved-tensor hooks:
    the chunked delta rule's last state update is saved and then dropped with the final state, and
    selective recompute's matmul outputs are held by its policy's cache, not by saved-tensor hooks."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg = load_config(preset, overrides)
    model = build_model(cfg.model, "cpu", seed=0)
    apply_activation_checkpointing(model.blocks, ac)
    block = model.blocks["0"]
    rope = (model.rope_cos, model.rope_sin) if cfg.model.pos_emb == "rope" else None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip = params | {t.untyped_storage().data_ptr() for t in rope or ()}
    made: dict[int, tuple] = {}

    class Outputs(TorchDispatchMode):  # every storage an op makes (a freed one's address may be reused)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in params:
                skip.add(out.untyped_storage().data_ptr())  # a parameter's 16-bit copy
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    storage = o.untyped_storage()
                    if storage.data_ptr() not in made or made[storage.data_ptr()][0].expired():
                        made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            return out

    precision_ = make_precision(precision, torch.device("cpu"))
    x = torch.randn(batch, seq, cfg.model.dim, requires_grad=True)
    with precision_.step(block):
        skip |= {m._parameters[n].untyped_storage().data_ptr() for m in block.modules() for n in m._parameters
                 if m._parameters[n] is not None}
        with precision_.training_forward(), Outputs():
            out = block(x, rope)
        gc.collect()
        skip.add(out.untyped_storage().data_ptr())
        held = x.untyped_storage().nbytes() + sum(nbytes for ptr, (ref, nbytes) in made.items()
                                                  if ptr not in skip and not ref.expired())
        out.float().sum().backward()  # (the kept tensors are real: backward runs)
    return held, cfg


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("ac", ["none", "selective"])
@pytest.mark.parametrize("case,seq", [("hybrid", 32), ("hybrid", 128), ("alt", 48)],
                         ids=["tiny-hybrid-1-padded-chunk", "tiny-hybrid-2-chunks", "alt-3-chunks"])
def test_deltanet_block_keeps_what_the_plan_counts(case, seq, precision, ac):
    """A Gated DeltaNet block keeps, byte for byte, what `lmforge_activation_per_layer(linear=True)`
    counts (`deltanet_mixer_bytes` states the rule): tiny-hybrid's shape (key heads repeated to the
    value heads) over one padded chunk and over two whole ones, another shape over three; without and
    with selective recompute; bf16 autocast and fp32. The old count (an attention block) is off."""
    preset, overrides = HYBRID if case == "hybrid" else HYBRID_ALT
    measured, cfg = block_held_bytes(preset, overrides, precision, ac, seq)
    layout = Layout(micro_batch=B, ac=ac, precision=precision, compile=False)
    planned = lmforge_activation_per_layer(cfg.model, layout, seq, ac, linear=True)
    assert measured == round(planned), (measured / (B * seq), planned / (B * seq))
    assert lmforge_activation_per_layer(cfg.model, layout, seq, ac) != planned


def test_deltanet_block_under_full_recompute_keeps_its_input():
    measured, cfg = block_held_bytes(*HYBRID_ALT, "bf16", "full", 48)
    assert measured == lmforge_activation_per_layer(cfg.model, Layout(micro_batch=B, ac="full"), 48, "full",
                                                    linear=True) == B * 48 * cfg.model.dim * 4


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_deltanet_block_per_tensor_parallel_rank(precision):
    """A tensor-parallel rank of tiny-hybrid's DeltaNet block (tp = 2) runs one key head and its two value
    heads and half the MLP on the whole input (lmforge.parallel.tensor_parallel; the forward counts heads
    from its weights' shapes): the block with those heads and that MLP keeps what the plan counts at tp = 2."""
    preset, _ = HYBRID
    rank = {"model.deltanet.key_heads": 1, "model.deltanet.value_heads": 2, "model.ffn_hidden": 256}
    measured, _ = block_held_bytes(preset, rank, precision, "none", 128)
    cfg = load_config(preset)
    planned = lmforge_activation_per_layer(cfg.model, Layout(micro_batch=B, tp=2, precision=precision, compile=False),
                                           128, "none", linear=True)
    assert measured == planned
