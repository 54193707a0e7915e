"""Performance paths that CPU can check: fused linear + chunked cross-entropy (train.loss_chunk)
equals the plain loss and gradients, saves the logits' memory; SDPA causal attention; fused
optimizer switch (optim.fused); FP8 (train.fp8) config and error paths without torchao."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ConfigError, load_config
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.model.loss import linear_cross_entropy_sum, token_nll_sum
from lmforge.parallel.activation_ckpt import saved_activation_bytes
from tests.test_train import SMALL, grads, make_trainer


@pytest.mark.parametrize("chunk", [0, 1, 7, 64, 1000])
def test_linear_cross_entropy_matches_plain_loss_and_grads(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 16, 32, generator=g, requires_grad=True)
    w = (0.1 * torch.randn(300, 32, generator=g)).requires_grad_()
    y = torch.randint(0, 300, (4, 16), generator=g)
    y[0, :5] = -100  # ignored targets: no loss, no gradient
    ref = F.cross_entropy((h @ w.t()).float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    gh_ref, gw_ref = torch.autograd.grad(ref * 0.37, (h, w))
    out = linear_cross_entropy_sum(h, w, y, chunk)
    gh, gw = torch.autograd.grad(out * 0.37, (h, w))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-6)
    assert gh[0, :5].abs().max() == 0


def _plain_and_fused(h, w, y, chunk, dtype, compiled=None):
    """(loss, grad h, grad w) of the plain path (logits, token_nll_sum) and of the fused one, both
    under the autocast the trainer uses (`dtype` bf16) or none (fp32)."""
    out = []
    for fused in (False, True):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = (linear_cross_entropy_sum(hh, ww, y, chunk, compiled=compiled) if fused
                    else token_nll_sum(hh @ ww.t(), y))
        (loss * 0.37).backward()
        out.append((loss.detach(), hh.grad, ww.grad))
    return out


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_loss_matches_the_plain_path_in_fp32_and_bf16_autocast(dtype, compiled):
    """Loss and the gradients of the head weight and of the hidden states, ignored targets (-100)
    included, against the plain logits path under the same precision. bf16: both compute the same
    bf16 logits and upcast them; the gradient matmuls run in bf16 in both paths."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 40, 64, generator=g)
    w = 0.05 * torch.randn(1000, 64, generator=g)
    y = torch.randint(0, 1000, (3, 40), generator=g)
    y[1, 7:30] = -100
    # (compiled: the elementwise part through torch.compile, as on CUDA; 120 tokens in chunks of 32
    # leave a last chunk of 24, a second compiled shape)
    (loss_p, gh_p, gw_p), (loss_f, gh_f, gw_f) = _plain_and_fused(h, w, y, 32, dtype, compiled)
    assert loss_f.dtype == torch.float32 and gh_f.dtype == h.dtype and gw_f.dtype == w.dtype
    assert gh_f[1, 7:30].abs().max() == 0 and gh_p[1, 7:30].abs().max() == 0
    tol = dict(rtol=1e-6, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(loss_f, loss_p, **tol)
    gtol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(gh_f, gh_p, **gtol)
    torch.testing.assert_close(gw_f, gw_p, **gtol)
    for a, b in ((gh_f, gh_p), (gw_f, gw_p)):  # gradient norms agree (bf16: to bf16 rounding)
        assert abs(a.norm() / b.norm() - 1) < (1e-6 if dtype == torch.float32 else 5e-3)


def test_fused_head_loss_with_every_target_ignored_is_zero():
    h = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    loss = linear_cross_entropy_sum(h, w, torch.full((8,), -100), 3)
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_loss_never_makes_a_tokens_by_vocab_tensor(dtype):
    """Forward and backward of the fused loss create no tensor larger than one chunk of logits
    (chunk x vocab); the plain path creates [tokens, vocab] ones (the check can fail)."""
    tokens, vocab, chunk = 256, 512, 64
    h = torch.randn(tokens, 32, requires_grad=True)
    w = torch.randn(vocab, 32, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    sizes = {}
    for name, f in (("plain", lambda: token_nll_sum(h @ w.t(), y)),
                    ("fused", lambda: linear_cross_entropy_sum(h, w, y, chunk))):
        with _LargestTensor() as mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            f().backward()
        sizes[name] = mode.largest
    assert sizes["plain"] >= tokens * vocab
    assert sizes["fused"] <= chunk * vocab, sizes


def test_linear_cross_entropy_only_needed_grads():
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(20, 8)  # frozen head (e.g. LoRA fine-tuning)
    y = torch.randint(0, 20, (10,))
    (gh,) = torch.autograd.grad(linear_cross_entropy_sum(h, w, y, 3), (h,))
    (gh_ref,) = torch.autograd.grad(F.cross_entropy(h @ w.t(), y, reduction="sum"), (h,))
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_trainer_loss_chunk_equals_plain_loss_and_grads(small_data, tmp_path, tie):
    """fp32, same batch: loss to 1e-6 relative, every gradient to 1e-5 (summation order only)."""
    over = {"model.tie_embeddings": tie}
    plain = make_trainer(small_data, tmp_path, **over)
    chunked = make_trainer(small_data, tmp_path, **over, **{"train.loss_chunk": 24})  # 256 tokens: 24 does not divide
    batch = plain.next_micro_batches()
    x, y = batch[0]
    y[1, :10] = -100
    loss_p = plain.forward_backward([(x, y)])
    loss_c = chunked.forward_backward([(x, y)])
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-6, atol=0)
    g_p, g_c = grads(plain.model), grads(chunked.model)
    assert g_p.keys() == g_c.keys()
    for name in g_p:
        torch.testing.assert_close(g_c[name], g_p[name], rtol=1e-5, atol=1e-7, msg=name)


def test_evaluation_runs_the_chunked_loss_and_equals_the_plain_one(small_data, tmp_path, monkeypatch):
    """With train.loss_chunk the validation loss goes through the chunked loss too (no [B, T, vocab]
    logits: the planner's validation term), and equals the plain logits' loss (fp32: summation
    order only)."""
    import lmforge.model.loss as loss_module

    plain = make_trainer(small_data, tmp_path)
    chunked = make_trainer(small_data, tmp_path, **{"train.loss_chunk": 24})
    calls = []
    real = loss_module._chunked_nll_sum
    monkeypatch.setattr(loss_module, "_chunked_nll_sum", lambda *a: calls.append(a[-1]) or real(*a))
    got = chunked.evaluate()
    assert calls and set(calls) == {24}
    calls.clear()
    want = plain.evaluate()
    assert not calls
    assert got["tokens"] == want["tokens"] > 0
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def test_trainer_loss_chunk_bf16_close_to_plain(small_data, tmp_path):
    plain = make_trainer(small_data, tmp_path, **{"train.precision": "bf16"})
    chunked = make_trainer(small_data, tmp_path, **{"train.precision": "bf16", "train.loss_chunk": 64})
    batch = plain.next_micro_batches()
    torch.testing.assert_close(chunked.forward_backward(batch), plain.forward_backward(batch), rtol=1e-2, atol=0)
    g_p, g_c = grads(plain.model), grads(chunked.model)
    for name in g_p:  # bf16 matmuls, different accumulation order: compare as directions and norms
        a, b = g_c[name].flatten(), g_p[name].flatten()
        assert F.cosine_similarity(a, b, dim=0) > 0.99, name
        assert abs(a.norm() / b.norm() - 1) < 0.03, name


def test_loss_chunk_never_holds_the_logits(small_data, tmp_path):
    over = {"model.vocab_size": 4096}  # logits 256 x 4096 fp32 = 4 MB per copy
    plain = make_trainer(small_data, tmp_path, **over)
    chunked = make_trainer(small_data, tmp_path, **over, **{"train.loss_chunk": 32})
    x, y = plain.next_micro_batches()[0]
    params = lambda t: list(t.model.parameters())
    saved_p = saved_activation_bytes(lambda: plain.layout.nll_sum(x, y, plain.precision), exclude=params(plain))
    saved_c = saved_activation_bytes(lambda: chunked.layout.nll_sum(x, y, chunked.precision), exclude=params(chunked))
    logits_bytes = x.numel() * 4096 * 4
    assert saved_p - saved_c > 0.5 * logits_bytes, (saved_p, saved_c, logits_bytes)


def test_attention_uses_sdpa_causal(monkeypatch):
    from lmforge.model import layers
    from lmforge.model.transformer import build_model

    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", spy)
    cfg = load_config("tiny", {"model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.n_layers": 2})
    model = build_model(cfg.model, seed=0)
    model(torch.randint(0, 100, (2, 16))).sum().backward()
    assert len(calls) == 2
    assert all(c["is_causal"] and c["attn_mask"] is None and c["enable_gqa"] for c in calls)  # flash-eligible


def test_optim_fused_switch(small_data, tmp_path):
    t = make_trainer(small_data, tmp_path, **{"optim.fused": "on"})
    assert t.optimizer.defaults["fused"] is True
    for _ in range(3):
        loss, norm = t.train_step(t.next_micro_batches())
        assert torch.isfinite(loss) and torch.isfinite(norm)
    assert make_trainer(small_data, tmp_path, **{"optim.fused": "off"}).optimizer.defaults["foreach"] is True
    assert make_trainer(small_data, tmp_path).optimizer.defaults["fused"] is True  # auto: fused on CPU too


@pytest.mark.parametrize("overrides, key", [
    ({"train.loss_chunk": -1}, "train.loss_chunk"),
    ({"train.loss_chunk": 512, "parallel.tp": 2}, "train.loss_chunk"),
    ({"optim.fused": "on", "optim.name": "lion"}, "optim.fused"),
    ({"optim.fused": "sometimes"}, "optim.fused"),
    ({"train.fp8": True, "train.fp8_all_gather": True}, "train.fp8_all_gather"),  # (no FSDP2 in one process)
])
def test_perf_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny", {**SMALL, **overrides})


def test_fp8_without_torchao_is_a_clear_error(monkeypatch):
    """(torchao is among the test dependencies: it is made absent here, as the package finder and the import
    of an environment without it see it.)"""
    import sys

    from lmforge.model.fp8 import apply_fp8

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # (import torchao... raises ImportError)
    with pytest.raises(ConfigError, match=r"train\.fp8.*torchao"):
        load_config("tiny", {**SMALL, "train.fp8": True})
    with pytest.raises(ImportError, match="pip install torchao"):
        apply_fp8(torch.nn.Linear(16, 16), torch.device("cpu"))


def test_fp8_filter_selects_block_linears_only():
    from lmforge.model.transformer import build_model
    from lmforge.model.fp8 import fp8_filter, fp8_supported

    for fused, per_block in ((True, 5), (False, 7)):  # wqkv (or wq wk wv) wo gate up down per block
        cfg = load_config("tiny", {"model.dim": 64, "model.n_heads": 4, "model.n_layers": 2, "model.fused_qkv": fused})
        model = build_model(cfg.model, seed=0)
        chosen = [n for n, m in model.named_modules() if fp8_filter(m, n)]
        assert len(chosen) == 2 * per_block
        assert "lm_head" not in chosen and all(n.startswith("blocks.") for n in chosen)
    assert fp8_supported(torch.device("cpu"))[0] is True  # (torch's FP8 matmul without FP8 units: layouts' checks)


def test_loss_chunk_with_a_lora_head_uses_the_adapter():
    """A LoRA-wrapped (untied) lm_head must not be bypassed by the fused loss: same loss and grads."""
    from lmforge.model.lora import apply_lora
    from lmforge.model.transformer import build_model

    cfg = load_config("tiny", {"model.dim": 64, "model.n_heads": 4, "model.n_layers": 2,
                               "model.tie_embeddings": False})
    model = build_model(cfg.model, seed=0)
    apply_lora(model, "wq,lm_head", rank=4, seed=0)
    with torch.no_grad():
        model.lm_head.lora_b.normal_()  # a non-zero adapter, so bypassing it would show
    x = torch.randint(0, 4096, (2, 16))
    y = torch.randint(0, 4096, (2, 16))
    plain = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
    g_plain = torch.autograd.grad(plain, model.lm_head.lora_b)[0]
    fused = model(x, targets=y, loss_chunk=8)
    g_fused = torch.autograd.grad(fused, model.lm_head.lora_b)[0]
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_fused, g_plain, rtol=1e-5, atol=1e-6)
