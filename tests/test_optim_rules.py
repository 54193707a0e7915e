"""Lion, LAMB, Adafactor and Muon steps against their published update rules, computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.optim.lamb import LAMB
from lmforge.optim.lion import Lion
from lmforge.optim.muon import Muon, zeropower_via_newtonschulz5
from lmforge.optim.optimizers import build_optimizer



# All hand computations run in fp64 against fp64 parameters: the only differences are the order of
# floating-point operations (~1e-15), so rtol 1e-10 is tight enough to catch any rule change.
RTOL, ATOL = 1e-10, 1e-12


def _grads(steps: int, *shape: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    """Apply the given gradient sequence: grads[k][i] is parameter i's gradient at step k."""
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


def test_lion_matches_rule() -> None:
    lr, wd, (b1, b2) = 1e-3, 0.5, (0.9, 0.99)
    p0 = torch.randn(5, 7, dtype=torch.float64)
    grads = _grads(6, 5, 7)
    p = nn.Parameter(p0.clone())
    _run(Lion([p], lr=lr, betas=(b1, b2), weight_decay=wd), [p], [[g] for g in grads])
    ref, m = p0.clone(), torch.zeros_like(p0)
    for g in grads:
        update = torch.sign(b1 * m + (1 - b1) * g)
        ref = ref - lr * (update + wd * ref)
        m = b2 * m + (1 - b2) * g
    torch.testing.assert_close(p.detach(), ref, rtol=RTOL, atol=ATOL)


def test_lamb_matches_rule_including_zero_norm_param() -> None:
    lr, wd, (b1, b2), eps = 1e-2, 0.01, (0.9, 0.999), 1e-6
    p0s = [torch.randn(4, 6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)]  # ||p|| = 0: trust 1
    grads = list(zip(_grads(5, 4, 6, seed=1), _grads(5, 6, seed=2), strict=True))
    params = [nn.Parameter(p.clone()) for p in p0s]
    _run(LAMB(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd), params, grads)
    for i, p0 in enumerate(p0s):
        ref, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for t, gs in enumerate(grads, start=1):
            g = gs[i]
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            r = (m / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t)) + eps) + wd * ref
            w_norm, r_norm = float(ref.norm()), float(r.norm())
            trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            ref = ref - lr * trust * r
        torch.testing.assert_close(params[i].detach(), ref, rtol=RTOL, atol=ATOL)


def test_adafactor_is_torch_and_matches_published_rule() -> None:
    """build_optimizer('adafactor') is torch.optim.Adafactor (lmforge's subclass only adds a DTensor path);
    check it against the paper's rule
    (factored second moment with row/column sums, beta2_t = 1 - t^-0.8, clipping d = 1,
    relative step rho_t = min(lr, 1/sqrt(t)), parameter scaling) plus torch's decoupled decay."""
    lr, wd, d, eps1, eps2 = 1e-2, 0.1, 1.0, torch.finfo(torch.float64).eps, 1e-3
    model = nn.Linear(6, 4).double()  # weight (4, 6): factored; bias (4,): full second moment
    p0s = [model.weight.detach().clone(), model.bias.detach().clone()]
    opt = build_optimizer(OptimConfig(name="adafactor", lr=lr, weight_decay=wd), model)
    assert isinstance(opt, torch.optim.Adafactor)
    grads = list(zip(_grads(4, 4, 6, seed=3), _grads(4, 4, seed=4), strict=True))
    _run(opt, [model.weight, model.bias], grads)

    def rms(x: torch.Tensor) -> float:
        return float(x.pow(2).mean().sqrt())

    for i, (p0, wd_i) in enumerate(zip(p0s, (wd, 0.0), strict=True)):  # bias is in the no-decay group
        theta = p0.clone()
        row, col, vec = torch.zeros(4), torch.zeros(6), torch.zeros(4)
        row, col, vec = row.double(), col.double(), vec.double()
        for t, gs in enumerate(grads, start=1):
            g = gs[i]
            beta2 = 1 - t**-0.8
            alpha = max(eps2, rms(theta)) * min(lr, 1 / math.sqrt(t))
            theta = theta - lr * wd_i * theta
            if g.ndim == 2:
                row = beta2 * row + (1 - beta2) * (g * g).sum(dim=1)
                col = beta2 * col + (1 - beta2) * (g * g).sum(dim=0)
                v_hat = torch.outer(row, col) / max(float(row.sum()), eps1)
            else:
                vec = beta2 * vec + (1 - beta2) * g * g
                v_hat = vec
            u = g / torch.sqrt(v_hat).clamp(min=eps1)
            u_hat = u / max(1.0, rms(u) / d)
            theta = theta - alpha * u_hat
        torch.testing.assert_close([model.weight, model.bias][i].detach(), theta, rtol=RTOL, atol=ATOL)


def test_adafactor_dtensor_path_equals_torch_bit_for_bit() -> None:
    """The out-of-place update lmforge runs for DTensor parameters (FSDP2 / TP) is torch's update:
    on a one-rank mesh (Shard(0) weight, Replicate bias) it gives torch's parameters exactly. (The
    multi-rank case, where the norms really are reductions, is in test_parallel_optim.py.)"""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        ref = nn.Linear(6, 4)
        sharded = nn.Linear(6, 4)
        sharded.weight = nn.Parameter(distribute_tensor(ref.weight.detach().clone(), mesh, [Shard(0)]))
        sharded.bias = nn.Parameter(distribute_tensor(ref.bias.detach().clone(), mesh, [Replicate()]))
        opts = [build_optimizer(OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.1), m) for m in (ref, sharded)]
        for step_grads in zip(_grads(4, 4, 6, seed=5), _grads(4, 4, seed=6), strict=True):
            for model, opt in zip((ref, sharded), opts, strict=True):
                for p, g in zip((model.weight, model.bias), step_grads, strict=True):
                    g = g.float()
                    p.grad = distribute_tensor(g, mesh, p.placements) if hasattr(p, "placements") else g
                opt.step()
        assert torch.equal(sharded.weight.full_tensor(), ref.weight)
        assert torch.equal(sharded.bias.full_tensor(), ref.bias)
    finally:
        dist.destroy_process_group()


