"""MoE balance as DeepSeek-V3 measures and trains it (lmforge.model.moe): the complementary
sequence-wise balance loss (arXiv 2412.19437 eq. 17-20) against its equations per sequence, beside
the batch-wise loss; group-limited routing against a per-token reference; no host read with both
on; the per-layer imbalance (busiest expert / mean) in the metrics. (Under data and context
parallelism: tests/test_parallel_mla_mtp.py.)"""

from __future__ import annotations

import pytest
import torch

from lmforge.parallel.expert_parallel import moe_metrics
from tests.test_moe import DIM, make_moe
from tests.test_moe_grouped_mm import host_reads, train_step


def seq_balance_loss(layer, x: torch.Tensor) -> torch.Tensor:
    """mean over sequences of sum_i f_i P_i, per the paper: f_i = E / (K T) x count of the sequence's
    tokens choosing i, P_i = (1/T) sum_t s_{i,t} / sum_j s_{j,t}."""
    m, E, K = layer.cfg, layer.num_experts, layer.top_k
    losses = []
    for seq in x:
        logits = seq @ layer.router.weight.t()
        s = logits.softmax(-1) if m.router == "softmax" else logits.sigmoid()
        chosen = torch.topk(s + layer.expert_bias, K, dim=-1).indices
        T = seq.shape[0]
        f = torch.stack([(chosen == i).sum() for i in range(E)]).float() * E / (K * T)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        losses.append((f * p).sum())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
def test_sequence_wise_loss_gradient_equals_autograd_of_the_papers_objective(router):
    layer = make_moe(router=router, aux_loss_coef=0.2, seq_aux_loss_coef=0.7)
    layer.train()
    layer.aux_grad_scale = 1.0
    x, g = torch.randn(3, 10, DIM), torch.randn(3, 10, DIM)
    grads = torch.autograd.grad((layer(x) * g).sum(), list(layer.parameters()))
    stats = layer.take_stats()
    layer.eval()
    y = layer(x)
    x2 = x.reshape(-1, DIM)
    logits = x2 @ layer.router.weight.t()
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    idx = torch.topk(scores, 2, dim=-1).indices
    f = torch.bincount(idx.flatten(), minlength=6).float() / (len(x2) * 2)
    batch = 6 * (f * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum()
    seq = seq_balance_loss(layer, x)
    ref = torch.autograd.grad((y * g).sum() + 0.2 * batch + 0.7 * seq, list(layer.parameters()))
    for a, b in zip(grads, ref):
        assert torch.allclose(a, b, atol=1e-5)
    assert stats.seq_aux_loss == pytest.approx(float(seq.detach()), rel=1e-5)
    assert stats.aux_loss == pytest.approx(float(batch.detach()), rel=1e-5)
    assert moe_metrics({0: stats})["moe/0/seq_aux_loss"] == pytest.approx(float(seq.detach()), rel=1e-5)


def test_sequence_wise_loss_differs_from_the_batch_wise_one():
    layer = make_moe(router="sigmoid", aux_loss_coef=0.0, seq_aux_loss_coef=1.0)
    layer.train()
    x = torch.randn(4, 8, DIM)
    x[0] += 3 * torch.randn(DIM)  # one sequence routed unlike the others
    layer(x)
    stats = layer.take_stats()
    assert stats.seq_aux_loss > stats.aux_loss > 0  # (imbalance within a sequence is hidden by the batch)


def reference_groups(layer, x: torch.Tensor) -> torch.Tensor:
    """Each token's chosen experts under group-limited routing, token by token."""
    m = layer.cfg
    per = layer.num_experts // m.n_groups
    out = []
    for row in x.reshape(-1, DIM):
        s = (row @ layer.router.weight.t()).sigmoid() + layer.expert_bias
        group_score = [sorted(s[g * per:(g + 1) * per].tolist())[-2:] for g in range(m.n_groups)]
        best = sorted(range(m.n_groups), key=lambda g: -sum(group_score[g]))[:m.topk_groups]
        allowed = [e for e in range(layer.num_experts) if e // per in best]
        out.append(sorted(sorted(allowed, key=lambda e: -float(s[e]))[:m.top_k]))
    return torch.tensor(out)


def test_group_limited_routing_picks_the_top_k_inside_the_best_groups():
    layer = make_moe(router="sigmoid", n_groups=3, topk_groups=1, aux_loss_coef=0.0)
    layer.expert_bias.copy_(torch.linspace(-0.2, 0.2, 6))
    x = torch.randn(4, 5, DIM)
    chosen = layer.route(x.reshape(-1, DIM))[2].sort(-1).values
    assert torch.equal(chosen, reference_groups(layer, x))
    free = make_moe(router="sigmoid", aux_loss_coef=0.0)
    free.load_state_dict(layer.state_dict())
    assert not torch.equal(free.route(x.reshape(-1, DIM))[2].sort(-1).values, chosen)  # (the limit binds here)


def test_routed_path_with_the_sequence_loss_and_groups_reads_nothing_on_the_host():
    layer = make_moe(router="sigmoid", n_groups=2, topk_groups=1, seq_aux_loss_coef=0.01, shared_experts=1)
    x = torch.randn(2, 16, DIM, requires_grad=True)
    assert host_reads(lambda: train_step(layer, x)) == []
    assert layer.take_stats().seq_aux_loss > 0


def test_imbalance_metric_is_the_busiest_expert_over_the_mean():
    layer = make_moe(aux_loss_coef=0.0)
    layer.train()
    layer(torch.randn(2, 12, DIM))
    stats = layer.take_stats()
    load = stats.tokens_per_expert.float()
    assert moe_metrics({3: stats})["moe/3/max_load"] == pytest.approx(float(load.max() / load.mean()))
