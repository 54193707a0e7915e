"""The training objective, in one place: next-token cross-entropy summed over target tokens,
`IGNORE_INDEX` (-100) targets ignored, and the normalisation by the global step's target count.

    nll = token_nll_sum(logits, targets)              # fp32 scalar, summed over tokens
    n = count_targets(targets_of_the_step)            # all-reduced over data-parallel ranks by the layout
    loss = normalise(nll, n, dp)                       # = nll / n * dp

Why `* dp`: DDP and FSDP *average* gradients over the dp ranks, so each rank scales its summed
NLL by dp / N (N the global step's target count): mean_r(dp * nll_r / N) = sum_r(nll_r) / N, the
gradient of one big batch, also when ranks or micro-batches hold different numbers of targets.

Cross-entropy fused with the output projection, computed over chunks of tokens
(`linear_cross_entropy_sum`, train.loss_chunk):

The plain loss materialises the logits of every token of a micro-batch: [B*T, vocab] in the
compute dtype, an fp32 copy, and the fp32 log-softmax autograd keeps for backward, then a
gradient of the same size. For GPT-2 124M at micro-batch 12 x 1024 that is ~2.5 GB per fp32
copy; for a 128k vocabulary it dominates activation memory.

`linear_cross_entropy_sum(hidden, weight, targets, chunk)` computes the same summed token NLL
chunk by chunk (`chunk` tokens at a time) and, in the same pass, the gradients with respect to
`hidden` and `weight` (d loss / d logits = softmax - one_hot, then two matmuls). Per chunk:

    logits = h_c @ W.T                      [chunk, vocab], compute dtype (bf16 under autocast)
    lp = log_softmax(logits, dtype=fp32)    (torch casts the logits to fp32 first: a copy)
    nll += -sum(lp[target])                 (ignored targets masked on [chunk] values)
    g = exp_(lp); g[target] -= 1            in place: d(sum NLL)/d logits, fp32, then cast to bf16
    grad_h_c = g @ W;  grad_W += g.T @ (h_c * valid)

An ignored target's row of g is not zeroed (a pass over [chunk, vocab]): its grad_h row is zeroed
and its hidden row is zeroed before the grad_W matmul ([chunk, d] work). Only one chunk of logits
exists at a time (at most two [chunk, vocab] fp32 buffers, briefly, plus the compute-dtype matmul
output); what is kept for backward is grad_hidden ([B*T, d], the size of the hidden states) and
grad_weight ([vocab, d] fp32, the size of the weight). Backward multiplies them by the incoming
scalar gradient, in place. FLOPs equal the plain path's: forward matmul + the two backward matmuls, done in
the forward (the alternative, recomputing each chunk's logits in backward as torch's own
checkpointing would, costs a fourth matmul: +33% of the head's FLOPs, for the same memory). Elementwise
memory traffic per chunk: one compute-dtype write and read, the fp32 cast, an fp32 write (log_softmax), an fp32
read + write (exp), and in bf16 one cast; the plain path also materialises an fp32 copy of all the
logits, the log-softmax autograd keeps, and a same-sized gradient (benchmarks/fused_head.py).

On CUDA the elementwise part of each chunk (everything between the two matmuls) is one function
compiled by torch.compile (`chunk_nll_and_grad`, Triton kernels): it reads the compute-dtype logits
twice (the log-sum-exp, then softmax - one_hot) and writes the gradient once in the compute dtype,
with no fp32 [chunk, vocab] buffer at all. Measured on an H100 at GPT-2's shape, the eager path's
fp32 casts, log_softmax, exp_ and cast back took ~45 ms of a 187 ms step; compiled, 9 ms at about
2.2 TB/s, so a hand-written kernel has little left to win (benchmarks/RESULTS.md). On the CPU
the eager path is kept (a compile costs more than it saves at the sizes the CPU trains, and the
tests' bitwise checks stay on the eager numbers); `compiled=True/False` forces either.

Precision follows the plain path: under autocast the matmuls run in the autocast dtype with
the logits upcast to fp32 for the softmax; grad_weight is accumulated in fp32.
Targets equal to -100 are ignored (zero loss, zero gradient).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from lmforge.config.rules import gpu_compile_blocker

IGNORE_INDEX = -100


def token_nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL (fp32 scalar) of logits (..., vocab) against targets (...), IGNORE_INDEX
    targets skipped. Under tensor parallelism `logits` is a vocab-sharded DTensor and the call must
    run inside `loss_parallel()`."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def model_nll_sum(model, x: torch.Tensor, y: torch.Tensor, loss_chunk: int = 0,
                  autocast=contextlib.nullcontext, targets_in_forward: bool = False,
                  **docs: torch.Tensor) -> torch.Tensor:
    """Summed token NLL (fp32) of `model` (a Transformer, or what wraps one) on tokens x, targets y: with
    `loss_chunk` > 0 computed inside its forward by the chunked loss (`linear_cross_entropy_sum`: no
    [B, T, vocab] logits), else `token_nll_sum` of its logits, outside `autocast` (a callable giving
    the precision's context, entered around the forward). `targets_in_forward`: the forward takes the
    targets whatever loss_chunk is (multi-token prediction's modules need them: lmforge.model.mtp).
    `docs`: the document arguments of the forward (lmforge.model.documents), if any."""
    inside = bool(loss_chunk) or targets_in_forward
    with autocast():
        out = model(x, targets=y, loss_chunk=loss_chunk, **docs) if inside else model(x, **docs)
    return out if inside else token_nll_sum(out, y)


def count_targets(targets: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Number of scored (not IGNORE_INDEX) targets, as an int64 tensor on the targets' device."""
    if isinstance(targets, torch.Tensor):
        return (targets != IGNORE_INDEX).sum()
    return sum(count_targets(t) for t in targets)


def normalise(nll_sum: torch.Tensor, n_targets: torch.Tensor, dp: int = 1) -> torch.Tensor:
    """Summed NLL / the global step's target count (at least 1), times `dp`: the number of ranks
    whose gradients DDP / FSDP average (module docstring). dp = 1: the mean token loss to report;
    a data-parallel layout backpropagates the loss normalised with its dp (x cp) degree. The one
    place the loss is scaled for gradient averaging."""
    loss = nll_sum / n_targets.clamp(min=1)
    return loss * dp if dp > 1 else loss


def _compute_dtype(t: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return weight.dtype


def chunk_nll_and_grad(logits: torch.Tensor, safe: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed NLL (fp32) and d(sum NLL)/d logits = softmax - one_hot (in the logits' dtype)
    from logits [chunk, vocab], targets `safe` [chunk, 1] (ignored ones replaced by 0) and `valid`
    [chunk] (False = ignored: no loss, and no one_hot; its gradient row is dropped by the caller).
    Written for torch.compile: eagerly it would make several fp32 [chunk, vocab] temporaries."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    nll = ((lse.squeeze(1) - lf.gather(1, safe).squeeze(1)) * valid).sum()
    hit = (torch.arange(lf.shape[1], device=lf.device)[None, :] == safe) & valid[:, None]
    return nll, (torch.exp(lf - lse) - hit.to(lf.dtype)).to(logits.dtype)


@functools.cache
def _compiled_chunk_fn():
    """The compiled chunk_nll_and_grad, made at its first use."""
    return torch.compile(chunk_nll_and_grad, dynamic=False, fullgraph=True)


def use_compiled_chunk(device: torch.device) -> bool:
    """Whether the chunked loss compiles its elementwise part by default on `device`: on a CUDA GPU
    where torch.compile can make kernels (lmforge.config.rules.gpu_compile_blocker: Triton, compute
    capability; module docstring)."""
    if device.type != "cuda":
        return False
    return gpu_compile_blocker(torch.cuda.get_device_capability(device)) is None


def _chunk_forward(hc: torch.Tensor, yc: torch.Tensor, w: torch.Tensor, grad_h: torch.Tensor | None,
                   grad_w: torch.Tensor | None, compiled: bool) -> torch.Tensor:
    """One chunk of `_LinearCrossEntropySum.forward`: its summed NLL, and its rows of grad_h and its
    share of grad_w added in place (either None: not needed). A function of its own so that the
    chunk's gradient and masked hidden rows are freed when it returns, before the next chunk's logits
    are made (bound in the loop, they would sit beside them: c (V + d) 16-bit values, ~420 MB at
    GPT-2's shape with 4096-token chunks)."""
    valid = yc != IGNORE_INDEX
    safe = torch.where(valid, yc, 0)[:, None]
    if compiled:  # one compiled pass: no fp32 [chunk, vocab] buffers
        nll, g = _compiled_chunk_fn()(hc @ w.t(), safe, valid)
    else:
        lp = torch.log_softmax(hc @ w.t(), dim=-1, dtype=torch.float32)  # (the logits are freed here)
        nll = -lp.gather(1, safe).squeeze(1).mul_(valid).sum()
        g = lp.exp_()  # softmax, in place: d(sum NLL)/d logits = softmax - one_hot
        g.scatter_add_(1, safe, valid.to(g.dtype).neg_()[:, None])
        g = g.to(hc.dtype)
    if grad_h is not None:
        grad_h.copy_(g @ w)
        grad_h.mul_(valid[:, None])  # ignored targets: no gradient
    if grad_w is not None:
        hm = hc * valid[:, None]
        if g.dtype == grad_w.dtype:
            grad_w.addmm_(g.t(), hm)
        else:
            grad_w += g.t() @ hm
    return nll


def _chunked_nll_sum(h: torch.Tensor, y: torch.Tensor, w: torch.Tensor, chunk: int) -> torch.Tensor:
    """The summed NLL alone, chunk by chunk (no gradient: evaluation under no_grad). One chunk's
    logits and their fp32 log-softmax exist at a time."""
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, y.numel(), chunk):
        yc = y[start:start + chunk]
        valid = yc != IGNORE_INDEX
        lp = torch.log_softmax(h[start:start + chunk].to(w.dtype) @ w.t(), dim=-1, dtype=torch.float32)
        total -= lp.gather(1, torch.where(valid, yc, 0)[:, None]).squeeze(1).mul_(valid).sum()
        del lp
    return total


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                cdtype: torch.dtype, compiled: bool) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        y = targets.reshape(-1)
        w = weight.to(cdtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = grad_w = None
        if not (need_h or need_w):
            total = _chunked_nll_sum(h, y, w, chunk)
        else:
            grad_h = torch.empty_like(h) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, y.numel(), chunk):
                end = start + chunk
                total += _chunk_forward(h[start:end].to(cdtype), y[start:end], w,
                                        None if grad_h is None else grad_h[start:end], grad_w, compiled)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.need = (need_h, need_w)
        ctx.shapes = (hidden.shape, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = ctx.saved_tensors
        need_h, need_w = ctx.need
        shape, wdtype = ctx.shapes
        # in place: the gradients become the returned ones (no second hidden- or weight-sized buffer;
        # a second backward through this graph is refused by autograd's version check)
        gh = saved[0].mul_(grad_out).reshape(shape) if need_h else None
        gw = saved[-1].mul_(grad_out).to(wdtype) if need_w else None
        return gh, gw, None, None, None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk: int, compiled: bool | None = None) -> torch.Tensor:
    """sum over tokens of -log softmax(hidden @ weight.T)[target] (fp32 scalar), `chunk` tokens at a
    time, never holding more than one chunk of logits. hidden (..., d), weight (vocab, d), targets
    (...) int64 with -100 = ignored. chunk <= 0 or >= the token count: one chunk. `compiled`: the
    elementwise part through torch.compile (None = where `use_compiled_chunk` says: CUDA; never inside a
    graph being compiled)."""
    n = targets.numel()
    chunk = n if chunk <= 0 else min(chunk, n)
    if not torch.is_grad_enabled():  # (autograd.Function would still report needs_input_grad)
        return _chunked_nll_sum(hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1),
                                weight.to(_compute_dtype(hidden, weight)), chunk)
    if compiled is None:  # (inside a whole-model graph, train.compile = model, the outer compile fuses the chunk
        # already; deciding there would also trace the Triton probe, which dynamo refuses: 2026-11-27 H100)
        compiled = False if torch.compiler.is_compiling() else use_compiled_chunk(hidden.device)
    return _LinearCrossEntropySum.apply(hidden, weight, targets, chunk, _compute_dtype(hidden, weight), compiled)
