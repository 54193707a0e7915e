"""The model's parameter tensors from its config (no torch): names, shapes, where they live, how
TP / EP split them and how FSDP2 chunks them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lmforge.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of the model: name (as in `named_parameters`), shape, where it lives
    (stage "first"/"last"/"block"), its block index, how TP splits it (None, 0 or 1)."""

    name: str
    shape: tuple[int, ...]
    where: str
    layer: int = -1
    tp_dim: int | None = None
    is_embedding: bool = False
    matmul: bool = False          # an input of a Linear (weight or bias): the step casts it to 16-bit
    expert: bool = False          # routed experts (MoE; experts along dim 0): split over layout.ep
    whole: bool = False           # left whole by FSDP2 (a tied weight that a V's two stage chunks share)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_SPEC_CACHE: dict[tuple, tuple[ParamSpec, ...]] = {}
_TOTAL_CACHE: dict[tuple, int] = {}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_PLAIN = (int, float, str, bool, type(None))


def cfg_key(cfg) -> tuple:
    """A hashable key of a model config (for the planner's caches; nested sections such as model.moe
    as tuples too). A search computes it ~90,000 times: the field names are looked up once per class,
    and plain values are taken as they are (dataclasses.fields / is_dataclass per value took half of
    a long-context search's time)."""
    names = _FIELD_NAMES.get(type(cfg))
    if names is None:
        names = _FIELD_NAMES[type(cfg)] = tuple(f.name for f in dataclasses.fields(cfg))
    key = []
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, list):  # (model.layer_types)
            v = tuple(v)
        elif not isinstance(v, _PLAIN) and dataclasses.is_dataclass(v):
            v = cfg_key(v)
        key.append(v)
    return tuple(key)


def total_params(cfg: ModelConfig) -> int:
    """Unique parameters (tied embedding once), from the config."""
    key = cfg_key(cfg)
    if key not in _TOTAL_CACHE:
        _TOTAL_CACHE[key] = sum(s.numel for s in param_specs(cfg))
    return _TOTAL_CACHE[key]


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """The model's parameter tensors, in `named_parameters()` order, tied embeddings once."""
    key = cfg_key(cfg)
    if key not in _SPEC_CACHE:
        if len(_SPEC_CACHE) > 64:
            _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = tuple(_param_specs(cfg))
    return list(_SPEC_CACHE[key])


