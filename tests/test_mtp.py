"""Multi-token prediction (lmforge.model.mtp) against DeepSeek-V3's equations (arXiv 2412.19437 eq.
21-25) written out per depth on sequences of length T - k (no padding), the objective's value and
gradient; its per-depth statistics; evaluation and generation without the modules; the config rules.
(Layouts: tests/test_parallel_mla_mtp.py; transformers' MtpLayer: tests/test_interop_hf_deepseek.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ConfigError, ModelConfig, load_config
from lmforge.config.sections import MLAConfig, MoEConfig
from lmforge.eval.generate import generate_tokens
from lmforge.model.transformer import build_model

CFG = ModelConfig(vocab_size=89, dim=32, n_layers=2, n_heads=4, max_seq_len=32, tie_embeddings=False,
                  mtp_depth=2, mtp_loss_weight=0.4)
MLA_MOE = dataclasses.replace(CFG, mla=MLAConfig(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
                                                 qk_rope_head_dim=4, v_head_dim=8),
                              moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, shared_experts=1, first_dense=1,
                                            router="sigmoid", aux_loss_coef=0.0))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_objective(model, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(L_main + lambda / D sum_k L^k) x N (the summed form lmforge's forward backpropagates, N the target
    count), and each depth's summed NLL. The main model's hidden states come from its own blocks; each
    depth is computed on the T - k positions that have a next token, as the paper writes it."""
    cfg, T = model.cfg, x.shape[1]
    rope = (model.rope_cos, model.rope_sin)
    h = model.tok_emb(x)
    for block in model.blocks.values():
        h = block(h, rope)
    main = F.cross_entropy(model.lm_head(model.norm(h)).flatten(0, 1), y.flatten(), reduction="sum")
    depths = []
    for k, module in enumerate(model.mtp.values(), start=1):
        emb = model.tok_emb(x[:, k:])                                  # Emb(t_{i+k}), i = 1 .. T - k
        prev = h[:, :T - k]                                             # h^{k-1}_i
        w_e, w_h = module.emb_norm.weight, module.hidden_norm.weight
        hp = torch.cat([rms(emb, w_e, cfg.norm_eps), rms(prev, w_h, cfg.norm_eps)], -1) @ module.proj.weight.t()
        h = module.block(hp, rope)                                      # TRM_k over T - k positions
        logits = rms(h, module.norm.weight, cfg.norm_eps) @ model.lm_head.weight.t()
        depths.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten(), reduction="sum"))
    return main + cfg.mtp_loss_weight / cfg.mtp_depth * sum(depths), depths


@pytest.mark.parametrize("cfg", [CFG, MLA_MOE], ids=["mha", "mla-moe"])
def test_mtp_objective_matches_the_papers_equations(cfg):
    model = build_model(cfg, seed=5).train()
    for m in model.modules():  # (no MoE balancing loss: the objective here is the language model's + MTP)
        if hasattr(m, "aux_grad_scale"):
            m.aux_grad_scale = 0.0
    x, y = torch.randint(0, 89, (3, 12)), torch.randint(0, 89, (3, 12))
    nll = model(x, targets=y)
    got = torch.autograd.grad(nll, list(model.parameters()))
    stats = model.mtp.take_stats()
    ref, depths = reference_objective(model, x, y)
    main = F.cross_entropy(model.eval()(x).flatten(0, 1), y.flatten(), reduction="sum")
    assert torch.allclose(nll, main, rtol=1e-5)  # the value: the language-model NLL alone
    want = torch.autograd.grad(ref, list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (name, (a - b).abs().max())
    assert torch.allclose(stats[:, 0], torch.stack(depths).double().detach(), rtol=1e-5)
    assert stats[:, 1].tolist() == [3 * 11, 3 * 10]  # each depth's targets: T - k per sequence
    assert any(b.abs().sum() > 0 for (n, _), b in zip(model.named_parameters(), got) if n.startswith("mtp.1."))


def test_ignored_targets_are_left_out_of_every_depth():
    model = build_model(CFG, seed=1).train()
    x, y = torch.randint(0, 89, (2, 10)), torch.randint(0, 89, (2, 10))
    y[0, 4] = -100
    model(x, targets=y).backward()
    stats = model.mtp.take_stats()
    assert stats[:, 1].tolist() == [2 * 9 - 1, 2 * 8 - 1]  # y[0, 4] is depth 1's target at 3, depth 2's at 2


def test_evaluation_and_generation_ignore_the_mtp_modules():
    model = build_model(MLA_MOE, seed=2)
    plain = build_model(dataclasses.replace(MLA_MOE, mtp_depth=0), seed=2)
    assert set(model.state_dict()) - set(plain.state_dict()) == {n for n in model.state_dict() if n.startswith("mtp.")}
    plain.load_state_dict({n: t for n, t in model.state_dict().items() if not n.startswith("mtp.")})
    x, y = torch.randint(0, 89, (2, 10)), torch.randint(0, 89, (2, 10))
    model.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(model(x, targets=y), plain(x, targets=y))
        assert model.mtp.take_stats() is None
    prompt = [3, 1, 4, 1, 5]
    assert list(generate_tokens(model, prompt, 8, temperature=0)) == list(generate_tokens(plain, prompt, 8, temperature=0))


@pytest.mark.parametrize("overrides, key", [
    ({"parallel.pp": 2}, "parallel.pp"), ({"parallel.cp": 2}, "parallel.cp"),
    ({"parallel.tp": 2, "parallel.sequence_parallel": True}, "parallel.sequence_parallel"),
])
def test_mtp_layouts_it_does_not_run_on_are_refused_up_front(overrides, key):
    with pytest.raises(ConfigError, match=r"model\.mtp_depth = 1 .*" + key.replace(".", r"\.")):
        load_config("tiny", {"model.mtp_depth": 1, "model.tie_embeddings": False, **overrides})


def test_mtp_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model\.mtp_depth"):
        dataclasses.replace(CFG, mtp_depth=-1).check()