def _newton_schulz_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration as published, in fp64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_singular_values_near_one(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    before = torch.linalg.svdvals(g.double())
    assert before.max() / before.min() > 2.5  # the input is far from orthogonal
    out = zeropower_via_newtonschulz5(g, dtype=dtype)
    assert out.dtype == dtype and out.shape == g.shape
    s = torch.linalg.svdvals(out.double())
    # Keller Jordan documents S' ~ Uniform(0.5, 1.5) for these coefficients (measured here:
    # [0.68, 1.14] for fp32 and bf16); a bug (wrong transpose, no normalisation) leaves this band.
    assert 0.5 < float(s.min()) and float(s.max()) < 1.5


def test_newton_schulz_matches_reference_in_fp64() -> None:
    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    torch.testing.assert_close(
        zeropower_via_newtonschulz5(g, dtype=torch.float64), _newton_schulz_reference(g), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_matches_hand_computation(nesterov: bool) -> None:
    lr, mu, wd, rows, cols = 0.02, 0.95, 0.1, 48, 16  # tall: transposed inside, scale sqrt(3)
    p0 = torch.randn(rows, cols, dtype=torch.float64)
    grads = _grads(4, rows, cols, seed=7)
    p = nn.Parameter(p0.clone())
    opt = Muon([p], lr=lr, momentum=mu, nesterov=nesterov, ns_dtype=torch.float64, weight_decay=wd)
    _run(opt, [p], [[g] for g in grads])
    ref, buf = p0.clone(), torch.zeros_like(p0)
    for g in grads:
        buf = mu * buf + (1 - mu) * g
        u = (1 - mu) * g + mu * buf if nesterov else buf
        ref = ref * (1 - lr * wd) - lr * math.sqrt(rows / cols) * _newton_schulz_reference(u)
    torch.testing.assert_close(p.detach(), ref, rtol=RTOL, atol=ATOL)


def test_muon_matrix_update_agrees_with_torch_muon() -> None:
    """Cross-check against torch.optim.Muon (2-D only), both orthogonalising in bf16."""
    w0 = torch.randn(32, 48)
    ours, theirs = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt_ours = Muon([ours], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)  # (CPU default: fp32)
    opt_theirs = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1)
    grads = [[g] for g in _grads(5, 32, 48, seed=8)]
    _run(opt_ours, [ours], [[g[0].float()] for g in grads])
    _run(opt_theirs, [theirs], [[g[0].float()] for g in grads])
    # Same published rule; bf16 Newton-Schulz may round differently (one bf16 ulp of an O entry
    # ~0.1 is ~4e-4, times lr 0.02 ~ 1e-5 per step). The parameters moved by ~0.05.
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=5e-5)
    assert float((ours.detach() - w0).abs().max()) > 0.01


def test_muon_adamw_groups_equal_torch_adamw_bitwise() -> None:
    p0 = torch.randn(10)
    ours, theirs = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    opt_ours = Muon([{"params": [ours], "use_muon": False, "lr": 1e-2, "weight_decay": 0.1}], foreach=True)
    opt_theirs = torch.optim.AdamW(
        [theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True
    )
    grads = [[g.float()] for g in _grads(5, 10, seed=9)]
    _run(opt_ours, [ours], grads)
    _run(opt_theirs, [theirs], grads)
    assert torch.equal(ours, theirs)  # the AdamW half *is* torch's functional AdamW


class _TinyLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(20, 8)
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        if tied:
            self.lm_head.weight = self.tok_emb.weight


@pytest.mark.parametrize("tied", [True, False])
def test_build_muon_assigns_groups(tied: bool) -> None:
    opt = build_optimizer(OptimConfig(name="muon", lr=3e-4, weight_decay=0.1), _TinyLM(tied))
    groups = {g["group"]: g for g in opt.param_groups}
    assert groups["muon"]["param_names"] == ["fc.weight", "proj.weight"]
    assert groups["muon"]["use_muon"] and groups["muon"]["lr"] == 0.02 and groups["muon"]["momentum"] == 0.95
    assert groups["adamw_decay"]["param_names"] == ([] if tied else ["lm_head.weight"])
    no_decay = sorted(groups["adamw_no_decay"]["param_names"])
    assert no_decay == ["fc.bias", "norm.bias", "norm.weight", "tok_emb.weight"]
    assert groups["adamw_no_decay"]["lr"] == 3e-4 and groups["adamw_no_decay"]["weight_decay"] == 0.0
    assert not groups["adamw_decay"]["use_muon"] and not groups["adamw_no_decay"]["use_muon"]


def test_muon_rejects_vectors_in_muon_group() -> None:
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon([nn.Parameter(torch.zeros(4))])


def test_optimizers_skip_params_without_grad_and_call_closure() -> None:
    for cls in (Lion, LAMB, Muon):
        a, b = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(3, 3))
        opt = cls([a, b], lr=0.1)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (a**2).sum()
            loss.backward()
            return loss

        assert float(opt.step(closure).detach()) == 9.0
        assert not torch.equal(a, torch.ones(3, 3)) and torch.equal(b, torch.ones(3, 3)), cls.__name__
        assert b not in opt.state or not opt.state[b]
