"""Tensor parallelism (Megatron-style) with DTensor: `torch.distributed.tensor.parallel`.

Per transformer block (on the "tp" sub-mesh of the DeviceMesh):

* attention: q/k/v (or the fused wqkv, model.fused_qkv) column-parallel (each rank holds
  n_heads/tp query heads and kv_heads/tp kv heads: attention is local, the reshape uses -1 heads; q/k/v biases split with their weights),
  output projection ``wo`` row-parallel; QK-norm weights (model.qk_norm) replicated, applied to
  the rank's heads as a DTensor sharded along the heads (`_qk_norm_plan`); multi-head latent
  attention (model.mla): the query and K/V up-projections (wq or wq_b, wkv_b) column-parallel, wo
  row-parallel, the latent down-projections and their norms replicated (why: lmforge.model.mla);
  multi-token prediction's blocks (model.mtp_depth) split as the others;
* Gated DeltaNet (model.layer_types): its heads split as attention's (each rank whole key heads and
  the value heads they serve): the q/k/v/z/beta/decay input projections column-parallel, the
  depthwise convolutions' channels, A_log and dt_bias sharded on dim 0 with them (`_shard_heads`),
  the gated output norm's weight (per head dim, shared by the heads) replicated and applied to the
  rank's heads as a DTensor sharded along them (`heads_sharded_norm`: its gradient summed over the
  ranks' heads), the output projection row-parallel; the recurrence is per head, so local;
* MLP: gate/up (SwiGLU) or fc (GELU) column-parallel, down/proj row-parallel;
* token embedding vocab-parallel (RowwiseParallel on the embedding: each rank holds vocab/tp rows);
* output head column-parallel with DTensor logits sharded over the vocabulary, consumed by
  ``loss_parallel()`` cross-entropy (the full logits are never gathered);
* sequence parallel (``parallel.sequence_parallel``): the norms run on a sequence shard
  (``SequenceParallel``); ``PrepareModuleInput`` all-gathers the sequence before attention / MLP
  and the row-parallel outputs reduce-scatter back to sequence shards. Learned positions
  (GPT-2 / GPT-3's ``pos_emb``): each rank adds the rows of its own sequence shard to the
  embedding's (already scattered) output (`positions_of_sequence_shard`); the weight is replicated,
  its gradient a partial sum of the ranks' rows, reduced over the TP group with the norms'.

Tied embeddings: the embedding and the head are both sharded along the vocabulary (dim 0 of the
shared weight), so after sharding the head's weight is re-pointed at the embedding's DTensor
parameter and the tie holds (one parameter, both gradients accumulate into it).

LoRA adapters (`lmforge.model.lora.LoRALinear`) follow their layer's split: on a column-parallel
layer A (rank x in) is replicated and B (out x rank) split by output rows like W; on a row-parallel
layer A is split by input columns like W and B replicated, so x A^T is a partial sum that the
layer's own all-reduce (or reduce-scatter) completes together with x W^T. No extra communication.
The q/k/v part adapters of a fused wqkv (`FusedQKVLoRA`) split like the separate projections' (B by
rows: each part's rows are in kv-group order, so a rank gets the rows of its own kv groups).

Applied by `lmforge.parallel.parallelize` before activation checkpointing / compile (the plan
names the modules) and before FSDP. `TensorParallel` is the layout: FSDP2 on the data-parallel
sub-mesh when dp > 1 (2-D FSDP x TP; over dp_shard x cp with context parallelism), loss_parallel
cross-entropy, evaluation and sampling on the sharded model (lmforge.parallel.inference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from lmforge.config import Config
from lmforge.model.gated_deltanet import GatedDeltaNet
from lmforge.model.mla import MLAttention
from lmforge.model.moe import is_moe
from lmforge.model.transformer import Transformer
from lmforge.parallel.fsdp import apply_fsdp, fsdp_description, micro_batch_sync
from lmforge.parallel.inference import ShardedInference
from lmforge.parallel.layout import ShardedLayout
from lmforge.parallel.mesh import DistInfo


def tp_plan(model: nn.Module, sequence_parallel: bool, local_logits: bool = False, fp8_collectives: bool = True) -> dict:
    """`parallelize_module` plan for a Transformer or a pipeline stage chunk (keys of present modules).
    `fp8_collectives`: the backend carries float8 tensors (NCCL; gloo has no float8 type)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput, SequenceParallel

    ColwiseParallel, RowwiseParallel = _lora_aware_styles()  # noqa: N806 (torch's class names)
    sp = sequence_parallel
    col, row = _float8_aware(model, ColwiseParallel, RowwiseParallel, fp8_gathers=not sp or fp8_collectives)
    plan: dict = {}
    if getattr(model, "tok_emb", None) is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if sp and getattr(model, "pos_emb", None) is not None:
        plan["pos_emb"] = positions_of_sequence_shard()
    if getattr(model, "lm_head", None) is not None:
        if sp:
            plan["norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                          use_local_output=local_logits)
    blocks = {f"blocks.{name}": block for name, block in model.blocks.items()}
    if getattr(model, "mtp", None) is not None:  # multi-token prediction's blocks (lmforge.model.mtp): the same split
        blocks.update({f"mtp.{k}.block": depth.block for k, depth in model.mtp.items()})
    for pre, block in blocks.items():
        row_out = {"output_layouts": Shard(1)} if sp else {}
        # the fused wqkv (model.fused_qkv) too: its rows are grouped by kv head, so the plain row
        # split gives each rank whole groups (lmforge.model.layers.qkv_layout); multi-head latent
        # attention: its up-projections (whole heads: each head's rows are contiguous), the latent
        # down-projections and norms replicated (lmforge.model.mla)
        for n in _column_parallel_attention(block.attn):
            plan[f"{pre}.attn.{n}"] = col(f"{pre}.attn.{n}")
        plan[f"{pre}.attn.wo"] = row(f"{pre}.attn.wo", **row_out)
        if getattr(block.attn, "q_norm", None) is not None and not isinstance(block.attn, MLAttention):  # (QK-norm)
            plan.update(_qk_norm_plan(pre))
        if isinstance(block.attn, GatedDeltaNet):
            plan[f"{pre}.attn.norm"] = heads_sharded_norm()
        if is_moe(block.mlp):  # TP shards attention only: each TP rank runs the MoE feed-forward whole
            pass
        else:
            up = ("gate", "up") if hasattr(block.mlp, "gate") else ("fc",)
            down = "down" if hasattr(block.mlp, "down") else "proj"
            for n in up:
                plan[f"{pre}.mlp.{n}"] = col(f"{pre}.mlp.{n}")
            plan[f"{pre}.mlp.{down}"] = row(f"{pre}.mlp.{down}", **row_out)
        if sp:
            for n in ("attn_norm", "mlp_norm"):  # (model.norm_placement = "post": none)
                if getattr(block, n, None) is not None:
                    plan[f"{pre}.{n}"] = SequenceParallel()
            for n in ("attn_post_norm", "mlp_post_norm"):  # (Gemma 3, OLMo: on the rank's sequence shard of
                if getattr(block, n, None) is not None:     # the sublayer's output, before the residual add)
                    plan[f"{pre}.{n}"] = SequenceParallel(use_local_output=True)
            plan[f"{pre}.attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None),
                                                     use_local_output=True)
            if is_moe(block.mlp):  # whole sequence in, this rank's sequence shard out
                plan[f"{pre}.mlp"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
            else:
                plan[f"{pre}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                        use_local_output=True)
    return plan


def _replicate_params(name: str, module: nn.Module, mesh) -> None:
    """A ParallelStyle's partition: `module`'s own parameters replicated over the TP mesh (trainable as before)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for key, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(p, mesh, [Replicate()]),
                                                    requires_grad=p.requires_grad))


def _to_local(module: nn.Module, output, mesh) -> torch.Tensor:
    """A ParallelStyle's output: the DTensor's local tensor."""
    return output.to_local()


def positions_of_sequence_shard():
    """The `PositionsOfSequenceShard` style for a learned position embedding (below)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class PositionsOfSequenceShard(ParallelStyle):
        """Learned position embedding under sequence parallelism: its weight replicated over the TP
        ranks; its input (the forward's positions, the sequence last) cut to this rank's sequence
        shard, the same torch.chunk split as the token embedding's Shard(1) output, and seen as a
        DTensor sharded along the sequence, so the lookup's weight gradient is a Partial sum that
        lmforge.parallel.clip reduces over the TP group (the true gradient: every position once)."""

        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            return distribute_module(module, mesh, _replicate_params, self._shard_positions, _to_local)

        @staticmethod
        def _shard_positions(module: nn.Module, inputs: tuple, mesh) -> tuple:
            positions = inputs[0]
            mine = positions.chunk(mesh.size(), dim=-1)[mesh.get_local_rank()]
            return (DTensor.from_local(mine, mesh, [Shard(positions.ndim - 1)], run_check=False), *inputs[1:])

    return PositionsOfSequenceShard()


def heads_sharded_norm():
    """The `HeadsShardedNorm` style for Gated DeltaNet's gated output norm (below)."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class HeadsShardedNorm(ParallelStyle):
        """A norm over each head's last dim whose inputs (the heads' outputs and their gates, (batch,
        seq, heads here, head dim)) are this rank's heads: its weight replicated over the TP ranks,
        every input seen as a DTensor sharded along the heads, so the weight's gradient is a partial
        sum over the ranks' heads, reduced by DTensor (torch's SequenceParallel does this for one input;
        the gated norm takes two)."""

        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            return distribute_module(module, mesh, _replicate_params, self._heads, _to_local)

        @staticmethod
        def _heads(module: nn.Module, inputs: tuple, mesh) -> tuple:
            return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in inputs)

    return HeadsShardedNorm()


def _shard_heads(deltanet: GatedDeltaNet, mesh) -> None:
    """Gated DeltaNet's per-channel and per-head parameters (the depthwise convolutions' weights,
    A_log, dt_bias) as DTensors sharded on dim 0 over `mesh`, the split of the column-parallel input
    projections' rows: the forward uses their local shards (lmforge.model.gated_deltanet)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for owner, key in ((deltanet.conv_q, "weight"), (deltanet.conv_k, "weight"), (deltanet.conv_v, "weight"),
                       (deltanet, "A_log"), (deltanet, "dt_bias")):
        p = getattr(owner, key)
        owner.register_parameter(key, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]),
                                                   requires_grad=p.requires_grad))


