"""build_optimizer for sgd / momentum / adam / adamw against textbook update rules, and param_groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.optim.optimizers import build_optimizer, describe_groups, param_groups



STEPS = 20
LR = 1e-2
WD = 0.1


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(8, 3, generator=g, dtype=torch.float64)


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Gradients of the MSE loss at `step`'s batch, by parameter name."""
    x, y = _batch(step)
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _textbook_step(name: str, p: torch.Tensor, g: torch.Tensor, wd: float, t: int, s: dict) -> torch.Tensor:
    """One update of `name` written from the published rule, plain tensor math; returns new p."""
    if name == "sgd":
        return p - LR * (g + wd * p)
    if name in ("momentum", "nesterov"):
        mu = 0.9
        d = g + wd * p  # torch SGD: L2 weight decay added to the gradient
        s["buf"] = d.clone() if t == 1 else mu * s["buf"] + d
        return p - LR * (d + mu * s["buf"] if name == "nesterov" else s["buf"])
    b1, b2, eps = 0.9, 0.95, 1e-8
    if name == "adam":  # L2 regularisation through the gradient
        g = g + wd * p
    else:  # adamw: decoupled decay
        p = p * (1 - LR * wd)
    s["m"] = b1 * s.get("m", torch.zeros_like(p)) + (1 - b1) * g
    s["v"] = b2 * s.get("v", torch.zeros_like(p)) + (1 - b2) * g * g
    m_hat, v_hat = s["m"] / (1 - b1**t), s["v"] / (1 - b2**t)
    return p - LR * m_hat / (torch.sqrt(v_hat) + eps)


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_trajectory_matches_textbook_rule(name: str) -> None:
    model = _mlp()
    ref = _mlp()
    builder_name = "momentum" if name == "nesterov" else name
    opt = build_optimizer(OptimConfig(name=builder_name, lr=LR, weight_decay=WD, nesterov=name == "nesterov"), model)
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_state: dict[str, dict] = {n: {} for n in ref_params}
    for t in range(1, STEPS + 1):
        _grads(model, t)
        opt.step()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(ref_params[n])
        grads = _grads(ref, t)
        for n, p in ref_params.items():
            wd = WD if p.ndim >= 2 else 0.0  # Linear weights decay, biases / LayerNorm do not
            ref_params[n] = _textbook_step(name, p, grads[n], wd, t, ref_state[n])
    initial = {n: p.detach() for n, p in _mlp().named_parameters()}
    for n, p in model.named_parameters():
        # fp64 on both sides; only the order of floating-point operations differs, so the
        # trajectories agree to ~1e-12. rtol 1e-6 (as specified) leaves a wide margin.
        torch.testing.assert_close(p.detach(), ref_params[n], rtol=1e-6, atol=1e-12)
    # Not vacuous: 20 steps of lr 1e-2 moved the weights by far more than the tolerance.
    moved = max(float((p.detach() - initial[n]).abs().max()) for n, p in model.named_parameters())
    assert moved > 1e-3


@pytest.mark.parametrize(("name", "cls"), [
    ("sgd", torch.optim.SGD), ("momentum", torch.optim.SGD),
    ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW),
])
def test_torch_optimizers_are_used_with_fused_kernels_on_cpu(name: str, cls: type) -> None:
    # optim.fused = "auto": torch 2.13 has fused CPU kernels for these, and auto picks them
    opt = build_optimizer(OptimConfig(name=name, lr=LR, weight_decay=WD), _mlp())
    assert type(opt) is cls
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    foreach = build_optimizer(OptimConfig(name=name, lr=LR, weight_decay=WD, fused="off"), _mlp())
    assert foreach.defaults["foreach"] is True and not foreach.defaults["fused"]
    assert name != "sgd" or opt.defaults["momentum"] == 0.0


def _tied_lm() -> nn.Module:
    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(20, 8)
            self.fc = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)
            self.lm_head = nn.Linear(8, 20, bias=False)
            self.lm_head.weight = self.tok_emb.weight  # tied
            self.frozen = nn.Parameter(torch.zeros(3, 3), requires_grad=False)

    return TinyLM()


def test_param_groups_split_and_tied_embedding_counted_once() -> None:
    decay, no_decay = param_groups(_tied_lm(), weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["param_names"] == ["fc.weight"]
    assert sorted(no_decay["param_names"]) == ["fc.bias", "norm.bias", "norm.weight", "tok_emb.weight"]
    all_params = decay["params"] + no_decay["params"]
    assert len({id(p) for p in all_params}) == len(all_params) == 5  # tied weight once, frozen left out


def test_param_groups_decay_embeddings_and_torch_keeps_extra_keys() -> None:
    model = _tied_lm()
    decay, _ = param_groups(model, weight_decay=0.1, decay_embeddings=True)
    assert sorted(decay["param_names"]) == ["fc.weight", "tok_emb.weight"]
    opt = build_optimizer(OptimConfig(name="adamw", lr=LR, weight_decay=0.1), model)
    assert [g["group"] for g in opt.param_groups] == ["decay", "no_decay"]
    assert opt.param_groups[0]["param_names"] == ["fc.weight"]
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["fc.weight"]
    rows = describe_groups(opt)
    counts = [(r["group"], r["tensors"], r["params"]) for r in rows]
    assert counts == [("decay", 1, 64), ("no_decay", 4, 8 + 16 + 160)]


def test_unknown_name_and_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="adamw.*lion.*muon"):
        build_optimizer(OptimConfig(name="adamx", lr=LR, weight_decay=WD), _mlp())
    with pytest.raises(ValueError, match="weight_decay"):
        build_optimizer(OptimConfig(name="adamw", lr=LR, weight_decay=-1.0), _mlp())
    with pytest.raises(ValueError, match="nesterov"):
        build_optimizer(OptimConfig(name="sgd", lr=LR, weight_decay=WD, nesterov=True), _mlp())
    with pytest.raises(ValueError, match="fused"):
        build_optimizer(OptimConfig(name="lion", lr=LR, weight_decay=WD, fused="on"), _mlp())
    with pytest.raises(ValueError, match="bogus"):
        build_optimizer(OptimConfig(name="adamw", lr=LR, weight_decay=WD), _mlp(), bogus=1)
    with pytest.raises(ValueError, match="relative_step"):
        build_optimizer(OptimConfig(name="adafactor", lr=LR, weight_decay=WD), _mlp(), relative_step=False)
