"""`lmforge plan`: will it fit, how long, how much, and which layout, from the config alone.

    lmforge plan --model PRESET_OR_TOML [--set KEY=VALUE ...] --gpus 8xA100-80GB [--nodes N]
                 [--layout dp=8,zero=3,cp=1,tp=1,pp=1,mb=1,ac=full] [--global-batch-tokens T]
                 [--seq-len S] [--tokens D] [--flops palm|6N] [--ideal --mfu 0.4] [--price 2.0]
                 [--optimizer adamw] [--precision bf16] [--weights lmforge,megatron,zero-paper|all]
                 [--devices extra.toml] [--usable 0.9]
                 [--search [--allow-offload [--host-memory-gb 2048]] [--top 10]] [--json] [--loss FIT.json] [--verify]

Defaults come from the model's config: sequence length `data.seq_len`, global batch
`train.global_batch_size` x seq_len tokens, training tokens those of the config's run
(`train.steps` steps, the batch ramp-up included),
optimizer `optim.name`, precision `train.precision` ('auto' = bf16 if the device has it, else fp16, else fp32), micro-batch `train.micro_batch_size`
("auto": the largest whose planned peak fits in 85% of the GPU), compile `train.compile` (as resolved on CUDA),
activation checkpointing `train.activation_checkpoint`, the chunked loss `train.loss_chunk` (as resolved on
CUDA; 0 under tp or pp > 1; layout key loss_chunk=N overrides it), tp/pp/cp from `[parallel]`; the default
layout spends the rest of the GPUs on data parallelism (ZeRO-3 when parallel.dp_shard > 1). A layout that
`lmforge train` would refuse (lmforge.config.layout_rules: e.g. Megatron's ZeRO-1 with TP and PP) is planned all
the same, to compare, with every reason at the top (--json: `refused`).

Memory is shown under each convention asked for (`--weights`, default all three: "lmforge" =
what lmforge allocates, "megatron" = Megatron-LM's estimator (18 B/param), "zero-paper" = the
ZeRO paper's 16 B/param); the search fit-checks with "lmforge" whenever it is among them (planning an lmforge
run), else with the first one named, and says which. The step time is the model per op kind of
`lmforge.plan.op_time` (its constants: `lmforge.plan.hardware.H100_CALIBRATION`); `--ideal --mfu X`
is the back-of-envelope estimate at an end-to-end MFU instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from lmforge.plan.flops import config_train_tokens, estimate_step
from lmforge.cli.options import OptionParser, float_in, int_in, positive_int
from lmforge.plan.hardware import load_devices, parse_cluster
from lmforge.config.rules import pipeline_micro_batches, preset_precision_note
from lmforge.plan.conventions import CONVENTIONS
from lmforge.plan.documents import corpus_document_tokens, prepared_train_dir
from lmforge.plan.layout import (Layout, layout_for_config, lmforge_refusals, planned_compile, planned_documents,
                                 planned_loss_chunk, refusal_lines)
from lmforge.plan.loss_prediction import loss_lines, predict_loss
from lmforge.plan.memory import estimate_memory
from lmforge.plan.micro_batch import AUTO_HEADROOM, largest_fitting
from lmforge.plan.report import candidates_table, memory_table, step_table, to_json
from lmforge.plan.search import search_layouts
from lmforge.spec.precision import hardware_precision

_WEIGHTS_ALIASES = {"all": CONVENTIONS, "both": ("lmforge", "megatron")}


def parse_conventions(text: str) -> tuple[str, ...]:
    """'lmforge,megatron' -> ('lmforge', 'megatron'); 'all' -> every convention."""
    names: list[str] = []
    for item in filter(None, (p.strip().lower() for p in text.split(","))):
        for name in _WEIGHTS_ALIASES.get(item, (item,)):
            if name not in CONVENTIONS:
                raise ValueError(f"--weights {text!r}: unknown convention {item!r}; use {', '.join(CONVENTIONS)}, "
                                 f"a comma-separated list of them, or all")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError(f"--weights {text!r} names no convention; use {', '.join(CONVENTIONS)} or all")
    return tuple(names)


def _parse_sets(items: list[str]) -> dict:
    """`--set key=value` options as config overrides (values parsed as on `lmforge train`'s command line)."""
    from lmforge.config.loading import parse_override_value

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: use KEY=VALUE, e.g. --set data.seq_len=32768")
        out[key.strip()] = parse_override_value(value.strip())
    return out


def build_parser() -> argparse.ArgumentParser:
    p = OptionParser(prog="lmforge plan", description="Memory, time, cost and the best layout for a model on a cluster.")
    p.add_argument("--model", required=True, help="preset name (e.g. llama2-70b) or path to a config TOML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="a config override, as `lmforge train --KEY VALUE` takes it (repeatable), e.g. "
                        "--set model.max_seq_len=131072 --set data.seq_len=131072 to plan a long-context run")
    p.add_argument("--gpus", required=True, help="cluster: 8xA100-80GB (one node), 64x8xH100 (nodes x GPUs x device) or H100")
    p.add_argument("--nodes", type=positive_int, default=None, help="number of nodes (multiplies a one-node --gpus spec)")
    p.add_argument("--layout", default=None,
                   help="dp=8,zero=3,cp=1,tp=1,pp=1,mb=1,ga=4,ac=full,sp=1,sched=1f1b,v=1,offload=0,"
                        "loss_chunk=4096 (cp: context parallelism, cp divides seq_len / 2; cpm=ulysses: its "
                        "all-to-all of heads instead of the K/V all-gather, cpm=allgather; dp left out fills the "
                        "cluster; loss_chunk left out: train.loss_chunk as resolved on CUDA)")
    p.add_argument("--global-batch-tokens", type=positive_int, default=None,
                   help="tokens per optimizer step, a multiple of the sequence length (default: from the config)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length (default: data.seq_len)")
    p.add_argument("--tokens", type=float_in(0, lo_open=True), default=None,
                   help="training tokens D (default: the config's run, train.steps steps with its batch ramp-up)")
    p.add_argument("--mfu", type=float_in(0, 1, lo_open=True, note="a fraction of the peak, e.g. 0.4"), default=None,
                   help="with --ideal: the run's end-to-end model FLOPs utilisation (PaLM: model FLOPs, recompute not "
                        "counted, / peak), applied as is. Without --ideal the step time comes from the time model per "
                        "op kind (lmforge/plan/op_time.py, constants in lmforge/plan/hardware.py)")
    p.add_argument("--flops", default="palm", choices=("palm", "6N"),
                   help="FLOPs per token: palm = 6N_matmul + 12*L*h*s (default) or 6N = 6 x all parameters")
    p.add_argument("--ideal", action="store_true",
                   help="back-of-envelope: time = D x FLOPs/token / (GPUs x peak x MFU), --mfu as is (no op-kind "
                        "model, bubble, communication or recompute time: they are inside the MFU)")
    p.add_argument("--price", type=float_in(0), default=None, help="price per GPU-hour for the cost estimate")
    p.add_argument("--optimizer", default=None, help="optimizer (default: optim.name)")
    p.add_argument("--precision", default=None, choices=("bf16", "fp16", "fp32", "fp8", "bf16-pure"),
                   help="default: train.precision. bf16-pure: bf16 weights and activations, fp32 master weights and "
                        "gradients in the optimizer")
    p.add_argument("--weights", default="all",
                   help="memory conventions to show, comma-separated: lmforge (what lmforge allocates), megatron "
                        "(Megatron-LM's estimator, 18 B/param), zero-paper (the ZeRO paper's 16 B/param), or all "
                        "(default). The search fit-checks with lmforge when listed, else with the first")
    p.add_argument("--devices", default=None, help="TOML file with extra devices")
    p.add_argument("--usable", type=float_in(0, 1, lo_open=True, note="a fraction of the device memory, e.g. 0.9"), default=0.9, help="fraction of device (and host) memory a plan may use (default 0.9)")
    p.add_argument("--search", action="store_true", help="enumerate and rank layouts that fit")
    p.add_argument("--allow-offload", action="store_true",
                   help="let --search also try CPU offload (FSDP's sharded states in host RAM, checked per node)")
    p.add_argument("--host-memory-gb", type=float_in(0, lo_open=True), default=None,
                   help="host RAM per node in GB, for --allow-offload (default: the device's reference system)")
    p.add_argument("--top", type=int_in(1, note="the number of layouts to show"), default=10, help="candidates to show with --search (>= 1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--loss", default=None, metavar="FIT.json",
                   help="a scaling-law fit (`lmforge scale fit`): print the run's predicted final loss with its "
                        "interval, and the compute-optimal N and D for its compute budget")
    p.add_argument("--verify", action="store_true",
                   help="certify the planned layout on this machine's CPU: scaled down (each degree to its smallest "
                        "divisor > 1) at toy width and depth, a few steps on gloo in the plan's precision against one "
                        "process (loss, gradient norm; 16 bits: within a band measured from reruns), a resume at another "
                        "world size, each rank's memory against this plan; PASS/FAIL per check, and a failing layout's "
                        "first diverging module (lmforge/verify/certify.py)")
    return p


def _check_args(args: argparse.Namespace) -> None:
    """Refuse impossible combinations up front, naming the flags (each number's range: its type=)."""
    if args.ideal and args.mfu is None:
        raise ValueError("--ideal applies an end-to-end MFU as is: give --mfu (e.g. --mfu 0.4)")
    if args.mfu is not None and not args.ideal:
        raise ValueError(f"--mfu {args.mfu:g} is the end-to-end MFU of --ideal; without --ideal the step time comes "
                         f"from the time model per op kind (its constants: lmforge/plan/hardware.py): add --ideal or "
                         f"drop --mfu")
    if args.host_memory_gb is not None and not args.allow_offload:
        raise ValueError("--host-memory-gb bounds CPU offload; it needs --search --allow-offload")
    if args.verify and args.json:
        raise ValueError("--verify prints its checks as lines; drop --json")
    if args.allow_offload and not args.search:
        raise ValueError("--allow-offload widens the layout search; add --search")


def _default_layout(cfg, cluster, seq_sequences: int, precision: str, layout_text: str | None,
                    seq_len: int, optimizer: str) -> tuple[Layout, list[str]]:
    """The layout to plan, from `--layout` over the config's settings, and notes on what was derived:
    dp fills the cluster; the micro-batch is the config's lowered to a divisor of the per-replica batch
    ("auto": the largest the memory plan fits in `AUTO_HEADROOM` of the device); compile and
    loss_chunk as lmforge resolves them on CUDA; a flag of the config's that does not apply to the
    layout is dropped, with a note, unless the user chose it."""
    auto_mb = cfg.train.micro_batch_size == "auto"
    # the config's layout (the one conversion: layout_for_config); grad_accum, reduce_every and loss_chunk are
    # derived below for the layout typed over it
    base = {**layout_for_config(cfg, precision, "cuda", 1 if auto_mb else cfg.train.micro_batch_size).to_dict(),
            "grad_accum": 1, "fsdp_reduce_every_micro_batch": False, "loss_chunk": 0}
    explicit = {item.split("=", 1)[0].strip().lower() for item in (layout_text or "").split(",") if "=" in item}
    notes: list[str] = []
    given = Layout.parse(layout_text or "", **base)
    if "loss_chunk" not in explicit:  # train.loss_chunk as lmforge runs it on GPUs under this tp / pp
        given.loss_chunk = planned_loss_chunk(cfg, precision, given.tp, given.pp)
    if "compile" not in explicit:  # train.compile as lmforge resolves it on CUDA under this tp
        given.compile = planned_compile(cfg, given.tp, given.pp, given.pp_schedule)
    if "documents" not in explicit:  # data.attention = "document" and its kernel on CUDA (lmforge.plan.documents)
        given.documents = planned_documents(cfg)
    if "doc_tokens" not in explicit and given.documents != "none":
        given.doc_tokens = corpus_document_tokens(cfg)
    given.validate(cfg.model, seq_len)  # values, then vs. the model
    model_ranks = given.cp * given.tp * given.pp  # the GPUs that one data-parallel replica spans
    if not ({"dp"} & explicit):
        if cluster.world_size % model_ranks:
            raise ValueError(f"cp x tp x pp = {given.cp} x {given.tp} x {given.pp} = {model_ranks} does not divide "
                             f"the {cluster.world_size} GPUs")
        given.dp = cluster.world_size // model_ranks
    if given.world_size != cluster.world_size:
        raise ValueError(f"layout uses dp x cp x tp x pp = {given.dp} x {given.cp} x {given.tp} x {given.pp} = "
                         f"{given.world_size} GPUs but --gpus gives {cluster.world_size}; the plan is for every GPU of "
                         f"the cluster: leave dp= out (it fills the cluster) or set dp = "
                         f"{cluster.world_size // model_ranks or 1}, or change --gpus")
    if given.zero and given.shard_ranks == 1:
        given.zero = 0
    _inherit_reduce_every(cfg, given, explicit, notes)
    typed_mb = {"mb", "micro_batch"} & explicit
    if not typed_mb and seq_sequences % given.dp == 0:
        per_dp = seq_sequences // given.dp
        if auto_mb:
            notes.append(_auto_micro_batch(cfg, cluster, given, per_dp, seq_len, optimizer))
        else:  # the config's micro-batch, lowered to the largest divisor of the per-replica batch
            given.micro_batch = max(k for k in range(1, min(given.micro_batch, per_dp) + 1) if per_dp % k == 0)
    if not ({"ga", "grad_accum", "m"} & explicit):
        per = given.micro_batch * given.dp
        if seq_sequences % per:
            raise ValueError(f"global batch of {seq_sequences} sequences is not divisible by micro-batch "
                             f"{given.micro_batch} x dp {given.dp}; change --global-batch-tokens or mb=")
        given.grad_accum = seq_sequences // per
    return given, notes


def data_plan(cfg) -> tuple[list[str], list[str]]:
    """The run header's lines about the data (lmforge.data.mixture.plan_for_config): the tokens each
    source gives each stage of data.stages and every source's epochs, and the warnings of sources
    repeated beyond data.max_epochs; none where data.corpus is not a prepared mixture folder."""
    train = prepared_train_dir(cfg)
    if train is None:
        return [], []
    from lmforge.data.mixture import plan_for_config

    rampup = None
    if cfg.schedule.batch_rampup_start:  # (torch only then: the trainer's BatchRampup)
        from lmforge.optim.schedules import config_batch_rampup

        rampup = config_batch_rampup(cfg)
    return plan_for_config(cfg, train, rampup.batch_at if rampup else None)


def _inherit_reduce_every(cfg, given: Layout, typed: set[str], notes: list[str]) -> None:
    """parallel.fsdp_reduce_every_micro_batch from the config, where it applies (FSDP without a
    pipeline). A preset's true that does not apply to the layout typed is dropped, with a note; one the
    user chose (their --set or TOML file) is an error, as a typed reduce_every=1 is."""
    key = "parallel.fsdp_reduce_every_micro_batch"
    if {"reduce_every", "fsdp_reduce_every_micro_batch"} & typed or not cfg.parallel.fsdp_reduce_every_micro_batch:
        return
    if given.fsdp and given.pp == 1:
        given.fsdp_reduce_every_micro_batch = True
        return
    why = (f"pp = {given.pp}: torch's pipeline schedule reduces FSDP2's gradients once per step" if given.pp > 1
           else f"the layout's data parallelism is {'ZeRO-1' if given.zero == 1 else 'DDP'}, not FSDP (zero=2/3)"
           if given.shard_ranks > 1 else "the layout has no data-parallel ranks to reduce-scatter over")
    if key in cfg.explicit_keys:
        raise ValueError(f"{key} = true does not apply to the layout {given.short()}: {why}; set it to false "
                         f"(--set {key}=false) or plan an FSDP layout without a pipeline")
    notes.append(f"{key} = true (the preset's) dropped: it applies to FSDP without a pipeline, and {why}")


def _auto_micro_batch(cfg, cluster, given: Layout, per_dp: int, seq_len: int, optimizer: str) -> str:
    """train.micro_batch_size = "auto": the largest size the layout can run whose lmforge-convention
    peak fits in AUTO_HEADROOM of the device's memory (lmforge.plan.micro_batch); sets it, returns a note."""
    sizes = pipeline_micro_batches(per_dp, given.pp, given.pp_schedule)
    if not sizes:
        raise ValueError(f"train.micro_batch_size = 'auto': no micro-batch leaves >= pp = {given.pp} micro-batches of "
                         f"the {per_dp} sequences per data-parallel rank; change --global-batch-tokens or type mb=")
    budget = AUTO_HEADROOM * cluster.device.memory_bytes
    m, planned, refused = largest_fitting(
        sizes, lambda k: dataclasses.replace(given, micro_batch=k, grad_accum=per_dp // k), cfg.model, optimizer,
        seq_len, budget)
    given.micro_batch = m
    return (f"train.micro_batch_size = auto -> {m}: the largest of {sizes} whose planned peak (lmforge) fits in "
            f"{AUTO_HEADROOM:.0%} of {cluster.device.memory_gb:g} GB: {planned / 1e9:.2f} GB{refused}")


def _resolve_precision(precision: str, device) -> str:
    """'auto' (the trainer's default) as the trainer resolves it on that GPU (lmforge.train.precision.
    hardware_precision: bf16-pure where it has bf16 tensor cores, a bf16 peak, else fp16), or fp32
    where the catalogue lists no 16-bit peak."""
    if precision != "auto":
        return precision
    if device.bf16_tflops or device.fp16_tflops:
        return hardware_precision("cuda", cuda_bf16=bool(device.bf16_tflops)).name
    if device.fp32_tflops:
        return "fp32"
    raise ValueError(f"{device.name} lists no bf16/fp16/fp32 peak; pass --precision")


def linear_attention_notes(model) -> list[str]:
    """One line where the model has Gated DeltaNet blocks (model.layer_types), whose time the planner
    does not count in full yet: the numbers below would otherwise look exact."""
    blocks = sum(model.is_linear_layer(i) for i in range(model.n_layers))
    if not blocks:
        return []
    return [f"{blocks} of the {model.n_layers} blocks are Gated DeltaNet (linear attention): their weights are "
            f"counted exactly and their activations (lmforge convention) from what the chunked form saves, but "
            f"their FLOPs only by the recurrent form's 6 x value heads x key dim x value dim per token (the "
            f"megatron and zero-paper conventions count their activations as attention blocks'); treat the time "
            f"below as rough."]


def _cross_group(cfg, precision: str, cluster):
    """The cross-group traffic of a fault-tolerant job's ranks (fault_tolerance.enabled with replica_groups
    > 1: lmforge.plan.cross_group), at the cluster's inter-node bandwidth; else None. Each rank averages
    its own part of the parameters: 1 / (dp_shard under FSDP2 x tp x pp) of them."""
    f, p = cfg.fault_tolerance, cfg.parallel
    if not (f.enabled and f.replica_groups > 1):
        return None
    from lmforge.plan.cross_group import cross_group_traffic
    from lmforge.plan.params import total_params

    parts = (p.dp_shard if p.fsdp else 1) * p.tp * p.pp
    return cross_group_traffic(total_params(cfg.model) // parts, 2 if precision == "bf16-pure" else 4,
                               f.replica_groups, f.diloco_sync_every, f.diloco_fragments, cluster.device.inter_node_gbps)


def plan_main(argv: list[str]) -> int:
    """Entry point of `lmforge plan`. Returns a process exit code (2 on bad input)."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):  # `--gpus -3xH100`: argparse takes -3xH100 for an option; keep it a value
        if arg == "--gpus" and argv[i + 1].startswith("-"):
            argv[i:i + 2] = [f"--gpus={argv[i + 1]}"]
            break
    try:
        args = build_parser().parse_args(argv)
        _check_args(args)
        conventions = parse_conventions(args.weights)
        fit_convention = "lmforge" if "lmforge" in conventions else conventions[0]
        from lmforge.config import load_config

        cfg = load_config(args.model, _parse_sets(args.sets))
        devices = load_devices(args.devices)
        cluster = parse_cluster(args.gpus, nodes=args.nodes, devices=devices)
        seq_len = args.seq_len if args.seq_len is not None else cfg.data.seq_len
        if seq_len > cfg.model.max_seq_len:
            raise ValueError(f"--seq-len {seq_len} exceeds model.max_seq_len = {cfg.model.max_seq_len}")
        batch_tokens = (args.global_batch_tokens if args.global_batch_tokens is not None
                        else cfg.train.global_batch_size * seq_len)
        if batch_tokens % seq_len:
            raise ValueError(f"--global-batch-tokens {batch_tokens} is not a multiple of the sequence length {seq_len}")
        sequences = batch_tokens // seq_len
        precision = _resolve_precision(args.precision or cfg.train.precision, cluster.device)
        optimizer = args.optimizer or cfg.optim.name
        layout, notes = _default_layout(cfg, cluster, sequences, precision, args.layout, seq_len, optimizer)
        notes += linear_attention_notes(cfg.model)
        if args.precision is None and (note := preset_precision_note(cfg, precision)):
            notes.append(note)
        if precision == "fp8" and layout.fsdp:
            notes.append("fp8: FSDP2 gathers the FP8 layers' weights in FP8, 1 byte each (train.fp8_all_gather = auto "
                         "with the default tensorwise recipe; a rowwise recipe gathers them in 16 bits)")
        refused = lmforge_refusals(cfg, layout, seq_len)  # (planned all the same: said at the top)
        train_tokens = args.tokens if args.tokens is not None else float(config_train_tokens(cfg, layout.micro_batch))
        mems = [estimate_memory(cfg.model, layout, optimizer, seq_len, weights=w, model_name=cfg.preset) for w in conventions]
        step = estimate_step(cfg.model, layout, cluster, seq_len, mfu=args.mfu, train_tokens=train_tokens,
                             price_per_gpu_hour=args.price, flops_convention=args.flops, ideal=args.ideal,
                             convention=fit_convention, optimizer=optimizer)
        data_lines, data_warnings = data_plan(cfg)
        cross = _cross_group(cfg, precision, cluster)
        loss = None if args.loss is None else predict_loss(args.loss, cfg, train_tokens)
        cands = None
        if args.search:
            cands = search_layouts(cfg.model, cluster, sequences, seq_len, optimizer=optimizer,
                                   precision=precision, weights=fit_convention, show=conventions,
                                   usable_fraction=args.usable, top=args.top, model_name=cfg.preset,
                                   config=cfg, allow_offload=args.allow_offload, host_memory_gb=args.host_memory_gb)
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"lmforge plan: error: {exc}", file=sys.stderr)
        return 2
    budget = args.usable * cluster.device.memory_bytes
    if args.json:
        report = {"model": cfg.preset, "cluster": cluster.to_dict(), "seq_len": seq_len,
                  "global_batch_tokens": batch_tokens, "optimizer": optimizer, "precision": precision,
                  "layout": layout.to_dict(), "usable_fraction": args.usable, "conventions": list(conventions),
                  "memory": {m.convention: m.as_dict() | {"fits": m.total <= budget} for m in mems},
                  "compute": step.as_dict(), "assumed_mfu": args.mfu, "ideal": args.ideal, "notes": notes,
                  "data": data_lines, "data_warnings": data_warnings,
                  "refused": [r._asdict() for r in refused]}
        if cross is not None:
            report["cross_group"] = cross.as_dict()
        if loss is not None:
            report["loss"] = loss
        if cands is not None:
            report["search_fit_convention"] = cands.fit_convention
            report["search_refused_by_lmforge"] = cands.refused
            report["search"] = [c.as_dict() for c in cands]
        print(to_json(report))
        return 0
    if cands is not None and args.layout is None:  # the search first; then its best layout in detail
        print(candidates_table(cands, cluster, args.usable))
        if not cands:
            return 0
        layout, notes = cands[0].layout, [f"the search's best layout (--layout {cands[0].layout.short()} plans it alone)"]
        refused = []  # (the search leaves out what lmforge refuses)
        mems = [estimate_memory(cfg.model, layout, optimizer, seq_len, weights=w, model_name=cfg.preset)
                for w in conventions]
        step = estimate_step(cfg.model, layout, cluster, seq_len, mfu=args.mfu, train_tokens=train_tokens,
                             price_per_gpu_hour=args.price, flops_convention=args.flops, ideal=args.ideal,
                             convention=fit_convention, optimizer=optimizer)
        print()
    print(f"lmforge plan: {cfg.preset} on {cluster} ({cluster.world_size} GPUs), layout {layout.short()}")
    for line in refusal_lines(refused):
        print(f"  {line}")
    for note in notes:
        print(f"  note: {note}")
    for line in data_lines:
        print(f"  {line}")
    for line in data_warnings:
        print(f"  warning: {line}")
    print()
    print(memory_table(mems, cluster.device.memory_bytes, args.usable))
    print()
    print(step_table(step, cluster, args.mfu, precision))
    if cross is not None:
        print()
        print("\n".join(cross.lines()))
    if cands is not None and args.layout is not None:
        print()
        print(candidates_table(cands, cluster, args.usable))
    if loss is not None:
        print()
        print("\n".join(loss_lines(loss)))
    if args.verify:
        from lmforge.verify.certify import verify_layout

        return verify_layout(cfg, layout, optimizer)
    return 0


def main() -> None:  # pragma: no cover - convenience for `python -m lmforge.cli.plan`
    raise SystemExit(plan_main(sys.argv[1:]))


if __name__ == "__main__":  # pragma: no cover
    main()
