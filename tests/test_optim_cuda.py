"""GPU smoke tests (skipped without CUDA): fused kernels are default, every optimizer agrees with CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.optim.optimizers import OPTIMIZER_NAMES, build_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32))
    return model.to(device)


def _train(name: str, device: str, steps: int = 5) -> list[torch.Tensor]:
    model = _model(device)
    extra = {"min_8bit_size": 1024} if name == "adam8bit" else {}
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.1), model, **extra)
    for step in range(steps):
        idx = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(step)).to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_fused_is_default_on_cuda(name: str) -> None:
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.1), _model("cuda"))
    assert opt.defaults["fused"] is True


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_cuda_trajectory_close_to_cpu(name: str) -> None:
    cpu, gpu = _train(name, "cpu"), _train(name, "cuda")
    for a, b in zip(cpu, gpu, strict=True):
        # Different kernels (TF32 is off by default for matmul; bf16 Newton-Schulz for Muon, sign()
        # for Lion and 8-bit rounding may flip on near-ties): loose absolute tolerance on weights
        # that move ~5 * lr-scaled steps; the point is that every optimizer runs on CUDA and agrees.
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3)