def _param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    d, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
    out: list[ParamSpec] = [ParamSpec("tok_emb.weight", (cfg.vocab_size, d), "first", tp_dim=0, is_embedding=True)]
    if cfg.pos_emb == "learned":
        out.append(ParamSpec("pos_emb.weight", (cfg.max_seq_len, d), "first", is_embedding=True))

    def norm(prefix: str, where: str, layer: int = -1) -> list[ParamSpec]:
        specs = [ParamSpec(f"{prefix}.weight", (d,), where, layer)]
        if cfg.norm == "layernorm" and cfg.bias:
            specs.append(ParamSpec(f"{prefix}.bias", (d,), where, layer))
        return specs

    def linear(prefix: str, n_in: int, n_out: int, tp_dim: int | None, layer: int, bias: bool | None = None,
               where: str = "block") -> list[ParamSpec]:
        specs = [ParamSpec(f"{prefix}.weight", (n_out, n_in), where, layer, tp_dim, matmul=True)]
        if cfg.bias if bias is None else bias:
            specs.append(ParamSpec(f"{prefix}.bias", (n_out,), where, layer, 0 if tp_dim == 0 else None,
                                   matmul=True))
        return specs

    def attention(p: str, i: int, where: str) -> list[ParamSpec]:
        if cfg.is_linear_layer(i):  # Gated DeltaNet (lmforge.model.gated_deltanet): TP splits its heads
            hk, hv, dk, dv = cfg.deltanet_shape
            kernel = cfg.deltanet.conv_kernel
            out = []
            for name, width in (("in_q", hk * dk), ("in_k", hk * dk), ("in_v", hv * dv), ("in_z", hv * dv),
                                ("in_b", hv), ("in_a", hv)):
                out += linear(f"{p}.attn.{name}", d, width, 0, i, False, where)
            out += [ParamSpec(f"{p}.attn.conv_{n}.weight", (width, 1, kernel), where, i, 0)
                    for n, width in (("q", hk * dk), ("k", hk * dk), ("v", hv * dv))]
            out += [ParamSpec(f"{p}.attn.{n}", (hv,), where, i, 0) for n in ("A_log", "dt_bias")]
            out.append(ParamSpec(f"{p}.attn.norm.weight", (dv,), where, i))  # (replicated: shared by the heads)
            return out + linear(f"{p}.attn.wo", hv * dv, d, 1, i, False, where)
        if cfg.mla.enabled:  # lmforge.model.mla: up-projections split by heads, latent ones replicated
            m, heads, out = cfg.mla, cfg.n_heads, []
            if m.q_lora_rank:
                out += linear(f"{p}.attn.wq_a", d, m.q_lora_rank, None, i, False, where)
                out.append(ParamSpec(f"{p}.attn.q_norm.weight", (m.q_lora_rank,), where, i))
                out += linear(f"{p}.attn.wq_b", m.q_lora_rank, heads * m.qk_head_dim, 0, i, False, where)
            else:
                out += linear(f"{p}.attn.wq", d, heads * m.qk_head_dim, 0, i, False, where)
            out += linear(f"{p}.attn.wkv_a", d, m.kv_lora_rank + m.qk_rope_head_dim, None, i, False, where)
            out.append(ParamSpec(f"{p}.attn.kv_norm.weight", (m.kv_lora_rank,), where, i))
            out += linear(f"{p}.attn.wkv_b", m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), 0, i, False,
                          where)
            return out + linear(f"{p}.attn.wo", heads * m.v_head_dim, d, 1, i, False, where)
        if cfg.fused_qkv:  # one attn.wqkv (lmforge.model.layers.qkv_layout), column-split like the three
            out = linear(f"{p}.attn.wqkv", d, (cfg.n_heads + 2 * cfg.kv_heads) * hd, 0, i, cfg.attn_qkv_bias, where)
        else:
            out = linear(f"{p}.attn.wq", d, cfg.n_heads * hd, 0, i, cfg.attn_qkv_bias, where)
            out += linear(f"{p}.attn.wk", d, cfg.kv_heads * hd, 0, i, cfg.attn_qkv_bias, where)
            out += linear(f"{p}.attn.wv", d, cfg.kv_heads * hd, 0, i, cfg.attn_qkv_bias, where)
        if cfg.attn_gate:  # (model.attn_gate: q's shape, column-split by heads like q)
            out += linear(f"{p}.attn.wg", d, cfg.n_heads * hd, 0, i, cfg.attn_qkv_bias, where)
        out += linear(f"{p}.attn.wo", cfg.n_heads * hd, d, 1, i, where=where)
        if cfg.qk_norm:  # (head_dim each, replicated under TP; model.qk_norm_scope = "projection": q's and k's widths)
            out += [ParamSpec(f"{p}.attn.{n}.weight", (w,), where, i)
                    for n, w in zip(("q_norm", "k_norm"), cfg.qk_norm_widths)]
        return out

    def block(p: str, i: int, where: str = "block") -> list[ParamSpec]:
        # (model.norm_placement: input norms unless "post", output norms unless "pre")
        pre, post = cfg.norm_placement != "post", cfg.norm_placement != "pre"
        out = [*(norm(f"{p}.attn_norm", where, i) if pre else []), *attention(p, i, where),
               *(norm(f"{p}.attn_post_norm", where, i) if post else []), *(norm(f"{p}.mlp_norm", where, i) if pre else [])]
        if cfg.moe.is_moe_layer(i):  # lmforge.model.moe: router, stacked experts, shared experts; no TP split
            m, he = cfg.moe, cfg.moe.expert_hidden or f
            out.append(ParamSpec(f"{p}.mlp.router.weight", (m.num_experts, d), where, i, matmul=True))
            for name, shape in (("w_gate", (d, he)), ("w_up", (d, he)), ("w_down", (he, d))):
                out.append(ParamSpec(f"{p}.mlp.experts.{name}", (m.num_experts, *shape), where, i, matmul=True,
                                     expert=True))
            if m.shared_experts:
                hs = m.shared_experts * he
                out += [ParamSpec(f"{p}.mlp.shared.{n}.weight", sh, where, i, matmul=True)
                        for n, sh in (("gate", (hs, d)), ("up", (hs, d)), ("down", (d, hs)))]
                if m.shared_gate:  # (Qwen3-Next's per-token gate on the shared experts)
                    out.append(ParamSpec(f"{p}.mlp.shared_gate.weight", (1, d), where, i, matmul=True))
        elif cfg.gated_mlp:
            out += linear(f"{p}.mlp.gate", d, f, 0, i, where=where)
            out += linear(f"{p}.mlp.up", d, f, 0, i, where=where)
            out += linear(f"{p}.mlp.down", f, d, 1, i, where=where)
        else:
            out += linear(f"{p}.mlp.fc", d, f, 0, i, where=where)
            out += linear(f"{p}.mlp.proj", f, d, 1, i, where=where)
        return out + (norm(f"{p}.mlp_post_norm", where, i) if post else [])

    for i in range(cfg.n_layers):
        out += block(f"blocks.{i}", i)
    out += norm("norm", "last")
    if not cfg.tie_embeddings:
        out.append(ParamSpec("lm_head.weight", (cfg.vocab_size, d), "last", tp_dim=0, matmul=True))
    for k in range(cfg.mtp_depth):  # multi-token prediction (lmforge.model.mtp): beside the head, on the last stage
        i, p = cfg.n_layers + k, f"mtp.{k}"
        out += norm(f"{p}.emb_norm", "last", i) + norm(f"{p}.hidden_norm", "last", i)
        out += linear(f"{p}.proj", 2 * d, d, None, i, False, "last")
        out += block(f"{p}.block", i, "last") + norm(f"{p}.norm", "last", i)
    return out


