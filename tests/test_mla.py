"""Multi-head latent attention (lmforge.model.mla) against a reference written from DeepSeek-V2 / V3's
equations (DeepSeek-V3 arXiv 2412.19437 eq. 1-11): per token and per head, unoptimised, with its own
RMSNorm, rotation matrices and masked softmax; the KV cache of generation holding the latent and
the RoPE key; the config rules. (Tensor and context parallelism: tests/test_parallel_mla_mtp.py;
transformers' DeepseekV3 model: tests/test_interop_hf_deepseek.py.)"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lmforge.config import ConfigError, ModelConfig
from lmforge.config.sections import MLAConfig
from lmforge.model.layers import KVCache, rope_tables
from lmforge.model.mla import MLAttention
from lmforge.model.transformer import build_model

DIM, HEADS, EPS = 48, 3, 1e-6


def mla_cfg(**mla) -> ModelConfig:
    return ModelConfig(vocab_size=101, dim=DIM, n_layers=2, n_heads=HEADS, max_seq_len=32, norm_eps=EPS,
                       tie_embeddings=False, rope_theta=500.0,
                       mla=MLAConfig(**{"kv_lora_rank": 20, "q_lora_rank": 16, "qk_nope_head_dim": 12,
                                        "qk_rope_head_dim": 8, "v_head_dim": 10, **mla}))


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + EPS) * weight


def rotation(pos: int, dim: int, theta: float) -> torch.Tensor:
    """The RoPE matrix of position `pos` (RoFormer): pair (j, j + dim/2) rotated by pos * theta^(-2j/dim)
    (the half-split pairing lmforge and transformers' `rotate_half` use)."""
    r = torch.zeros(dim, dim, dtype=torch.float64)
    for j in range(dim // 2):
        a = pos * theta ** (-2 * j / dim)
        r[j, j], r[j, j + dim // 2] = math.cos(a), -math.sin(a)
        r[j + dim // 2, j], r[j + dim // 2, j + dim // 2] = math.sin(a), math.cos(a)
    return r


def reference_mla(w: dict[str, torch.Tensor], cfg: ModelConfig, h: torch.Tensor) -> torch.Tensor:
    """u_t for every token of one sequence h (T, dim), from the equations, with the weights `w` (the
    module's, by name; the paper's matrices are blocks of their rows)."""
    m, n = cfg.mla, cfg.n_heads
    nope, rope, vd, rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    w_dkv, w_kr = w["wkv_a.weight"][:rank], w["wkv_a.weight"][rank:]                 # eq. 1, 3
    w_ukv = w["wkv_b.weight"].view(n, nope + vd, rank)
    w_uk, w_uv = w_ukv[:, :nope], w_ukv[:, nope:]                                       # eq. 2, 5
    w_uq_all = (w["wq_b.weight"] if m.q_lora_rank else w["wq.weight"]).view(n, nope + rope, -1)
    w_uq, w_qr = w_uq_all[:, :nope], w_uq_all[:, nope:]                                 # eq. 7, 8
    scale = 1 / math.sqrt(nope + rope)
    T = h.shape[0]
    c_kv = [rms(w_dkv @ h[t], w["kv_norm.weight"]) for t in range(T)]
    k_r = [rotation(t, rope, cfg.rope_theta) @ (w_kr @ h[t]) for t in range(T)]
    out = []
    for t in range(T):
        c_q = rms(w["wq_a.weight"] @ h[t], w["q_norm.weight"]) if m.q_lora_rank else h[t]     # eq. 6
        heads = []
        for i in range(n):
            q = torch.cat([w_uq[i] @ c_q, rotation(t, rope, cfg.rope_theta) @ (w_qr[i] @ c_q)])  # eq. 9
            keys = [torch.cat([w_uk[i] @ c_kv[j], k_r[j]]) for j in range(t + 1)]                 # eq. 4
            scores = torch.stack([q @ k * scale for k in keys])
            p = torch.exp(scores - scores.max())
            p = p / p.sum()
            heads.append(sum(p[j] * (w_uv[i] @ c_kv[j]) for j in range(t + 1)))                  # eq. 10
        out.append(w["wo.weight"] @ torch.cat(heads))                                              # eq. 11
    return torch.stack(out)


@pytest.mark.parametrize("mla", [{}, {"q_lora_rank": 0}, {"v_head_dim": 20}, {"v_head_dim": 12, "qk_nope_head_dim": 4}])
def test_mla_matches_the_papers_equations_in_output_and_gradients(mla):
    cfg = mla_cfg(**mla)
    cfg.check()
    torch.manual_seed(0)
    attn = MLAttention(cfg)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    cos, sin = rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg=cfg)
    x = torch.randn(2, 7, DIM, requires_grad=True)
    y = attn(x, (cos, sin))
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *attn.parameters()], g)
    ref_params = {n: p.detach().double().requires_grad_() for n, p in attn.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    ref = torch.stack([reference_mla(ref_params, cfg, x64[b]) for b in range(2)])
    want = torch.autograd.grad(ref, [x64, *ref_params.values()], g.double())
    assert torch.allclose(y.double(), ref, atol=1e-5, rtol=1e-4), (y.double() - ref).abs().max()
    for (name, _), a, b in zip([("x", None), *attn.named_parameters()], got, want):
        assert torch.allclose(a.double(), b, atol=1e-5, rtol=1e-4), (name, (a.double() - b).abs().max())


def test_yarn_softmax_scale_is_the_mscale_squared_over_the_head_width():
    base = mla_cfg()
    yarn = dataclasses.replace(base, rope_scaling="yarn", rope_factor=40.0, rope_original_max_seq_len=8,
                               rope_mscale=1.0, rope_mscale_all_dim=0.707)
    yarn.check()
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert MLAttention(yarn).scale == pytest.approx(mscale ** 2 / math.sqrt(20))
    assert MLAttention(base).scale == pytest.approx(1 / math.sqrt(20))


def test_kv_cache_holds_the_latent_and_rope_key_and_decodes_like_the_whole_forward():
    cfg = mla_cfg()
    model = build_model(cfg, seed=3).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        whole = model(tokens)
        caches = [KVCache() for _ in range(cfg.n_layers)]
        steps = [model(tokens[:, :5], caches)]  # a prompt of 5, then one token at a time
        steps += [model(tokens[:, t:t + 1], caches) for t in range(5, 9)]
    assert torch.allclose(torch.cat(steps, dim=1), whole, atol=1e-5)
    latent, k_rope = caches[0].k, caches[0].v
    assert latent.shape == (2, 1, 9, cfg.mla.kv_lora_rank) and k_rope.shape == (2, 1, 9, cfg.mla.qk_rope_head_dim)
    per_token = sum(t[0, :, 0].numel() for t in (latent, k_rope))
    assert per_token == 28 < 2 * HEADS * 20  # (full K/V of these heads: 2 x heads x qk width)


@pytest.mark.parametrize("bad, key", [
    ({"n_kv_heads": 1}, "model.n_kv_heads"), ({"qk_norm": True}, "model.qk_norm"),
    ({"pos_emb": "learned"}, "model.pos_emb"), ({"bias": True}, "model.bias"),
    ({"mla": MLAConfig(kv_lora_rank=8, qk_rope_head_dim=7)}, "model.mla.qk_rope_head_dim"),
    ({"mla": MLAConfig(kv_lora_rank=8, q_lora_rank=-1)}, "model.mla.q_lora_rank"),
])
def test_mla_config_errors_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        dataclasses.replace(mla_cfg(), **bad).check()
