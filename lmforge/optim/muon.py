"""Muon (Keller Jordan 2024, "Muon: An optimizer for hidden layers in neural networks").

For a hidden weight matrix W (rows x cols) with gradient G, at every step:

    B = mu * B + (1 - mu) * G                     (momentum buffer, EMA form)
    U = (1 - mu) * G + mu * B  if nesterov else B
    O = NewtonSchulz5(U)                          (approximately U V^T of U's SVD)
    W = W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O

The EMA form of the buffer differs from the "B = mu * B + G" form only by the factor (1 - mu),
which the Frobenius normalisation inside Newton-Schulz removes.

Why hand-written: torch 2.13 has `torch.optim.Muon`, but it refuses every non-2-D parameter, so
a model would need two optimizers (and two schedulers, two checkpoints). This class keeps one
optimizer: param groups flagged `use_muon=True` get the update above; groups flagged
`use_muon=False` (embeddings, lm_head, norms, biases) run AdamW through torch's own functional
AdamW (`torch.optim.adam.adam` with decoupled weight decay), so that half is torch's code.

A fused q/k/v projection (model.fused_qkv: `attn.wqkv`, rows grouped by kv head) is three matrices
in one parameter: its Muon group carries `qkv_heads = (query heads per kv head, head_dim)`, and q,
k and v are orthogonalised and scaled apart, exactly as the separate `wq`, `wk`, `wv` would be
(bit-equal on one process; tests/test_fused_qkv.py).

Sharded parameters: under FSDP2 (rows sharded over one mesh dim; HSDP's replicas alike) and under
tensor parallelism alone (rows or columns) the matrices are dealt over the shard ranks
(`_dealt_updates`: one gather and one scatter per matrix, each rank orthogonalising 1/N of them);
under FSDP2 x TP (a shard of a shard) DTensor runs Newton-Schulz on the shards itself, gathering
inside each product (a fused q/k/v weight there is gathered whole on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.adam import adam as torch_functional_adam

from lmforge.optim._common import check_betas, check_non_negative, evaluate_closure, grad_of
from lmforge.optim.optimizers import embedding_ids, mup_groups, param_groups

if TYPE_CHECKING:
    from lmforge.config import OptimConfig

# Quintic Newton-Schulz coefficients (a, b, c) from Keller Jordan's post: chosen to maximise the
# slope at zero, so 5 steps push every singular value into roughly [0.5, 1.5] rather than to 1.
NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)


def zeropower_via_newtonschulz5(
    g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7
) -> torch.Tensor:
    """Approximately orthogonalise a 2-D matrix: returns ~U V^T (singular values ~1), in `dtype`.

    X = G / (||G||_F + eps) (so the spectral norm is <= 1), transposed to be wide, then
    `steps` times: A = X X^T;  X = a X + (b A + c A A) X.  Singular values land in ~[0.5, 1.5]
    (not exactly 1: the coefficients trade accuracy for speed of growth near zero).
    """
    assert g.ndim == 2, f"Newton-Schulz expects a matrix, got shape {tuple(g.shape)}"
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    transposed = x.size(0) > x.size(1)
    if transposed:  # iterate on the wide orientation: the Gram matrix X X^T is the smaller one
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        # addmm rounds each "beta * input + alpha * (m1 @ m2)" once: noticeably closer to the
        # exact iteration in bf16 than separate multiply/add ops.
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if transposed else x


class Muon(torch.optim.Optimizer):
    """Muon for matrices (`use_muon=True` groups) + AdamW for the rest (`use_muon=False` groups).

    Muon-group keys: lr, momentum, nesterov, ns_steps, ns_dtype, weight_decay, and qkv_heads (None, or
    (rep, head_dim) for a group of fused q/k/v weights: each q, k and v orthogonalised apart).
    AdamW-group keys: lr, betas, eps, weight_decay. A group without `use_muon` defaults to True.
    State: `momentum_buffer` for Muon params; `step`, `exp_avg`, `exp_avg_sq` (torch's AdamW
    layout) for the others. Parameters with more than 2 dims are flattened to (dim0, rest).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        foreach: bool | None = None,
    ) -> None:
        check_non_negative(lr=lr, weight_decay=weight_decay, eps=eps)
        check_betas(betas)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1) (Muon default 0.95)")
        if ns_steps < 1:
            raise ValueError(f"ns_steps={ns_steps} must be >= 1 (default 5)")
        defaults = {
            "use_muon": True, "lr": lr, "momentum": momentum, "nesterov": nesterov,
            "ns_steps": ns_steps, "ns_dtype": ns_dtype, "weight_decay": weight_decay, "qkv_heads": None,
            "betas": tuple(betas), "eps": eps, "foreach": foreach,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, then reject vectors in Muon groups."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(
                        f"Muon got a parameter of shape {tuple(p.shape)} in a use_muon=True group; "
                        "Muon orthogonalises matrices, put vectors in a group with use_muon=False (AdamW)"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One update: Muon on `use_muon` groups, AdamW on the others."""
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        heads, steps = group["qkv_heads"], group["ns_steps"]
        dealt: dict[Any, list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]] = {}  # (mesh, shard dim) -> matrices
        for p in group["params"]:
            g = grad_of(p, "Muon")
            if g is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1.0 - mu)
            update = g.lerp(buf, mu) if group["nesterov"] else buf
            matrix = update.reshape(update.size(0), -1)
            # None: bf16 on accelerators (as in the Muon paper), fp32 on CPUs, most of which emulate bf16
            # matmuls (~1-2% of fp32 speed on this AVX2 machine)
            ns_dtype = group["ns_dtype"] or (torch.float32 if matrix.device.type == "cpu" else torch.bfloat16)
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            dims = _shard_dims(p)
            if dims is not None:
                dealt.setdefault((p.device_mesh, *dims), []).append((p, matrix, ns_dtype))
            elif heads is not None:
                _fused_qkv_update(p, matrix, heads, steps, ns_dtype, lr)
            else:
                ortho = zeropower_via_newtonschulz5(matrix, steps, ns_dtype)
                rows, cols = matrix.shape
                p.add_(ortho.view_as(p).to(p.dtype), alpha=-lr * max(1.0, rows / cols) ** 0.5)
        for (mesh, mesh_dim, dim), items in dealt.items():
            _dealt_updates(mesh, mesh_dim, dim, items, heads, steps, lr)

    def _adamw_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            g = grad_of(p, "Muon (AdamW part)")
            if g is None:
                continue
            state = self.state[p]
            if "step" not in state:  # same layout as torch.optim.AdamW (step on the host)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(g)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        torch_functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=group["foreach"], decoupled_weight_decay=True, amsgrad=False,
            beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=False,
        )


def _qkv_view(shape: tuple[int, int], heads: tuple[int, int]) -> tuple[tuple[int, int, int, int], list[slice]]:
    """A fused q/k/v matrix of `shape` (rows, cols) with `heads` = (rep, head_dim) viewed as [kv groups,
    rep + 2, head_dim, cols] (lmforge.model.layers.qkv_layout's order), and the slices of q, k and v
    along its second dim."""
    (rows, cols), (rep, hd) = shape, heads
    groups = rows // ((rep + 2) * hd)
    assert groups * (rep + 2) * hd == rows, (rows, rep, hd)
    return (groups, rep + 2, hd, cols), [slice(0, rep), slice(rep, rep + 1), slice(rep + 1, rep + 2)]


def _qkv_orthogonalised_parts(matrix: torch.Tensor, heads: tuple[int, int], steps: int, ns_dtype: torch.dtype):
    """(slice, NewtonSchulz5 of that part in `_qkv_view`'s 4-D shape, the part's scale sqrt(max(1,
    rows / cols))) for q, k and v of a fused q/k/v matrix: each orthogonalised as the separate
    matrix would be (the same contiguous values)."""
    shape, parts = _qkv_view(tuple(matrix.shape), heads)
    u4 = matrix.view(shape)
    for part in parts:
        piece = u4[:, part].reshape(-1, shape[-1])
        ortho = zeropower_via_newtonschulz5(piece, steps, ns_dtype).view(shape[0], -1, *shape[2:])
        yield part, ortho, max(1.0, piece.size(0) / shape[-1]) ** 0.5


def _orthogonalised(full: torch.Tensor, heads: tuple[int, int] | None, steps: int,
                    ns_dtype: torch.dtype) -> torch.Tensor:
    """Muon's update direction for a whole matrix, in `ns_dtype`: NewtonSchulz5(update) x sqrt(max(1,
    rows / cols)), or for a fused q/k/v weight (`heads` = (rep, head_dim)) that of q, k and v apart."""
    rows, cols = full.shape
    if heads is None:
        return zeropower_via_newtonschulz5(full, steps, ns_dtype) * max(1.0, rows / cols) ** 0.5
    out = torch.empty(full.shape, dtype=ns_dtype, device=full.device)
    o4 = out.view(_qkv_view((rows, cols), heads)[0])
    for part, ortho, scale in _qkv_orthogonalised_parts(full, heads, steps, ns_dtype):
        o4[:, part] = ortho * scale
    return out


def _fused_qkv_update(p: torch.Tensor, matrix: torch.Tensor, heads: tuple[int, int], steps: int,
                      ns_dtype: torch.dtype, lr: float) -> None:
    """Muon's step (weight decay already applied) for a fused q/k/v weight (`qkv_heads` = (rep,
    head_dim)): q, k and v orthogonalised and scaled apart, as three separate matrices would be. A
    plain tensor is updated in place part by part (the same operations as on the separate matrices:
    bit-equal). A DTensor that `_dealt_updates` does not take (FSDP2 x TP) is gathered
    on every rank (its rows are split by kv group: no rank holds all of a part), and each rank adds
    its own shard of the update."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(matrix, DTensor):
        delta = _orthogonalised(matrix.full_tensor(), heads, steps, ns_dtype).to(p.dtype)
        mesh = p.device_mesh
        replicated = DTensor.from_local(delta, mesh, [Replicate()] * mesh.ndim, run_check=False)
        p.add_(replicated.redistribute(mesh, p.placements).view_as(p), alpha=-lr)
        return
    p4 = p.view(_qkv_view(tuple(matrix.shape), heads)[0])
    for part, ortho, scale in _qkv_orthogonalised_parts(matrix, heads, steps, ns_dtype):
        p4[:, part].add_(ortho.to(p.dtype), alpha=-lr * scale)


