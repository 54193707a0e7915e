"""Hugging Face `transformers` interop for DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type
"deepseek_v3"): a model with multi-head latent attention (model.mla) is exported as one, and such a
folder imports, streamed one tensor at a time in both directions (lmforge.interop.hf calls these).

Config: MLA's ranks and head widths map one to one (q_lora_rank 0 = None); the MoE blocks are those
from `first_k_dense_replace` on (model.moe.first_dense, every = 1; all dense when it equals the layer
count), sigmoid routing (model.moe.router = 'sigmoid') with `norm_topk_prob` (renormalize),
`routed_scaling_factor` (route_scale), `n_group` / `topk_group` (model.moe.n_groups / topk_groups);
`n_shared_experts` >= 1; RoPE (default or YaRN) as hf_common maps it; `num_nextn_predict_layers`
= model.mtp_depth. An import takes DeepSeek-V3's published training settings for what the config
does not hold: no batch-wise aux loss, the sequence-wise one at 0.0001, the bias update at 0.001.

Weights, as DeepSeek's released checkpoints (and transformers' save_pretrained) store them:

* embedding, final norm, head: `model.embed_tokens`, `model.norm`, `lm_head` (untied only);
* block i: `model.layers.i.input_layernorm` / `post_attention_layernorm` (attn_norm / mlp_norm);
  `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` (wq_a, q_norm, wq_b; or `q_proj`: wq),
  `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj` (wkv_a, kv_norm, wkv_b, wo);
  dense blocks `mlp.gate_proj` / `up_proj` / `down_proj`; MoE blocks `mlp.gate.weight` (the router),
  `mlp.gate.e_score_correction_bias` (lmforge's `expert_bias` buffer), `mlp.experts.j.gate_proj` /
  `up_proj` / `down_proj` per expert (lmforge stacks them, transposed: w_gate[j] = gate_proj.T) and
  `mlp.shared_experts.*` (mlp.shared.gate / up / down);
* MTP depth k (model.mtp_depth): layer num_hidden_layers + k - 1, a block's names plus `enorm`,
  `hnorm`, `eh_proj` (emb_norm, hidden_norm, proj: [enorm(emb); hnorm(h)], lmforge's column order),
  `shared_head.norm` (its final norm) and the layer's own copies of the embedding and the head
  (`embed_tokens`, `shared_head.head`: written on export, where vLLM reads them; shared, so not read
  on import). transformers' DeepseekV3ForCausalLM ignores that layer.

RoPE pairs: DeepSeek's checkpoints rotate neighbouring dimensions (2j, 2j + 1) of the RoPE part
(`rope_interleave`, true in its config), lmforge rotates j with j + rope/2; the rope rows of each
head's query and of the shared key are permuted between the two (even rows first, then odd), which
gives the same q . k (transformers' interleaved rotation outputs exactly that order). A folder with
`rope_interleave` false is read as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmforge.config import ModelConfig
from lmforge.config.sections import MLAConfig, MoEConfig
from lmforge.interop.hf_common import hf_rope_keys, rope_from_hf

ARCH = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"


def check_deepseek(cfg: ModelConfig) -> None:
    """ValueError unless DeepseekV3ForCausalLM represents `cfg` exactly; the message names every setting
    it cannot."""
    m, problems = cfg.moe, []
    if not cfg.mla.enabled:
        problems.append("DeepseekV3 attends with multi-head latent attention (set model.mla.kv_lora_rank)")
    if (cfg.norm, cfg.activation) != ("rmsnorm", "swiglu"):
        problems.append("DeepseekV3 is RMSNorm + SwiGLU (model.norm = 'rmsnorm', model.activation = 'swiglu')")
    if m.enabled:
        if m.router != "sigmoid":
            problems.append("DeepseekV3 routes with sigmoid scores (model.moe.router = 'sigmoid')")
        if m.every != 1:
            problems.append("DeepseekV3's MoE blocks are all blocks after the first dense ones (model.moe.every = 1)")
        if m.shared_experts < 1:
            problems.append("DeepseekV3's MoE blocks have shared experts (model.moe.shared_experts >= 1)")
        if m.shared_gate:
            problems.append("DeepseekV3's shared experts are not gated (model.moe.shared_gate = false)")
    if problems:
        raise ValueError(f"cannot be represented by {ARCH}: " + "; ".join(problems) + ".")


def deepseek_hf_config(cfg: ModelConfig, eos_id: int | None = None, bos_id: int | None = None,
                       pad_id: int | None = None):
    """The transformers DeepseekV3Config equivalent to `cfg` (ValueError where none is)."""
    import transformers

    check_deepseek(cfg)
    m, mla = cfg.moe, cfg.mla
    moe = dict(n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.expert_hidden or
               cfg.ffn_dim, n_shared_experts=m.shared_experts, routed_scaling_factor=m.route_scale,
               norm_topk_prob=m.renormalize, n_group=m.n_groups, topk_group=m.topk_groups,
               first_k_dense_replace=m.first_dense) if m.enabled else \
        dict(n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=cfg.n_layers)
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads, kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=mla.q_lora_rank or None, qk_rope_head_dim=mla.qk_rope_head_dim, qk_nope_head_dim=mla.qk_nope_head_dim,
        v_head_dim=mla.v_head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        hidden_act="silu", tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
        attention_dropout=cfg.dropout, rope_interleave=True, num_nextn_predict_layers=cfg.mtp_depth,
        eos_token_id=eos_id, bos_token_id=bos_id, pad_token_id=pad_id, architectures=[ARCH],
        **hf_rope_keys(cfg), **moe)


def model_config_from_deepseek(hf: dict, source: str, mtp_layers: int | None = None) -> ModelConfig:
    """The lmforge ModelConfig of a DeepSeek-V3 config.json dict (`mtp_layers`: the MTP layers its
    weights hold, at most num_nextn_predict_layers; None = that number), or ValueError."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act = {hf['hidden_act']!r}; lmforge's SwiGLU uses 'silu'.")
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias = true is not supported (lmforge's MLA has no biases).")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") not in ("noaux_tc",):
        raise ValueError(f"{source}: scoring_func = {hf.get('scoring_func')!r} / topk_method = "
                         f"{hf.get('topk_method')!r}; lmforge routes DeepSeek-V3's way (sigmoid, noaux_tc).")
    n, first = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{source}: moe_layer_freq = {hf['moe_layer_freq']} is not supported (every block from "
                         f"first_k_dense_replace on is MoE in lmforge's DeepSeek-V3).")
    depth = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    moe = MoEConfig() if first >= n else MoEConfig(
        num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], expert_hidden=hf["moe_intermediate_size"],
        shared_experts=hf["n_shared_experts"], first_dense=first, router="sigmoid",
        renormalize=bool(hf.get("norm_topk_prob", True)), route_scale=float(hf.get("routed_scaling_factor", 1.0)),
        n_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1, aux_loss_coef=0.0,
        seq_aux_loss_coef=1e-4, bias_update_rate=1e-3)
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n, n_heads=hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 4096), pos_emb="rope",
        norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0, **rope_from_hf(hf, source),
        mla=MLAConfig(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank") or 0,
                      qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                      v_head_dim=hf["v_head_dim"]),
        moe=moe, mtp_depth=depth if mtp_layers is None else min(depth, mtp_layers))


