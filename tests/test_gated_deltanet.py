"""Gated DeltaNet (lmforge.model.gated_deltanet, issue 57 item 1): the chunked form (training) and the
recurrent form (generation) agree in fp32 whatever the chunk size, values and gradients; prefill then
one token at a time through the cache equals the whole forward; and the module equals transformers'
own Qwen3NextGatedDeltaNet (its PyTorch path) given the same weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lmforge.config import ConfigError, ModelConfig
from lmforge.config.sections import DeltaNetConfig
from lmforge.model.gated_deltanet import DeltaNetCache, GatedDeltaNet, chunked_delta_rule, recurrent_delta_rule

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, DIM, TAPS = 2, 4, 8, 6, 32, 4


def _inputs(seq: int, heads: int = 3, dk: int = 5, dv: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, seq, heads, dk, generator=gen), torch.randn(2, seq, heads, dk, generator=gen)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)  # (as the module feeds them)
    v = torch.randn(2, seq, heads, dv, generator=gen)
    g = -2 * torch.rand(2, seq, heads, generator=gen)  # log decays <= 0
    beta = torch.rand(2, seq, heads, generator=gen)
    state = torch.randn(2, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq", [1, 7, 33])
def test_chunked_and_recurrent_forms_agree_whatever_the_chunk_size(seq):
    q, k, v, g, beta, state = _inputs(seq)
    for start in (None, state):  # from zeros, and carrying a state on
        want, want_state = recurrent_delta_rule(q, k, v, g, beta, start)
        for chunk in (1, 3, 8, 64):
            out, out_state = chunked_delta_rule(q, k, v, g, beta, chunk, start)
            assert (out - want).abs().max().item() < 1e-5, (seq, chunk)
            assert (out_state - want_state).abs().max().item() < 1e-5, (seq, chunk)


def test_the_chunked_form_has_the_recurrent_forms_gradients():
    inputs = [t.requires_grad_() for t in _inputs(19)]
    grads = []
    for form in (lambda *a: recurrent_delta_rule(*a[:5], a[5]), lambda *a: chunked_delta_rule(*a[:5], 4, a[5])):
        out, state = form(*inputs)
        grads.append(torch.autograd.grad(out.square().sum() + state.sum(), inputs))
    for name, a, b in zip("q k v g beta state".split(), *grads):
        assert (a - b).abs().max().item() < 1e-5, name


def _model_config(chunk: int = 5) -> ModelConfig:
    return ModelConfig(vocab_size=64, dim=DIM, n_layers=1, n_heads=4, norm_eps=1e-6,
                       deltanet=DeltaNetConfig(key_heads=KEY_HEADS, value_heads=VALUE_HEADS, key_head_dim=KEY_DIM,
                                               value_head_dim=VALUE_DIM, conv_kernel=TAPS, chunk_size=chunk))


def _random_module(chunk: int = 5) -> GatedDeltaNet:
    torch.manual_seed(0)
    module = GatedDeltaNet(_model_config(chunk)).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


def test_prefill_then_one_token_at_a_time_through_the_cache_equals_the_whole_forward():
    module = _random_module()
    x = torch.randn(2, 23, DIM)
    cache = DeltaNetCache()
    with torch.no_grad():
        whole = module(x)
        parts = [module(x[:, :9], cache=cache), module(x[:, 9:16], cache=cache)]  # (chunked, from the cache)
        parts += [module(x[:, t:t + 1], cache=cache) for t in range(16, 23)]  # (recurrent)
    assert cache.length == 23 and cache.state.shape == (2, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    assert cache.conv["conv_v"].shape == (2, VALUE_HEADS * VALUE_DIM, TAPS - 1)
    assert (torch.cat(parts, dim=1) - whole).abs().max().item() < 1e-5


def test_the_chunk_size_does_not_change_the_module():
    x = torch.randn(2, 23, DIM)
    with torch.no_grad():
        outs = [_random_module(chunk)(x) for chunk in (1, 5, 64)]
    assert max((o - outs[0]).abs().max().item() for o in outs) < 1e-5


def test_the_module_equals_transformers_qwen3_next_gated_deltanet():
    """The same weights in both (transformers keeps q, k, v, z of each key head's group side by side
    in in_proj_qkvz, and beta's and the decay's inputs likewise in in_proj_ba; one convolution over
    [q; k; v])."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf_cfg = transformers.Qwen3NextConfig(
        hidden_size=DIM, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, linear_conv_kernel_dim=TAPS,
        num_hidden_layers=1, rms_norm_eps=1e-6, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(1)
    hf = Qwen3NextGatedDeltaNet(hf_cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GatedDeltaNet(_model_config()).eval()
    rep, keys = VALUE_HEADS // KEY_HEADS, KEY_HEADS * KEY_DIM
    qkvz = hf.in_proj_qkvz.weight.view(KEY_HEADS, 2 * KEY_DIM + 2 * rep * VALUE_DIM, DIM)
    ba = hf.in_proj_ba.weight.view(KEY_HEADS, 2 * rep, DIM)
    rows = lambda t, a, b: t[:, a:b].reshape(-1, DIM)  # noqa: E731
    v_end = 2 * KEY_DIM + rep * VALUE_DIM
    weights = {"in_q.weight": rows(qkvz, 0, KEY_DIM), "in_k.weight": rows(qkvz, KEY_DIM, 2 * KEY_DIM),
               "in_v.weight": rows(qkvz, 2 * KEY_DIM, v_end), "in_z.weight": rows(qkvz, v_end, qkvz.shape[1]),
               "in_b.weight": rows(ba, 0, rep), "in_a.weight": rows(ba, rep, 2 * rep),
               "conv_q.weight": hf.conv1d.weight[:keys], "conv_k.weight": hf.conv1d.weight[keys:2 * keys],
               "conv_v.weight": hf.conv1d.weight[2 * keys:], "A_log": hf.A_log, "dt_bias": hf.dt_bias,
               "norm.weight": hf.norm.weight, "wo.weight": hf.out_proj.weight}
    ours.load_state_dict(weights, strict=True)
    x = torch.randn(2, 23, DIM)
    with torch.no_grad():
        got, want = ours(x), hf(x)
    assert want.abs().max().item() > 0.5  # (a real output, not a vanishing one)
    assert (got - want).abs().max().item() < 1e-5


def test_the_deltanet_shape_defaults_to_the_attention_shape_and_is_checked():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4)
    assert cfg.deltanet_shape == (4, 4, 8, 8)
    assert _model_config().deltanet_shape == (KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM)
    with pytest.raises(ConfigError, match=r"model.deltanet.value_heads = 6 must be a multiple of model.deltanet.key_heads = 4"):
        ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, deltanet=DeltaNetConfig(value_heads=6)).check()
    with pytest.raises(ConfigError, match=r"model.deltanet.conv_kernel"):
        ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, deltanet=DeltaNetConfig(conv_kernel=0)).check()