def _shard_dims(p: torch.Tensor) -> tuple[int, int] | None:
    """(mesh dim, tensor dim) when `p` is a matrix sharded along one tensor dim over one mesh dim in
    torch.chunk pieces and replicated over every other mesh dim, else None: what `_dealt_updates`
    orthogonalises. FSDP2's `fully_shard` (rows; HSDP's replicas alike), and tensor parallelism on a
    mesh of its own (column-wise layers: rows; row-wise layers: columns). FSDP2 x TP shards a
    shard (2-D placements): not dealt."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor) or p.ndim != 2:
        return None
    sharded = [(i, pl.dim) for i, pl in enumerate(p.placements) if type(pl) is Shard]
    rest_replicated = all(pl == Replicate() for pl in p.placements if type(pl) is not Shard)
    if len(sharded) != 1 or not rest_replicated or p.device_mesh.size(sharded[0][0]) < 2:
        return None
    return sharded[0]


def _dealt_updates(mesh, mesh_dim: int, dim: int, items: list[tuple[torch.Tensor, torch.Tensor, torch.dtype]],
                   heads: tuple[int, int] | None, steps: int, lr: float) -> None:
    """Muon's step for matrices sharded along tensor dim `dim` over mesh dim `mesh_dim` (`_shard_dims`;
    weight decay already applied), the matrices dealt round-robin over that mesh dim's W ranks (other
    mesh dims, e.g. HSDP's replicas, do the same on the same values): in each round of W, every rank gathers one
    matrix's update from all shards (`dist.gather`), orthogonalises it (`_orthogonalised`) while the
    others do theirs, and scatters the shards back (`dist.scatter`). One gather and one scatter per
    matrix, and 1/W of the Newton-Schulz work per rank, where DTensor's own ops on the shards would
    all-gather inside every Newton-Schulz product. The result is the one-process update, to rounding
    (the owner's matrix is the whole update). Hand-written: torch has no sharded Muon (torch.optim.Muon
    takes plain 2-D tensors). Shards are padded to ceil(size / W) along `dim` for the collectives, and