def mtp_layers_present(hf: dict, keys) -> int:
    """How many of a DeepSeek-V3 folder's MTP layers (num_hidden_layers, +1, ...) its weights hold."""
    n, depth = hf["num_hidden_layers"], 0
    while any(k.startswith(f"model.layers.{n + depth}.") for k in keys):
        depth += 1
    return depth


# --------------------------------------------------------------------------------------------
# the weight names
# --------------------------------------------------------------------------------------------


def rope_rows(cfg: ModelConfig, rows: int, per: int, offset: int) -> torch.Tensor:
    """For a weight of `rows` rows in blocks of `per` (a head, or the whole K/V latent projection) whose
    RoPE rows start at `offset` in each block: lmforge's row r is DeepSeek's row `perm[r]` (the RoPE
    part's half-split order is DeepSeek's even rows, then its odd rows)."""
    d = cfg.mla.qk_rope_head_dim
    within = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    perm = torch.arange(rows)
    for start in range(0, rows, per):
        perm[start + offset:start + offset + d] = start + offset + within
    return perm


def _attention(cfg: ModelConfig) -> dict[str, tuple[str, torch.Tensor | None]]:
    """lmforge attention name (after `attn.`) -> (DeepSeek's after `self_attn.`, the row permutation or None)."""
    m, heads = cfg.mla, cfg.n_heads
    q_rows = rope_rows(cfg, heads * m.qk_head_dim, m.qk_head_dim, m.qk_nope_head_dim)
    out = {"wkv_a": ("kv_a_proj_with_mqa", rope_rows(cfg, m.kv_lora_rank + m.qk_rope_head_dim,
                                                     m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank)),
           "kv_norm": ("kv_a_layernorm", None), "wkv_b": ("kv_b_proj", None), "wo": ("o_proj", None)}
    if m.q_lora_rank:
        out.update({"wq_a": ("q_a_proj", None), "q_norm": ("q_a_layernorm", None), "wq_b": ("q_b_proj", q_rows)})
    else:
        out["wq"] = ("q_proj", q_rows)
    return out


