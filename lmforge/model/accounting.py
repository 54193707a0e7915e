"""Parameter and FLOPs accounting from a `ModelConfig` (and, for FLOPs, which parameters train).

Pure arithmetic, no torch import: the trainer reports these numbers and `lmforge plan` uses the
same functions, so a planner never needs PyTorch and the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping

from lmforge.config import ModelConfig


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the config alone (no allocation), split by kind.

    "total" is every parameter the model holds, the multi-token prediction modules (model.mtp_depth)
    included, the embedding and head once (shared by the main model and the MTP modules); "active"
    what a training token's forward uses (the routed experts it does not visit left out; = total
    for a dense model). "mtp" / "mtp_active" are the MTP modules' own share of them, and "main" /
    "main_active" the main model's: the figures DeepSeek-V3 publishes (671B / 37B), which leave the
    MTP module out (its Hugging Face checkpoint, 685B, adds the MTP module's 11.6B and its own copies
    of the embedding and head, 2 x 0.93B)."""
    d, v = cfg.dim, cfg.vocab_size
    norm = norm_params(cfg)
    blocks = blocks_active = 0
    for i in range(cfg.n_layers):
        total, active = block_params(cfg, i)
        blocks, blocks_active = blocks + total, blocks_active + active
    mtp = mtp_active = 0
    for k in range(cfg.mtp_depth):  # two input norms, the 2d -> d projection, a block, its final norm
        total, active = block_params(cfg, cfg.n_layers + k)
        mtp, mtp_active = mtp + 3 * norm + 2 * d * d + total, mtp_active + 3 * norm + 2 * d * d + active
    embedding = v * d
    position = cfg.max_seq_len * d if cfg.pos_emb == "learned" else 0
    head = 0 if cfg.tie_embeddings else v * d
    total = embedding + position + blocks + norm + head + mtp
    active = total - (blocks - blocks_active) - (mtp - mtp_active)
    n_moe = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.n_layers + cfg.mtp_depth))
    return {"total": total, "embedding": embedding, "position": position, "blocks": blocks,
            "lm_head": head, "non_embedding": total - embedding - position,
            # a token's parameters: the routed experts it does not visit left out (= total for a dense model)
            "active": active, "experts": n_moe * moe_params(cfg)["experts"],
            "mtp": mtp, "mtp_active": mtp_active, "main": total - mtp, "main_active": active - mtp_active}


def norm_params(cfg: ModelConfig) -> int:
    """One normalisation layer over dim (LayerNorm with biases: weight and bias)."""
    return cfg.dim * (2 if (cfg.norm == "layernorm" and cfg.bias) else 1)


def attention_params(cfg: ModelConfig) -> int:
    """One block's attention: q, k, v, o (with biases, QK-norm), or multi-head latent attention's
    down- and up-projections and the two latent norms (lmforge.model.mla)."""
    d, h, H = cfg.dim, cfg.head_dim, cfg.n_heads
    if cfg.mla.enabled:
        m = cfg.mla
        q = (d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * m.qk_head_dim) if m.q_lora_rank else \
            d * H * m.qk_head_dim
        kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_head_dim +
                                                                                                m.v_head_dim)
        return q + kv + H * m.v_head_dim * d
    qkv_b = 1 if cfg.attn_qkv_bias else 0
    attn = d * h * (H + 2 * cfg.kv_heads) + qkv_b * h * (H + 2 * cfg.kv_heads)
    gate = (d * H * h + qkv_b * H * h) if cfg.attn_gate else 0  # (model.attn_gate: attn.wg, q's shape)
    return attn + gate + H * h * d + (d if cfg.bias else 0) + (sum(cfg.qk_norm_widths) if cfg.qk_norm else 0)


def block_norms(cfg: ModelConfig) -> int:
    """Norms over dim in one block (model.norm_placement): 2 pre or post, 4 sandwich (Gemma 3)."""
    return 4 if cfg.norm_placement == "sandwich" else 2


