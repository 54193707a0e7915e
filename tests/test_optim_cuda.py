"""GPU smoke tests (skipped without CUDA): fused kernels are default, every optimizer agrees with CPU.

The trajectories are compared by their *updates* (final weights minus initial weights), relative
to the size of the update, so an optimizer that did nothing (or half a step) on the GPU fails:
comparing the weights themselves with an absolute tolerance of the size of the whole movement
could not tell.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.optim.optimizers import OPTIMIZER_NAMES, build_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 5
LR = {"sgd": 0.05, "momentum": 0.05}  # others 1e-3
# Relative tolerance on each tensor's update, ||update_gpu - update_cpu|| / ||update_cpu||. The math is
# the same on both devices in fp32 (TF32 is off for matmuls by default), so only rounding differs:
# 1e-3. Muon runs its Newton-Schulz iteration in fp32 on both sides here (the GPU default is bf16),
# and the iteration amplifies rounding differences of near-zero singular values: 1e-2. Lion takes
# sign() of the update and 8-bit Adam rounds its moments to 8-bit codes: an element on a tie may flip
# on one device, one element of a small tensor moving a whole step: 5e-2.
RTOL = {"muon": 1e-2, "lion": 5e-2, "adam8bit": 5e-2}


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32))
    return model.to(device)


def _train(name: str, device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(initial weights, weights after STEPS steps minus the initial ones), fp32 on the CPU."""
    model = _model(device)
    start = [p.detach().cpu().clone() for p in model.parameters()]
    extra = {"min_8bit_size": 1024} if name == "adam8bit" else {}
    if name == "muon":
        extra["muon_ns_dtype"] = torch.float32
    opt = build_optimizer(OptimConfig(name=name, lr=LR.get(name, 1e-3), weight_decay=0.1), model, **extra)
    for step in range(STEPS):
        idx = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(step)).to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
    return start, [p.detach().cpu() - s for p, s in zip(model.parameters(), start, strict=True)]


def compare_updates(name: str, start: list[torch.Tensor], cpu: list[torch.Tensor], other: list[torch.Tensor]) -> None:
    rtol = RTOL.get(name, 1e-3)
    for i, (w0, a, b) in enumerate(zip(start, cpu, other, strict=True)):
        # every tensor moved, by far more than fp32 rounding of its weights (1000 ulps), so the
        # relative comparison below is about the update itself: an optimizer that skipped its step,
        # or took a partial one, misses by a large fraction of the update
        moved = a.abs().max().item()
        assert moved > 0 and moved > 1000 * torch.finfo(torch.float32).eps * w0.abs().max().item(), (name, i, moved)
        err = ((b - a).norm() / a.norm()).item()
        assert err < rtol, f"{name}: tensor {i}: update differs by {err:.2e} relative (tolerance {rtol:.0e})"


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_fused_is_default_on_cuda(name: str) -> None:
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.1), _model("cuda"))
    assert opt.defaults["fused"] is True


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_cuda_updates_match_cpu(name: str) -> None:
    start, cpu = _train(name, "cpu")
    _, cuda = _train(name, "cuda")
    compare_updates(name, start, cpu, cuda)
