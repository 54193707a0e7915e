"""Every rule of a parallel layout, written once (issue 53): the config check that `lmforge train`
runs (`check_layout`, from `Config.validate`), the planner's typed `--layout` (`lmforge.plan.layout`:
`Layout.validate` and `lmforge_refusals`) and the layout search (`lmforge.plan.search`) all read
`LAYOUT_RULES`.

A rule reads a `Config` (the planner converts its `Layout` with
`lmforge.plan.layout.config_for_layout`) and, where it is broken, gives its message: a `str.format`
template written once here, whose `{k[...]}` fields name the layout's keys in the words of whoever
asks: the config's (`CONFIG_NAMES`: parallel.tp, data.seq_len, ...) or the planner's `--layout`
(`LAYOUT_NAMES`: tp, seq_len, ...). Two kinds:

* structural (`structural=True`): the layout cannot exist for this model and sequence (TP of whole
  heads, pipeline stages of whole layers, CP chunks of whole tokens, a key that needs another). The
  planner refuses to plan it, as the config does.
* the rest: what lmforge does not run (ZeRO-1 with TP or PP, ...). Megatron-LM and others run some
  of them, so `lmforge plan --layout` still plans them and says at the top that lmforge refuses
  them, with every reason; the search leaves them out.

The rules that read no layout key (a section's own values, data recipes, ...) stay in
`lmforge.config.sections` and `lmforge.config.rules`, and so does one that does:
parallel.ep's shard dimension (`ParallelConfig.check`), named before the process count because
`infer_dp_shard` decides dp_shard from it. The planner reads them all the same
(`lmforge.config.rules.config_refusals`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from lmforge.config.base import ConfigError, divisors
from lmforge.spec.parallel import LOOPED, V_SHAPED, ulysses_splits

if TYPE_CHECKING:
    from lmforge.config.sections import Config


# How a message names the layout's keys: `lmforge train`'s config keys, or `lmforge plan --layout`'s.
CONFIG_NAMES: dict[str, str] = {
    "dp": "dp (parallel.dp_replicate x parallel.dp_shard)", "tp": "parallel.tp", "pp": "parallel.pp",
    "cp": "parallel.cp", "cp_mode": "parallel.cp_mode", "ep": "parallel.ep", "sp": "parallel.sequence_parallel",
    "v": "parallel.pp_virtual_stages",
    "sched": "parallel.pp_schedule", "reduce_every": "parallel.fsdp_reduce_every_micro_batch",
    "loss_chunk": "train.loss_chunk", "seq_len": "data.seq_len", "change_seq_len": "data.seq_len",
    "true": "true", "false": "false"}
LAYOUT_NAMES: dict[str, str] = {
    "dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "cp_mode": "cpm", "ep": "ep", "sp": "sp", "v": "v",
    "sched": "sched",
    "reduce_every": "reduce_every", "loss_chunk": "loss_chunk", "seq_len": "seq_len", "change_seq_len": "--seq-len",
    "true": "1", "false": "0"}


def _none(cfg: "Config", k: dict[str, str]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class LayoutRule:
    """One layout rule: its name, when a config breaks it, and its message (a `str.format` template
    over p, m, d, t = the config's parallel, model, data and train sections, k = the key names, and
    what `values` adds)."""

    name: str
    broken: Callable[["Config"], bool]
    message: str
    values: Callable[["Config", dict[str, str]], dict[str, Any]] = _none
    structural: bool = False
    needs: frozenset[str] = frozenset()  # "model", "seq_len": what a structural rule reads besides the layout

    def refusal(self, cfg: "Config", names: dict[str, str] = CONFIG_NAMES) -> str | None:
        if not self.broken(cfg):
            return None
        return self.message.format(p=cfg.parallel, m=cfg.model, d=cfg.data, t=cfg.train, k=names,
                                   **self.values(cfg, names))


class Refusal(NamedTuple):
    rule: str      # the rule's name (a LayoutRule's, or the check of the config that refused)
    message: str


class LayoutRefused(ConfigError):
    """A config that breaks layout rules: the message is the first one's (`lmforge train` names one
    problem per line), `refusals` all of them."""

    def __init__(self, refusals: list[Refusal]):
        super().__init__(refusals[0].message)
        self.refusals = refusals


def valid_tp_degrees(cfg: "Config") -> list[int]:
    """Every tensor-parallel degree that passes all of the TP rules for this model and data."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    return [t for t in divisors(m.n_heads) if m.kv_heads % t == 0 and (t == 1 or (
        m.vocab_size % t == 0 and m.ffn_dim % t == 0 and (not p.sequence_parallel or (d.seq_len // p.cp) % t == 0)
        and not (m.has_linear_layers and any(h % t for h in m.deltanet_shape[:2]))))]


