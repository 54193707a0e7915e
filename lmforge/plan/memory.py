"""Memory per GPU for a model config, an optimizer and a parallel layout.

Two conventions, chosen with `weights=`:

``"megatron"`` (the literature; Rajbhandari et al. 2020, Korthikanti et al. 2022)
    Mixed precision (bf16/fp16/fp8) keeps a 16-bit copy of the weights (2 B/param), 16-bit
    gradients (2), and fp32 master weights (4) plus the optimizer state in fp32 (Adam/AdamW: m
    and v, 8): mixed-precision Adam = 2 + 2 + 12 = 16 bytes/param. fp32 training: 4 + 4 + 8.
    ZeRO with N data-parallel ranks shards flat buffers exactly (numel/N):
    ZeRO-1 (optimizer + master) 4 + 12/N, ZeRO-2 (+ gradients) 2 + 14/N, ZeRO-3 (+ weights) 16/N.
    Activations per layer, 16-bit, with dropout masks (s seq, b micro-batch, h hidden, a heads,
    t TP): sbh(34 + 5as/h); with TP sbh(10 + 24/t + 5as/(ht)); with TP+SP (sbh/t)(34 + 5as/h);
    selective recompute drops the 5as/h term; full recompute keeps the layer input, 2sbh
    (2sbh/t with SP).

``"lmforge"`` (what lmforge allocates today, modelled exactly for the tests)
    Parameters are fp32 and are the master weights (4 B/param, no 16-bit copy), gradients are
    fp32 (4), optimizer state is whatever `lmforge.optim` keeps per tensor (AdamW: m, v fp32 plus
    a 4-byte `step` tensor per parameter tensor). bf16/fp16 is autocast: each matmul weight is
    cast once per forward and that 2-byte copy is held for backward (reported under buffers).
    ZeRO shards like FSDP2's `fully_shard`: each tensor is chunked along dim 0 into N pieces of
    ceil(dim0/N) rows (padded), so the worst rank holds ceil(dim0/N) x (other dims) elements.
    Activations are counted tensor by tensor from what autograd saves under bf16 autocast with
    `scaled_dot_product_attention` (no s^2 term, no dropout): per layer
    sbh(8 [fp32 inputs of the two norms] + 6 [16-bit copies fed to q/k/v] + 4 + 4r [q, k, v,
    attention output] + 8 if RMSNorm [its fp32 outputs] + 2 if RoPE [wo input copy] + MLP),
    MLP = 8f/h + 4 (SwiGLU) or 4f/h + 2 (GELU), r = kv_heads/heads, plus norm statistics and the
    attention log-sum-exp (4bas); full recompute keeps the fp32 block input, 4sbh. Outside the
    blocks: token ids, the final norm, and the fp32 log-softmax of the logits (4sbV). These are
    byte-exact against autograd's saved tensors on CPU (tests); CUDA kernels may differ slightly
    (benchmarks/plan_activation_check.py measures it).

Common to both: tied embeddings count once (a pipeline's last stage keeps its own copy of a
tied embedding, as Megatron does); TP shards q/k/v/gate/up/fc by rows (dim 0, biases too),
wo/down/proj by columns (dim 1, bias replicated), the embedding and output head by vocabulary
rows, and replicates norms and a learned position table. PP puts the embedding on stage 0 and
the final norm + head on the last stage; the report is for the worst stage. In flight on stage 0:
GPipe all m micro-batches, 1F1B min(p, m), interleaved 1F1B p(1 + (p-1)/(pv)) micro-batches of
its layers. CPU offload moves master weights and optimizer states (and, with ZeRO-3, the
sharded weights and gradients, as FSDP2's CPUOffloadPolicy does) to host memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lmforge.config import ModelConfig
from lmforge.optim.state_memory import OPTIMIZER_NAMES, optimizer_state_bytes_per_param

AC_MODES = ("none", "full", "every_k", "selective")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
CONVENTIONS = ("megatron", "lmforge")
COMPONENTS = ("weights", "gradients", "master_weights", "optimizer_states", "activations", "buffers")

# Optimizer spelling accepted by the planner -> lmforge.optim name.
_OPT_ALIASES = {"8bit-adam": "adam8bit", "adam-8bit": "adam8bit", "adamw8bit": "adam8bit", "sgdm": "momentum"}


def normalise_optimizer(name: str) -> str:
    key = name.strip().lower()
    key = _OPT_ALIASES.get(key, key)
    if key not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_NAMES)}")
    return key


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """A parallel layout. world size = dp x tp x pp; global batch = micro_batch x grad_accum x dp
    sequences (with pipelining, grad_accum is the number of micro-batches m per step)."""

    dp: int = 1
    zero: int = 0                 # 0 = DDP (replicated), 1, 2, 3 (= FSDP full sharding)
    tp: int = 1
    sp: bool = False              # sequence parallelism (with tp > 1)
    pp: int = 1
    pp_schedule: str = "1f1b"     # gpipe | 1f1b | interleaved
    virtual_stages: int = 1       # interleaved: model chunks per pipeline rank (v)
    micro_batch: int = 1
    grad_accum: int = 1
    ac: str = "none"              # none | full | every_k | selective
    ac_every: int = 2
    cpu_offload: bool = False
    precision: str = "bf16"       # bf16 | fp16 | fp32 | fp8

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def validate(self, model_cfg: ModelConfig | None = None) -> "Layout":
        for key in ("dp", "tp", "pp", "virtual_stages", "micro_batch", "grad_accum", "ac_every"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {key} = {value!r} must be an integer >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"layout zero = {self.zero!r} must be 0, 1, 2 or 3")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"layout pp_schedule = {self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        if self.ac not in AC_MODES:
            raise ValueError(f"layout ac = {self.ac!r} is not one of {', '.join(AC_MODES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"layout precision = {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.virtual_stages > 1 and self.pp_schedule != "interleaved":
            raise ValueError(f"layout virtual_stages = {self.virtual_stages} needs pp_schedule = interleaved")
        if model_cfg is not None:
            if model_cfg.n_heads % self.tp or model_cfg.kv_heads % self.tp:
                raise ValueError(f"layout tp = {self.tp} must divide n_heads = {model_cfg.n_heads} "
                                 f"and kv heads = {model_cfg.kv_heads}")
            if model_cfg.n_layers % (self.pp * self.virtual_stages):
                raise ValueError(f"layout pp = {self.pp} (x virtual stages {self.virtual_stages}) must divide "
                                 f"n_layers = {model_cfg.n_layers}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def short(self) -> str:
        s = f"dp={self.dp},zero={self.zero},tp={self.tp},pp={self.pp},mb={self.micro_batch},ga={self.grad_accum},ac={self.ac}"
        if self.sp:
            s += ",sp=1"
        if self.pp > 1:
            s += f",sched={self.pp_schedule}"
            if self.virtual_stages > 1:
                s += f",v={self.virtual_stages}"
        if self.cpu_offload:
            s += ",offload=1"
        return s

    _KEYS = {"dp": "dp", "zero": "zero", "tp": "tp", "sp": "sp", "pp": "pp", "sched": "pp_schedule",
             "pp_schedule": "pp_schedule", "schedule": "pp_schedule", "v": "virtual_stages",
             "virtual_stages": "virtual_stages", "mb": "micro_batch", "micro_batch": "micro_batch",
             "ga": "grad_accum", "grad_accum": "grad_accum", "m": "grad_accum", "ac": "ac",
             "ac_every": "ac_every", "offload": "cpu_offload", "cpu_offload": "cpu_offload",
             "precision": "precision", "dtype": "precision"}

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> "Layout":
        """Parse "dp=8,zero=3,tp=1,pp=1,mb=1,ac=full" (keys: dp zero tp sp pp sched v mb ga ac
        ac_every offload precision); unknown keys or bad values raise ValueError naming them."""
        kw: dict[str, Any] = dict(defaults)
        for item in filter(None, (p.strip() for p in (text or "").split(","))):
            if "=" not in item:
                raise ValueError(f"layout item {item!r} must be key=value (e.g. dp=8)")
            key, value = (s.strip() for s in item.split("=", 1))
            field_name = cls._KEYS.get(key.lower())
            if field_name is None:
                raise ValueError(f"unknown layout key {key!r}; valid: {', '.join(sorted(set(cls._KEYS)))}")
            if field_name in ("sp", "cpu_offload"):
                if value.lower() not in ("0", "1", "true", "false", "yes", "no"):
                    raise ValueError(f"layout {key} = {value!r} must be 0/1/true/false")
                kw[field_name] = value.lower() in ("1", "true", "yes")
            elif field_name in ("pp_schedule", "ac", "precision"):
                kw[field_name] = value.lower()
            else:
                try:
                    kw[field_name] = int(value)
                except ValueError:
                    raise ValueError(f"layout {key} = {value!r} must be an integer") from None
        return cls(**kw).validate()


# --------------------------------------------------------------------------------------------
# Parameter tensors from the config (no torch)
# --------------------------------------------------------------------------------------------


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
    matmul: bool = False          # a Linear weight: its 16-bit autocast copy is saved for backward

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_SPEC_CACHE: dict[tuple, tuple[ParamSpec, ...]] = {}
_TOTAL_CACHE: dict[tuple, int] = {}


def cfg_key(cfg: ModelConfig) -> tuple:
    """A hashable key of a model config (for the planner's caches)."""
    return tuple(getattr(cfg, f.name) for f in dataclasses.fields(cfg))


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

    def linear(prefix: str, n_in: int, n_out: int, tp_dim: int, layer: int) -> list[ParamSpec]:
        specs = [ParamSpec(f"{prefix}.weight", (n_out, n_in), "block", layer, tp_dim, matmul=True)]
        if cfg.bias:
            specs.append(ParamSpec(f"{prefix}.bias", (n_out,), "block", layer, 0 if tp_dim == 0 else None))
        return specs

    for i in range(cfg.n_layers):
        p = f"blocks.{i}"
        out += norm(f"{p}.attn_norm", "block", i)
        out += linear(f"{p}.attn.wq", d, cfg.n_heads * hd, 0, i)
        out += linear(f"{p}.attn.wk", d, cfg.kv_heads * hd, 0, i)
        out += linear(f"{p}.attn.wv", d, cfg.kv_heads * hd, 0, i)
        out += linear(f"{p}.attn.wo", cfg.n_heads * hd, d, 1, i)
        out += norm(f"{p}.mlp_norm", "block", i)
        if cfg.activation == "swiglu":
            out += linear(f"{p}.mlp.gate", d, f, 0, i)
            out += linear(f"{p}.mlp.up", d, f, 0, i)
            out += linear(f"{p}.mlp.down", f, d, 1, i)
        else:
            out += linear(f"{p}.mlp.fc", d, f, 0, i)
            out += linear(f"{p}.mlp.proj", f, d, 1, i)
    out += norm("norm", "last")
    if not cfg.tie_embeddings:
        out.append(ParamSpec("lm_head.weight", (cfg.vocab_size, d), "last", tp_dim=0, matmul=True))
    return out


_STAGE_CACHE: dict[tuple, tuple[ParamSpec, ...]] = {}


def stage_specs(cfg: ModelConfig, pp: int, stage: int) -> list[ParamSpec]:
    """Parameters held by pipeline `stage` of `pp` (contiguous blocks; tied head copied to the last)."""
    key = (cfg_key(cfg), pp, stage)
    if key not in _STAGE_CACHE:
        if len(_STAGE_CACHE) > 1024:
            _STAGE_CACHE.clear()
        _STAGE_CACHE[key] = tuple(_stage_specs(cfg, pp, stage))
    return list(_STAGE_CACHE[key])


def _stage_specs(cfg: ModelConfig, pp: int, stage: int) -> list[ParamSpec]:
    per = cfg.n_layers // pp
    lo, hi = stage * per, (stage + 1) * per
    specs = []
    for s in param_specs(cfg):
        if s.where == "block" and lo <= s.layer < hi:
            specs.append(s)
        elif s.where == "first" and stage == 0:
            specs.append(s)
        elif s.where == "last" and stage == pp - 1:
            specs.append(s)
    if cfg.tie_embeddings and stage == pp - 1:
        head = ParamSpec("lm_head.weight", (cfg.vocab_size, cfg.dim), "last", tp_dim=0, is_embedding=True, matmul=True)
        if pp > 1:
            specs.append(head)  # the last stage's own copy of the tied embedding
    return specs


def tp_shape(spec: ParamSpec, tp: int) -> tuple[int, ...]:
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


# --------------------------------------------------------------------------------------------
# Optimizer state per tensor
# --------------------------------------------------------------------------------------------


def _uses_muon(spec: ParamSpec) -> bool:
    return len(spec.shape) >= 2 and not spec.is_embedding and "lm_head" not in spec.name


def lmforge_state_bytes(optimizer: str, spec: ParamSpec, shape: tuple[int, ...], *, block_size: int = 256,
                        min_8bit_size: int = 4096) -> int:
    """Exact bytes `lmforge.optim` keeps in `optimizer.state[p]` for a fp32 tensor of `shape`
    (the element part from `optimizer_state_bytes_per_param`, plus per-tensor `step` tensors and
    8-bit block padding, as the implementations allocate them)."""
    n = math.prod(shape)
    name = normalise_optimizer(optimizer)
    if name in ("sgd", "momentum", "lion", "lamb"):  # lamb's step is a Python int
        return int(optimizer_state_bytes_per_param(name) * n)
    if name in ("adam", "adamw"):
        return int(optimizer_state_bytes_per_param(name) * n) + 4  # fp32 0-dim `step` tensor
    if name == "adafactor":
        if len(shape) >= 2:
            batch = math.prod(shape[:-2])
            return 4 * batch * (shape[-2] + shape[-1]) + 4
        return 4 * n + 4
    if name == "muon":
        if _uses_muon(spec):
            return 4 * n
        return 8 * n + 4
    assert name == "adam8bit"
    if n >= min_8bit_size:
        blocks = math.ceil(n / block_size)
        return 2 * (blocks * block_size + 4 * blocks)
    return 8 * n


def literature_state_bytes_per_param(optimizer: str, shape: tuple[int, ...] | None = None) -> float:
    """fp32 optimizer state bytes per parameter (the literature convention; no per-tensor scalars)."""
    name = normalise_optimizer(optimizer)
    if name == "adafactor":
        return optimizer_state_bytes_per_param(name, shape=shape)
    return optimizer_state_bytes_per_param(name)


def model_state_bytes_per_param(optimizer: str = "adamw", zero: int = 0, dp: int = 1, precision: str = "bf16") -> float:
    """Literature bytes/param of weights + gradients + master + optimizer state per GPU, for large
    matrices: mixed-precision Adam 2 + 2 + 12 = 16; ZeRO-1 4 + 12/N; ZeRO-2 2 + 14/N; ZeRO-3 16/N
    (N = dp). Other optimizers replace the 8 bytes of Adam's m and v by their own state."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero = {zero!r} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp = {dp} must be >= 1")
    w, g, m = (2, 2, 4) if precision != "fp32" else (4, 4, 0)
    k = m + literature_state_bytes_per_param(optimizer)
    n = dp if zero else 1
    return (w / n if zero >= 3 else w) + (g / n if zero >= 2 else g) + k / n


# --------------------------------------------------------------------------------------------
# Breakdown
# --------------------------------------------------------------------------------------------


@dataclass
class MemoryBreakdown:
    """Bytes per GPU (the worst pipeline stage) by component, and bytes kept in host memory."""

    model: str
    layout: Layout
    optimizer: str
    seq_len: int
    convention: str
    params_total: int                      # unique parameters of the model
    params_per_rank: float                 # parameters held (unsharded by ZeRO) on this rank
    stage: int
    weights: float = 0.0
    gradients: float = 0.0
    master_weights: float = 0.0
    optimizer_states: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    cpu_bytes: float = 0.0
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.master_weights + self.optimizer_states

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "convention": self.convention, "optimizer": self.optimizer,
            "seq_len": self.seq_len, "layout": self.layout.to_dict(), "stage": self.stage,
            "params_total": self.params_total, "params_per_rank": self.params_per_rank,
            "bytes": {c: getattr(self, c) for c in COMPONENTS} | {"model_states": self.model_states,
                                                                   "total": self.total, "cpu": self.cpu_bytes},
            "bytes_per_param": {c: getattr(self, c) / self.params_total for c in COMPONENTS[:4]}
            | {"model_states": self.model_states / self.params_total},
            "detail": dict(self.detail),
        }

    def table(self) -> str:
        """A table like the ones in the ZeRO / Korthikanti papers: GB and bytes/param per component."""
        n = self.params_total
        rows = [("component", "GB/GPU", "bytes/param")]
        for c in COMPONENTS:
            v = getattr(self, c)
            rows.append((c.replace("_", " "), f"{v / 1e9:,.2f}", f"{v / n:.3f}" if c in COMPONENTS[:4] else ""))
        rows.append(("model states", f"{self.model_states / 1e9:,.2f}", f"{self.model_states / n:.3f}"))
        rows.append(("TOTAL per GPU", f"{self.total / 1e9:,.2f}", ""))
        if self.cpu_bytes:
            rows.append(("host (CPU offload)", f"{self.cpu_bytes / 1e9:,.2f}", ""))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        head = (f"{self.model}: {n / 1e9:.3f}B params, {self.optimizer}, {self.layout.precision}, "
                f"seq {self.seq_len}, {self.layout.short()}, convention={self.convention}, stage {self.stage}")
        lines = [head]
        for i, r in enumerate(rows):
            lines.append(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}")
            if i == 0 or r[0] == "buffers":
                lines.append("  " + "-" * (w[0] + w[1] + w[2] + 4))
        return "\n".join(lines)


def _in_flight(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak."""
    p, m = layout.pp, layout.grad_accum
    if p == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(m)
    k = min(p - stage, m)  # 1F1B: stage i warms up with p - i forwards
    if layout.pp_schedule == "interleaved":
        return min(p * (1 + (p - 1) / (p * layout.virtual_stages)), float(m)) if stage == 0 else float(k)
    return float(k)


def activation_bytes_per_layer(cfg: ModelConfig, layout: Layout, seq_len: int, convention: str,
                               checkpointed: bool | None = None) -> float:
    """Activation bytes of one transformer layer for one micro-batch on one GPU."""
    s, b, h, a, t = seq_len, layout.micro_batch, cfg.dim, cfg.n_heads, layout.tp
    sbh = s * b * h
    ac = layout.ac if checkpointed is None else ("full" if checkpointed else "none")
    if convention == "megatron":
        sp_div = t if layout.sp else 1
        if ac == "full":
            return 2 * sbh / sp_div
        attn = 0.0 if ac == "selective" else 5 * a * s / h
        if layout.sp or t == 1:
            return sbh / t * (34 + attn)
        return sbh * (10 + 24 / t + attn / t)
    # lmforge: tensors autograd saves under bf16 autocast with SDPA (see module docstring).
    half = 4 if layout.precision == "fp32" else 2
    r = cfg.kv_heads / cfg.n_heads
    F = cfg.ffn_dim / h
    if ac == "full":
        return 4 * sbh  # the fp32 residual-stream input of the block
    norm_stats = (4 if cfg.norm == "rmsnorm" else 8) * s * b * 2
    lse = 4 * b * a * s / t
    if ac == "selective":  # outputs of the matmuls and attention, plus the block input
        mlp_out = (2 * F + 1) if cfg.activation == "swiglu" else (F + 1)
        return sbh * (4 + half * ((1 + 2 * r + 1 + 1) / t + mlp_out / t)) + lse
    resid = 8                                   # fp32 inputs of the two norms (block in, mid)
    normed = 8 if cfg.norm == "rmsnorm" else 0  # RMSNorm saves its fp32 output for the weight grad
    casts = half * (3 + (2 if cfg.activation == "swiglu" else 1))  # 16-bit copies fed to the projections
    attn = half * (1 + 2 * r + 1) / t           # q, k, v, attention output
    wo_in = half / t if cfg.pos_emb == "rope" else 0.0
    mlp = half * (4 * F if cfg.activation == "swiglu" else 2 * F) / t
    return sbh * (resid + normed + casts + attn + wo_in + mlp) + norm_stats + lse


def _extras(cfg: ModelConfig, layout: Layout, seq_len: int, convention: str, stage: int) -> dict[str, float]:
    """Activations outside the blocks: embedding output on the first stage, final norm + logits on
    the last (one micro-batch)."""
    s, b, h, V, t = seq_len, layout.micro_batch, cfg.dim, cfg.vocab_size, layout.tp
    sbh = s * b * h
    out: dict[str, float] = {}
    if convention == "megatron":
        sp_div = t if layout.sp else 1
        if stage == 0:
            out["embedding"] = sbh / sp_div  # dropout mask
        if stage == layout.pp - 1:
            out["output"] = 4 * sbh / sp_div + 4 * s * b * V / t  # final norm + head input, fp32 logits
        return out
    half = 4 if layout.precision == "fp32" else 2
    if stage == 0:
        out["embedding"] = 8 * s * b + (8 * s if cfg.pos_emb == "learned" else 0)  # int64 ids, positions
    if stage == layout.pp - 1:
        normed = 4 if cfg.norm == "rmsnorm" else 0
        stats = (4 if cfg.norm == "rmsnorm" else 8) * s * b
        out["output"] = sbh * (4 + normed + half) + stats + 4 * s * b * V / t + 4  # + fp32 log-softmax
    return out


_STATE_CACHE: dict[tuple, tuple[dict[str, float], float, float]] = {}


def _stage_states(cfg: ModelConfig, layout: Layout, opt: str, convention: str, stage: int
                  ) -> tuple[dict[str, float], float, float]:
    """(model-state bytes by component, parameters held, 16-bit autocast copies) for one stage."""
    key = (cfg_key(cfg), layout.dp if layout.zero else 1, layout.zero, layout.tp, layout.pp,
           layout.precision, opt, convention, stage)
    hit = _STATE_CACHE.get(key)
    if hit is not None:
        return dict(hit[0]), hit[1], hit[2]
    n_dp = layout.dp if layout.zero > 0 else 1
    mixed = layout.precision != "fp32"
    comp = dict.fromkeys(COMPONENTS, 0.0)
    params_here = 0.0
    cast_bytes = 0.0
    specs = stage_specs(cfg, layout.pp, stage)
    for spec in specs:
        local = tp_shape(spec, layout.tp)
        full_n = math.prod(local)
        params_here += full_n

        def sharded(component_stage: int) -> float:
            if layout.zero < component_stage or n_dp == 1:
                return float(full_n)
            if convention == "megatron":
                return full_n / n_dp
            return float(math.prod(fsdp_shard_shape(local, n_dp)))

        if convention == "megatron":
            w_b, g_b, m_b = (2, 2, 4) if mixed else (4, 4, 0)
            comp["weights"] += w_b * sharded(3)
            comp["gradients"] += g_b * sharded(2)
            comp["master_weights"] += m_b * sharded(1)
            comp["optimizer_states"] += literature_state_bytes_per_param(opt, local) * sharded(1)
        else:
            comp["weights"] += 4 * sharded(3)
            comp["gradients"] += 4 * sharded(2)
            shard_shape = fsdp_shard_shape(local, n_dp) if (layout.zero >= 1 and n_dp > 1) else local
            comp["optimizer_states"] += lmforge_state_bytes(opt, spec, shard_shape)
            if mixed and spec.matmul:
                cast_bytes += 2 * full_n
    if convention == "lmforge" and mixed and cfg.tie_embeddings and layout.pp == 1:
        # the tied head multiplies by a 16-bit cast of the embedding
        cast_bytes += 2 * math.prod(tp_shape(specs[0], layout.tp))
    if len(_STATE_CACHE) > 4096:
        _STATE_CACHE.clear()
    _STATE_CACHE[key] = (dict(comp), params_here, cast_bytes)
    return comp, params_here, cast_bytes


_SUM_CACHE: dict[tuple, float] = {}


def _cached_sum(key: tuple, fn) -> float:
    if key not in _SUM_CACHE:
        if len(_SUM_CACHE) > 4096:
            _SUM_CACHE.clear()
        _SUM_CACHE[key] = fn()
    return _SUM_CACHE[key]


class _LazySpecs:
    """stage_specs(...) built only when iterated (the sums over it are cached)."""

    def __init__(self, cfg: ModelConfig, pp: int, stage: int):
        self.args = (cfg, pp, stage)

    def __iter__(self):
        return iter(stage_specs(*self.args))


def _stage_breakdown(cfg: ModelConfig, layout: Layout, opt: str, seq_len: int, convention: str,
                     stage: int) -> tuple[dict[str, float], float, float, dict[str, float]]:
    n_dp = layout.dp if layout.zero > 0 else 1
    mixed = layout.precision != "fp32"
    detail: dict[str, float] = {}
    cpu = 0.0
    comp, params_here, cast_bytes = _stage_states(cfg, layout, opt, convention, stage)
    specs = _LazySpecs(cfg, layout.pp, stage)
    # Host offload.
    if layout.cpu_offload:
        moved = ["master_weights", "optimizer_states"] + (["weights", "gradients"] if layout.zero == 3 else [])
        for c in moved:
            cpu += comp[c]
            comp[c] = 0.0
    # Activations.
    layers = cfg.n_layers // layout.pp
    n_ckpt = 0
    if layout.ac == "full":
        n_ckpt = layers
    elif layout.ac == "every_k":
        n_ckpt = len(range(0, layers, layout.ac_every))
    if layout.ac in ("full", "every_k"):
        per_layer = (n_ckpt * activation_bytes_per_layer(cfg, layout, seq_len, convention, True)
                     + (layers - n_ckpt) * activation_bytes_per_layer(cfg, layout, seq_len, convention, False))
    else:
        per_layer = layers * activation_bytes_per_layer(cfg, layout, seq_len, convention)
    extras = _extras(cfg, layout, seq_len, convention, stage)
    in_flight = _in_flight(layout, stage)
    last_in_flight = float(layout.grad_accum) if layout.pp_schedule == "gpipe" and layout.pp > 1 else 1.0
    comp["activations"] = in_flight * (per_layer + extras.get("embedding", 0.0)) + last_in_flight * extras.get("output", 0.0)
    detail["activations_blocks"] = in_flight * per_layer
    detail["activations_outside_blocks"] = comp["activations"] - detail["activations_blocks"]
    detail["micro_batches_in_flight"] = in_flight
    # Buffers.
    if convention == "lmforge":
        # autocast's cached 16-bit weight copies, held until backward; with recompute, the block
        # weights are re-cast in backward and only the head's copy outlives the forward.
        if layout.ac in ("full", "every_k"):
            block_cast = _cached_sum(("cast", cfg_key(cfg), layout.pp, stage, layout.tp), lambda: sum(
                2 * math.prod(tp_shape(s, layout.tp)) for s in specs if s.matmul and s.where == "block"))
            frac = n_ckpt / layers if layers else 0.0
            cast_bytes -= block_cast * frac
        # autocast drops its cache when each micro-batch's forward exits, so every micro-batch
        # in flight holds its own copies
        cast_bytes *= in_flight
        detail["autocast_weight_copies"] = cast_bytes
        comp["buffers"] += cast_bytes
        if cfg.pos_emb == "rope":
            detail["rope_tables"] = 2 * cfg.max_seq_len * (cfg.head_dim // 2) * 4
            comp["buffers"] += detail["rope_tables"]
    if layout.zero == 3 and n_dp > 1:
        # all-gathered 16-bit weights of the current and the prefetched layer + one layer's
        # unsharded gradients before the reduce-scatter.
        layer_params = _cached_sum(("layer", cfg_key(cfg), layout.pp, stage, layout.tp), lambda: sum(
            math.prod(tp_shape(s, layout.tp)) for s in specs if s.where == "block" and s.layer == stage * layers))
        wb = 2 if mixed else 4
        detail["zero3_gather_buffers"] = 2 * wb * layer_params + (wb if convention == "megatron" else 4) * layer_params
        comp["buffers"] += detail["zero3_gather_buffers"]
    return comp, cpu, params_here, detail


def estimate_memory(model_cfg: ModelConfig, layout: Layout, optimizer: str = "adamw", seq_len: int | None = None,
                    weights: str = "megatron", model_name: str = "model") -> MemoryBreakdown:
    """Bytes per GPU for `model_cfg` trained with `optimizer` under `layout`, worst pipeline stage.

    `weights` picks the convention: "megatron" (literature, 16 B/param for mixed-precision Adam)
    or "lmforge" (what lmforge allocates: fp32 params = master, fp32 grads, exact optimizer
    state per tensor). See the module docstring for every formula.
    """
    if weights not in CONVENTIONS:
        raise ValueError(f"weights convention {weights!r} is not one of {', '.join(CONVENTIONS)}")
    opt = normalise_optimizer(optimizer)
    layout.validate(model_cfg)
    seq_len = model_cfg.max_seq_len if seq_len is None else int(seq_len)
    if seq_len < 1:
        raise ValueError(f"seq_len = {seq_len} must be >= 1")
    n_total = total_params(model_cfg)
    best = None
    for stage in sorted({0, layout.pp - 1}):
        comp, cpu, params_here, detail = _stage_breakdown(model_cfg, layout, opt, seq_len, weights, stage)
        total = sum(comp.values())
        if best is None or total > best[0]:
            best = (total, stage, comp, cpu, params_here, detail)
    _, stage, comp, cpu, params_here, detail = best
    return MemoryBreakdown(model=model_name, layout=layout, optimizer=opt, seq_len=seq_len, convention=weights,
                           params_total=n_total, params_per_rank=params_here, stage=stage,
                           cpu_bytes=cpu, detail=detail, **comp)