def test_the_initial_values_follow_lmforges_rules():
    """Built on the meta device and filled by lmforge.model.init, as every model is: the projections
    N(0, init_std) (wo scaled as a residual projection), the convolutions U(+-1/sqrt(taps)),
    exp(A_log) in (0.01, 16), dt_bias and the gated norm's weight 1."""
    import math

    from lmforge.model.init import init_source
    from lmforge.model.materialise import materialise

    cfg = _model_config()
    with torch.device("meta"):
        module = GatedDeltaNet(cfg)
    module = materialise(module, "cpu", init_source(cfg, 7))
    assert all(not p.is_meta for p in module.parameters())
    assert abs(module.in_v.weight.std().item() - cfg.init_std) < 0.005
    assert module.conv_q.weight.abs().max().item() <= 1 / math.sqrt(TAPS)
    assert 0.01 <= module.A_log.exp().min().item() and module.A_log.exp().max().item() <= 16
    assert torch.equal(module.dt_bias, torch.ones(VALUE_HEADS)) and torch.equal(module.norm.weight, torch.ones(VALUE_DIM))
    again = materialise(GatedDeltaNet(cfg).to("meta"), "cpu", init_source(cfg, 7))
    for (name, p), q in zip(module.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name


def test_the_kernel_choice_takes_the_pytorch_form_off_cuda_and_names_the_fix_for_fla(monkeypatch):
    """model.deltanet.kernel: auto and torch run the PyTorch form on the CPU (flash-linear-attention is not
    even looked up); fla there is an error naming the fix, in the config (train.device = cpu, or the package
    absent) and in the module."""
    import lmforge.model.gated_deltanet as gd
    from lmforge.config import load_config

    monkeypatch.setattr(gd, "fla_chunked", lambda: pytest.fail("the fla kernels were looked up on the CPU"))
    x = torch.randn(2, 9, DIM)
    with torch.no_grad():
        outs = []
        for kernel in ("auto", "torch"):
            module = _random_module()
            module.kernel = kernel
            outs.append(module(x))
    assert torch.equal(outs[0], outs[1])
    module.kernel = "fla"
    with pytest.raises(RuntimeError, match=r"model\.deltanet\.kernel = 'fla': its Triton kernels need CUDA, this "
                                           r"forward runs on cpu; set model\.deltanet\.kernel = 'auto' or 'torch'"):
        module(x)
    with pytest.raises(ConfigError, match=r"model\.deltanet\.kernel = 'fla' runs flash-linear-attention's Triton "
                                          r"kernels, which need CUDA; train\.device = 'cpu'"):
        load_config("tiny-hybrid", {"model.deltanet.kernel": "fla", "train.device": "cpu"})
    if importlib.util.find_spec("fla") is None:
        with pytest.raises(ConfigError, match=r"needs the flash-linear-attention package, which is not installed"):
            load_config("tiny-hybrid", {"model.deltanet.kernel": "fla", "train.device": "cuda"})
    load_config("tiny", {"model.deltanet.kernel": "fla", "train.device": "cpu"})  # (no linear layer: unused)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="GPU only: flash-linear-attention's Triton kernels on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fla_kernels_match_the_pytorch_form_on_cuda(dtype):
    """(GPU, not run by CI.) The module with kernel = fla against kernel = torch on the same weights and
    input, forward and every parameter's gradient, from a cached state too: fp32 within 1e-4 of the
    output's scale, bf16 within 2e-2 (the kernels compute in the activations' dtype, the PyTorch form in fp32)."""
    torch.manual_seed(0)
    x = torch.randn(2, 150, DIM, device="cuda")  # (2 chunks of 64 and a padded one)
    runs = {}
    for kernel in ("torch", "fla"):
        module = _random_module().cuda()
        module.kernel = kernel
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = module(x)
        out.float().square().sum().backward()
        runs[kernel] = (out.float(), {n: p.grad.float() for n, p in module.named_parameters()})
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    (a, ga), (b, gb) = runs["torch"], runs["fla"]
    assert (a - b).abs().max() <= tol * a.abs().max()
    for name in ga:
        assert (ga[name] - gb[name]).abs().max() <= tol * ga[name].abs().max() + 1e-8, name
