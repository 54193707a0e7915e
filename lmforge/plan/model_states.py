"""Model-state bytes: weights, gradients, fp32 master weights and optimizer states per parameter,
in each convention (lmforge.plan.memory's docstring), and one pipeline stage's on one rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lmforge.config import ModelConfig
from lmforge.spec.optimizers import REGISTRY
from lmforge.spec.optimizer_state import OPTIMIZER_NAMES, optimizer_state_bytes_per_param
from lmforge.plan.conventions import LITERATURE, MODEL_STATES
from lmforge.plan.layout import Layout
from lmforge.plan.params import ParamSpec, cfg_key, fsdp_shard_shape, is_hidden_matrix, stage_specs, tp_shape

# Optimizer spelling accepted by the planner -> lmforge.optim name.
_OPT_ALIASES = {"8bit-adam": "adam8bit", "adam-8bit": "adam8bit", "adamw8bit": "adam8bit", "sgdm": "momentum"}


def normalise_optimizer(name: str) -> str:
    key = name.strip().lower()
    key = _OPT_ALIASES.get(key, key)
    if key not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    return key


def lmforge_state_bytes(optimizer: str, spec: ParamSpec, shape: tuple[int, ...], *, block_size: int = 256,
                        min_8bit_size: int = 4096) -> int:
    """Exact bytes `lmforge.optim` keeps in `optimizer.state[p]` for a fp32 tensor of `shape`: the
    optimizer's `StateSize` in `lmforge.spec.optimizers` (state tensors, per-tensor `step` tensors,
    8-bit block padding and scales), as the implementations allocate them."""
    state = REGISTRY[normalise_optimizer(optimizer)].state
    return state.tensor_bytes(shape, hidden_matrix=is_hidden_matrix(spec), block_size=block_size,
                              min_8bit_size=min_8bit_size)


def literature_state_bytes_per_param(optimizer: str, shape: tuple[int, ...] | None = None) -> float:
    """fp32 optimizer state bytes per parameter (the literature convention; no per-tensor scalars;
    `shape` matters for factored state only; an optimizer with its own rule for hidden matrices
    is counted at its matrix figure)."""
    return optimizer_state_bytes_per_param(normalise_optimizer(optimizer), shape=shape)


def literature_parts(convention: str, precision: str, state_bytes: float) -> tuple[tuple[str, float, int], ...]:
    """Model-state bytes per parameter of a literature convention, as (component, bytes, the
    lowest ZeRO stage that shards it); `state_bytes` = the optimizer's fp32 state per parameter
    (Adam: 8). See the module docstring."""
    if precision in ("bf16-pure", "fp8"):  # (bf16 weights, fp32 main gradients and master: the bf16 figures)
        precision = "bf16"
    if precision == "fp32":  # no 16-bit copy, no separate master: 4 + 4 + state in both
        return (("weights", 4, 3), ("gradients", 4, 2), ("optimizer_states", state_bytes, 1))
    if convention == "zero-paper":
        return (("weights", 2, 3), ("gradients", 2, 2), ("master_weights", 4, 1), ("optimizer_states", state_bytes, 1))
    assert convention == "megatron", convention
    if precision == "fp16":  # fp16 gradients, plus an fp32 copy of them that the optimizer shards
        return (("weights", 2, 3), ("gradients", 2, 2), ("gradients", 4, 1), ("master_weights", 4, 1),
                ("optimizer_states", state_bytes, 1))
    return (("weights", 2, 3), ("gradients", 4, 2), ("master_weights", 4, 1), ("optimizer_states", state_bytes, 1))


def model_state_bytes_per_param(optimizer: str = "adamw", zero: int = 0, dp: int = 1, precision: str = "bf16",
                                convention: str = "zero-paper") -> float:
    """Bytes/param of weights + gradients + master + optimizer state per GPU for large matrices,
    in a literature convention (N = dp). zero-paper, mixed-precision Adam: 2 + 2 + 12 = 16;
    ZeRO-1 4 + 12/N; ZeRO-2 2 + 14/N; ZeRO-3 16/N. megatron, bf16 Adam: 2 + 4 + 12 = 18;
    distributed optimizer (ZeRO-1) 6 + 12/N; ZeRO-2 2 + 16/N; ZeRO-3 18/N. Other optimizers
    replace the 8 bytes of Adam's m and v by their own state."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero = {zero!r} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp = {dp} must be >= 1")
    if convention not in LITERATURE:
        raise ValueError(f"convention {convention!r} must be one of {', '.join(LITERATURE)} (lmforge's bytes "
                         f"depend on the tensor shapes: use estimate_memory)")
    parts = literature_parts(convention, precision, literature_state_bytes_per_param(optimizer))
    n = dp if zero else 1
    return sum(b / n if zero >= stage else b for _, b, stage in parts)


@dataclass(frozen=True)
class StageStates:
    """Model-state bytes of one pipeline stage on one rank, and the parameter counts (after TP,
    before ZeRO) that the buffers depend on."""

    comp: tuple[tuple[str, float], ...]
    params: float          # parameters of the stage on this TP rank
    matmul_16bit: float    # bytes of the step's 16-bit weight copy: the matmul weights (bf16-pure: every
    #                        parameter but the embeddings'; a tied head's included)
    layer_params: float    # one transformer block
    root_params: float     # outside the blocks: embedding, positions, final norm, head
    head_params: float     # the output projection (last stage), tied or not


