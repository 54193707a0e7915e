"""The transformer: shapes, parameter accounting, causality, GQA, RoPE, KV cache, meta init."""

import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.config.sections import DeltaNetConfig
from lmforge.eval.generate import generate_tokens
from lmforge.model.layers import apply_rope, rope_tables
from lmforge.model.transformer import Transformer, build_model, count_params, flops_per_token

LLAMA = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
GPT2 = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, max_seq_len=64, pos_emb="learned", norm="layernorm",
            activation="gelu", bias=True, tie_embeddings=True)
VARIANTS = {"llama": LLAMA, "gpt2": GPT2, "gqa": {**LLAMA, "n_kv_heads": 2, "tie_embeddings": False},
            "mqa": {**LLAMA, "n_kv_heads": 1},
            # the families' attention options (issue 37)
            "qwen2": {**LLAMA, "n_kv_heads": 2, "qkv_bias": True}, "qwen3": {**LLAMA, "qk_norm": True},
            "mistral": {**LLAMA, "n_kv_heads": 2, "sliding_window": 6},
            "llama3": {**LLAMA, "rope_scaling": "llama3", "rope_original_max_seq_len": 16},
            # Qwen3-Next's full attention (issue 57): the output gate and RoPE on a quarter of each head
            "gated": {**LLAMA, "n_kv_heads": 2, "qk_norm": True, "attn_gate": True, "rope_fraction": 0.25},
            # Qwen3-Next's 3:1 pattern (issue 57): Gated DeltaNet blocks, then a gated full-attention one
            "hybrid": {**LLAMA, "n_layers": 4, "full_attention_interval": 4, "attn_gate": True,
                       "deltanet": DeltaNetConfig(value_heads=8, chunk_size=4)}}


@pytest.mark.parametrize("name", VARIANTS)
def test_param_count_matches_config_formula(name):
    cfg = ModelConfig(**VARIANTS[name])
    model = build_model(cfg, seed=0)
    assert model.num_params() == count_params(cfg)["total"]
    assert model(torch.randint(0, 97, (2, 10))).shape == (2, 10, 97)


def test_gpt2_124m_parameter_count_without_allocating():
    cfg = ModelConfig(vocab_size=50257, dim=768, n_layers=12, n_heads=12, max_seq_len=1024, pos_emb="learned",
                      norm="layernorm", activation="gelu", bias=True, tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_params() == count_params(cfg)["total"] == 124_439_808  # the published GPT-2 small count
    assert all(p.is_meta for p in model.parameters())


def test_meta_init_is_deterministic_and_ties_weights():
    cfg = ModelConfig(**GPT2)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert a.lm_head.weight is a.tok_emb.weight
    c = build_model(cfg, seed=4)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    # residual projections get the scaled std
    std = a.blocks["0"].mlp.proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(4)) < 0.003


@pytest.mark.parametrize("name", VARIANTS)
def test_causal_future_tokens_do_not_change_past_logits(name):
    model = build_model(ModelConfig(**VARIANTS[name]), seed=0)
    x = torch.randint(0, 97, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 97
    la, lb = model(x), model(y)
    assert torch.allclose(la[0, :8], lb[0, :8], atol=1e-5)
    assert not torch.allclose(la[0, 8:], lb[0, 8:], atol=1e-3)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_cfg = ModelConfig(**{**LLAMA, "n_kv_heads": 2, "fused_qkv": False})  # (separate wk, wv to repeat)
    mha_cfg = ModelConfig(**{**LLAMA, "fused_qkv": False})
    gqa, mha = build_model(gqa_cfg, seed=0), build_model(mha_cfg, seed=1)
    state = gqa.state_dict()
    hd = gqa_cfg.head_dim
    for key in list(state):
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):  # (kv_heads*hd, dim) -> (heads*hd, dim)
            w = state[key].view(2, hd, -1)
            state[key] = w.repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state, strict=False)
    x = torch.randint(0, 97, (2, 9))
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i, j):
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i:i + 1], sin[i:i + 1]).flatten()
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j:j + 1], sin[j:j + 1]).flatten()
        return float(qi @ kj)

    assert abs(score(3, 1) - score(13, 11)) < 1e-4
    assert abs(score(3, 1) - score(3, 2)) > 1e-4