@dataclass(frozen=True)
class Entry:
    """One lmforge tensor's place in a DeepSeek folder: the stored name, a row permutation of it (RoPE),
    or, for stacked experts, the per-expert names (each stored transposed)."""

    hf: str | None = None
    perm: torch.Tensor | None = None
    experts: tuple[str, ...] = ()


def weight_map(cfg: ModelConfig) -> dict[str, Entry]:
    """lmforge name -> where it lies in DeepSeek's layout (module docstring), every tensor of `cfg`'s
    model: its parameters and the MoE blocks' `expert_bias` buffers."""
    out = {"tok_emb.weight": Entry("model.embed_tokens.weight"), "norm.weight": Entry("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = Entry("lm_head.weight")
    attention = _attention(cfg)

    def block(ours: str, theirs: str, layer: int) -> None:
        out[f"{ours}attn_norm.weight"] = Entry(f"{theirs}input_layernorm.weight")
        out[f"{ours}mlp_norm.weight"] = Entry(f"{theirs}post_attention_layernorm.weight")
        for name, (hf, perm) in attention.items():
            out[f"{ours}attn.{name}.weight"] = Entry(f"{theirs}self_attn.{hf}.weight", perm)
        if not cfg.moe.is_moe_layer(layer):
            for name in ("gate", "up", "down"):
                out[f"{ours}mlp.{name}.weight"] = Entry(f"{theirs}mlp.{name}_proj.weight")
            return
        out[f"{ours}mlp.router.weight"] = Entry(f"{theirs}mlp.gate.weight")
        out[f"{ours}mlp.expert_bias"] = Entry(f"{theirs}mlp.gate.e_score_correction_bias")
        for name in ("gate", "up", "down"):
            out[f"{ours}mlp.experts.w_{name}"] = Entry(experts=tuple(
                f"{theirs}mlp.experts.{j}.{name}_proj.weight" for j in range(cfg.moe.num_experts)))
            out[f"{ours}mlp.shared.{name}.weight"] = Entry(f"{theirs}mlp.shared_experts.{name}_proj.weight")

    for i in range(cfg.n_layers):
        block(f"blocks.{i}.", f"model.layers.{i}.", i)
    for k in range(cfg.mtp_depth):
        ours, theirs = f"mtp.{k}.", f"model.layers.{cfg.n_layers + k}."
        block(f"{ours}block.", theirs, cfg.n_layers + k)
        for name, hf in (("emb_norm.weight", "enorm.weight"), ("hidden_norm.weight", "hnorm.weight"),
                         ("proj.weight", "eh_proj.weight"), ("norm.weight", "shared_head.norm.weight")):
            out[ours + name] = Entry(theirs + hf)
    return out


def mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """DeepSeek's name -> lmforge's, of the MTP layers' own copies of the embedding and the head."""
    head = "tok_emb.weight" if cfg.tie_embeddings else "lm_head.weight"
    out = {}
    for k in range(cfg.mtp_depth):
        theirs = f"model.layers.{cfg.n_layers + k}."
        out.update({f"{theirs}embed_tokens.weight": "tok_emb.weight", f"{theirs}shared_head.head.weight": head})
    return out


# --------------------------------------------------------------------------------------------
# export and import
# --------------------------------------------------------------------------------------------


def deepseek_tensors(cfg: ModelConfig, get: Callable[[str], torch.Tensor],
                     has: Callable[[str], bool]) -> dict[str, Callable[[], torch.Tensor]]:
    """DeepSeek's name -> a function making that tensor from lmforge's (`get(name)`; `has(name)`), in the
    order to write them; nothing is read until a function is called (lmforge.interop.hf's writer). An
    expert's tensor reads its stacked weight once for all experts (the last one read is kept)."""
    last: dict[str, torch.Tensor] = {}

    def stacked(name: str) -> torch.Tensor:
        if name not in last:
            last.clear()
            last[name] = get(name)
        return last[name]

    def rows(name: str, perm: torch.Tensor) -> torch.Tensor:
        return get(name)[torch.argsort(perm)]  # (DeepSeek's row perm[r] is lmforge's row r)

    def bias(name: str) -> torch.Tensor:  # (zero until the auxiliary-loss-free update moves it)
        if has(name):
            return get(name)
        return torch.zeros(cfg.moe.num_experts, dtype=get("tok_emb.weight").dtype,
                           device=get("tok_emb.weight").device)

    out: dict[str, Callable[[], torch.Tensor]] = {}
    for ours, entry in weight_map(cfg).items():
        if entry.experts:
            for j, theirs in enumerate(entry.experts):
                out[theirs] = lambda n=ours, j=j: stacked(n)[j].t()
        elif ours.endswith("expert_bias"):
            out[entry.hf] = functools.partial(bias, ours)
        elif entry.perm is not None:
            out[entry.hf] = functools.partial(rows, ours, entry.perm)
        else:
            out[entry.hf] = functools.partial(get, ours)
    for theirs, ours in mtp_copies(cfg).items():
        out[theirs] = functools.partial(get, ours)
    return out


@dataclass(frozen=True)
class PermutedRowsRef:
    """A tensor whose rows are a permutation of a stored one's (RoPE rows: `rope_rows`)."""

    ref: object
    perm: torch.Tensor

    def read(self, shape, index, name: str = "") -> torch.Tensor:
        rows = torch.arange(shape[0]) if index[0] is None else index[0].to(torch.int64)
        want = self.perm[rows]
        order = torch.argsort(want)
        got = self.ref.read(shape, (want[order], *index[1:]), name)
        return got[torch.argsort(order)]


@dataclass(frozen=True)
class StackedExpertsRef:
    """lmforge's stacked expert weight (experts, in, out) from one stored (out, in) tensor per expert:
    a rank reads only its own experts' (expert parallelism) and their slices."""

    refs: tuple

    def read(self, shape, index, name: str = "") -> torch.Tensor:
        experts = range(shape[0]) if index[0] is None else index[0].tolist()
        return torch.stack([self.refs[j].read(shape[1:], index[1:], name) for j in experts])


def deepseek_refs(cfg: ModelConfig, ref: Callable[..., object], interleaved: bool = True) -> dict[str, object]:
    """lmforge name -> where to read it in a DeepSeek folder (`ref(key, transpose=False)`: the stored
    tensor's ref; `interleaved`: the folder's rope_interleave)."""
    out = {}
    for ours, entry in weight_map(cfg).items():
        if entry.experts:
            out[ours] = StackedExpertsRef(tuple(ref(theirs, transpose=True) for theirs in entry.experts))
        elif entry.perm is not None and interleaved:
            out[ours] = PermutedRowsRef(ref(entry.hf), entry.perm)
        else:
            out[ours] = ref(entry.hf)
    return out


__all__ = ["ARCH", "MODEL_TYPE", "check_deepseek", "deepseek_hf_config", "deepseek_refs", "deepseek_tensors",
           "model_config_from_deepseek", "mtp_layers_present", "weight_map"]
