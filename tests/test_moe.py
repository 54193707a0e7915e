"""Mixture-of-Experts (lmforge.model.moe): the grouped GEMM against a per-expert loop, the MoE layer
against a naive per-expert reference (softmax and sigmoid routers, shared experts, capacity drops),
the load-balancing losses' gradients, the auxiliary-loss-free bias update, parameter accounting and
config checks."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ConfigError, ModelConfig
from lmforge.config.sections import MoEConfig
from lmforge.model.moe import (GroupedExperts, MoE, experts_loop, grouped_matmul, grouped_mm_ok, moe_layers,
                                padded_bmm)
from lmforge.model.transformer import Transformer, build_model, count_params, flops_per_token

DIM, HIDDEN = 32, 48


def moe_cfg(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=97, dim=DIM, n_layers=2, n_heads=4, max_seq_len=64,
                       moe=MoEConfig(**{"num_experts": 6, "top_k": 2, "expert_hidden": HIDDEN, **moe}))


def make_moe(seed=0, **moe) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(moe_cfg(**moe))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def naive_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Independent reference: route each token by hand, loop over experts with masks, drop past
    capacity in token order."""
    m = layer.cfg
    x2 = x.reshape(-1, x.shape[-1])
    logits = x2 @ layer.router.weight.t()
    scores = logits.softmax(-1) if m.router == "softmax" else logits.sigmoid()
    idx = torch.topk(scores + layer.expert_bias, m.top_k, dim=-1).indices
    w = torch.stack([scores[t, idx[t]] for t in range(len(x2))])
    if m.renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * m.route_scale
    out = torch.zeros_like(x2)
    cap = None
    if m.capacity_factor:
        import math
        cap = math.ceil(m.capacity_factor * len(x2) * m.top_k / m.num_experts)
    for e in range(m.num_experts):
        taken = 0
        for t in range(len(x2)):
            for j in range(m.top_k):
                if idx[t, j] != e:
                    continue
                taken += 1
                if cap is not None and taken > cap:
                    continue
                h = F.silu(x2[t] @ layer.experts.w_gate[e]) * (x2[t] @ layer.experts.w_up[e])
                out[t] = out[t] + w[t, j] * (h @ layer.experts.w_down[e])
    if layer.shared is not None:
        out = out + layer.shared(x2)
    return out.view(x.shape)


@pytest.mark.parametrize("kernel", ["grouped_mm", "padded_bmm"])
def test_grouped_matmul_equals_per_group_matmuls_forward_and_backward(kernel):
    torch.manual_seed(0)
    offs = torch.tensor([5, 5, 14, 15, 15, 22], dtype=torch.int32)  # experts 1 and 4 empty
    x = torch.randn(26, 16, requires_grad=True)  # rows 22..25: past the last group
    w = torch.randn(6, 16, 24, requires_grad=True)
    y = grouped_matmul(x, w, offs) if kernel == "grouped_mm" else padded_bmm(x, w, offs.tolist())
    ends = offs.tolist()
    ref = torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends))])
    assert torch.allclose(y[:22], ref, atol=1e-5)
    g = torch.cat([torch.randn_like(ref), torch.zeros(4, 24)])  # (nothing reads the rows past the groups)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g[:22])
    assert torch.allclose(gx[:22], rx[:22], atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)
    assert gw[1].abs().sum() == 0 and gw[4].abs().sum() == 0  # experts without tokens get no gradient


def test_experts_fall_back_where_strides_break_the_16_byte_rule():
    assert grouped_mm_ok(torch.randn(5, 8), 12) and not grouped_mm_ok(torch.randn(5, 7), 12)  # 7 x 4 bytes
    assert not grouped_mm_ok(torch.randn(5, 8), 6) and not grouped_mm_ok(torch.randn(5, 8, dtype=torch.float64), 12)
    experts = GroupedExperts(2, 7, 5)
    x = torch.randn(5, 7)
    assert not experts.uses_grouped_mm(x) and experts.row_alignment(x) == 1
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    counts = torch.tensor([2, 3])
    ref = experts_loop(x, counts, experts.w_gate, experts.w_up, experts.w_down)
    assert torch.allclose(experts.sorted_rows(x, counts), ref, atol=1e-5)