def pipeline_micro_batches_ok(count: int, pp: int, schedule: str) -> bool:
    """Whether a step of `count` micro-batches fills a pipeline of `pp` ranks under `schedule`: at
    least pp; a multiple of pp for interleaved and interleaved-zb (torch's rounds of pp micro-batches);
    at least 2 pp, the number of stages, for zbv and dualpipev (torch's DualPipeV requires it; the
    V fills from it)."""
    if schedule in V_SHAPED:
        return count >= 2 * pp
    return count >= pp and (schedule not in LOOPED or count % pp == 0)


def _accum(cfg: "Config") -> int | None:
    """Micro-batches per step where the batch rules allow a number (else None: `check_batch` names it)."""
    t, p = cfg.train, cfg.parallel
    if t.micro_batch_size == "auto" or p.async_sgd or t.global_batch_size % (t.micro_batch_size * p.dp):
        return None
    return cfg.grad_accum_steps


def _pp_stages(cfg: "Config", k: dict[str, str]) -> dict[str, Any]:
    p = cfg.parallel
    v = p.stages_per_rank
    per = f"{k['v']} = {v}" if p.pp_schedule in LOOPED else f"{v} stages per rank ({p.pp_schedule})"
    return {"stages": f" x {per} = {p.pp * v} pipeline stages" if v > 1 else ""}