_STAGE_CACHE: dict[tuple, tuple[ParamSpec, ...]] = {}


def stage_specs(cfg: ModelConfig, pp: int, stage: int, last_rank: int | None = None) -> list[ParamSpec]:
    """Parameters held by pipeline rank `stage` of `pp`: its share of the blocks (n_layers / pp,
    counted as a contiguous range), the embedding on rank 0 and the final norm and head on
    `last_rank` (default pp - 1; rank 0 under a V-shaped schedule, lmforge.spec.parallel.V_SHAPED);
    a tied head copied there (in a V rank 0 holds the one weight, whole under FSDP2)."""
    last = pp - 1 if last_rank is None else last_rank
    key = (cfg_key(cfg), pp, stage, last)
    if key not in _STAGE_CACHE:
        if len(_STAGE_CACHE) > 1024:
            _STAGE_CACHE.clear()
        _STAGE_CACHE[key] = tuple(_stage_specs(cfg, pp, stage, last))
    return list(_STAGE_CACHE[key])


def _stage_specs(cfg: ModelConfig, pp: int, stage: int, last: int) -> list[ParamSpec]:
    per = cfg.n_layers // pp
    lo, hi = stage * per, (stage + 1) * per
    specs = []
    for s in param_specs(cfg):
        if s.where == "block" and lo <= s.layer < hi:
            specs.append(s)
        elif s.where == "first" and stage == 0:
            specs.append(s)
        elif s.where == "last" and stage == last:
            specs.append(s)
    if cfg.tie_embeddings and pp > 1 and stage == last:
        if last != 0:  # the last stage's own copy of the tied embedding (its gradient summed with the first's)
            specs.append(ParamSpec("lm_head.weight", (cfg.vocab_size, cfg.dim), "last", tp_dim=0, is_embedding=True,
                                   matmul=True))
        else:  # a V: rank 0 holds both stages and the one weight, which FSDP2 leaves whole (two stage chunks use it)
            specs = [dataclasses.replace(s, whole=True) if s.name == "tok_emb.weight" else s for s in specs]
    return specs


def tp_shape(spec: ParamSpec, tp: int, ep: int = 1) -> tuple[int, ...]:
    """A rank's part of `spec` under TP degree `tp` (and, for routed experts, EP degree `ep`)."""
    if spec.expert and ep > 1:
        return (math.ceil(spec.shape[0] / ep), *spec.shape[1:])
    if tp == 1 or spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] = math.ceil(shape[spec.tp_dim] / tp)
    return tuple(shape)


def fsdp_shard_shape(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The padded per-rank shard of FSDP2 `fully_shard`: dim 0 chunked into ceil(dim0/n) rows."""
    if n == 1:
        return shape
    return (math.ceil(shape[0] / n), *shape[1:])


def is_hidden_matrix(spec: ParamSpec) -> bool:
    """A matrix that optimizers with a rule of their own for hidden matrices (Muon) treat as one:
    2-D, not an embedding, not the output head (lmforge.optim.muon's grouping)."""
    return len(spec.shape) >= 2 and not spec.is_embedding and "lm_head" not in spec.name