def attention_keys(cfg: ModelConfig, layer: int, seq_len: int) -> int:
    """The keys each query of block `layer` is counted against in the attention term: seq_len (the PaLM
    convention, causal masking not halved), or the block's sliding window where shorter (model.sliding_window,
    on every block or on model.layer_types' 'sliding_attention' ones)."""
    window = cfg.layer_window(layer)
    return min(window, seq_len) if window else seq_len


def deltanet_params(cfg: ModelConfig) -> int:
    """One Gated DeltaNet block's token mixer (lmforge.model.gated_deltanet): the q/k/v/z projections,
    beta's and the decay's, the three depthwise convolutions, A_log and dt_bias, the gated norm, wo."""
    hk, hv, dk, dv = cfg.deltanet_shape
    qkv = 2 * hk * dk + hv * dv
    return cfg.dim * (qkv + hv * dv + 2 * hv) + qkv * cfg.deltanet.conv_kernel + 2 * hv + dv + hv * dv * cfg.dim


def deltanet_flops(cfg: ModelConfig) -> float:
    """The gated delta rule's own forward FLOPs per token of one layer, by the recurrent form's count:
    per value head the state's read S^T k, its rank-one write and the output S^T q, 2 dk dv each
    (the chunked form regroups the same work; the planner's detailed count is later work)."""
    _, hv, dk, dv = cfg.deltanet_shape
    return 6.0 * hv * dk * dv


def block_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(total, active) parameters of block `layer` (n_layers + k - 1: MTP depth k's block): attention
    (or Gated DeltaNet, model.layer_types), the dense MLP or the MoE feed-forward, its norms (`block_norms`)."""
    d, f, b = cfg.dim, cfg.ffn_dim, 1 if cfg.bias else 0
    mixer = deltanet_params(cfg) if cfg.is_linear_layer(layer) else attention_params(cfg)
    common = mixer + block_norms(cfg) * norm_params(cfg)
    if cfg.moe.is_moe_layer(layer):
        moe = moe_params(cfg)
        return common + moe["total"], common + moe["active"]
    mlp = (3 * d * f + b * (2 * f + d)) if cfg.gated_mlp else (2 * d * f + b * (f + d))
    return common + mlp, common + mlp


def moe_params(cfg: ModelConfig) -> dict[str, int]:
    """One MoE feed-forward's parameters (lmforge.model.moe.MoE): router + routed experts (SwiGLU,
    3 x dim x expert_hidden each) + shared experts (and their gate); "active" counts top_k routed experts."""
    m = cfg.moe
    if not m.enabled:
        return {"total": 0, "active": 0, "experts": 0}
    one = 3 * cfg.dim * (m.expert_hidden or cfg.ffn_dim)
    common = cfg.dim * m.num_experts + m.shared_experts * one + (cfg.dim if m.shared_experts and m.shared_gate else 0)
    return {"total": common + m.num_experts * one, "active": common + m.top_k * one, "experts": m.num_experts * one}


def flops_per_token(cfg: ModelConfig, seq_len: int, trainable: Mapping[str, int] | None = None) -> float:
    """Training FLOPs per token, PaLM convention: 6 * N_matmul + 12 * L * d * s when every weight trains.
    A Mixture-of-Experts model counts its *active* parameters (router, top_k routed experts, shared
    experts: `count_params(cfg)["active"]`), the weights one token's matmuls use. Multi-token
    prediction (model.mtp_depth = D) adds each depth's module (its block counted as one more layer)
    and one more use of the output projection per depth: L + D layers and D + 1 heads. Multi-head
    latent attention: its own weights, and `attention_width` in place of d.

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
        heads = 1 + cfg.mtp_depth  # the output projection: the main model's and each MTP depth's
        n_matmul = counts["active"] - counts["embedding"] - counts["position"] - counts["lm_head"] \
            - norm_params(cfg) + heads * cfg.vocab_size * cfg.dim
        linear = sum(cfg.is_linear_layer(i) for i in range(cfg.n_layers))  # (Gated DeltaNet: its recurrence, x 3)
        keys = sum(attention_keys(cfg, i, seq_len) for i in range(cfg.n_layers + cfg.mtp_depth)
                   if not cfg.is_linear_layer(i))
        return 6.0 * n_matmul + 12.0 * attention_width(cfg) * keys + 3.0 * linear * deltanet_flops(cfg)
    return training_flops(cfg, seq_len, trainable)["total"]


