"""The full gpt2-124m preset: predicted parameter/gradient/optimizer bytes equal the tensors
lmforge allocates after one forward/backward + optimizer step (slow: 124M parameters on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import OptimConfig, load_config
from lmforge.plan.memory import Layout, estimate_memory, param_specs


def _real_bytes(preset: str, optimizer: str, overrides: dict, seq: int = 8) -> tuple:
    from lmforge.model.transformer import Transformer
    from lmforge.optim.optimizers import build_optimizer

    cfg = load_config(preset, overrides)
    with torch.device("meta"):  # build_model's construction, with a constant fill instead of the init
        model = Transformer(cfg.model)
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)
    opt = build_optimizer(OptimConfig(name=optimizer, lr=1e-3, weight_decay=0.1), model)
    x = torch.randint(0, cfg.model.vocab_size, (1, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    F.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
    opt.step()
    params = list({id(p): p for p in model.parameters()}.values())
    real = {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params),
        "optimizer_states": sum(v.numel() * v.element_size() for st in opt.state.values()
                                for v in st.values() if isinstance(v, torch.Tensor)),
    }
    return cfg, real


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,overrides", [("adamw", {}), ("adam8bit", {"model.n_layers": 2})])
def test_gpt2_bytes_equal_real_tensors(optimizer, overrides):
    cfg, real = _real_bytes("gpt2-124m", optimizer, overrides)
    mem = estimate_memory(cfg.model, Layout(), optimizer, 8, weights="lmforge")
    assert {k: getattr(mem, k) for k in real} == real
    if optimizer == "adamw":  # 4 + 4 + 8 bytes/param and one 4-byte `step` per tensor
        assert mem.params_total == 124_475_904
        assert mem.model_states == 16 * mem.params_total + 4 * len(param_specs(cfg.model))
