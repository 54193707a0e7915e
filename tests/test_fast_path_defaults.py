"""The fast path by default: optim.fused = "auto" picks torch's fused kernels on the CPU too, and
train.loss_chunk = "auto" turns the fused chunked cross-entropy on wherever it is not slower
(vocabulary >= 8192, no TP/PP), both exact to float rounding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.config import ConfigError, OptimConfig, load_config
from lmforge.config import rules
from lmforge.config.rules import resolve_loss_chunk
from lmforge.optim.optimizers import build_optimizer
from lmforge.train.trainer import Trainer

SMALL = {"model.vocab_size": 320, "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
         "data.seq_len": 32, "data.tokenizer_vocab_size": 320, "train.global_batch_size": 8,
         "train.micro_batch_size": 8, "train.precision": "fp32", "train.eval_sequences": 8, "train.sample_tokens": 0}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 64))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_auto_picks_the_fused_cpu_kernels(name):
    opt = build_optimizer(OptimConfig(name=name, lr=1e-3), _model())
    assert opt.defaults.get("fused") is True and not opt.defaults.get("foreach")
    off = build_optimizer(OptimConfig(name=name, lr=1e-3, fused="off"), _model())
    assert off.defaults.get("foreach") is True and not off.defaults.get("fused")
    # 16-bit parameters on the CPU keep foreach (torch 2.13's fused CPU momentum SGD is not
    # deterministic in bf16); lmforge's trainer keeps fp32 master weights, so it gets fused
    bf16 = build_optimizer(OptimConfig(name=name, lr=1e-3), _model().to(torch.bfloat16))
    assert bf16.defaults.get("foreach") is True and not bf16.defaults.get("fused")


@pytest.mark.parametrize("name", ["sgd", "momentum", "adamw"])
def test_fused_cpu_update_equals_foreach(name):
    """Same update, one pass per element instead of several multi-tensor passes: after 5 steps the
    weights agree to float rounding (1e-6; observed <= 2.4e-7, one ulp of a unit weight), while
    every tensor moved by more than 1e-3."""
    final, start = {}, [p.detach().clone() for p in _model().parameters()]
    for fused in ("on", "off"):
        model = _model()
        opt = build_optimizer(OptimConfig(name=name, lr=0.1 if name in ("sgd", "momentum") else 1e-2,
                                          weight_decay=0.1, fused=fused), model)
        for step in range(5):
            idx = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
            opt.step()
        final[fused] = [p.detach().clone() for p in model.parameters()]
    for fused, foreach, w0 in zip(final["on"], final["off"], start, strict=True):
        assert (foreach - w0).abs().max().item() > 1e-3
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-6)


def test_loss_chunk_auto_rule(monkeypatch):
    big = {**SMALL, "model.vocab_size": 50304, "data.tokenizer_vocab_size": 50304}
    cfg = load_config("tiny", big)
    assert cfg.train.loss_chunk == "auto"  # the default
    # on every device and precision where it is not slower (benchmarks/fused_head.py on the CPU; on
    # CUDA the GPU suite's head-loss row checks the choice)
    for device, precision in (("cpu", "fp32"), ("cuda", "bf16"), ("cuda", "fp16"), ("cuda", "fp32")):
        assert resolve_loss_chunk(cfg, device, precision) == 4096, (device, precision)
    assert resolve_loss_chunk(cfg, "cpu", "bf16") == 0  # measured slower there (benchmarks/RESULTS.md)
    monkeypatch.setattr(rules, "FUSED_HEAD_SLOWER", frozenset({("cuda", "bf16")}))  # what a slower row would add
    assert resolve_loss_chunk(cfg, "cuda", "bf16") == 0 and resolve_loss_chunk(cfg, "cuda", "fp32") == 4096
    assert resolve_loss_chunk(load_config("tiny", SMALL), "cpu", "fp32") == 0  # small vocabulary
    for layout in ({"parallel.tp": 2}, {"parallel.pp": 2, "model.tie_embeddings": False, "train.micro_batch_size": 2}):
        assert resolve_loss_chunk(load_config("tiny", {**big, **layout}), "cpu", "fp32") == 0  # (not refused)
    assert resolve_loss_chunk(load_config("tiny", {**big, "train.loss_chunk": 0}), "cpu", "fp32") == 0
    assert resolve_loss_chunk(load_config("tiny", {**SMALL, "train.loss_chunk": 24}), "cuda", "bf16") == 24
    with pytest.raises(ConfigError, match="train.loss_chunk"):
        load_config("tiny", {**big, "train.loss_chunk": 512, "parallel.tp": 2})
    with pytest.raises(ConfigError, match="train.loss_chunk"):
        load_config("tiny", {**big, "train.loss_chunk": "sometimes"})


def test_defaults_train_on_the_fast_path_and_match_the_plain_one(small_data, tmp_path, monkeypatch):
    """A large-vocabulary model with default settings on the CPU: the trainer's optimizer is fused and
    its loss runs chunked; loss and gradients equal the plain path's (fp32: 1e-6 / 1e-5 relative)."""
    big = {**SMALL, "model.vocab_size": 8192}
    fast = Trainer(load_config("tiny", big), out_dir=tmp_path / "fast", data=small_data)
    plain = Trainer(load_config("tiny", {**big, "train.loss_chunk": 0, "optim.fused": "off"}),
                    out_dir=tmp_path / "plain", data=small_data)
    fast.setup()
    plain.setup()
    assert fast.optimizer.defaults.get("fused") is True
    assert plain.optimizer.defaults.get("foreach") is True
    chunks = []
    forward = type(fast.model).forward

    def spy(self, *args, **kwargs):
        if self is fast.model:
            chunks.append(kwargs.get("loss_chunk", 0))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(fast.model), "forward", spy)
    batch = plain.next_micro_batches()
    loss_fast, loss_plain = fast.forward_backward(batch), plain.forward_backward(batch)
    assert chunks == [4096]
    torch.testing.assert_close(loss_fast, loss_plain, rtol=1e-6, atol=0)
    g_fast = {n: p.grad for n, p in fast.model.named_parameters()}
    for name, p in plain.model.named_parameters():
        torch.testing.assert_close(g_fast[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
