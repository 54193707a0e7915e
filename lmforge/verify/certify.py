"""`lmforge plan ... --verify`: a layout certificate, earned on the CPU before GPU hours are spent.

The plan's layout is scaled down (lmforge/verify/toy.py: each degree to its smallest divisor > 1; the
family's options at toy width and depth) and trained for a few steps on gloo, one process per rank
(`python -m torch.distributed.run`, lmforge/verify/rank.py), then checked:

  parity   every step's loss and gradient norm (before clipping) against the same run in one process
           (same seed, data, global batch and micro-batches). A 16-bit toy (bf16, bf16-pure, fp16: the
           layout's precision) within the band its one-process run measures from BAND_RERUNS reruns with
           the 16-bit rounding perturbed (lmforge/verify/band.py states the statistic); the band and where
           the layout falls in it (its distance as a fraction of the band) are printed. An fp32 toy
           within PARITY_TOL relative: the layouts
           differ from one process only in the order of fp32 sums. The gradient norm sees the gradient's
           scale, which a layout that summed instead of averaged, or lost a factor, would change. Its
           tolerance is wider: the one-process norm (torch.linalg.vector_norm, torch 2.13 on a CPU) is off
           by up to ~7e-5 relative on a toy's 4096 x 64 output-head gradient, where the sharded layouts'
           sum of squares agrees with float64 to 1e-8 (measured; benchmarks/RESULTS.md).
  resume   the layout's checkpoint of step STEPS / 2, resumed at another world size (one process; a
           one-process layout resumes on two), trains the remaining steps as the one-process run does.
  memory   each rank's parameters, gradients, optimizer state and EMA of the weights (the tensors it holds,
           measured in the trainer) against `lmforge plan`'s estimate for the toy under the scaled layout (lmforge
           convention): ranks of the stage the plan reports must match within MEMORY_TOL; the others
           may hold less (the plan is the worst stage's).

When parity fails, the layout and the one-process run (and the band's reruns) train again with hooks that
record, per module, the norm of its output and of its parameters' gradient at the first failing step
(lmforge/verify/probe.py: of the full tensors, shards gathered and ranks merged), and the first module
whose difference leaves the band is printed with its numbers: in forward order for outputs, in backward
order for gradients (`localise`). The band per module: a 16-bit toy's measured as the steps' is (BAND_FACTOR
x the largest rerun's relative difference, at least MODULE_FLOOR: a quarter of the dtype's eps, more
than the norm of a tensor moves when a layout holds in 16 bits what one process holds in fp32, e.g.
FSDP's embedding gathered in bf16: each element's rounding is random in sign, so the norm's is far
smaller than an element's), an fp32 toy's MODULE_TOL relative.

Each check prints PASS or FAIL with its numbers; the command exits 0 when all pass, 1 otherwise, and 2
when the layout cannot be emulated on the CPU (the reason is printed).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lmforge.config import Config, ConfigError, to_toml
from lmforge.folders import CHECKPOINTS
from lmforge.plan.layout import Layout
from lmforge.plan.memory import estimate_memory
from lmforge.plan.model_states import zero1_by_tensor, zero1_state_per_rank
from lmforge.plan.params import stage_specs
from lmforge.verify.band import BAND_FACTOR, BAND_RERUNS, Band, measure_band, read_metrics, within_band
from lmforge.verify.probe import read_probe
from lmforge.verify.toy import STEPS, CannotEmulate, Toy, describe, toy_run

PARITY_TOL = {"loss": 1e-4, "grad_norm": 3e-4}  # relative, per step
MODULE_TOL = 1e-4  # fp32: relative, per module norm (the parity check's loss tolerance)
MODULE_FLOOR = {"bf16": 2.0 ** -9, "bf16-pure": 2.0 ** -9, "fp16": 2.0 ** -12}
MEMORY_TOL = 0.01
RUN_TIMEOUT_S = 900
MEMORY_PARTS = ("weights", "gradients", "optimizer_states")


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    first_step: int | None = None  # the first step outside the tolerance (parity)

    def line(self) -> str:
        return f"  {'PASS' if self.passed else 'FAIL'}  {self.name}: {self.detail}"


def verify_layout(cfg: Config, layout: Layout, optimizer: str, echo=print, keep: str | Path | None = None) -> int:
    """Emulate `layout` of `cfg` on the CPU and check it; returns the exit status (0 pass, 1 fail, 2 refused)."""
    echo(f"\nverify: layout {layout.short()} of {cfg.preset}, emulated on the CPU (gloo, one process per rank)")
    try:
        toy = toy_run(cfg, layout)
        toy.config.validate()
    except CannotEmulate as exc:
        echo(f"verify: cannot emulate this layout on the CPU: {exc}")
        return 2
    except ConfigError as exc:  # lmforge itself refuses the layout for this model: a finding, not a limit
        echo(f"  FAIL  config: lmforge refuses the layout for this family: {exc}")
        return 1
    for note in toy.notes:
        echo(f"  scaled: {note}")
    echo(f"  {toy.world_size} process{'es' if toy.world_size > 1 else ''} ({toy.layout.short()}); {describe(toy)}")
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="lmforge-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        checks = run_checks(toy, optimizer, work, echo)
    except RunFailed as exc:
        echo(f"  FAIL  run: {exc}")
        echo(f"verify: FAIL (the runs are in {work})")
        return 1
    for check in checks:
        echo(check.line())
    parity = checks[0]
    if not parity.passed and parity.first_step:
        try:
            localise(toy, work, parity.first_step, echo)
        except RunFailed as exc:
            echo(f"  (the runs that localise the difference failed: {exc})")
    failed = [c for c in checks if not c.passed]
    if failed:
        echo(f"verify: FAIL ({len(failed)} of {len(checks)} checks; the runs are in {work})")
        return 1
    echo(f"verify: PASS ({len(checks)} checks)")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


class RunFailed(RuntimeError):
    """A toy run did not finish (its output's tail is the message)."""


def run_checks(toy: Toy, optimizer: str, work: Path, echo=print) -> list[Check]:
    layout_cfg, single_cfg = work / "layout.toml", work / "single.toml"
    layout_cfg.write_text(to_toml(toy.config))
    single_cfg.write_text(to_toml(toy.reference))
    world = toy.world_size
    resume_world, resume_cfg = (1, single_cfg) if world > 1 else (2, _ddp_config(toy, work))
    ckpt = work / "layout" / CHECKPOINTS / f"step_{STEPS // 2:08d}"  # (lmforge.ckpt.manager.step_name, without torch)
    t0 = time.perf_counter()
    layout_run = {"config": str(layout_cfg), "out": str(work / "layout")}
    sixteen = toy.config.train.precision != "fp32"
    reruns = [f"perturbed{k}" for k in range(1, BAND_RERUNS + 1)] if sixteen else []
    runs = [{"config": str(single_cfg), "out": str(work / "single")}]
    runs += [{"config": str(single_cfg), "out": str(work / name), "perturb": k} for k, name in enumerate(reruns, 1)]
    if world > 1:
        _launch(world, [layout_run], work / "layout.job.json")
        runs.append({"config": str(resume_cfg), "out": str(work / "resumed"), "resume": str(ckpt)})
    else:  # (a one-process layout: one launch trains it and the reference)
        runs.insert(0, layout_run)
    _launch(1, runs, work / "single.job.json")
    if resume_world != 1:
        _launch(resume_world, [{"config": str(resume_cfg), "out": str(work / "resumed"), "resume": str(ckpt)}],
                work / "resumed.job.json")
    echo(f"  ran {world}-process layout, one-process reference{f' and {len(reruns)} reruns' if reruns else ''} and "
         f"the resume in {time.perf_counter() - t0:.0f} s ({_precision_note(toy.config.train.precision)})")
    layout_m, single_m, resumed_m = (read_metrics(work / name) for name in ("layout", "single", "resumed"))
    steps = list(range(1, STEPS + 1))
    band = None
    if sixteen:
        band = measure_band(single_m, [read_metrics(work / name) for name in reruns],
                            how=f"band ({toy.config.train.precision}, measured)")
        echo(f"  {band.describe(steps)}")
    return [
        band_check(f"parity with one process, steps 1-{STEPS}", layout_m, single_m, steps, band),
        resume_check(resume_world, resumed_m, single_m, band),
        memory_check(toy, optimizer, [json.loads(p.read_text()) for p in sorted((work / "layout").glob("memory.rank*.json"))]),
    ]


def localise(toy: Toy, work: Path, step: int, echo=print) -> None:
    """Train the layout and the one-process run again (and a 16-bit toy's reruns) with per-module probes at
    `step`, and print the first module whose output (forward order) and whose gradient (backward order)
    leaves the band (module docstring)."""
    precision = toy.config.train.precision
    reruns = range(1, BAND_RERUNS + 1) if precision != "fp32" else range(0)
    layout_run = {"config": str(work / "layout.toml"), "out": str(work / "probe-layout"), "probe": step}
    single = [{"config": str(work / "single.toml"), "out": str(work / "probe-single"), "probe": step}]
    single += [{"config": str(work / "single.toml"), "out": str(work / f"probe-perturbed{k}"), "probe": step,
                "perturb": k} for k in reruns]
    t0 = time.perf_counter()
    if toy.world_size > 1:
        _launch(toy.world_size, [layout_run], work / "probe-layout.job.json")
    else:
        single.insert(0, layout_run)
    _launch(1, single, work / "probe-single.job.json")
    report_localised(work, step, precision, toy.config.optim.grad_clip, len(reruns), time.perf_counter() - t0, echo)


def report_localised(work: Path, step: int, precision: str, clip: float, reruns: int, seconds: float,
                     echo=print) -> None:
    """`localise`'s verdict from the probed runs in `work` (probe-layout, probe-single, probe-perturbed<k>)."""
    lay, ref = (_probed(work / name, step, clip) for name in ("probe-layout", "probe-single"))
    others = [_probed(work / f"probe-perturbed{k}", step, clip) for k in range(1, reruns + 1)]
    echo(f"  localised at step {step} (per-module norms of the full tensors, layout vs one process; "
         f"{'band: ' + f'{BAND_FACTOR:g} x the largest of {len(others)} reruns, at least {MODULE_FLOOR[precision]:.1e}' if others else f'tolerance {MODULE_TOL:g}'}"
         f", relative; {seconds:.0f} s):")
    order = ref["order"]
    # backward order: the modules whose weights the loss uses without running them (the chunked loss's head:
    # lm_head's weight, no forward call) first, then the modules in reverse forward order
    unrun = sorted(n for n in ref["gradient"] if n not in order)
    for kind, names in (("forward output", order),
                        ("gradient", unrun + [n for n in reversed(order) if n in ref["gradient"]])):
        key = "forward" if kind == "forward output" else "gradient"
        first = None
        for name in names:
            if name not in lay[key] or name not in ref[key]:
                continue
            got, want = lay[key][name], ref[key][name]
            diff = abs(got - want) / want if want else (0.0 if got == want else math.inf)
            band = (max(MODULE_FLOOR[precision], BAND_FACTOR * max(abs(o[key][name] - want) / want if want else 0.0
                                                                   for o in others)) if others else MODULE_TOL)
            if diff > band:
                first = (name, got, want, diff, band)
                break
        order_word = "forward" if key == "forward" else "backward"
        if first:
            name, got, want, diff, band = first
            echo(f"    first {kind} outside the band ({order_word} order): {name}: norm {got:.6g} vs {want:.6g}, "
                 f"relative difference {diff:.2e} (band {band:.2e})")
        else:
            echo(f"    every module's {kind} norm within the band")


def _probed(run: Path, step: int, clip: float) -> dict:
    """A run's per-module norms at `step`, its gradients as before clipping (the clip's factor,
    min(1, clip / (norm + 1e-6)) of lmforge.parallel.clip, undone with the run's reported norm)."""
    probe = read_probe(run)
    norm = read_metrics(run).get(step, {}).get("grad_norm")
    if clip > 0 and norm is not None:
        scale = max(1.0, (norm + 1e-6) / clip)
        probe["gradient"] = {k: v * scale for k, v in probe["gradient"].items()}
    return probe


def _precision_note(precision: str) -> str:
    """The toy's precision, and for bf16 whether this CPU computes it natively or emulates it (slower)."""
    if precision not in ("bf16", "bf16-pure"):
        return precision
    from lmforge.spec.precision import cpu_bf16_units, cpu_flags

    units = cpu_bf16_units(cpu_flags())
    return f"{precision} on this CPU's {', '.join(units)} units" if units else \
        f"{precision}, emulated: this CPU has no bf16 units (AMX-BF16, AVX512-BF16), 50-100x slower than fp32"


def _ddp_config(toy: Toy, work: Path) -> Path:
    """A one-process layout's resume: the reference run's config on two DDP ranks, each micro-batch split
    between them."""
    par = dataclasses.replace(toy.reference.parallel, dp_replicate=2)
    train = dataclasses.replace(toy.reference.train, micro_batch_size=toy.reference.train.micro_batch_size // 2)
    path = work / "resume2.toml"
    path.write_text(to_toml(dataclasses.replace(toy.reference, parallel=par, train=train)))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, runs: list[dict], job: Path) -> None:
    """Run lmforge.verify.rank on `world` processes (torchrun when > 1) over `runs`."""
    job.write_text(json.dumps({"runs": runs}))
    python = os.environ.get("PYTHON_EXEC") or sys.executable  # (the interpreter torchrun starts ranks with, too)
    head = [python] if world == 1 else [python, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                                        "--master-port", str(_free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(head + ["-m", "lmforge.verify.rank", str(job)], capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S)
    if proc.returncode:
        tail = (proc.stdout[-1500:] + proc.stderr[-2500:]).strip().splitlines()
        raise RunFailed(f"the {world}-process run of {job.name} exited {proc.returncode}:\n      "
                        + "\n      ".join(tail[-25:]))


def band_check(name: str, got: dict, want: dict, steps: list[int], band: Band | None) -> Check:
    """`got` against `want`: within `band` (a 16-bit toy), else at fp32's PARITY_TOL (`compare`)."""
    if band is None:
        return compare(name, got, want, steps)
    parity = within_band(got, want, band, steps)
    detail = parity.summary() + "".join(f"; {line}" for line in parity.step_lines())
    return Check(name, parity.ok, detail, parity.outside[0].step if parity.outside else None)


def compare(name: str, got: dict, want: dict, steps: list[int]) -> Check:
    missing = [s for s in steps if s not in got or s not in want]
    if missing:
        return Check(name, False, f"steps {missing} missing from the metrics")
    worst = {}
    for key in ("loss", "grad_norm"):
        rel = [(abs(got[s][key] - want[s][key]) / abs(want[s][key]), s) for s in steps]
        worst[key] = max(rel)
    ok = all(v < PARITY_TOL[k] for k, (v, _) in worst.items())
    first = next((s for s in steps for k in PARITY_TOL
                  if abs(got[s][k] - want[s][k]) / abs(want[s][k]) >= PARITY_TOL[k]), None)
    detail = ", ".join(f"{k.replace('_', ' ')} max relative difference {v:.1e} (step {s}: {got[s][k]:.6g} vs "
                       f"{want[s][k]:.6g}; tolerance {PARITY_TOL[k]:g})" for k, (v, s) in worst.items())
    return Check(name, ok, detail, first)


def resume_check(world: int, resumed: dict, single: dict, band: Band | None = None) -> Check:
    """The resumed run trained exactly the steps after the checkpoint (a run that started over, or went on
    from another step, fails here), each as the one-process run did."""
    after = list(range(STEPS // 2 + 1, STEPS + 1))
    name = f"resume at world size {world} from step {STEPS // 2}, steps {after[0]}-{after[-1]}"
    if sorted(resumed) != after:
        return Check(name, False, f"the run did not continue from the checkpoint: it trained steps {sorted(resumed)}, "
                                  f"not {after}")
    return band_check(name, resumed, single, after, band)


def memory_check(toy: Toy, optimizer: str, ranks: list[dict]) -> Check:
    name = "memory per rank vs lmforge plan (lmforge convention) for the toy"
    if len(ranks) != toy.world_size or any("weights" not in r for r in ranks):
        return Check(name, False, f"{len(ranks)} of {toy.world_size} ranks recorded their memory")
    plan = estimate_memory(toy.config.model, toy.layout, optimizer, toy.config.data.seq_len, weights="lmforge")
    parts = MEMORY_PARTS + (("ema",) if toy.layout.ema else ())
    # plain ZeRO-1: each rank its own tensors' state (the plan per GPU is the fullest rank's)
    own = (zero1_state_per_rank(stage_specs(toy.config.model, 1, 0, toy.layout.last_rank), toy.layout, optimizer)
           if zero1_by_tensor(toy.layout) else None)
    bad, lines = [], []
    for r in ranks:
        for part in parts:
            planned, got = (own[r["rank"]] if own and part == "optimizer_states" else getattr(plan, part)), r[part]
            same_stage = r["pp_rank"] == plan.stage or toy.layout.pp == 1
            off = abs(got - planned) > MEMORY_TOL * planned if same_stage else got > planned * (1 + MEMORY_TOL)
            if off:
                bad.append(f"rank {r['rank']} {part.replace('_', ' ')} {got:,} B vs planned {planned:,.0f} B")
    worst = {part: max(r[part] for r in ranks) for part in parts}
    lines = [f"{part.replace('_', ' ')} {worst[part] / 1e6:.3f} MB (planned {getattr(plan, part) / 1e6:.3f})"
             for part in parts]
    detail = f"largest rank: {', '.join(lines)}; tolerance {MEMORY_TOL:.0%}"
    return Check(name, not bad, detail + ("; off: " + "; ".join(bad) if bad else ""))