def attention_width(cfg: ModelConfig) -> float:
    """w in the attention term 12 * L * w * s: d in the PaLM convention (q . k and p . v over heads of
    total width d); for multi-head latent attention the mean of its query/key and value widths, n_heads
    x (qk_nope + qk_rope + v) / 2 (DeepSeek-V3: 128 x 320 / 2 = 20480 against d = 7168)."""
    if cfg.mla.enabled:
        return cfg.n_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) / 2
    return float(cfg.dim)


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
    d, L, width = cfg.dim, cfg.n_layers, attention_width(cfg)
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

    def norm(prefix: str, x_grad: bool, size: int = norm_size) -> bool:
        w_trains = trains(prefix + ".weight") or trains(prefix + ".bias")
        total["elementwise"] += cost(size, x_grad, w_trains)
        return x_grad or w_trains

    def attention(b: str, h: bool) -> bool:
        """q, k, v of block prefix `b` from an input needing a gradient if `h`: whether they need one."""
        if cfg.mla.enabled:  # lmforge.model.mla: the down-projections, the latent norms, the up-projections
            m, heads = cfg.mla, cfg.n_heads
            if m.q_lora_rank:
                cq = norm(b + "attn.q_norm", linear(b + "attn.wq_a", d, m.q_lora_rank, h, bias=False), m.q_lora_rank)
                q = linear(b + "attn.wq_b", m.q_lora_rank, heads * m.qk_head_dim, cq, bias=False)
            else:
                q = linear(b + "attn.wq", d, heads * m.qk_head_dim, h, bias=False)
            latent = linear(b + "attn.wkv_a", d, m.kv_lora_rank + m.qk_rope_head_dim, h, bias=False)
            c = norm(b + "attn.kv_norm", latent, m.kv_lora_rank)
            kv = linear(b + "attn.wkv_b", m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), c, bias=False)
            return q or latent or kv
        qb = cfg.attn_qkv_bias
        if cfg.fused_qkv:  # one matmul of the three's width: the same FLOPs (its own LoRA adapter, if any)
            fused = linear(b + "attn.wqkv", d, q_width + 2 * kv_width, h, bias=qb)
            qkv = [fused, fused, fused]
        else:
            qkv = [linear(b + "attn.wq", d, q_width, h, bias=qb), linear(b + "attn.wk", d, kv_width, h, bias=qb),
                   linear(b + "attn.wv", d, kv_width, h, bias=qb)]
        if cfg.attn_gate:  # (the gate's projection, q's shape; its sigmoid and product: elementwise, not counted)
            qkv.append(linear(b + "attn.wg", d, q_width, h, bias=qb))
        if cfg.qk_norm:  # (head_dim weights each, or the projections' widths; counted like the other norms)
            qkv += [trains(b + "attn.q_norm.weight"), trains(b + "attn.k_norm.weight")]
            total["elementwise"] += sum(cost(width, any(qkv[:3]), trains(b + f"attn.{n}.weight"))
                                        for n, width in zip(("q_norm", "k_norm"), cfg.qk_norm_widths))
        return any(qkv)

    def deltanet(b: str, h: bool) -> bool:
        """Gated DeltaNet's projections, convolutions, gates and norm (elementwise, counted as weights) and
        its recurrence (forward, and twice that backward where its inputs need a gradient)."""
        hk, hv, dk, dv = cfg.deltanet_shape
        parts = [linear(b + f"attn.{n}", d, w, h, bias=False) for n, w in (
            ("in_q", hk * dk), ("in_k", hk * dk), ("in_v", hv * dv), ("in_z", hv * dv), ("in_b", hv), ("in_a", hv))]
        x_grad = any(parts)
        for name, n in (("conv_q.weight", hk * dk), ("conv_k.weight", hk * dk), ("conv_v.weight", hv * dv)):
            total["elementwise"] += cost(n * cfg.deltanet.conv_kernel, x_grad, trains(b + "attn." + name))
        for name, n in (("A_log", hv), ("dt_bias", hv), ("norm.weight", dv)):
            total["elementwise"] += cost(n, x_grad, trains(b + "attn." + name))
        out = x_grad or any(trains(b + f"attn.{n}") for n in (
            "conv_q.weight", "conv_k.weight", "conv_v.weight", "A_log", "dt_bias", "norm.weight"))
        total["attention"] += deltanet_flops(cfg) * (3.0 if out else 1.0)
        return out

    def block(b: str, i: int, grad: bool) -> bool:
        """Block `i` (prefix `b`) on a residual stream needing a gradient if `grad`: whether its output does."""
        pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"  # (model.norm_placement)
        h = norm(b + "attn_norm", grad) if pre else grad
        if cfg.is_linear_layer(i):
            _, hv, _, dv = cfg.deltanet_shape
            out = linear(b + "attn.wo", hv * dv, d, deltanet(b, h), bias=False)
        else:
            a_grad = attention(b, h)
            keys = attention_keys(cfg, i, seq_len)
            total["attention"] += 4.0 * width * keys + (8.0 * width * keys if a_grad else 0.0)
            o_width = cfg.n_heads * cfg.mla.v_head_dim if cfg.mla.enabled else q_width
            out = linear(b + "attn.wo", o_width, d, a_grad, bias=False if cfg.mla.enabled else None)
        grad = (norm(b + "attn_post_norm", out) if post else out) or grad
        h = norm(b + "mlp_norm", grad) if pre else grad
        if post:  # (the MLP's output through mlp_post_norm)
            return norm(b + "mlp_post_norm", mlp(b, i, h)) or grad
        return mlp(b, i, h) or grad

    def mlp(b: str, i: int, h: bool) -> bool:
        """Block `i`'s feed-forward on an input needing a gradient if `h`: whether its output needs one."""
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
                if m.shared_gate:  # (Qwen3-Next's per-token gate on them: dim -> 1)
                    out = linear(b + "mlp.shared_gate", d, 1, h, bias=False) or out
            return out
        if cfg.gated_mlp:
            gate, up = linear(b + "mlp.gate", d, f, h), linear(b + "mlp.up", d, f, h)
            return linear(b + "mlp.down", f, d, gate or up)
        return linear(b + "mlp.proj", f, d, linear(b + "mlp.fc", d, f, h))

    head = "tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"
    emb = trains("tok_emb.weight") or trains("pos_emb.weight")  # does the residual stream need a gradient?
    grad = emb
    for i in range(L):
        grad = block(f"blocks.{i}.", i, grad)
    final = grad or trains("norm.weight") or trains("norm.bias")  # (the final norm is not counted)
    linear("lm_head", d, cfg.vocab_size, final, weight=head)
    for k in range(cfg.mtp_depth):  # lmforge.model.mtp: norms (counted, as a block's), projection, block, head
        b = f"mtp.{k}."
        normed = [norm(b + "emb_norm", trains("tok_emb.weight")), norm(b + "hidden_norm", grad)]
        x = linear(b + "proj", 2 * d, d, any(normed), bias=False)
        grad = block(b + "block.", L + k, x)
        linear("lm_head", d, cfg.vocab_size, norm(b + "norm", grad), weight=head)
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
