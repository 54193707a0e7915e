"""Parameter and FLOPs accounting from a `ModelConfig` alone.

Pure arithmetic, no torch import: the trainer reports these numbers and `lmforge plan` uses the
same functions, so a planner never needs PyTorch and the two can never disagree.
"""

from __future__ import annotations

from lmforge.config import ModelConfig


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config alone (no allocation), split by kind."""
    d, v, h = cfg.dim, cfg.vocab_size, cfg.head_dim
    b = 1 if cfg.bias else 0
    norm = d * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)
    attn = d * h * (cfg.n_heads + 2 * cfg.kv_heads) + b * h * (cfg.n_heads + 2 * cfg.kv_heads)
    attn += cfg.n_heads * h * d + b * d
    f = cfg.ffn_dim
    mlp = (3 * d * f + b * (2 * f + d)) if cfg.activation == "swiglu" else (2 * d * f + b * (f + d))
    block = attn + mlp + 2 * norm
    embedding = v * d
    position = cfg.max_seq_len * d if cfg.pos_emb == "learned" else 0
    head = 0 if cfg.tie_embeddings else v * d
    total = embedding + position + cfg.n_layers * block + norm + head
    return {"total": total, "embedding": embedding, "position": position, "blocks": cfg.n_layers * block,
            "lm_head": head, "non_embedding": total - embedding - position}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM convention: 6 * N_matmul + 12 * L * d * s.

    N_matmul counts the weights that take part in a matrix multiply per token: every block weight
    and the output projection (vocab x dim, whether tied or not). The embedding lookup and a
    learned position table do no matmul and are excluded. The 12*L*d*s term is the attention
    score and value matmuls (forward + backward), with s the sequence length.
    """
    counts = count_params(cfg)
    n_matmul = counts["blocks"] + cfg.vocab_size * cfg.dim
    return 6.0 * n_matmul + 12.0 * cfg.n_layers * cfg.dim * seq_len