_STATE_CACHE: dict[tuple, StageStates] = {}


def zero1_by_tensor(layout: Layout) -> bool:
    """ZeRO-1 without FSDP2 (plain data parallelism: lmforge.parallel.data_parallel.zero1): torch's
    ZeroRedundancyOptimizer, which gives each rank whole tensors' state, not an even chunk of each."""
    return layout.zero == 1 and layout.shard_ranks > 1 and not layout.fsdp and layout.ep == 1


def zero1_state_per_rank(specs: list[ParamSpec], layout: Layout, opt: str) -> list[float]:
    """The optimizer-state bytes of each rank under `zero1_by_tensor`: ZeroRedundancyOptimizer's own
    partition, replayed (hand-written: torch has no function that returns it without a process group).
    Over lmforge's parameter groups in order (lmforge.optim.optimizers.param_groups: matrices that are
    not embeddings decay, the rest do not), each group's tensors largest first (a stable sort, so equal
    sizes keep the model's order), each to the rank with the fewest elements so far (the first such);
    the element counts carry over from group to group, as torch's do."""
    n = layout.shard_ranks
    groups = ([s for s in specs if len(s.shape) >= 2 and not s.is_embedding],
              [s for s in specs if not (len(s.shape) >= 2 and not s.is_embedding)])
    sizes, state = [0] * n, [0.0] * n
    for group in groups:
        for spec in sorted(group, key=lambda s: math.prod(s.shape), reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += math.prod(spec.shape)
            state[rank] += lmforge_state_bytes(opt, spec, spec.shape)
    return state


def stage_states(cfg: ModelConfig, layout: Layout, opt: str, convention: str, stage: int) -> StageStates:
    n_dp = layout.shard_ranks if layout.zero > 0 else 1  # (context parallel: dp x cp)
    key = (cfg_key(cfg), n_dp, layout.zero, layout.tp, layout.pp, layout.precision, opt, convention, stage, layout.ep,
           layout.last_rank, layout.ema)
    hit = _STATE_CACHE.get(key)
    if hit is not None:
        return hit
    comp = dict.fromkeys(MODEL_STATES, 0.0)
    params = matmul = layer = root = head = 0.0
    specs = stage_specs(cfg, layout.pp, stage, layout.last_rank)
    first_layer = stage * (cfg.n_layers // layout.pp)
    all_dp = n_dp
    pure = layout.precision == "bf16-pure"
    for spec in specs:
        local = tp_shape(spec, layout.tp, layout.ep)
        full_n = math.prod(local)
        # routed experts under EP: E / ep of them per rank, sharded (ZeRO / FSDP2) over the dp / ep
        # ranks holding the same experts (lmforge.parallel.expert_parallel)
        n_dp = max(all_dp // layout.ep, 1) if spec.expert else 1 if spec.whole else all_dp
        params += full_n
        if spec.where == "block":
            layer += full_n if spec.layer == first_layer else 0
        else:
            root += full_n
        if "lm_head" in spec.name:
            head += full_n
        # the step's 16-bit copy (lmforge.train.precision.copied_parameters): the matmul weights under
        # autocast; every parameter but the embeddings' in bf16-pure
        if (not spec.is_embedding) if pure else spec.matmul:
            matmul += 2 * full_n
        if convention in LITERATURE:  # flat buffers sharded exactly
            state = literature_state_bytes_per_param(opt, local)
            for c, nbytes, zero_stage in literature_parts(convention, layout.precision, state):
                shard = n_dp if (layout.zero >= zero_stage and n_dp > 1) else 1
                comp[c] += nbytes * full_n / shard
            if layout.ema:  # fp32, sharded where the weights are (ZeRO-3)
                comp["ema"] += 4 * full_n / (n_dp if layout.zero >= 3 and n_dp > 1 else 1)
            continue
        # lmforge: FSDP2 shards every tensor along dim 0; ZeroRedundancyOptimizer the state only
        shard_n = math.prod(fsdp_shard_shape(local, n_dp))
        state_shape = fsdp_shard_shape(local, n_dp) if (layout.zero >= 1 and n_dp > 1) else local
        # every precision: the fp32 parameters are the master weights (bf16-pure's bf16 weights are the
        # step's copy, a buffer), fp32 gradients (bf16-pure's "main gradients")
        comp["weights"] += 4 * (shard_n if layout.fsdp else full_n)
        comp["gradients"] += 4 * (shard_n if layout.fsdp else full_n)
        comp["optimizer_states"] += lmforge_state_bytes(opt, spec, state_shape)
        # the EMA of the weights (lmforge.train.ema): fp32, one tensor per parameter made like it (FSDP2's shard)
        comp["ema"] += 4 * (shard_n if layout.fsdp else full_n) if layout.ema else 0.0
    if convention not in LITERATURE and zero1_by_tensor(layout):  # whole tensors per rank, not even chunks
        comp["optimizer_states"] = max(zero1_state_per_rank(specs, layout, opt))
    if cfg.tie_embeddings and stage == layout.last_rank == 0:
        # the tied embedding is also the head (one process, or a V's rank 0): its matmul uses a 16-bit cast of it
        emb = math.prod(tp_shape(specs[0], layout.tp))
        matmul += 2 * emb
        head += emb
    if len(_STATE_CACHE) > 4096:
        _STATE_CACHE.clear()
    hit = StageStates(tuple(comp.items()), params, matmul, layer, root, head)
    _STATE_CACHE[key] = hit
    return hit