def _column_parallel_attention(attn: nn.Module) -> tuple[str, ...]:
    """The column-parallel projections of a block's attention (its heads split over the TP ranks)."""
    if isinstance(attn, GatedDeltaNet):  # (rows grouped by head, key heads before the value heads they serve)
        return ("in_q", "in_k", "in_v", "in_z", "in_b", "in_a")
    if isinstance(attn, MLAttention):
        return ("wq_b" if hasattr(attn, "wq_b") else "wq", "wkv_b")
    gate = ("wg",) if getattr(attn, "wg", None) is not None else ()  # (model.attn_gate: rows are heads, as q's)
    return (("wqkv",) if getattr(attn, "fused", False) else ("wq", "wk", "wv")) + gate


def _qk_norm_plan(pre: str) -> dict:
    """QK-norm weights (head_dim values, shared by the heads) replicated; each rank normalises its own
    heads, seen as a DTensor sharded along the heads dim (2 of batch, seq, heads, head_dim), so the
    weight's gradient is summed over the TP ranks' heads (as torchtitan's Qwen3 plan does)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return {f"{pre}.attn.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")}


def _float8_aware(model: nn.Module, colwise: type, rowwise: type, fp8_gathers: bool = True):
    """(col, row): the style for a block linear by its name in `model`: torchao's Float8ColwiseParallel /
    Float8RowwiseParallel for a Float8Linear with tensorwise scales (its casts made after the DTensor is,
    so every scale is the whole tensor's, as in one process; lmforge.model.fp8), else `colwise` /
    `rowwise` (rowwise-scaled Float8Linear layers too, as torchtitan does). Without `fp8_gathers` (gloo
    under sequence parallelism, where Float8RowwiseParallel would all-gather its output's FP8 gradient)
    the row-parallel layers take `rowwise`: the Float8Linear casts that gradient itself, with the same
    whole-tensor scale, after a high-precision gather."""
    from lmforge.model.fp8 import is_float8, tensorwise

    def pick(name: str, plain: type, fp8: str):
        module = model.get_submodule(name)
        if is_float8(module) and tensorwise(module) and (fp8_gathers or fp8 == "Float8ColwiseParallel"):
            from torchao.float8 import float8_tensor_parallel

            return getattr(float8_tensor_parallel, fp8)
        return plain

    return (lambda name, **kw: pick(name, colwise, "Float8ColwiseParallel")(**kw),
            lambda name, **kw: pick(name, rowwise, "Float8RowwiseParallel")(**kw))


def _lora_aware_styles() -> tuple[type, type]:
    """torch's ColwiseParallel / RowwiseParallel, also splitting a LoRALinear's adapters.

    torch's styles split every parameter of the module *and of its submodules* as if it were
    nn.Linear's weight/bias (a LoRALinear's dropout submodule made them fail). These subclasses
    handle a LoRALinear themselves (see the module docstring) and defer to torch otherwise.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lmforge.model.lora import FusedQKVLoRA, LoRALinear, QKVAdapter

    def split(module: nn.Module, mesh, placements: dict[str, object]) -> None:
        for name, placement in placements.items():
            param = getattr(module, name)
            if param is not None:
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                             requires_grad=param.requires_grad))

    class Colwise(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            if isinstance(module, LoRALinear):
                split(module, device_mesh, {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(),
                                            "lora_b": Shard(0)})
            elif isinstance(module, FusedQKVLoRA):  # (its part adapters: the QKVAdapter submodules)
                split(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)})
            elif isinstance(module, QKVAdapter):  # each part's rows in kv-group order: the rank's groups
                split(module, device_mesh, {"lora_a": Replicate(), "lora_b": Shard(0)})
            elif not list(module.parameters(recurse=False)):
                return  # a parameter-free submodule (the adapter's dropout)
            else:
                super()._partition_linear_fn(name, module, device_mesh)

    class Rowwise(RowwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            if isinstance(module, LoRALinear):
                split(module, device_mesh, {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1),
                                            "lora_b": Replicate()})
            elif not list(module.parameters(recurse=False)):
                return
            else:
                super()._partition_linear_fn(name, module, device_mesh)

    return Colwise, Rowwise


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool, local_logits: bool = False) -> nn.Module:
    """Shard `model` (a Transformer or a pipeline chunk) in place over `tp_mesh`."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = (getattr(model, "tok_emb", None) is not None and getattr(model, "lm_head", None) is not None
            and model.lm_head.weight is model.tok_emb.weight)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # (LoRA: the base weights)
    parallelize_module(model, tp_mesh, tp_plan(model, sequence_parallel, local_logits, tp_mesh.device_type == "cuda"))
    for m in model.modules():
        if isinstance(m, MLAttention):  # multi-head latent attention: its shared RoPE key's gradient, summed over TP
            m.tp_group = tp_mesh.get_group()
        if isinstance(m, GatedDeltaNet):
            _shard_heads(m, tp_mesh)
    for name, p in model.named_parameters():  # torch's SequenceParallel re-creates norm weights trainable
        if name in frozen:
            p.requires_grad_(False)
    if tied:  # both sharded along the vocabulary: point the head back at the embedding's DTensor
        assert model.lm_head.weight.placements == model.tok_emb.weight.placements
        model.lm_head.weight = model.tok_emb.weight
    return model


def unalias_embedding_output(model: nn.Module) -> None:
    """Before the blocks of a tensor-parallel `model` are compiled one by one (train.compile = true):
    the vocab-parallel embedding's output becomes a copy of its own (a forward hook), [batch, seq, dim]
    once per forward. Its plan hands the first block DTensor's `to_local()` result, a view of the
    DTensor's local tensor; a compiled block whose input is that view gives `to_local`'s backward a
    plain tensor where a DTensor gradient belongs, and the backward fails in DTensor's redistribute
    ("'Tensor' object has no attribute '_local_tensor'", torch 2.13 on CPU, every precision but
    bf16-pure, whose embedding output is already a cast copy). The same class of failure as
    pytorch/pytorch#173123 (a DTensor op's gradient arriving as a plain tensor under torch.compile)."""
    if getattr(model, "tok_emb", None) is not None:
        model.tok_emb.register_forward_hook(lambda module, args, output: output.clone())


