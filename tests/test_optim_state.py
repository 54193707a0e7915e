"""state_dict round trips (bitwise resume) and optimizer-state memory, for every optimizer."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.optim.optimizers import OPTIMIZER_NAMES, build_optimizer, measured_state_bytes
from lmforge.spec.optimizer_state import optimizer_state_bytes_per_param




class _TinyLM(nn.Module):
    """Embedding, matrices, a norm, biases and an lm_head: every kind of parameter group."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 32, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.tanh(self.fc(self.tok_emb(idx)))))


def _kwargs(name: str) -> dict:
    # min_8bit_size=512 so fc.weight / lm_head.weight take the quantised path; muon orthogonalises in bf16.
    return {"min_8bit_size": 512} if name == "adam8bit" else {}


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    idx = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
    opt.zero_grad()
    nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, dims=1).flatten()).backward()
    opt.step()


def _roundtrip(obj: dict) -> dict:
    """What a checkpoint does: serialise with torch.save, read back with torch.load."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _assert_state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        assert sa[pid].keys() == sb[pid].keys()
        for key, va in sa[pid].items():
            vb = sb[pid][key]
            if isinstance(va, torch.Tensor):
                assert va.dtype == vb.dtype and torch.equal(va, vb), (pid, key)
            else:
                assert va == vb, (pid, key)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_from_state_dict_is_bitwise_identical(name: str, dtype: torch.dtype) -> None:
    model = _TinyLM().to(dtype)
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.1), model, **_kwargs(name))
    for step in range(3):
        _train_step(model, opt, step)
    saved_model, saved_opt = _roundtrip(model.state_dict()), _roundtrip(opt.state_dict())

    _train_step(model, opt, 3)  # uninterrupted run

    resumed = _TinyLM().to(dtype)
    resumed.load_state_dict(saved_model)
    resumed_opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.1), resumed, **_kwargs(name))
    resumed_opt.load_state_dict(saved_opt)
    _train_step(resumed, resumed_opt, 3)

    for (n, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {n} differs after resume"  # bitwise, no tolerance
    _assert_state_equal(opt, resumed_opt)


def test_adam8bit_keeps_uint8_codes_and_fp32_scales_on_load_for_bf16_params() -> None:
    model = _TinyLM().to(torch.bfloat16)
    opt = build_optimizer(OptimConfig(name="adam8bit", lr=1e-3, weight_decay=0.1), model, min_8bit_size=512)
    _train_step(model, opt, 0)
    fresh = build_optimizer(OptimConfig(name="adam8bit", lr=1e-3, weight_decay=0.1), model, min_8bit_size=512)
    fresh.load_state_dict(_roundtrip(opt.state_dict()))
    state = fresh.state[model.fc.weight]
    assert state["exp_avg_codes"].dtype == torch.uint8  # torch alone would cast these to bf16
    assert state["exp_avg_scale"].dtype == torch.float32


def _bytes_per_param(name: str, model: nn.Module, **kw) -> float:
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.0), model, **kw)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return measured_state_bytes(opt) / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw", "lion", "lamb", "muon", "adam8bit"])
def test_analytical_bytes_match_measured_for_a_matrix(name: str) -> None:
    model = nn.Linear(256, 256, bias=False)  # one 65536-element matrix (Muon-handled for "muon")
    measured = _bytes_per_param(name, model)
    expected = optimizer_state_bytes_per_param(name)
    assert expected == {"sgd": 0, "momentum": 4, "adam": 8, "adamw": 8, "lion": 4, "lamb": 8,
                        "muon": 4, "adam8bit": 2.03125}[name]
    # Only per-tensor scalars (torch's 4-byte `step` tensor) are not in the analytical figure:
    # 4 bytes / 65536 params = 6e-5 bytes/param, so abs_tol 1e-4.
    assert math.isclose(measured, expected, abs_tol=1e-4), (name, measured, expected)


def test_adafactor_bytes_match_formula() -> None:
    m, n = 64, 256
    model = nn.Linear(n, m)  # weight (64, 256) factored, bias (64,) full
    opt = build_optimizer(OptimConfig(name="adafactor", lr=1e-2, weight_decay=0.0), model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    expected = (optimizer_state_bytes_per_param("adafactor", shape=(m, n)) * m * n
                + optimizer_state_bytes_per_param("adafactor", shape=(m,)) * m
                + 2 * 4)  # two 4-byte `step` tensors
    assert measured_state_bytes(opt) == expected == 4 * (m + n) + 4 * m + 8
    assert optimizer_state_bytes_per_param("adafactor", shape=(m, n)) <= 4
    assert optimizer_state_bytes_per_param("adafactor") == 0.0  # large-matrix limit


def test_muon_fraction_blends_muon_and_adamw() -> None:
    model = _TinyLM()
    matrices = model.fc.weight.numel()  # lm_head and the embedding stay on AdamW
    total = sum(p.numel() for p in model.parameters())
    measured = _bytes_per_param("muon", model)
    expected = optimizer_state_bytes_per_param("muon", muon_fraction=matrices / total)
    # AdamW keeps one 4-byte `step` tensor per parameter tensor (5 here): 20 bytes / 3360 params.
    assert math.isclose(measured, expected, abs_tol=20 / total + 1e-9)


def test_state_bytes_arguments_validated() -> None:
    with pytest.raises(ValueError, match="adamw"):
        optimizer_state_bytes_per_param("adamx")
    with pytest.raises(ValueError, match="muon_fraction"):
        optimizer_state_bytes_per_param("muon", muon_fraction=1.5)
    assert optimizer_state_bytes_per_param("adamw", state_elem_bytes=2) == 4.0


def test_state_memory_module_does_not_import_torch() -> None:
    code = ("import sys; from lmforge.spec.optimizer_state import optimizer_state_bytes_per_param as f; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(f('adamw'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "8.0", out.stderr