@pytest.mark.parametrize("name", ["llama", "gpt2", "gqa", "qwen2", "qwen3", "mistral", "llama3", "gated", "hybrid"])
def test_kv_cache_generation_equals_full_recompute(name):
    model = build_model(ModelConfig(**VARIANTS[name]), seed=0)
    prompt = [5, 17, 3]
    cached = list(generate_tokens(model, prompt, 20, temperature=0.0, use_cache=True))
    plain = list(generate_tokens(model, prompt, 20, temperature=0.0, use_cache=False))
    assert cached == plain and len(cached) == 20
    # sampling is reproducible by seed
    s1 = list(generate_tokens(model, prompt, 10, temperature=1.0, seed=7))
    s2 = list(generate_tokens(model, prompt, 10, temperature=1.0, seed=7))
    assert s1 == s2


def test_flops_per_token_formula():
    cfg = ModelConfig(**LLAMA)
    c = count_params(cfg)
    expected = 6 * (c["blocks"] + 97 * 32) + 12 * 2 * 32 * 64
    assert flops_per_token(cfg, 64) == expected


def test_sequence_longer_than_max_is_rejected():
    model = build_model(ModelConfig(**LLAMA), seed=0)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len = 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_streamed_text_never_contains_a_stop_string(monkeypatch):
    """Streaming holds back text that could begin a stop string, so a stop string split across
    tokens ('\\n' then '\\n') is cut whole, and the pieces join to generate_text's answer."""
    from lmforge.eval import generate as gen

    class Tok:
        eos_id = None

        def encode(self, text):
            return [1]

        def decode(self, ids):
            return "".join("ab\n\ncd"[i % 6] for i in range(len(ids)))

    monkeypatch.setattr(gen, "generate_tokens", lambda model, prompt, n, eos_id=None, **kw: iter(range(n)))
    pieces = list(gen.stream_text(None, Tok(), "x", 6, stop=["\n\n"]))
    assert "".join(pieces) == "ab" == gen.generate_text(None, Tok(), "x", 6, stop=["\n\n"])
    assert gen.generate_text(None, Tok(), "x", 6) == "ab\n\ncd"
    assert list(gen.stream_text(None, Tok(), "x", 3)) == ["a", "b", "\n"]  # no stops: nothing held back


@pytest.mark.parametrize("name", ["mistral", "qwen3", "gated", "hybrid"])
def test_chunked_prefill_and_decoding_with_a_cache_equal_the_full_forward(name):
    """Chunks of several tokens after cached ones (the offset mask, within the sliding window) and
    single tokens (the window over the cache) give the full forward's logits."""
    from lmforge.model.transformer import generation_caches

    model = build_model(ModelConfig(**VARIANTS[name]), seed=0).eval()
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    caches = generation_caches(model.cfg)  # (Gated DeltaNet blocks: their fixed-size state)
    with torch.no_grad():
        full = model(tokens)
        parts = [model(tokens[:, a:b], caches) for a, b in ((0, 9), (9, 10), (10, 25), (25, 26), (26, 40))]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < 1e-5


def test_sliding_window_mask_and_llama3_rope_frequencies():
    """The window: query p sees keys p - window + 1 .. p; a window covering the keys is no mask
    (is_causal). llama3 RoPE: high frequencies kept, low ones divided by the factor (Hugging Face's
    formula: wavelengths above original / low_freq_factor)."""
    from lmforge.model.layers import scaled_inv_freq, window_mask

    mask = window_mask(0, 6, 6, 3, torch.device("cpu"))
    assert mask.int().tolist()[5] == [0, 0, 0, 1, 1, 1] and mask.int().tolist()[1] == [1, 1, 0, 0, 0, 0]
    assert window_mask(0, 6, 6, 6, torch.device("cpu")) is None and window_mask(0, 6, 6, 0, torch.device("cpu")) is None
    assert window_mask(5, 1, 6, 0, torch.device("cpu")) is None  # one token after cached ones sees them all
    assert window_mask(5, 1, 6, 2, torch.device("cpu")).int().tolist() == [[0, 0, 0, 0, 1, 1]]
    cfg = ModelConfig(**{**VARIANTS["llama3"], "rope_original_max_seq_len": 64})  # thresholds 64/4 and 64/1
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # wavelengths 6.3 .. 6283
    scaled, wavelen = scaled_inv_freq(inv, cfg), 2 * math.pi / inv
    high, low = wavelen < 16, wavelen > 64
    medium = ~high & ~low
    assert high.any() and low.any() and medium.any()
    assert torch.equal(scaled[high], inv[high]) and torch.allclose(scaled[low], inv[low] / 8.0)
    assert ((scaled[medium] < inv[medium]) & (scaled[medium] > inv[medium] / 8.0)).all()
    assert torch.allclose(scaled_inv_freq(inv, ModelConfig(**{**LLAMA, "rope_scaling": "linear", "rope_factor": 4.0})),
                          inv / 4.0)
