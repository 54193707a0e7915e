"""Parameter and FLOPs accounting from a `ModelConfig` (and, for FLOPs, which parameters train).

Pure arithmetic, no torch import: the trainer reports these numbers and `lmforge plan` uses the
same functions, so a planner never needs PyTorch and the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping

from lmforge.config import ModelConfig


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config alone (no allocation), split by kind."""
    d, v, h = cfg.dim, cfg.vocab_size, cfg.head_dim
    b = 1 if cfg.bias else 0
    norm = d * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)
    qkv_b = 1 if cfg.attn_qkv_bias else 0
    attn = d * h * (cfg.n_heads + 2 * cfg.kv_heads) + qkv_b * h * (cfg.n_heads + 2 * cfg.kv_heads)
    attn += cfg.n_heads * h * d + b * d + (2 * h if cfg.qk_norm else 0)
    f = cfg.ffn_dim
    mlp = (3 * d * f + b * (2 * f + d)) if cfg.activation == "swiglu" else (2 * d * f + b * (f + d))
    block = attn + mlp + 2 * norm
    moe, n_moe = moe_params(cfg), sum(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layers))
    blocks = cfg.n_layers * block + n_moe * (moe["total"] - mlp)
    embedding = v * d
    position = cfg.max_seq_len * d if cfg.pos_emb == "learned" else 0
    head = 0 if cfg.tie_embeddings else v * d
    total = embedding + position + blocks + norm + head
    return {"total": total, "embedding": embedding, "position": position, "blocks": blocks,
            "lm_head": head, "non_embedding": total - embedding - position,
            # a token's parameters: the routed experts it does not visit left out (= total for a dense model)
            "active": total - n_moe * (moe["total"] - moe["active"]),
            "experts": n_moe * moe["experts"]}


def moe_params(cfg: ModelConfig) -> dict[str, int]:
    """One MoE feed-forward's parameters (lmforge.model.moe.MoE): router + routed experts (SwiGLU,
    3 x dim x expert_hidden each) + shared experts; "active" counts top_k routed experts."""
    m = cfg.moe
    if not m.enabled:
        return {"total": 0, "active": 0, "experts": 0}
    one = 3 * cfg.dim * (m.expert_hidden or cfg.ffn_dim)
    common = cfg.dim * m.num_experts + m.shared_experts * one
    return {"total": common + m.num_experts * one, "active": common + m.top_k * one, "experts": m.num_experts * one}


def flops_per_token(cfg: ModelConfig, seq_len: int, trainable: Mapping[str, int] | None = None) -> float:
    """Training FLOPs per token, PaLM convention: 6 * N_matmul + 12 * L * d * s when every weight trains.
    A Mixture-of-Experts model counts its *active* parameters (router, top_k routed experts, shared
    experts: `count_params(cfg)["active"]`), the weights one token's matmuls use.

    N_matmul counts the weights that take part in a matrix multiply per token: every block weight
    and the output projection (vocab x dim, whether tied or not). The embedding lookup and a
    learned position table do no matmul and are excluded. The 12*L*d*s term is the attention
    score and value matmuls (forward + backward), with s the sequence length.

    `trainable` (parameter name -> element count of every parameter that trains, as
    `model.named_parameters()` names them, LoRA adapters included; None = every parameter of the
    plain model): the FLOPs autograd actually computes, from `training_flops`. Frozen weights skip
    their weight-gradient matmul, so a LoRA run costs forward 2*N_all + input gradients 2*N_all
    (less the first block's q/k/v) + weight gradients 2*N_trainable, not 6N; with every weight
    trainable both give 6N + 12*L*d*s exactly.
    """
    if trainable is None:
        counts = count_params(cfg)
        n_matmul = counts["blocks"] - (counts["total"] - counts["active"]) + cfg.vocab_size * cfg.dim
        return 6.0 * n_matmul + 12.0 * cfg.n_layers * cfg.dim * seq_len
    return training_flops(cfg, seq_len, trainable)["total"]