def _cp_chunks(cfg: "Config", k: dict[str, str]) -> dict[str, Any]:
    seq = cfg.data.seq_len
    ok = [c for c in divisors(seq // 2) if c > 1][:6] if seq % 2 == 0 else []
    hint = f"choose {k['cp']} among {ok}" if ok else f"use an even {k['seq_len']}"
    return {"half": seq / 2, "chunks": 2 * cfg.parallel.cp, "hint": hint}


def _ulysses_broken(cfg: "Config") -> bool:
    """Ulysses CP whose all-to-all cannot split a TP rank's heads over the cp ranks: cp must divide
    the query heads, and the KV heads be a multiple of cp or divide it (then replicated)."""
    p, m = cfg.parallel, cfg.model
    return p.cp > 1 and p.cp_mode == "ulysses" and not ulysses_splits(m.n_heads // p.tp, m.kv_heads // p.tp, p.cp)


def _ulysses_heads(cfg: "Config", k: dict[str, str]) -> dict[str, Any]:
    p, m = cfg.parallel, cfg.model
    heads, kv = m.n_heads // p.tp, m.kv_heads // p.tp
    ok = [c for c in divisors(heads) if c > 1 and ulysses_splits(heads, kv, c)]
    return {"heads": heads, "kv": kv, "hint": f"choose {k['cp']} among {ok}" if ok else f"lower {k['tp']}"}


def _micro_batches_needed(cfg: "Config", k: dict[str, str]) -> dict[str, Any]:
    p = cfg.parallel
    need = f">= 2 x parallel.pp = {2 * p.pp} (its stages)" if p.pp_schedule in V_SHAPED else \
        f"a multiple of parallel.pp = {p.pp}"
    return {"accum": _accum(cfg), "need": need}


_R = LayoutRule
# In the order the config check names them (the first broken one is `lmforge train`'s error).
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    # -- data parallelism, ZeRO, expert parallelism's ranks
    _R("ep-divides-dp", lambda c: c.parallel.ep > 1 and c.parallel.dp % c.parallel.ep > 0,
       "{k[ep]} = {p.ep} must divide the data-parallel degree {k[dp]} = {p.dp}: expert parallelism borrows "
       "data-parallel ranks.", structural=True),
    _R("zero1-needs-dp-shard", lambda c: c.parallel.zero_stage == 1 and c.parallel.dp_shard < 2,
       "parallel.zero_stage = 1 shards the optimizer state over the parallel.dp_shard ranks, but parallel.dp_shard = "
       "{p.dp_shard}; set parallel.dp_shard >= 2 (or zero_stage = 0 for plain DDP)."),
    _R("zero1-not-replicated", lambda c: c.parallel.zero_stage == 1 and c.parallel.dp_replicate != 1,
       "parallel.zero_stage = 1 (ZeroRedundancyOptimizer over all ranks) needs parallel.dp_replicate = 1, got "
       "{p.dp_replicate}; put all data-parallel ranks in parallel.dp_shard."),
    _R("offload-needs-fsdp", lambda c: c.parallel.cpu_offload and not c.parallel.fsdp,
       "parallel.cpu_offload = true needs FSDP (parallel.dp_shard >= 2, zero_stage 0, 2 or 3)."),
    _R("reduce-every-without-pp", lambda c: c.parallel.fsdp_reduce_every_micro_batch and c.parallel.pp > 1,
       "{k[reduce_every]} = {k[true]} with {k[pp]} > 1: torch.distributed.pipelining's schedule turns FSDP2's "
       "gradient sync off for every micro-batch and reduces once after the last, so {k[reduce_every]} = {k[true]} "
       "needs {k[pp]} = 1; set {k[reduce_every]} = {k[false]}.", structural=True),
    # -- sequence parallelism, pipeline schedules
    _R("sp-needs-tp", lambda c: c.parallel.sequence_parallel and c.parallel.tp < 2,
       "{k[sp]} = {k[true]} needs {k[tp]} >= 2 (sequence parallelism shards activations over the tensor-parallel "
       "ranks), got {k[tp]} = {p.tp}; set {k[tp]} or {k[sp]} = {k[false]}.", structural=True),
    _R("interleaved-needs-v", lambda c: c.parallel.pp_schedule == "interleaved" and c.parallel.pp > 1
       and c.parallel.pp_virtual_stages < 2,
       "parallel.pp_schedule = 'interleaved' needs parallel.pp_virtual_stages >= 2 (model chunks per rank); set it "
       "to 2, or use pp_schedule = '1f1b'."),
    _R("v-shape-two-stages", lambda c: c.parallel.pp_schedule in V_SHAPED and c.parallel.pp_virtual_stages not in (1, 2),
       "{k[sched]} = {p.pp_schedule!r} places exactly 2 stages per rank (a V), but {k[v]} = {p.pp_virtual_stages}; "
       "leave it at 1 (or 2), or use {k[sched]} = 'interleaved-zb' for {p.pp_virtual_stages} stages per rank.",
       structural=True),
    _R("v-needs-looped-schedule", lambda c: c.parallel.pp_schedule not in LOOPED + V_SHAPED
       and c.parallel.pp_virtual_stages != 1,
       "{k[v]} = {p.pp_virtual_stages} applies to pp_schedule = 'interleaved' or 'interleaved-zb' only; set "
       "{k[sched]} = 'interleaved' or {k[v]} = 1.", structural=True),
    _R("tp-needs-fsdp", lambda c: c.parallel.tp > 1 and c.parallel.dp_replicate > 1 and c.parallel.dp_shard == 1,
       "parallel.tp = {p.tp} with parallel.dp_replicate = {p.dp_replicate}: data parallelism next to tensor "
       "parallelism goes through FSDP2 on the DeviceMesh; use parallel.dp_shard = {p.dp_replicate} (dp_replicate = "
       "1) instead."),
    # -- tensor parallelism: whole heads, the vocabulary and the MLP split; sequence parallelism
    _R("tp-whole-heads", lambda c: c.model.n_heads % c.parallel.tp > 0 or c.model.kv_heads % c.parallel.tp > 0,
       "{k[tp]} = {p.tp} must divide model.n_heads = {m.n_heads} and the kv heads = {m.kv_heads} (each TP rank holds "
       "whole heads); the degrees this model allows are {ok}.",
       lambda c, k: {"ok": valid_tp_degrees(c)}, structural=True, needs=frozenset({"model"})),
    _R("tp-divides-vocab", lambda c: c.parallel.tp > 1 and c.model.vocab_size % c.parallel.tp > 0,
       "parallel.tp = {p.tp} must divide model.vocab_size = {m.vocab_size} (vocab-parallel embedding and loss); pad "
       "model.vocab_size to a multiple of {p.tp} (a multiple of 64 is fastest), or use one of {ok}.",
       lambda c, k: {"ok": valid_tp_degrees(c)}),
    _R("tp-divides-mlp", lambda c: c.parallel.tp > 1 and c.model.ffn_dim % c.parallel.tp > 0,
       "parallel.tp = {p.tp} must divide the MLP hidden size {m.ffn_dim}; set model.ffn_hidden to a multiple of "
       "{p.tp}, or use one of {ok}.", lambda c, k: {"ok": valid_tp_degrees(c)}),
    _R("sp-divides-sequence", lambda c: c.parallel.sequence_parallel and c.data.seq_len % c.parallel.tp > 0,
       "parallel.sequence_parallel: data.seq_len = {d.seq_len} must be divisible by parallel.tp = {p.tp}; the "
       "degrees this model allows are {ok}.", lambda c, k: {"ok": valid_tp_degrees(c)}),
    # -- context parallelism: 2 x cp chunks of each sequence (rank i keeps chunks i and 2cp-1-i)
    _R("cp-whole-chunks", lambda c: c.parallel.cp > 1 and c.data.seq_len % (2 * c.parallel.cp) > 0,
       "{k[cp]} = {p.cp} must divide {k[seq_len]} / 2 = {half:g}: each sequence is cut into 2 x cp = {chunks} equal "
       "chunks (CP rank i keeps chunks i and 2cp-1-i); {hint}, or change {k[change_seq_len]}.",
       _cp_chunks, structural=True, needs=frozenset({"seq_len"})),
    _R("sp-divides-cp-chunk", lambda c: c.parallel.cp > 1 and c.parallel.sequence_parallel
       and (c.data.seq_len // c.parallel.cp) % c.parallel.tp > 0,
       "{k[sp]} with {k[cp]} = {p.cp}: each CP rank's {tokens} tokens ({k[seq_len]} / cp) must be divisible by "
       "{k[tp]} = {p.tp}, over whose ranks sequence parallelism splits them.",
       lambda c, k: {"tokens": c.data.seq_len // c.parallel.cp}, structural=True,
       needs=frozenset({"seq_len"})),
    _R("ulysses-whole-heads", _ulysses_broken,
       "{k[cp_mode]} = 'ulysses' with {k[cp]} = {p.cp}: its all-to-all gives each CP rank 1/cp of a TP rank's heads, "
       "so cp must divide the {heads} query heads per TP rank (model.n_heads / {k[tp]}) and the {kv} KV heads per TP "
       "rank must be a multiple of cp or divide it (fewer are replicated); {hint}, or set {k[cp_mode]} = 'allgather' "
       "(any head count).", _ulysses_heads, structural=True, needs=frozenset({"model"})),
    _R("ulysses-no-mla", lambda c: c.parallel.cp > 1 and c.parallel.cp_mode == "ulysses" and c.model.mla.enabled,
       "{k[cp_mode]} = 'ulysses' with multi-head latent attention (model.mla): lmforge's Ulysses splits K/V heads, "
       "and MLA's context parallelism gathers its per-token latent instead; set {k[cp_mode]} = 'allgather'."),
    # -- pipelines: stages of whole layers, enough micro-batches; the zero-bubble
    #    schedules run each backward as an input-gradient and a later weight-gradient pass through the same graph
    _R("pp-whole-layers", lambda c: c.model.n_layers % (c.parallel.pp * c.parallel.stages_per_rank) > 0,
       "{k[pp]} = {p.pp}{stages} must divide model.n_layers = {m.n_layers}; choose a divisor of {m.n_layers} or "
       "change n_layers.", _pp_stages, structural=True, needs=frozenset({"model"})),
    _R("split-backward-eager", lambda c: c.parallel.split_backward and c.train.compile not in (False, "auto"),
       "train.compile = {compile} with parallel.pp_schedule = {p.pp_schedule!r}: torch's zero-bubble schedules do not "
       "run compiled stage modules (their split backward; pytorch/pytorch#161904); set train.compile = false (or "
       "'auto'), or pp_schedule = 'interleaved'.", lambda c, k: {"compile": str(c.train.compile).lower()}),
    _R("split-backward-not-selective", lambda c: c.parallel.split_backward
       and c.train.activation_checkpoint == "selective",
       "train.activation_checkpoint = 'selective' with parallel.pp_schedule = {p.pp_schedule!r}: selective "
       "checkpointing allows one backward through a checkpointed region, and the split backward runs two (the input "
       "gradient, then the weight gradient: torch raises \"Trying to backward an extra time\"); use "
       "activation_checkpoint = 'full' or 'every_k', or pp_schedule = 'interleaved'."),
    _R("pp-fills-stages", lambda c: c.parallel.pp > 1 and _accum(c) is not None and _accum(c) < c.parallel.pp,
       "parallel.pp = {p.pp}: the pipeline runs the step's {accum} micro-batch(es) (global_batch_size "
       "{t.global_batch_size} / (micro_batch_size {t.micro_batch_size} x dp {p.dp})), fewer than the stages; lower "
       "train.micro_batch_size so there are >= {p.pp} micro-batches per step.", lambda c, k: {"accum": _accum(c)}),
    _R("pp-schedule-micro-batches", lambda c: c.parallel.pp > 1 and _accum(c) is not None and _accum(c) >= c.parallel.pp
       and not pipeline_micro_batches_ok(_accum(c), c.parallel.pp, c.parallel.pp_schedule),
       "parallel.pp_schedule = {p.pp_schedule!r}: the step's {accum} micro-batches must be {need}; change "
       "train.micro_batch_size or train.global_batch_size.", _micro_batches_needed),
    # -- expert parallelism splits the routed experts
    _R("ep-needs-experts", lambda c: c.parallel.ep > 1 and not c.model.moe.enabled,
       "{k[ep]} = {p.ep} splits the routed experts of Mixture-of-Experts layers, but model.moe.num_experts = 0 (a "
       "dense model); set model.moe.num_experts or {k[ep]} = 1.", structural=True, needs=frozenset({"model"})),
    _R("ep-divides-experts", lambda c: c.parallel.ep > 1 and c.model.moe.enabled
       and c.model.moe.num_experts % c.parallel.ep > 0,
       "{k[ep]} = {p.ep} must divide model.moe.num_experts = {m.moe.num_experts} (each expert-parallel "
       "rank holds an equal share of the routed experts); choose {k[ep]} among {ok}.",
       lambda c, k: {"ok": divisors(c.model.moe.num_experts)}, structural=True, needs=frozenset({"model"})),
    # -- Gated DeltaNet blocks (model.layer_types): every layout but context parallelism
    _R("linear-attention-layouts", lambda c: c.model.has_linear_layers and c.parallel.cp > 1,
       "{k[cp]} = {p.cp}: model.layer_types / full_attention_interval make Gated DeltaNet (linear-attention) "
       "blocks, which lmforge runs on one process and under DDP, FSDP2, tensor, pipeline and expert parallelism; "
       "context parallelism would pass each block's recurrent state from rank to rank in sequence order, which "
       "lmforge does not do yet; set {k[cp]} = 1, or make every block full attention."),
    _R("tp-divides-deltanet-heads", lambda c: c.model.has_linear_layers and c.parallel.tp > 1
       and any(h % c.parallel.tp for h in c.model.deltanet_shape[:2]),
       "{k[tp]} = {p.tp} must divide the Gated DeltaNet key heads and value heads ({dn[0]} and {dn[1]}: each TP "
       "rank holds whole key heads and the value heads they serve); the degrees this model allows are {ok}, or set "
       "model.deltanet.key_heads / value_heads.",
       lambda c, k: {"dn": c.model.deltanet_shape, "ok": valid_tp_degrees(c)}, structural=True,
       needs=frozenset({"model"})),
    # -- OLMo 2 / 3's QK-norm (model.qk_norm_scope = "projection") normalises over every head at once
    _R("qk-norm-projection-tp", lambda c: c.parallel.tp > 1 and c.model.qk_norm and c.model.qk_norm_scope == "projection",
       "{k[tp]} = {p.tp} with model.qk_norm_scope = 'projection': that QK-norm sums over every head of q and k, and "
       "tensor parallelism splits the heads over ranks (the sum would need an all-reduce lmforge does not run yet); "
       "set {k[tp]} = 1 (FSDP2, DDP, PP and CP run it), or model.qk_norm_scope = 'head'."),
    # -- the chunked loss runs without tensor and pipeline parallelism
    _R("loss-chunk-alone", lambda c: c.train.loss_chunk != "auto" and bool(c.train.loss_chunk)
       and (c.parallel.tp > 1 or c.parallel.pp > 1),
       "{k[loss_chunk]} = {t.loss_chunk} needs {k[tp]} = {k[pp]} = 1 (lmforge runs the chunked loss only without "
       "tensor and pipeline parallelism); set {k[loss_chunk]} = 0 with {k[tp]} = {p.tp}, {k[pp]} = {p.pp}.",
       structural=True),
)


def layout_refusals(cfg: "Config", names: dict[str, str] = CONFIG_NAMES, structural: bool = False,
                    given: frozenset[str] = frozenset({"model", "seq_len"})) -> list[Refusal]:
    """Every layout rule `cfg` breaks, in order, with its message in `names`' words. `structural`:
    only the structural rules, and of those only the ones whose `needs` are among `given` (the
    planner checks a layout without a model or a sequence length too)."""
    out = []
    for rule in LAYOUT_RULES:
        if structural and not (rule.structural and rule.needs <= given):
            continue
        message = rule.refusal(cfg, names)
        if message is not None:
            out.append(Refusal(rule.name, message))
    return out


def check_layout(cfg: "Config") -> None:
    """The config's layout rules (`LAYOUT_RULES`): raises `LayoutRefused` naming the first broken
    one, carrying all of them."""
    refusals = layout_refusals(cfg)
    if refusals:
        raise LayoutRefused(refusals)
