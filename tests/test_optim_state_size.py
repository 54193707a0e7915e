"""Every optimizer's state size, as declared once in lmforge.spec.optimizers (`StateSize`), against
the tensors the real optimizer keeps after one step.

For EVERY registry name (a new entry is covered without touching this file): build the optimizer
on a small lmforge model, run one forward / backward / step, and measure the bytes of the tensors
in `optimizer.state[p]` for each parameter p. They must equal, exactly, the planner's per-tensor
figure (`lmforge.plan.memory.lmforge_state_bytes`, read from the registry), and agree with the
per-parameter figure (`optimizer_state_bytes_per_param`: what the literature conventions of
`lmforge plan` count) up to its documented rounding: the per-tensor counters (`step_bytes`) and,
for block-quantised state, the zero padding of the last block (< block_size + 4 bytes per
quantised tensor). A registry entry that states a wrong size fails here (checked by perturbing
each entry).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import OptimConfig, load_config
from lmforge.model.transformer import Transformer
from lmforge.spec import optimizers as registry
from lmforge.optim.optimizers import build_optimizer, measured_state_bytes_by_param
from lmforge.spec.optimizers import OPTIMIZER_NAMES, REGISTRY, SCALE_BYTES
from lmforge.spec.optimizer_state import optimizer_state_bytes_per_param
from lmforge.plan.memory import Layout, estimate_memory, is_hidden_matrix, lmforge_state_bytes, param_specs

# "tiny" (tied embedding, SwiGLU, every size a multiple of 256) and an odd-sized model (untied
# head, GQA, biases, LayerNorm; 180 x 180 matrices are not whole 256-element blocks; vectors and
# biases fall under adam8bit's min_8bit_size = 4096 and keep fp32 moments).
MODELS = {
    "tiny": ("tiny", {}),
    "odd": ("tiny", {"model.dim": 180, "model.n_layers": 2, "model.vocab_size": 4100, "model.n_kv_heads": 2,
                     "model.bias": True, "model.norm": "layernorm", "model.tie_embeddings": False}),
}


def _stepped(name: str, model_key: str):
    """(model config, parameters by name, optimizer) after one training step with optimizer `name`."""
    preset, overrides = MODELS[model_key]
    cfg = load_config(preset, overrides).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3, weight_decay=0.1), model)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, dims=1).flatten()).backward()
    opt.step()
    return cfg, dict(model.named_parameters()), opt


_CACHE: dict[tuple[str, str], tuple] = {}


def stepped(name: str, model_key: str):
    if (name, model_key) not in _CACHE:
        _CACHE[(name, model_key)] = _stepped(name, model_key)
    return _CACHE[(name, model_key)]


def mismatches(name: str, model_key: str) -> list[tuple[str, int, int]]:
    """(parameter, measured bytes, planner's bytes) for every tensor where they differ."""
    cfg, params, opt = stepped(name, model_key)
    measured = measured_state_bytes_by_param(opt)
    out = []
    for spec in param_specs(cfg):
        got = measured.get(params[spec.name], 0)
        want = lmforge_state_bytes(name, spec, spec.shape)
        if got != want:
            out.append((spec.name, got, want))
    return out


@pytest.mark.parametrize("model_key", sorted(MODELS))
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_registry_state_size_equals_the_real_optimizer_state(name, model_key):
    assert mismatches(name, model_key) == []
    cfg, _, opt = stepped(name, model_key)
    # the planner's whole-model figure is the same sum
    assert estimate_memory(cfg, Layout(), name, 16, weights="lmforge").optimizer_states == sum(
        measured_state_bytes_by_param(opt).values())


@pytest.mark.parametrize("model_key", sorted(MODELS))
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_per_parameter_figure_within_its_documented_rounding(name, model_key):
    """bytes/param x numel vs the measured bytes, for every tensor large enough for 8-bit state."""
    cfg, params, opt = stepped(name, model_key)
    measured = measured_state_bytes_by_param(opt)
    state = REGISTRY[name].state
    checked = 0
    for spec in param_specs(cfg):
        if spec.numel < 4096:  # adam8bit's min_8bit_size: smaller tensors keep fp32 moments
            continue
        hidden = is_hidden_matrix(spec)
        rule = state.rule(hidden)
        per_param = optimizer_state_bytes_per_param(name, shape=spec.shape, muon_fraction=1.0 if hidden else 0.0)
        padding = rule.quantised * (256 + SCALE_BYTES)  # the last block of each quantised tensor
        error = measured.get(params[spec.name], 0) - per_param * spec.numel
        assert -1e-6 <= error - rule.step_bytes <= padding, (spec.name, error)
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_a_wrong_registry_entry_is_caught(name, monkeypatch):
    """Each field of the entry, off by one, changes the planner's figure away from the measured one
    (fields that do not apply to a rule are left alone: a quantised count on an optimizer without
    quantised state would be wrong too, but it is the same kind of check)."""
    stepped(name, "odd")  # measured with the true entry
    spec = REGISTRY[name]
    wrong_states = [dataclasses.replace(spec.state, full=spec.state.full + 1),
                    dataclasses.replace(spec.state, step_bytes=spec.state.step_bytes + 4),
                    dataclasses.replace(spec.state, quantised=spec.state.quantised + 1)]
    if spec.state.matrices is not None:
        wrong_states.append(dataclasses.replace(spec.state, matrices=None))
    for wrong in wrong_states:
        monkeypatch.setitem(registry.REGISTRY, name, dataclasses.replace(spec, state=wrong))
        assert mismatches(name, "odd"), wrong