def loss_parallel_context(tp: int):
    """`loss_parallel()` for vocab-sharded DTensor logits, else a no-op context."""
    if tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def to_local_value(t: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor scalar -> a plain tensor holding its full value."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class TensorParallel(ShardedLayout):
    """Tensor (+ sequence) parallel over the "tp" mesh dim, FSDP2 over the data-parallel ranks."""

    name = "tp"

    def __init__(self, model: Transformer, cfg: Config, dist_info: DistInfo, precision: str):
        super().__init__(model, cfg, dist_info, precision)
        if cfg.parallel.dp * cfg.parallel.cp > 1:  # (the CP ranks hold the same parameters: FSDP2 shards over them)
            apply_fsdp(model, cfg, dist_info, precision)
            self.name = "fsdp+tp"

    @contextlib.contextmanager
    def micro_batch_context(self, last: bool) -> Iterator[None]:
        # FSDP2's gradient sync on the last micro-batch only (when dp > 1); the logits are sharded
        # over the vocabulary
        with micro_batch_sync(self.model, self.cfg, last), loss_parallel_context(self.cfg.parallel.tp):
            yield

    def local_value(self, t: torch.Tensor) -> torch.Tensor:
        return to_local_value(t)

    def inference_model(self) -> ShardedInference:
        """Evaluation and sampling on the sharded model (lmforge.parallel.inference)."""
        return ShardedInference(self)

    def describe(self) -> Iterator[str]:
        p = self.cfg.parallel
        sp = "sequence parallel" if p.sequence_parallel else "no sequence parallelism"
        yield f"tensor parallel: {p.tp} ranks, {sp}, vocab-parallel embedding + loss_parallel cross-entropy"
        if p.dp * p.cp > 1:
            yield fsdp_description(self.cfg)
