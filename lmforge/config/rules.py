"""The config rules that span sections, in one short place (each section checks its own values
in `lmforge.config.sections`). Every rule raises a ConfigError naming the keys and the fix."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from lmforge.config.base import ConfigError, divisors
from lmforge.config.launch import launcher_command
from lmforge.config.layout_rules import (LAYOUT_RULES, LayoutRefused, Refusal, check_layout,
                                         pipeline_micro_batches_ok)
from lmforge.folders import MIXTURE, mixture_entries
from lmforge.spec.optimizers import REGISTRY, SPECS

if TYPE_CHECKING:
    from lmforge.config.sections import Config


def adapt_defaults(cfg: "Config", explicit: set[str]) -> list[str]:
    """Fit the preset's defaults to the layout, in place, where the user did not choose them
    (`explicit`: dotted keys set on the command line or in their own TOML file). Returns one line
    per change, for the log.

    * train.micro_batch_size: the presets fix the global batch (the math of a step); the micro-batch
      shrinks to the largest divisor of the per-rank batch (global / dp) that is <= the preset's and
      leaves the micro-batches per step the pipeline schedule needs (`pipeline_micro_batches_ok`).
    * schedule.warmup_steps: at most a tenth of train.steps when the preset's warmup would not end
      within the run.
    * train.hang_min_s: half of parallel.timeout_s where that is lower (the watchdog writes the
      stacks before a collective times out).
    * parallel.fsdp_reduce_every_micro_batch: a preset's true (the large models' presets: their
      unsharded gradients would not fit between micro-batches) is false under pp > 1, where torch's
      pipeline schedule reduces once per step whatever FSDP2 is told.
    An explicit choice that cannot work stays an error (`check_cross_section`, the sections' checks).
    """
    t, s, p = cfg.train, cfg.schedule, cfg.parallel
    notes = []
    auto = t.micro_batch_size == "auto"  # (chosen at run start: lmforge.plan.micro_batch)
    if "train.micro_batch_size" not in explicit and not auto and t.global_batch_size % p.dp == 0 \
            and not s.batch_rampup_start:
        ok = [m for m in valid_micro_batches(cfg) if m <= t.micro_batch_size]
        if ok and ok[-1] != t.micro_batch_size:
            per_rank, need = t.global_batch_size // p.dp, p.pp if p.pp > 1 else 1
            notes.append(f"train.micro_batch_size {t.micro_batch_size} -> {ok[-1]}: the global batch of "
                         f"{t.global_batch_size} sequences is {per_rank} per data-parallel rank (dp {p.dp})"
                         + (f", in >= {need} micro-batches for {p.pp} pipeline stages" if p.pp > 1 else ""))
            t.micro_batch_size = ok[-1]
    if "schedule.warmup_steps" not in explicit and s.warmup_steps >= t.steps:
        new = t.steps // 10
        notes.append(f"schedule.warmup_steps {s.warmup_steps} -> {new}: a tenth of the run's {t.steps} steps")
        s.warmup_steps = new
    if "train.hang_min_s" not in explicit and t.hang_min_s >= p.timeout_s:
        notes.append(f"train.hang_min_s {t.hang_min_s:g} -> {p.timeout_s / 2:g}: below parallel.timeout_s = "
                     f"{p.timeout_s:g}, so the hang watchdog writes the stacks before a collective times out")
        t.hang_min_s = p.timeout_s / 2
    if "parallel.fsdp_reduce_every_micro_batch" not in explicit and p.fsdp_reduce_every_micro_batch and p.pp > 1:
        notes.append("parallel.fsdp_reduce_every_micro_batch true -> false: with pp > 1 the pipeline schedule "
                     "reduces the gradients once per step")
        p.fsdp_reduce_every_micro_batch = False
    return notes


def valid_micro_batches(cfg: "Config") -> list[int]:
    """The micro-batch sizes the layout can run, smallest first: divisors of the global batch per
    data-parallel rank (global / dp; async SGD: any divisor of the global batch, one worker's
    gradient per update) that leave the micro-batches per step the pipeline schedule needs
    (`pipeline_micro_batches_ok`) and keep a batch ramp-up's start and increments multiples of micro x dp."""
    t, s, p = cfg.train, cfg.schedule, cfg.parallel
    if p.async_sgd:
        return divisors(t.global_batch_size)
    if t.global_batch_size % p.dp:
        return []

    def ramp_whole(m: int) -> bool:
        inc = s.batch_rampup_increment or m * p.dp
        return (s.batch_rampup_start % (m * p.dp) == 0 and inc % (m * p.dp) == 0
                and 0 < s.batch_rampup_start <= t.global_batch_size
                and (t.global_batch_size - s.batch_rampup_start) % inc == 0)

    sizes = pipeline_micro_batches(t.global_batch_size // p.dp, p.pp, p.pp_schedule)
    return [m for m in sizes if not s.batch_rampup_start or ramp_whole(m)]


def pipeline_micro_batches(per_rank: int, pp: int, schedule: str) -> list[int]:
    """The divisors m of a rank's `per_rank` sequences that leave a step's micro-batches the pipeline
    `schedule` needs (pp > 1: `pipeline_micro_batches_ok`), smallest first."""
    return [m for m in divisors(per_rank) if pp == 1 or pipeline_micro_batches_ok(per_rank // m, pp, schedule)]


MESH_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")  # the degrees whose product is the world size
PLAINEST = ("dp_shard", "dp_replicate", "tp", "pp", "cp")  # a suggested layout adds these first


def infer_dp_shard(cfg: "Config", world: int, explicit: set[str]) -> str | None:
    """parallel.dp_shard from the process count, in place, for a launched run with expert parallelism
    whose user did not choose dp_shard (`explicit`): EP borrows its ranks from dp_shard and adds no
    processes, so `torchrun --nproc-per-node 2 ... --parallel.ep 2` means dp_shard = 2 = world /
    (dp_replicate x cp x tp x pp). Returns the log line, or None where nothing was inferred (ep = 1,
    dp_shard chosen, or a world that the other degrees do not divide: the process-count rule then
    names the mismatch)."""
    p = cfg.parallel
    others = [getattr(p, d) for d in MESH_DEGREES if d != "dp_shard"]
    if p.ep < 2 or "parallel.dp_shard" in explicit or any(not isinstance(v, int) or v < 1 for v in others):
        return None
    rest = p.dp_replicate * p.cp * p.tp * p.pp
    if world % rest or world // rest == p.dp_shard:
        return None
    p.dp_shard = world // rest
    return (f"parallel.dp_shard -> {p.dp_shard}: inferred from the {world} processes started (world / (dp_replicate "
            f"{p.dp_replicate} x cp {p.cp} x tp {p.tp} x pp {p.pp})); parallel.ep = {p.ep} borrows its ranks from it")


def check_process_count(cfg: "Config", world: int, launch: str) -> None:
    """The first layout rule: the product of the parallel degrees against the processes started
    (`world`; `launch` says who started them: "torchrun started 2 processes" or "a single process,
    not launched by torchrun"). It runs before any model or batch rule, so a wrong process count is
    named first instead of a rule of a degree that was never going to run. The message lists each
    degree, what was started, and layouts of `world` processes that this model and data allow."""
    p = cfg.parallel
    if p.world_size == world:
        return
    product = " x ".join(f"{d} {getattr(p, d)}" for d in MESH_DEGREES)
    typed = [f"parallel.{d} = {getattr(p, d)}" for d in MESH_DEGREES if getattr(p, d) > 1] or [
        "the layout of one process (every parallel degree 1)"]
    fits = fitting_layouts(cfg, world)
    options = "; ".join(" ".join(f"--parallel.{d} {v}" for d, v in f.items()) for f in fits if f)
    if world == 1:
        other = "or set every parallel degree to 1 to train in this one process."
    elif options:
        other = f"or use a layout of {world} processes: {options}."
    else:
        other = f"or change the degrees so that their product is {world}."
    raise ConfigError(
        f"{', '.join(typed)} needs {p.world_size} process{'es' if p.world_size > 1 else ''} ({product}), but "
        f"{launch}; launch "
        f"`{launcher_command(p.world_size)}`, {other}")


# The layout rules of the model and the data: the layouts a wrong process count is offered pass them
# (the user's other settings keep their own rules, named once the process count is right).
MODEL_AND_DATA_RULES = frozenset({"tp-whole-heads", "tp-divides-vocab", "tp-divides-mlp", "sp-divides-sequence",
                                  "cp-whole-chunks", "sp-divides-cp-chunk", "pp-whole-layers"})


def fitting_layouts(cfg: "Config", world: int, most: int = 3) -> list[dict[str, int]]:
    """Up to `most` layouts of exactly `world` processes that pass this model's and data's layout
    rules (TP degrees, pipeline stages of whole layers, CP chunks), as {degree: value} of the
    degrees > 1; those closest to what was typed first (the most typed degrees kept, then the
    fewest degrees changed)."""
    p = cfg.parallel
    found = []

    def walk(i: int, left: int, chosen: dict[str, int]) -> None:
        if i == len(MESH_DEGREES):
            if left == 1:
                found.append(dict(chosen))
            return
        for v in divisors(left):
            walk(i + 1, left // v, {**chosen, MESH_DEGREES[i]: v})

    walk(0, world, {})

    def allowed(c: dict[str, int]) -> bool:
        probe = dataclasses.replace(cfg, parallel=dataclasses.replace(p, **c))
        try:
            probe.parallel.check()  # (expert parallelism's shard dimension)
        except ConfigError:
            return False
        return not any(rule.broken(probe) for rule in LAYOUT_RULES if rule.name in MODEL_AND_DATA_RULES)

    def closeness(c: dict[str, int]) -> tuple[int, int, int]:
        kept = sum(1 for k in MESH_DEGREES if getattr(p, k) > 1 and c[k] > 1)
        changed = sum(1 for k in MESH_DEGREES if c[k] != getattr(p, k))
        plainest = sum(PLAINEST.index(k) for k in MESH_DEGREES if c[k] > 1)  # data parallel before cp / pp
        return (-kept, changed, plainest)

    ranked = sorted((c for c in found if allowed(c)), key=closeness)
    return [{k: v for k, v in c.items() if v > 1} for c in ranked[:most]]


def check_cross_section(cfg: "Config") -> None:
    """The rules that span sections, the first broken one raised (`config_refusals` names them all)."""
    for check in CROSS_SECTION_CHECKS:
        check(cfg)


def config_refusals(cfg: "Config") -> list[Refusal]:
    """Every reason `Config.validate` finds to refuse `cfg`, in its order: each section's first problem,
    each cross-section check's first, and every broken layout rule (`layout_rules.LAYOUT_RULES`). What
    `lmforge plan` shows for a layout lmforge refuses; `Config.validate` raises the first."""
    out: list[Refusal] = []
    checks = [(f.name, getattr(cfg, f.name).check) for f in dataclasses.fields(cfg)
              if dataclasses.is_dataclass(getattr(cfg, f.name))]
    for name, check in checks + [(c.__name__, lambda c=c: c(cfg)) for c in CROSS_SECTION_CHECKS]:
        try:
            check()
        except LayoutRefused as exc:
            out += exc.refusals
        except ConfigError as exc:
            out.append(Refusal(name, str(exc)))
    return out


def check_parametrization(cfg: "Config") -> None:
    """μP (model.parametrization = 'mup') needs an optimizer with a μP learning-rate rule."""
    if cfg.model.parametrization == "mup" and REGISTRY[cfg.optim.name].mup_rule is None:
        raise ConfigError(f"model.parametrization = 'mup' has no learning-rate rule for optim.name = "
                          f"{cfg.optim.name!r} (its update is scaled by the parameter's own norm, which μP's tables do "
                          f"not cover); use one of {', '.join(s.name for s in SPECS if s.mup_rule)}, or "
                          f"model.parametrization = 'sp'.")


def check_data_recipes(cfg: "Config") -> None:
    """data.stages' learning-rate hook on a WSD schedule, once; packing and stages apply to pre-training
    data (supervised fine-tuning rows have their own packing: finetune.pack). (A stage that starts at or
    after train.steps is allowed: it is not reached, and the run header says so.)"""
    d, s = cfg.data, cfg.schedule
    decays = [i for i, stage in enumerate(d.stages) if stage.lr_decay]
    if len(decays) > 1:
        raise ConfigError(f"data.stages{decays}: lr_decay = true on more than one stage; the decay starts once, at "
                          f"one stage.")
    if decays:
        stage = d.stages[decays[0]]
        if s.name != "wsd":
            raise ConfigError(f"data.stages[{decays[0]}].lr_decay = true starts the decay of a warmup-stable-decay "
                              f"schedule, but schedule.name = {s.name!r}; set schedule.name = 'wsd'.")
        if stage.start_step < s.warmup_steps:
            raise ConfigError(f"data.stages[{decays[0]}].lr_decay = true at start_step = {stage.start_step} falls in "
                              f"the warmup (schedule.warmup_steps = {s.warmup_steps}); start the stage after it.")
    check_stage_sources(cfg)
    if cfg.finetune.data and (d.stages or d.packing != "concat"):
        raise ConfigError("data.stages and data.packing apply to pre-training token data, not to finetune.data rows "
                          "(those pack with finetune.pack); leave them at their defaults.")
    if d.attention == "document":
        m = cfg.model
        for key, value, why in (
                ("model.mla.kv_lora_rank", m.mla.kv_lora_rank, "multi-head latent attention builds its own causal "
                                                               "mask and takes no document mask"),
                ("model.mtp_depth", m.mtp_depth, "the MTP modules shift each sequence by k tokens, across document "
                                                 "boundaries")):
            if value:
                raise ConfigError(f"data.attention = 'document' is not supported with {key} = {value} yet ({why}); "
                                  f"set data.attention = 'causal' or {key} = 0.")


def unknown_stage_sources(key: str, label: str, unknown: list[str], names: list[str]) -> str:
    """The error of stage `key` (named `label`) whose weights name sources not among `names`."""
    known = list(names) if list(names) != [""] else "none: data.corpus is one unnamed source (leave weights empty)"
    return (f"{key}{f' ({label!r})' if label else ''}.weights names unknown sources {sorted(unknown)}; the prepared "
            f"mixture's sources: {known}.")


def check_stage_sources(cfg: "Config") -> None:
    """Each stage's weights name sources of data.corpus's prepared mixture: read from its manifest
    (train/mixture.json, not the shards) with the rest of the config, so a typo stops the run before
    anything loads rather than when the data opens. A corpus not prepared yet (or not a mixture) is
    checked there instead (lmforge.data.mixture.configured_stages)."""
    d = cfg.data
    if not any(st.weights for st in d.stages) or d.corpus == "default":
        return
    train = Path(d.corpus).expanduser() / "train"
    if not (train / MIXTURE).is_file():
        return
    try:
        names = [name for name, _, _ in mixture_entries(train)]
    except (ValueError, OSError):  # a damaged manifest: the loader says so, naming the file
        return
    for i, st in enumerate(d.stages):
        unknown = sorted(set(st.weights) - set(names))
        if unknown:
            raise ConfigError(unknown_stage_sources(f"data.stages[{i}]", st.name, unknown, names))


def check_multi_token_prediction(cfg: "Config") -> None:
    """model.mtp_depth: the modules shift each sequence by k tokens and reuse the embedding and the head,
    so they need whole sequences and both ends of the model on one rank."""
    m, p = cfg.model, cfg.parallel
    if not m.mtp_depth:
        return
    for key, value, why in (("pp", p.pp, "the MTP modules need the embedding (first stage) and the head (last stage)"),
                            ("cp", p.cp, "the MTP modules shift each sequence by k tokens across the CP chunks"),
                            ("async_sgd", p.async_sgd, "its loop computes the language-model loss only")):
        if value not in (1, False):
            raise ConfigError(f"model.mtp_depth = {m.mtp_depth} is not supported with parallel.{key} = {value} yet "
                              f"({why}); set model.mtp_depth = 0 or parallel.{key} to its default.")
    if p.sequence_parallel:
        raise ConfigError(f"model.mtp_depth = {m.mtp_depth} is not supported with parallel.sequence_parallel = true "
                          f"yet (the MTP modules' norms and projection are not sequence-parallel modules); set "
                          f"parallel.sequence_parallel = false or model.mtp_depth = 0.")


def check_data_vs_model(cfg: "Config") -> None:
    m, d = cfg.model, cfg.data
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len = {d.seq_len} exceeds model.max_seq_len = {m.max_seq_len}; raise "
                          f"model.max_seq_len or lower data.seq_len.")
    if d.tokenizer == "bpe" and d.tokenizer_vocab_size > m.vocab_size:
        raise ConfigError(f"data.tokenizer_vocab_size = {d.tokenizer_vocab_size} exceeds model.vocab_size = "
                          f"{m.vocab_size}; the embedding must have a row per token.")
    if d.tokenizer == "gpt2" and m.vocab_size < 50257:
        raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the GPT-2 vocabulary (50257); use 50304.")


def check_batch(cfg: "Config") -> None:
    """global batch = micro batch x accumulation x dp; warmup within the run; the ramp-up's grid."""
    t, s, p = cfg.train, cfg.schedule, cfg.parallel
    if s.warmup_steps >= t.steps:
        raise ConfigError(f"schedule.warmup_steps = {s.warmup_steps} must be < train.steps = {t.steps}; lower the "
                          f"warmup or train longer.")
    if s.batch_rampup_start and (p.pp > 1 or p.async_sgd):
        raise ConfigError(f"schedule.batch_rampup_start with parallel.{'pp > 1' if p.pp > 1 else 'async_sgd'}: "
                          "the pipeline schedule / parameter server has a fixed batch; turn the batch ramp-up off.")
    if t.micro_batch_size == "auto":  # chosen at run start among the sizes the layout can run
        if not valid_micro_batches(cfg):
            raise ConfigError(
                f"train.micro_batch_size = 'auto': no micro-batch fits the layout: train.global_batch_size = "
                f"{t.global_batch_size} must be divisible by the data-parallel degree ({p.dp} = parallel.dp_replicate "
                f"x parallel.dp_shard)" + (f", leave >= parallel.pp = {p.pp} micro-batches per step" if p.pp > 1
                                           else "") + (", and keep schedule.batch_rampup_start and its increment "
                                                       "multiples of micro-batch x dp" if s.batch_rampup_start else "")
                + "; change train.global_batch_size or set train.micro_batch_size to a number.")
        return
    per_step = t.micro_batch_size * p.dp
    if s.batch_rampup_start:
        inc = s.batch_rampup_increment or per_step
        if s.batch_rampup_start % per_step or inc % per_step:
            raise ConfigError(
                f"schedule.batch_rampup_start = {s.batch_rampup_start} and schedule.batch_rampup_increment = "
                f"{inc} must be multiples of train.micro_batch_size x dp = {per_step}.")
        if not 0 < s.batch_rampup_start <= t.global_batch_size or (t.global_batch_size - s.batch_rampup_start) % inc:
            raise ConfigError(
                f"schedule.batch_rampup_start = {s.batch_rampup_start} must be <= train.global_batch_size = "
                f"{t.global_batch_size}, and their difference a multiple of the increment {inc}.")
    if p.async_sgd:  # each server update is one worker's micro-batch: the global batch does not apply
        return
    if t.global_batch_size % per_step:
        lo = (t.global_batch_size // per_step) * per_step
        hint = f"{lo} or {lo + per_step}" if lo else f"{per_step}"
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel degree ({p.dp} = parallel.dp_replicate x "
            f"parallel.dp_shard); use global_batch_size = {hint}, or change micro_batch_size.")


def check_features(cfg: "Config") -> None:
    """Training features against the layout: loss_chunk, fp16, fp8, CUDA graphs, periodic checkpoints of
    async SGD, the hang watchdog before the collective timeout."""
    t, p = cfg.train, cfg.parallel
    if t.hang_factor > 0 and t.hang_min_s >= p.timeout_s:
        raise ConfigError(f"train.hang_min_s = {t.hang_min_s:g} must be below parallel.timeout_s = {p.timeout_s:g}: the "
                          f"hang watchdog writes the stacks before a collective times out; lower train.hang_min_s "
                          f"(or raise parallel.timeout_s).")
    if t.compile_mode == "reduce-overhead" and cfg.grad_accum_steps > 1:
        raise ConfigError(
            f"train.compile_mode = 'reduce-overhead' (CUDA graphs) with {cfg.grad_accum_steps} micro-batches per step: "
            f"torch's CUDA-graph trees hand a compiled region's gradient outputs to .grad and overwrite them at the "
            f"next micro-batch's replay (pytorch/pytorch#169545). Set train.micro_batch_size so that one micro-batch "
            f"makes the step (global_batch_size / dp = {t.global_batch_size // p.dp}), or another train.compile_mode.")
    if t.precision != "auto":  # (what auto resolves to is checked once it is known: check_resolved_precision)
        check_resolved_precision(cfg, t.precision)
    if cfg.model.deltanet.kernel == "fla" and cfg.model.has_linear_layers:
        if t.device == "cpu":
            raise ConfigError("model.deltanet.kernel = 'fla' runs flash-linear-attention's Triton kernels, which need "
                              "CUDA; train.device = 'cpu': set model.deltanet.kernel = 'auto' (the PyTorch form there).")
        if importlib.util.find_spec("fla") is None:
            raise ConfigError("model.deltanet.kernel = 'fla' needs the flash-linear-attention package, which is not "
                              "installed: `pip install flash-linear-attention`, or set model.deltanet.kernel = 'auto'.")
    if t.fp8:
        if t.fp8_all_gather is True and not (p.fsdp and t.fp8_recipe == "tensorwise"):
            why = "no FSDP2 in this layout (zero_stage 2/3, or 1 under tp / pp)" if not p.fsdp else \
                f"train.fp8_recipe = {t.fp8_recipe!r} (torchao gathers FP8 shards with tensorwise scales only)"
            raise ConfigError(f"train.fp8_all_gather = true does not apply: {why}; set train.fp8_all_gather = 'auto' "
                              f"(on where it applies) or false.")
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("train.fp8 = true needs the torchao package (torchao.float8), which is not "
                              "installed: `pip install torchao`, or set train.fp8 = false.")
    if p.async_sgd and (t.ema_decay or t.eval_tasks):
        key = "train.ema_decay" if t.ema_decay else "train.eval_tasks"
        raise ConfigError(f"{key} is not supported with parallel.async_sgd = true (the parameter server's loop keeps "
                          f"no EMA and scores no tasks); unset {key} or use a synchronous layout.")
    if p.async_sgd and cfg.checkpoint.every_steps:
        raise ConfigError("parallel.async_sgd = true does not write periodic checkpoints (the parameter "
                          "server's state is not checkpointed yet; checkpoint.every_minutes is ignored); set "
                          "checkpoint.every_steps = 0.")


def check_linear_attention(cfg: "Config") -> None:
    """Gated DeltaNet blocks (model.layer_types): what does not run with them yet, beside the layouts
    (config/layout_rules.py, linear-attention-layouts)."""
    m = cfg.model
    if not m.has_linear_layers:
        return
    blocks = sum(m.is_linear_layer(i) for i in range(m.n_layers))
    if cfg.data.attention == "document":
        raise ConfigError(f"data.attention = 'document' is not supported with linear-attention blocks (model."
                          f"layer_types / full_attention_interval make {blocks} of them) yet: a Gated DeltaNet state "
                          f"runs across document boundaries; set data.attention = 'causal'.")
    if cfg.optim.name == "muon":
        raise ConfigError("optim.name = 'muon' is not supported with linear-attention blocks (model.layer_types / "
                          "full_attention_interval) yet: Muon takes matrices, and Gated DeltaNet's convolutions are "
                          "3-D; use optim.name = 'adamw'.")


def check_fault_tolerance(cfg: "Config") -> None:
    """fault_tolerance.enabled: what a replica group may be (lmforge.train.fault_tolerance averages
    each rank's part of the gradients, its local shards, with the same rank of the other groups: one
    process, DDP, FSDP2, TP, PP, CP or EP ranks, every group alike)."""
    f, p = cfg.fault_tolerance, cfg.parallel
    if not f.enabled:
        return
    if p.async_sgd:
        raise ConfigError("fault_tolerance.enabled with parallel.async_sgd = true: the parameter server has its own "
                          "loop; use one of them.")
    sharded = p.fsdp or p.tp > 1 or p.pp > 1
    if f.diloco_sync_every and sharded:
        raise ConfigError("fault_tolerance.diloco_sync_every with a sharded layout in the group (FSDP2: dp_shard > 1 "
                          "or zero_stage 2/3, tp or pp > 1): DiLoCo's state (the weights at the last sync, the outer "
                          "momentum) is checkpointed as whole parameters, not as this rank's shards; use DDP ranks "
                          "in each group, or diloco_sync_every = 0.")
    if f.batch_policy == "keep" and p.pp > 1:
        raise ConfigError("fault_tolerance.batch_policy = 'keep' with parallel.pp > 1: a pipeline schedule runs a "
                          "fixed number of micro-batches per step, and 'keep' trains a missing group's micro-batches "
                          "as a pass of another count; use batch_policy = 'shrink'.")
    if cfg.guard.enabled:
        raise ConfigError("fault_tolerance.enabled needs guard.enabled = false: the guard judges each group's own "
                          "loss, so one group could skip an update another makes and the replicas would diverge.")
    if cfg.schedule.batch_rampup_start:
        raise ConfigError("fault_tolerance.enabled with schedule.batch_rampup_start: not supported (a rejoining "
                          "group takes its peer's position, not its ramp-up).")
    if f.diloco_sync_every and cfg.train.precision == "fp16":
        raise ConfigError("fault_tolerance.diloco_sync_every with train.precision = 'fp16': a step the loss scale "
                          "skips would put one group's count of inner steps behind the others'; use bf16 or fp32.")
    if f.diloco_sync_every and cfg.train.steps % f.diloco_sync_every:
        raise ConfigError(f"fault_tolerance.diloco_sync_every = {f.diloco_sync_every} must divide train.steps = "
                          f"{cfg.train.steps}, so that the run ends on a sync (its last steps would otherwise stay "
                          f"each group's own); e.g. train.steps = "
                          f"{-(-cfg.train.steps // f.diloco_sync_every) * f.diloco_sync_every}.")
    if f.diloco_fragments > cfg.model.n_layers:
        raise ConfigError(f"fault_tolerance.diloco_fragments = {f.diloco_fragments} is more than model.n_layers = "
                          f"{cfg.model.n_layers} (each fragment holds whole blocks).")


# The cross-section checks in the order `Config.validate` runs them (the layout's rules: `check_layout`).
CROSS_SECTION_CHECKS: tuple[Callable[["Config"], None], ...] = (
    check_data_vs_model, check_batch, check_layout, check_features, check_parametrization, check_data_recipes,
    check_multi_token_prediction, check_linear_attention, check_fault_tolerance)


def check_resolved_precision(cfg: "Config", precision: str, why: str = "") -> None:
    """The layout's rules on the precision the run really trains in: train.precision resolved
    (`precision`; `why` says how `auto` came to it: the hardware, or the checkpoint being resumed).
    A config rule cannot know what `auto` resolves to, so the trainer calls this once it does;
    `check_features` calls it on an explicit value, for an early error."""
    t, p = cfg.train, cfg.parallel
    if (p.tp > 1 or p.pp > 1) and precision == "fp16":
        what = "train.precision = 'fp16'" if t.precision == precision else \
            f"train.precision = {t.precision!r} resolved to 'fp16'" + (f" ({why})" if why else "")
        raise ConfigError(f"{what}, but fp16 (GradScaler) is not supported with parallel.tp = {p.tp} / parallel.pp "
                          f"= {p.pp}: the loss scale and its skipped steps are not agreed across tensor-parallel "
                          f"ranks and pipeline stages. Set train.precision = 'fp32' (or 'bf16' on hardware with bf16).")


AUTO_LOSS_CHUNK = 4096  # tokens per chunk of train.loss_chunk = "auto"
AUTO_LOSS_CHUNK_MIN_VOCAB = 8192
# (device type, precision) where the fused head + loss was measured slower than the plain logits:
# "auto" leaves it off there. Measured (benchmarks/fused_head.py; benchmarks/RESULTS.md): CPU fp32
# faster (1.4-2.4x); CPU bf16 autocast not shown faster (0.67x and 1.06x on a loaded 2-core AMD EPYC
# with avx512_bf16) and a higher peak at small batches: off. CUDA: the
# GPU suite's `head-loss` row (benchmarks/gpu/suite.py) measures GPT-2's head in bf16 and fails if this
# rule picks the slower path; add the pair here then.
FUSED_HEAD_SLOWER: frozenset[tuple[str, str]] = frozenset({("cpu", "bf16")})


# Presets of more than this many parameters train in bf16-pure (bf16 weights and activations over fp32
# master weights and gradients: Megatron's scheme), which trained faster than bf16 autocast on an H100
# (benchmarks/RESULTS.md: GPT-2 124M +2.5%, the 1B +2.1%) and plans less activation memory (a bf16
# residual stream: Megatron's GPT-3 layout 73.3 -> 66.4 GB per GPU); tests/test_config.py holds every
# preset to it, and `lmforge plan` says where a plan's bf16-pure comes from.
BF16_PURE_PRESETS_ABOVE = 10e9


def fp8_all_gather(cfg: "Config") -> bool:
    """train.fp8_all_gather as the layout uses it: FSDP2 gathers FP8 shards where asked (true) or where it
    applies (auto: FSDP2 and the tensorwise recipe; check_features refuses true elsewhere)."""
    t = cfg.train
    return bool(t.fp8 and t.fp8_all_gather and cfg.parallel.fsdp and t.fp8_recipe == "tensorwise")


def preset_precision_note(cfg: "Config", precision: str) -> str | None:
    """The plan's line for a bf16-pure that came from a large preset's train.precision (else None)."""
    if precision != "bf16-pure" or cfg.train.precision != "bf16-pure":
        return None
    return (f"precision bf16-pure: {cfg.preset}'s train.precision (presets of more than "
            f"{BF16_PURE_PRESETS_ABOVE / 1e9:g}B parameters train in bf16 weights and activations over fp32 master "
            f"weights and gradients, as Megatron does); --precision bf16 plans bf16 autocast")


# train.precision -> the precision its matmuls compute in (bf16-pure: bf16, without autocast)
COMPUTE_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "bf16", "fp8": "bf16"}  # (the planner's fp8: train.fp8 over bf16)


def compute_precision(precision: str) -> str:
    """The matmul precision of a resolved train.precision ('fp32' | 'bf16' | 'fp16'): what peaks,
    byte counts and the rules measured per dtype are looked up by."""
    return COMPUTE_PRECISION[precision]


def resolve_loss_chunk(cfg: "Config", device_type: str, precision: str) -> int:
    """train.loss_chunk as the layout uses it: the configured number, or for "auto" 4096-token chunks
    wherever the fused, chunked cross-entropy is not slower than the plain logits (every device and
    precision but FUSED_HEAD_SLOWER's), for model.vocab_size >= 8192, where the layout can use it
    (parallel.tp = parallel.pp = 1: with TP the loss is torch's vocab-parallel loss_parallel on
    vocab-sharded logits); else 0."""
    t, p = cfg.train, cfg.parallel
    if t.loss_chunk != "auto":
        return t.loss_chunk
    if p.tp > 1 or p.pp > 1 or (device_type, compute_precision(precision)) in FUSED_HEAD_SLOWER:
        return 0
    return auto_loss_chunk(cfg.model.vocab_size)


def auto_loss_chunk(vocab_size: int) -> int:
    """The chunk of train.loss_chunk = "auto" where the layout, device and precision allow it: 4096
    tokens for a vocabulary of at least 8192, else 0 (the plain logits)."""
    return AUTO_LOSS_CHUNK if vocab_size >= AUTO_LOSS_CHUNK_MIN_VOCAB else 0


# train.compile = "auto": the device types where per-block torch.compile was measured faster over a
# run. CUDA: GPT-2 124M, bf16, 16 x 1024 tokens x 4 micro-batches, fused AdamW, on one H100 80GB
# (torch 2.11; benchmarks/train_throughput.py, benchmarks/RESULTS.md): 331,801 tokens/s compiled
# against 278,865 eager (1.19x); the GPU suite's gpt2-compile row measures it again against
# gpt2-plain. CPU (inductor's C++ backend): off. On a loaded 2-core AMD EPYC (avx512_bf16), tiny
# preset, 1 thread, 32 x 128 tokens per step (benchmarks/train_throughput.py): compiled steps took
# 5-9% less CPU time (fp32 and bf16 autocast; dim 256: 9% in fp32, none in bf16), after a cold
# compile of ~19 CPU-s (37-47 s of wall time there) in the first steps: ~130-350 steps to earn it
# back (never where nothing is gained), more than most CPU runs and every test train
# (benchmarks/RESULTS.md).
COMPILE_FASTER_ON: frozenset[str] = frozenset({"cuda"})
COMPILE_MIN_CAPABILITY = (7, 0)  # Triton (inductor's GPU backend) needs a Volta or newer GPU


def resolve_compile(cfg: "Config", device_type: str, capability: tuple[int, int] | None = None,
                    gpu_compiles: bool | None = None) -> tuple[str | bool, str]:
    """train.compile as the layout applies it: False (eager), "blocks" (each transformer block
    compiled) or "model" (the whole training forward and its loss as one graph), and why (one
    phrase for the run's log). true = "blocks". "model" where the layout runs the whole model in one
    call it can trace (`whole_model_blocker`), else "blocks" with the reason. "auto": "blocks" where
    per-block torch.compile was measured faster (COMPILE_FASTER_ON: CUDA) and can run (Triton
    installed; `capability`, the GPU's compute capability where known, at least
    COMPILE_MIN_CAPABILITY), off with tensor parallelism (per-block compile runs there and matches
    one process, below, but is not measured faster on a GPU: `lmforge plan` ranks TP layouts by what
    auto runs), off for Mixture-of-Experts models (fp32 on CPU, torch 2.13: dynamo's
    fake-tensor rule of torch._grouped_mm wants bf16 inputs, so the first compiled step raises; and
    the routed experts' shapes depend on the data: graph breaks, recompiles) and everywhere else.
    PP, FSDP2 and TP (+ SP) with per-block compile match one process (benchmarks/parity_layouts.py
    --case pp2-1f1b-compile / fsdp2-compile / tp2-compile / tp2-sp-compile; TP once the embedding's
    output is its own tensor: lmforge.parallel.tensor_parallel.unalias_embedding_output). "auto"
    never picks "model" until a GPU measures it against per-block compile (the GPU suite's compile
    rows). Off under the zero-bubble pipeline schedules (their split backward does not run compiled
    stages: pytorch/pytorch#161904). `gpu_compiles` (lmforge plan, which plans for a GPU it does not
    run on): whether the GPU can compile, instead of looking for Triton here."""
    t = cfg.train
    if t.compile == "model":
        blocker = whole_model_blocker(cfg)
        whole = "each pipeline stage's forward as one graph" if cfg.parallel.pp > 1 else \
            "the whole forward and loss as one graph"
        return ("blocks", f"train.compile = model, per block instead: {blocker}") if blocker else \
            ("model", f"train.compile = model: {whole}")
    if t.compile in (True, "blocks"):
        return "blocks", f"train.compile = {str(t.compile).lower()}"
    if t.compile is False:
        return False, "train.compile = false"
    if cfg.parallel.split_backward:
        return False, (f"auto: off with parallel.pp_schedule = {cfg.parallel.pp_schedule!r} (torch's zero-bubble "
                       f"schedules do not run compiled stages: pytorch/pytorch#161904)")
    if device_type not in COMPILE_FASTER_ON:
        return False, (f"auto: off on {device_type}: a compile of tens of seconds for a few % per step, "
                       f"benchmarks/RESULTS.md; set train.compile = blocks or model for a long run")
    if cfg.parallel.tp > 1:
        return False, ("auto: off with parallel.tp > 1 (compiled blocks match one process there: benchmarks/"
                       "parity_layouts.py --case tp2-sp-compile; not measured faster on a GPU yet); set "
                       "train.compile = true to use it")
    if cfg.model.moe.num_experts > 0:
        return False, ("auto: off for Mixture-of-Experts models (compiled MoE blocks fail in torch._grouped_mm's "
                       "tracing on CPU and have data-dependent shapes); set train.compile = true to try it")
    blocker = gpu_compile_blocker(capability) if gpu_compiles is None else (
        None if gpu_compiles else "the GPU cannot compile")
    if blocker:
        return False, f"auto: off on {device_type}: {blocker}"
    return "blocks", (f"auto: per block on {device_type} (measured 1.19x tokens/s on an H100: "
                      f"benchmarks/RESULTS.md; train.compile = model is not measured on a GPU yet)")


def whole_model_blocker(cfg: "Config") -> str | None:
    """Why the layout cannot run the whole model (a pipeline: each stage's forward) as one compiled
    graph (train.compile = model), or None: one process and DDP / ZeRO-1 can (torch.compile splits
    DDP's graph at its buckets), and so can a pipeline's stages, each its own graph (the schedule
    calls a stage per micro-batch; the loss is the schedule's, outside). FSDP2 gathers and frees each
    block's parameters in hooks around the block, which a whole-model graph would have to trace
    (torch's compiled autograd, not used); tensor parallelism's DTensor modules compile per block
    (train.compile = true), and so does context parallelism (its attention's collectives). A
    Mixture-of-Experts model does not trace as one graph yet (torch 2.13, bf16-pure, CPU):
    `torch.bincount`'s output size depends on the data (dynamo: "Could not guard on data-dependent
    expression"; pytorch/pytorch#192343), and with counts of a static shape the load statistics'
    `torch._C._current_graph_task_id()` (activation-checkpoint recompute detection) is an
    untraceable non-tensor op."""
    p = cfg.parallel
    if cfg.model.moe.num_experts > 0:
        return ("a Mixture-of-Experts model's routing has data-dependent shapes (torch.bincount: "
                "pytorch/pytorch#192343) and reads "
                "autograd's graph task in its statistics, which one graph cannot trace")
    if p.tp > 1:
        return "tensor parallelism's DTensor modules (parallel.tp > 1)"
    if p.cp > 1:  # (per block, context parallelism matches one process: parity_layouts.py --case cp2-compile)
        return "context parallelism's K/V collectives inside attention (one graph not tried with them)"
    if p.fsdp or (p.pp > 1 and p.dp * p.cp > 1):  # (a pipeline's data-parallel stages are FSDP2 chunks)
        return "FSDP2 gathers and frees each block's parameters in hooks around it"
    return None


def document_kernel_rule(device_type: str, dropout_p: float, flex_runs: bool) -> str:
    """The attention kernel of data.attention = "document" (lmforge.model.documents): "flex"
    (FlexAttention's block mask) on CUDA where FlexAttention compiles (`flex_runs`) and without
    dropout, else "sdpa" (a dense boolean mask). Shared by the run and the planner (which plans a GPU
    with Triton, as it plans train.compile)."""
    return "flex" if device_type == "cuda" and dropout_p == 0.0 and flex_runs else "sdpa"


def gpu_compile_blocker(capability: tuple[int, int] | None = None) -> str | None:
    """Why torch.compile cannot make GPU kernels here (one phrase), or None where it can: Triton
    installed and `capability` (the GPU's compute capability, where known) at least
    COMPILE_MIN_CAPABILITY. The one check behind every compiled GPU path: train.compile = "auto" and
    the chunked loss's compiled elementwise part (lmforge.model.loss.use_compiled_chunk)."""
    if not triton_installed():
        return "torch.compile's GPU backend needs the triton package"
    if capability is not None and tuple(capability) < COMPILE_MIN_CAPABILITY:
        return (f"a GPU of compute capability {capability[0]}.{capability[1]} (Triton needs "
                f"{COMPILE_MIN_CAPABILITY[0]}.{COMPILE_MIN_CAPABILITY[1]} or newer)")
    return None


def triton_installed() -> bool:
    """Whether torch.compile's GPU backend (Triton) can be imported here."""
    return importlib.util.find_spec("triton") is not None
