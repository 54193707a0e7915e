"""The parallel layout a plan is for (`Layout`: degrees, micro-batching, recompute, precision,
the loss's chunking), parsed from "dp=8,zero=3,..." and checked against the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lmforge.config import Config, ModelConfig
from lmforge.config.layout_rules import LAYOUT_NAMES, LayoutRefused, Refusal, layout_refusals
from lmforge.config.rules import config_refusals, document_kernel_rule, resolve_compile, resolve_loss_chunk
from lmforge.config.sections import zero1_through_fsdp
from lmforge.spec.parallel import LOOPED, PP_SCHEDULES, SPLIT_BACKWARD, V_SHAPED, stages_per_rank


AC_MODES = ("none", "full", "every_k", "selective")
DOCUMENT_MASKS = ("none", "flex", "sdpa")
CP_MODES = ("allgather", "ulysses")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8", "bf16-pure")


@dataclass
class Layout:
    """A parallel layout. world size = dp x cp x tp x pp; global batch = micro_batch x grad_accum x dp
    sequences (with pipelining, grad_accum is the number of micro-batches m per step). The cp ranks
    of a context-parallel layout share each sequence (2 chunks each) and average their gradients
    with the dp ones, so ZeRO / FSDP shard over dp x cp (`shard_ranks`)."""

    dp: int = 1
    zero: int = 0                 # 0 = DDP (replicated), 1, 2, 3 (= FSDP full sharding)
    cp: int = 1                   # context parallelism (lmforge.parallel.context_parallel)
    cp_mode: str = "allgather"    # allgather (K/V all-gathered per layer) | ulysses (all-to-all of heads)
    tp: int = 1
    sp: bool = False              # sequence parallelism (with tp > 1)
    pp: int = 1
    pp_schedule: str = "1f1b"     # gpipe | 1f1b | interleaved | interleaved-zb | zbv | dualpipev
    virtual_stages: int = 1       # interleaved / interleaved-zb: model chunks per pipeline rank (v); zbv and
    #                               dualpipev always hold 2 (a V), whatever this says (1 or 2)
    micro_batch: int = 1
    grad_accum: int = 1
    ac: str = "none"              # none | full | every_k | selective
    ac_every: int = 2
    cpu_offload: bool = False
    precision: str = "bf16"       # bf16 | fp16 | fp32 | fp8 (autocast over fp32 weights) | bf16-pure (bf16
    #                               weights and activations, fp32 master weights and gradients in the optimizer)
    fsdp_reduce_every_micro_batch: bool = False  # FSDP2: reduce-scatter after every micro-batch (not pp > 1)
    ep: int = 1                   # expert parallelism (MoE): experts split over ep of the dp ranks
    loss_chunk: int = 0           # train.loss_chunk as resolved (`planned_loss_chunk`): 0 = plain logits +
    #                               F.cross_entropy, N = the head fused with the loss over N-token chunks
    compile: bool = True          # train.compile as resolved (`planned_compile`): per-block torch.compile
    ema: bool = False             # an fp32 EMA of the weights (train.ema_decay > 0), held like the weights
    documents: str = "none"       # data.attention = "document" and its kernel (`planned_documents`): none (causal) |
    #                               flex (FlexAttention's block mask) | sdpa (a dense boolean mask; lmforge.plan.documents)
    doc_tokens: int = 0           # mean tokens per document of the corpus (0 = not known), for the document
    #                               mask's attention work under flex

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def stages_per_rank(self) -> int:
        """Model chunks each pipeline rank holds (lmforge.spec.parallel.stages_per_rank)."""
        return stages_per_rank(self.pp_schedule, self.virtual_stages) if self.pp > 1 else 1

    @property
    def split_backward(self) -> bool:
        """A zero-bubble schedule (input and weight gradients in separate passes)."""
        return self.pp > 1 and self.pp_schedule in SPLIT_BACKWARD

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the final norm, the head and the loss: pp - 1, or 0 in a V."""
        return 0 if self.pp_schedule in V_SHAPED else self.pp - 1

    def holds_last(self, stage: int) -> bool:
        """Whether pipeline rank `stage` holds the last stage (the head and the loss)."""
        return stage == self.last_rank

    @property
    def shard_ranks(self) -> int:
        """The ranks that average gradients, and that ZeRO / FSDP shard over: dp x cp."""
        return self.dp * self.cp

    @property
    def fsdp(self) -> bool:
        """Parameters sharded over dp x cp (ZeRO-2/3 = FSDP2 `fully_shard` in lmforge; ZeRO-1 too under tp /
        pp: lmforge.config.sections.zero1_through_fsdp)."""
        return self.shard_ranks > 1 and (self.zero >= 2 or (self.zero == 1 and zero1_through_fsdp(self.tp, self.pp)))

    def validate(self, model_cfg: ModelConfig | None = None, seq_len: int | None = None) -> "Layout":
        """Check the values, then the layout's structural rules (`lmforge.config.layout_rules`: a key that
        needs another, and given the model and the sequence length, tp divides the heads, pp x v the
        layers, cp divides seq_len / 2, ...), the first broken one raised in the layout's words. What
        lmforge runs besides is `lmforge_refusals`' question."""
        for key in ("dp", "cp", "tp", "pp", "virtual_stages", "micro_batch", "grad_accum", "ac_every", "ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {key} = {value!r} must be an integer >= 1")
        if not isinstance(self.loss_chunk, int) or isinstance(self.loss_chunk, bool) or self.loss_chunk < 0:
            raise ValueError(f"layout loss_chunk = {self.loss_chunk!r} must be an integer >= 0 (0 = the plain "
                             f"logits; N = the cross-entropy fused with the head over N-token chunks)")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"layout cp_mode = {self.cp_mode!r} is not one of {', '.join(CP_MODES)}")
        if self.documents not in DOCUMENT_MASKS:
            raise ValueError(f"layout documents = {self.documents!r} is not one of {', '.join(DOCUMENT_MASKS)}")
        if not isinstance(self.doc_tokens, int) or self.doc_tokens < 0:
            raise ValueError(f"layout doc_tokens = {self.doc_tokens!r} must be an integer >= 0 (0 = not known)")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"layout zero = {self.zero!r} must be 0, 1, 2 or 3")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"layout pp_schedule = {self.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        if self.ac not in AC_MODES:
            raise ValueError(f"layout ac = {self.ac!r} is not one of {', '.join(AC_MODES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"layout precision = {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        # the layout's own rules (lmforge.config.layout_rules), in its words; those needing a model or a sequence
        # length only where given
        given = frozenset(k for k, v in (("model", model_cfg), ("seq_len", seq_len)) if v is not None)
        base = _DEFAULT_PROBE if model_cfg is None else _probe(model_cfg)
        probe = config_for_layout(base, self, seq_len if seq_len is not None else base.data.seq_len)
        broken = layout_refusals(probe, LAYOUT_NAMES, structural=True, given=given)
        if broken:  # (a ValueError naming the rule broken)
            raise LayoutRefused([broken[0]._replace(message=f"layout {broken[0].message}")])
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def short(self) -> str:
        cp = f",cp={self.cp}" + (f",cpm={self.cp_mode}" if self.cp_mode != "allgather" else "") if self.cp > 1 else ""
        s = (f"dp={self.dp},zero={self.zero}{cp},tp={self.tp},pp={self.pp},mb={self.micro_batch},ga={self.grad_accum},"
             f"ac={self.ac}")
        if self.sp:
            s += ",sp=1"
        if self.pp > 1:
            s += f",sched={self.pp_schedule}"
            if self.virtual_stages > 1 and self.pp_schedule in LOOPED:
                s += f",v={self.virtual_stages}"
        if self.cpu_offload:
            s += ",offload=1"
        if self.fsdp_reduce_every_micro_batch:
            s += ",reduce_every=1"
        if self.ep > 1:
            s += f",ep={self.ep}"
        if self.loss_chunk:
            s += f",loss_chunk={self.loss_chunk}"
        if self.precision == "bf16-pure":
            s += ",precision=bf16-pure"
        if not self.compile:
            s += ",compile=0"
        if self.ema:
            s += ",ema=1"
        if self.documents != "none":
            s += f",documents={self.documents}" + (f",doc_tokens={self.doc_tokens}" if self.doc_tokens else "")
        return s

    _KEYS = {"dp": "dp", "zero": "zero", "cp": "cp", "cpm": "cp_mode", "cp_mode": "cp_mode", "tp": "tp", "sp": "sp",
             "pp": "pp", "sched": "pp_schedule",
             "pp_schedule": "pp_schedule", "schedule": "pp_schedule", "v": "virtual_stages",
             "virtual_stages": "virtual_stages", "mb": "micro_batch", "micro_batch": "micro_batch",
             "ga": "grad_accum", "grad_accum": "grad_accum", "m": "grad_accum", "ac": "ac",
             "ac_every": "ac_every", "offload": "cpu_offload", "cpu_offload": "cpu_offload",
             "precision": "precision", "dtype": "precision", "reduce_every": "fsdp_reduce_every_micro_batch",
             "fsdp_reduce_every_micro_batch": "fsdp_reduce_every_micro_batch", "ep": "ep",
             "loss_chunk": "loss_chunk", "compile": "compile", "ema": "ema", "documents": "documents",
             "doc_tokens": "doc_tokens"}

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> "Layout":
        """Parse "dp=8,zero=3,cp=1,tp=1,pp=1,mb=1,ac=full" (keys: dp zero cp cpm tp sp pp sched v mb ga ac
        ac_every offload precision reduce_every ep loss_chunk compile ema documents doc_tokens); unknown keys or bad values raise
        ValueError naming them."""
        kw: dict[str, Any] = dict(defaults)
        for item in filter(None, (p.strip() for p in (text or "").split(","))):
            if "=" not in item:
                raise ValueError(f"layout item {item!r} must be key=value (e.g. dp=8)")
            key, value = (s.strip() for s in item.split("=", 1))
            field_name = cls._KEYS.get(key.lower())
            if field_name is None:
                raise ValueError(f"unknown layout key {key!r}; valid: {', '.join(sorted(set(cls._KEYS)))}")
            if field_name in ("sp", "cpu_offload", "fsdp_reduce_every_micro_batch", "compile", "ema"):
                if value.lower() not in ("0", "1", "true", "false", "yes", "no"):
                    raise ValueError(f"layout {key} = {value!r} must be 0/1/true/false")
                kw[field_name] = value.lower() in ("1", "true", "yes")
            elif field_name in ("pp_schedule", "ac", "precision", "documents", "cp_mode"):
                kw[field_name] = value.lower()
            else:
                try:
                    kw[field_name] = int(value)
                except ValueError:
                    raise ValueError(f"layout {key} = {value!r} must be an integer") from None
        return cls(**kw).validate()


_DEFAULT_PROBE = Config()  # the config a layout's rules are checked on without a model (its rules need none)
_LAST_PROBE: list[Config] = [_DEFAULT_PROBE]


def _probe(model_cfg: ModelConfig) -> Config:
    """A config of `model_cfg` for `Layout.validate`'s rules, kept for the next call: a search checks
    thousands of layouts of one model."""
    if _LAST_PROBE[0].model is not model_cfg:
        _LAST_PROBE[0] = Config(model=model_cfg)
    return _LAST_PROBE[0]


def config_for_layout(config: Config, layout: Layout, seq_len: int) -> Config:
    """`config` with `layout`'s parallel and batch settings and sequence length, as `lmforge train`
    would take them: one of the two conversions between the plan's Layout and the config
    (`layout_for_config` is the other). Data parallelism with ZeRO >= 1 over more than one rank is
    parallel.dp_shard (FSDP2, or ZeRO-1's DDP + sharded optimizer), else parallel.dp_replicate (DDP);
    fp8 is train.fp8 over bf16 and bf16-pure has bf16's layout rules, so both map to bf16; a batch
    ramp-up is left out (the plan is for the full batch: `lmforge.plan.search.rampup_note`)."""
    zero, dp = layout.zero, layout.dp
    sharded = layout.shard_ranks > 1 and zero >= 1
    par = dataclasses.replace(
        config.parallel, tp=layout.tp, pp=layout.pp, cp=layout.cp, cp_mode=layout.cp_mode,
        dp_replicate=1 if sharded else dp,
        dp_shard=dp if sharded else 1, zero_stage=zero if sharded else 0, sequence_parallel=layout.sp,
        pp_schedule=layout.pp_schedule, pp_virtual_stages=layout.virtual_stages, cpu_offload=layout.cpu_offload,
        fsdp_reduce_every_micro_batch=layout.fsdp_reduce_every_micro_batch, ep=layout.ep)
    precision = "bf16" if layout.precision in ("fp8", "bf16-pure") else layout.precision
    train = dataclasses.replace(config.train, micro_batch_size=layout.micro_batch, precision=precision,
                                global_batch_size=layout.sequences_per_step, activation_checkpoint=layout.ac,
                                ac_every=layout.ac_every, loss_chunk=layout.loss_chunk)
    data = dataclasses.replace(config.data, seq_len=seq_len)
    schedule = dataclasses.replace(config.schedule, batch_rampup_start=0, batch_rampup_tokens=0,
                                   batch_rampup_increment=0)
    return dataclasses.replace(config, parallel=par, train=train, data=data, schedule=schedule)


def layout_for_config(config: Config, precision: str, device_type: str, micro_batch: int) -> Layout:
    """The planner's `Layout` of a run of `config` at `micro_batch`, in `precision` (as resolved) on
    `device_type`: the other conversion (`config_for_layout`). ZeRO / FSDP shard over
    parallel.dp_shard (x cp): an HSDP run's replicas each hold a shard group's copy, so the plan is
    that group's."""
    p, t = config.parallel, config.train
    zero = p.zero_stage or ((3 if p.reshard_after_forward else 2) if p.dp_shard > 1 else 0)
    accum = 1 if p.async_sgd else t.global_batch_size // (micro_batch * p.dp)
    return Layout(dp=p.dp_shard if zero else p.dp, zero=zero, cp=p.cp, cp_mode=p.cp_mode, tp=p.tp,
                  sp=p.sequence_parallel, pp=p.pp,
                  pp_schedule=p.pp_schedule, virtual_stages=p.pp_virtual_stages if p.pp > 1 else 1,
                  micro_batch=micro_batch, grad_accum=accum, ac=t.activation_checkpoint, ac_every=t.ac_every,
                  cpu_offload=p.cpu_offload, precision=precision,
                  fsdp_reduce_every_micro_batch=p.fsdp_reduce_every_micro_batch, ep=p.ep,
                  loss_chunk=resolve_loss_chunk(config, device_type, precision), ema=t.ema_decay > 0,
                  documents=planned_documents(config, device_type))


def lmforge_refusals(config: Config, layout: Layout, seq_len: int) -> list[Refusal]:
    """Why `lmforge train` would refuse a run of `config` under `layout` at `seq_len` (every reason,
    in the config check's words and order: `lmforge.config.rules.config_refusals`); [] where it runs it."""
    return config_refusals(config_for_layout(config, layout, seq_len))


def refusal_lines(refusals: list[Refusal]) -> list[str]:
    """What `lmforge plan` prints at the top of a plan whose layout lmforge refuses (none where it runs it)."""
    if not refusals:
        return []
    head = (f"lmforge refuses this layout ({len(refusals)} reason{'s' if len(refusals) > 1 else ''}; planned anyway, "
            f"to compare: `lmforge train` stops with the first):")
    return [head] + [f"  - {r.message}" for r in refusals]


def planned_loss_chunk(config, precision: str, tp: int = 1, pp: int = 1) -> int:
    """`Layout.loss_chunk` for a run of `config` (a `lmforge.config.Config`) on GPUs in `precision`
    under tp / pp: train.loss_chunk as lmforge resolves it on CUDA
    (`lmforge.config.rules.resolve_loss_chunk`: "auto" = 4096-token chunks for a vocabulary of at
    least 8192), and 0 where the layout has tp > 1 or pp > 1 (lmforge runs the plain logits there)."""
    if tp > 1 or pp > 1:
        return 0
    return resolve_loss_chunk(config, "cuda", precision)


def planned_compile(config, tp: int = 1, pp: int = 1, pp_schedule: str = "1f1b") -> bool:
    """`Layout.compile` for a run of `config` on CUDA GPUs (with Triton) under tensor-parallel degree
    `tp` and pipeline `pp` / `pp_schedule`: train.compile as lmforge resolves it there
    (`lmforge.config.rules.resolve_compile`: "auto" = per block, but off for a Mixture-of-Experts
    model or a zero-bubble schedule; "blocks" or "model": on)."""
    cfg = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tp=tp, pp=pp,
                                                                   pp_schedule=pp_schedule))
    return bool(resolve_compile(cfg, "cuda", gpu_compiles=True)[0])


def planned_documents(config, device_type: str = "cuda") -> str:
    """`Layout.documents` for a run of `config` on `device_type` (the planner's GPUs: CUDA with Triton,
    as `planned_compile` assumes): "none" under causal attention, else the document mask's kernel as
    lmforge chooses it (`lmforge.config.rules.document_kernel_rule`: FlexAttention without dropout)."""
    if config.data.attention != "document":
        return "none"
    return document_kernel_rule(device_type, config.model.dropout, flex_runs=device_type == "cuda")