@pytest.mark.parametrize("variant", [
    {},  # Mixtral / Qwen3: softmax top-k, renormalised
    {"renormalize": False, "top_k": 3},
    {"router": "sigmoid", "route_scale": 2.5, "shared_experts": 1},  # DeepSeek-V3
    {"capacity_factor": 0.5},  # drops past capacity
    {"grouped_mm": "off"},  # the padded-bmm path
])
def test_moe_layer_matches_naive_reference_in_output_and_gradients(variant):
    layer = make_moe(**variant)
    if layer.cfg.router == "sigmoid":
        layer.expert_bias.copy_(torch.linspace(-0.3, 0.3, 6))  # the bias changes the choice, not the weights
    layer.eval()  # (no aux-loss gradient here: that is tested below)
    x = torch.randn(3, 7, DIM, requires_grad=True)
    y, ref = layer(x), naive_moe(layer, x)
    assert torch.allclose(y, ref, atol=1e-5), (y - ref).abs().max()
    g = torch.randn_like(y)
    params = [x, *layer.parameters()]
    for a, b in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        assert torch.allclose(a, b, atol=1e-5)


def test_capacity_factor_counts_dropped_assignments():
    layer = make_moe(capacity_factor=0.5, aux_loss_coef=0.0)
    layer.train()
    layer(torch.randn(2, 16, DIM))
    stats = layer.take_stats()
    capacity = 6  # ceil(0.5 * 32 * 2 / 6)
    expected = int(torch.clamp(stats.tokens_per_expert - capacity, min=0).sum())
    assert stats.dropped == expected > 0
    assert stats.tokens_per_expert.sum() == 64 and stats.tokens == 32


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_and_z_loss_gradients_equal_autograd_of_the_explicit_objective(router):
    layer = make_moe(router=router, aux_loss_coef=0.3, z_loss_coef=0.05)
    layer.train()
    layer.aux_grad_scale = 1.0
    x = torch.randn(2, 9, DIM)
    g = torch.randn(2, 9, DIM)
    grads = torch.autograd.grad((layer(x) * g).sum(), list(layer.parameters()))
    # the explicit objective: same forward output plus coef * aux + coef_z * z, by hand
    layer.eval()
    y = layer(x)
    x2 = x.reshape(-1, DIM)
    logits = x2 @ layer.router.weight.t()
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    idx = torch.topk(scores, 2, dim=-1).indices
    f = torch.bincount(idx.flatten(), minlength=6).float() / (len(x2) * 2)
    aux = 6 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    plain = torch.autograd.grad((y * g).sum(), layer.router.weight, retain_graph=True)[0]
    ref = torch.autograd.grad((y * g).sum() + 0.3 * aux + 0.05 * z, list(layer.parameters()))
    for a, b in zip(grads, ref):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(grads[0], plain, atol=1e-5)  # (the losses do reach the router)


def test_aux_loss_free_bias_moves_selection_towards_balance():
    layer = make_moe(router="sigmoid", aux_loss_coef=0.0, bias_update_rate=0.01)
    layer.train()
    x = torch.randn(4, 16, DIM)
    layer(x)
    stats = layer.take_stats()
    load = stats.tokens_per_expert
    expected = 0.01 * torch.sign(load.mean() - load).float()
    assert torch.equal(layer.expert_bias, expected) and layer.expert_bias.abs().sum() > 0
    assert "expert_bias" in layer.state_dict()  # checkpointed with the model


def test_moe_model_params_accounting_and_meta_init():
    cfg = ModelConfig(vocab_size=97, dim=DIM, n_layers=4, n_heads=4, max_seq_len=64,
                      moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=HIDDEN, shared_experts=1, first_dense=1, every=2))
    with torch.device("meta"):
        model = Transformer(cfg)
    assert sorted(moe_layers(model)) == [1, 3]
    counts = count_params(cfg)
    assert model.num_params() == counts["total"]
    one = 3 * DIM * HIDDEN
    assert counts["total"] - counts["active"] == 2 * 2 * one  # two MoE layers, two experts each not visited
    dense = dataclasses.replace(cfg, moe=MoEConfig())
    assert flops_per_token(cfg, 16) == pytest.approx(
        flops_per_token(dense, 16) + 6 * (counts["active"] - count_params(dense)["total"]))
    trainable = {n: p.numel() for n, p in model.named_parameters()}
    assert flops_per_token(cfg, 16, trainable) == pytest.approx(flops_per_token(cfg, 16))
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=1)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    w = a.blocks["1"].mlp.experts.w_gate
    assert abs(w.std().item() - 0.02) < 0.003 and not torch.equal(w[0], w[1])
    loss = a(torch.randint(0, 97, (2, 8)), targets=torch.randint(0, 97, (2, 8)))
    loss.backward()
    assert a.blocks["1"].mlp.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("bad, key", [
    ({"top_k": 7}, "model.moe.top_k"),
    ({"first_dense": 2}, "model.moe.first_dense"),
    ({"capacity_factor": -1.0}, "model.moe.capacity_factor"),
])
def test_moe_config_errors_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        moe_cfg(**bad).check()


def test_moe_needs_swiglu():
    with pytest.raises(ConfigError, match="model.activation"):
        dataclasses.replace(moe_cfg(), activation="gelu").check()