handled with `dim` first (a column shard transposed: the collectives take contiguous rows)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    pg, world, me = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    lead = (lambda t: t) if dim == 0 else (lambda t: t.t())  # the sharded dim first  # noqa: E731
    for first in range(0, len(items), world):
        batch = items[first:first + world]  # matrix k of the round is rank k's
        shapes = [tuple(lead(m).shape) for _, m, _ in batch]  # (sharded size, other size)
        pads = [-(-n // world) for n, _ in shapes]
        works, gathered = [], []
        for k, ((_, m, _), (_, other), per) in enumerate(zip(batch, shapes, pads, strict=True)):
            local = lead(m.to_local())
            send = local.new_zeros((per, other))
            send[:local.shape[0]] = local
            recv = [torch.empty_like(send) for _ in range(world)] if me == k else None
            works.append(dist.gather(send, recv, group=pg, group_dst=k, async_op=True))
            gathered.append(recv)
        for work in works:
            work.wait()
        pieces = None
        if me < len(batch):
            p, m, ns_dtype = batch[me]
            n, other = shapes[me]
            padded = torch.cat(gathered[me])  # (the padding follows the last rows: torch.chunk order)
            delta = lead(_orthogonalised(lead(padded[:n]).contiguous(), heads, steps, ns_dtype).to(p.dtype))
            out = delta.new_zeros((pads[me] * world, other))
            out[:n] = delta
            pieces = list(out.chunk(world))
        works, received = [], []
        for k, ((p, m, _), (_, other), per) in enumerate(zip(batch, shapes, pads, strict=True)):
            recv_piece = torch.empty((per, other), dtype=p.dtype, device=m.to_local().device)
            works.append(dist.scatter(recv_piece, pieces if me == k else None, group=pg, group_src=k, async_op=True))
            received.append(recv_piece)
        for work in works:
            work.wait()
        for (p, _, _), piece in zip(batch, received, strict=True):
            local = p.to_local()
            mine = lead(piece[:lead(local).shape[0]])
            shard = DTensor.from_local(mine.contiguous(), mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
            p.add_(shard, alpha=-lr)


def qkv_heads_of(model: nn.Module, name: str) -> tuple[int, int] | None:
    """(query heads per kv head, head_dim) when `name` is a fused q/k/v weight (`...attn.wqkv.weight`,
    model.fused_qkv), else None: read from its attention module."""
    suffix = ".wqkv.weight"
    if not name.endswith(suffix):
        return None
    attn = model.get_submodule(name[:-len(suffix)])
    return attn.n_heads // attn.n_kv_heads, attn.head_dim


def muon_groups(model: nn.Module, cfg: "OptimConfig", extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Muon groups: decay-group matrices not named in `muon_exclude` go to Muon, the rest to AdamW.
    Fused q/k/v weights (model.fused_qkv) go to a second Muon group of the same name and settings,
    with `qkv_heads` (its q, k and v orthogonalised apart; a group key, so ZeRO-1's per-rank
    rebuild and TP's split of groups keep it)."""
    lr, weight_decay = cfg.lr, cfg.weight_decay
    exclude = tuple(extra.pop("muon_exclude", ("lm_head",)))
    muon_group: dict[str, Any] = {
        "params": [], "param_names": [], "group": "muon", "use_muon": True,
        "lr": cfg.muon_lr,
        "momentum": cfg.muon_momentum,
        "nesterov": extra.pop("muon_nesterov", True),
        "ns_steps": extra.pop("muon_ns_steps", 5),
        "ns_dtype": extra.pop("muon_ns_dtype", None),
        "weight_decay": extra.pop("muon_weight_decay", weight_decay),
    }
    decay, no_decay = param_groups(model, weight_decay, cfg.decay_embeddings)
    adamw_decay: dict[str, Any] = {"params": [], "param_names": []}
    embeddings = embedding_ids(model)
    qkv_groups: dict[tuple[int, int], dict[str, Any]] = {}
    for name, p in zip(decay["param_names"], decay["params"], strict=True):
        to_muon = id(p) not in embeddings and not any(key in name for key in exclude)
        heads = qkv_heads_of(model, name) if to_muon else None
        if heads is not None:
            target = qkv_groups.setdefault(heads, {**muon_group, "params": [], "param_names": [], "qkv_heads": heads})
        else:
            target = muon_group if to_muon else adamw_decay
        target["params"].append(p)
        target["param_names"].append(name)
    adamw_decay.update(group="adamw_decay", use_muon=False, lr=lr, weight_decay=weight_decay)
    no_decay.update(group="adamw_no_decay", use_muon=False, lr=lr)
    return [muon_group, *qkv_groups.values(), adamw_decay, no_decay]



def build(model: nn.Module, cfg: "OptimConfig", extra: dict[str, Any]) -> "Muon":
    """The registry's builder: Muon for the matrices, AdamW (optim.lr, betas, eps) for the rest."""
    groups = mup_groups(model, muon_groups(model, cfg, extra), cfg.lr, "muon")  # (μP: lmforge.model.mup)
    return Muon(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