def training_flops(cfg: ModelConfig, seq_len: int, trainable: Mapping[str, int]) -> dict[str, float]:
    """FLOPs per token of one training step as autograd computes them, given which parameters train.

    Each matmul with weight W (n = out x in elements) costs, per token:

      forward          2n   always
      input gradient   2n   only if its input needs a gradient (a trainable parameter upstream)
      weight gradient  2n   only if W trains

    A run in which every weight trains costs 6N (+ attention). A LoRA run (base weights and
    embeddings frozen) costs forward 2*N_all + input gradients 2*N_all, less the first block's
    q/k/v projections whose input (the frozen embedding) needs none, + weight gradients
    2*N_trainable, with N_all including the adapters (A: rank x in, B: out x rank; B's input
    gradient is always formed, A's only where the layer's input needs one).

    Attention scores and values: 4*d*s forward per layer, and 8*d*s backward in every layer where
    q, k or v needs a gradient (SDPA's fused backward forms dq, dk and dv together).

    As in the 6N + 12*L*d*s count, the blocks' biases and norm weights are counted like matmul
    weights (a bias is a weight on a constant input, a norm weight a diagonal one; < 0.1% of the
    total), and the embedding lookup, the final norm, activations and the softmax are not counted,
    so with every parameter trainable the result equals `flops_per_token(cfg, seq_len)` exactly.

    Returns per-token FLOPs {"matmul" (the matrix multiplies, adapters included), "elementwise"
    (biases and norm weights, by the convention above), "attention", "total"}.
    """
    d, L = cfg.dim, cfg.n_layers
    q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    f = cfg.ffn_dim
    norm_size = d * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)
    total = {"matmul": 0.0, "elementwise": 0.0, "attention": 0.0}

    def trains(name: str) -> bool:
        return trainable.get(name, 0) > 0

    def cost(n: int, x_grad: bool, w_trains: bool) -> float:
        return 2.0 * n + (2.0 * n if x_grad else 0.0) + (2.0 * n if w_trains else 0.0)

    def linear(prefix: str, n_in: int, n_out: int, x_grad: bool, weight: str = "", bias: bool | None = None) -> bool:
        """Count one (possibly LoRA-adapted) linear layer; True if its output needs a gradient."""
        w_trains = trains(weight or prefix + ".weight")
        total["matmul"] += cost(n_in * n_out, x_grad, w_trains)
        out_grad = x_grad or w_trains
        if (cfg.bias if bias is None else bias) and not weight:
            b_trains = trains(prefix + ".bias")
            total["elementwise"] += cost(n_out, x_grad, b_trains)
            out_grad = out_grad or b_trains
        # (a fused attn.wqkv's part adapters, prefix.lora.<part>.lora_a: their sizes add up)
        n_a, n_b = (sum(n for k, n in trainable.items() if k == prefix + f".{ab}" or (
            k.startswith(prefix + ".lora.") and k.endswith(f".{ab}"))) for ab in ("lora_a", "lora_b"))
        if n_a or n_b:  # h = x A^T, then h B^T
            h_grad = x_grad or n_a > 0
            total["matmul"] += cost(n_a, x_grad, n_a > 0) + cost(n_b, h_grad, n_b > 0)
            out_grad = out_grad or h_grad or n_b > 0
        return out_grad

    def norm(prefix: str, x_grad: bool) -> bool:
        w_trains = trains(prefix + ".weight") or trains(prefix + ".bias")
        total["elementwise"] += cost(norm_size, x_grad, w_trains)
        return x_grad or w_trains

    grad = trains("tok_emb.weight") or trains("pos_emb.weight")  # does the residual stream need a gradient?
    for i in range(L):
        b = f"blocks.{i}."
        h = norm(b + "attn_norm", grad)
        qb = cfg.attn_qkv_bias
        if cfg.fused_qkv:  # one matmul of the three's width: the same FLOPs (its own LoRA adapter, if any)
            fused = linear(b + "attn.wqkv", d, q_width + 2 * kv_width, h, bias=qb)
            qkv = [fused, fused, fused]
        else:
            qkv = [linear(b + "attn.wq", d, q_width, h, bias=qb), linear(b + "attn.wk", d, kv_width, h, bias=qb),
                   linear(b + "attn.wv", d, kv_width, h, bias=qb)]
        if cfg.qk_norm:  # (head_dim weights each, counted like the other norms)
            qkv += [trains(b + "attn.q_norm.weight"), trains(b + "attn.k_norm.weight")]
            total["elementwise"] += sum(cost(cfg.head_dim, any(qkv[:3]), trains(b + f"attn.{n}.weight"))
                                        for n in ("q_norm", "k_norm"))
        a_grad = any(qkv)
        total["attention"] += 4.0 * d * seq_len + (8.0 * d * seq_len if a_grad else 0.0)
        grad = linear(b + "attn.wo", q_width, d, a_grad) or grad
        h = norm(b + "mlp_norm", grad)
        if cfg.moe.is_moe_layer(i):  # MoE: the router, top_k routed experts per token, the shared experts
            m, he = cfg.moe, cfg.moe.expert_hidden or f
            r = linear(b + "mlp.router", d, m.num_experts, h)
            w = [trains(b + f"mlp.experts.{n}") for n in ("w_gate", "w_up", "w_down")]
            total["matmul"] += m.top_k * (cost(d * he, h, w[0]) + cost(d * he, h, w[1]) + cost(he * d, h or w[0] or w[1], w[2]))
            out = r or h or any(w)
            if m.shared_experts:
                s_gate = linear(b + "mlp.shared.gate", d, m.shared_experts * he, h)
                s_up = linear(b + "mlp.shared.up", d, m.shared_experts * he, h)
                out = linear(b + "mlp.shared.down", m.shared_experts * he, d, s_gate or s_up) or out
            grad = out or grad
        elif cfg.activation == "swiglu":
            gate, up = linear(b + "mlp.gate", d, f, h), linear(b + "mlp.up", d, f, h)
            grad = linear(b + "mlp.down", f, d, gate or up) or grad
        else:
            grad = linear(b + "mlp.proj", f, d, linear(b + "mlp.fc", d, f, h)) or grad
    final = grad or trains("norm.weight") or trains("norm.bias")  # (the final norm is not counted)
    linear("lm_head", d, cfg.vocab_size, final, weight="tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight")
    total["total"] = total["matmul"] + total["elementwise"] + total["attention"]
    return total


def mlp_activation_width(cfg: ModelConfig) -> float:
    """Per token, the feed-forward hidden width whose activations a layer keeps, averaged over the
    layers (the planner's activation formulas take one per-layer figure): the dense MLP's ffn_dim,
    or for an MoE layer top_k x expert_hidden (each token's routed experts) + the shared experts'
    width + top_k x dim (the token's rows sorted by expert, and their outputs before the weighted
    sum)."""
    m = cfg.moe
    if not m.enabled:
        return float(cfg.ffn_dim)
    he = m.expert_hidden or cfg.ffn_dim
    moe_width = m.top_k * he + m.shared_experts * he + m.top_k * cfg.dim
    n_moe = sum(m.is_moe_layer(i) for i in range(cfg.n_layers))
    return (n_moe * moe_width + (cfg.n_layers - n_moe) * cfg.ffn_dim) / cfg.n_layers
