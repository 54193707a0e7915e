"""Hyperparameter sweeps: grid or random search over dotted config keys, one `lmforge train`
subprocess per trial, resumable, ranked by validation loss.

Layout of a sweep folder:

    SWEEP/sweep.json            the spec (base config, base overrides, search space, trials)
    SWEEP/t000-<hash>/          one run folder per trial (config.toml, metrics.jsonl, summary.json,
                                train.log with the trial's stdout/stderr)
    SWEEP/results.json, .csv    every trial with its parameters, status and final metrics, ranked
    SWEEP/sweep.png             validation loss per trial and against each swept key
    SWEEP/report/index.html     overlaid curves of all trials (`lmforge report SWEEP` makes it too)

`parallel` trials run at once: on a CPU with cores/parallel torch threads each, on a machine with
several GPUs one GPU each (CUDA_VISIBLE_DEVICES per trial).

A trial is done when its folder has `summary.json` (the trainer writes it last). Re-running the
same command skips done trials, resumes an interrupted one from its checkpoint and re-runs the
others from scratch, so an interrupted sweep resumes.

The sweep owns its trials (each in a process group of its own): SIGINT (Ctrl-C) or SIGTERM to the
sweep hands SIGTERM to every running trial, which saves a checkpoint of its step and exits
(lmforge.train.preempt); the sweep waits for them, records them as `interrupted` and exits
128 + the signal. A second signal kills the trials at once. No trial outlives its sweep. The trial folder name holds a hash of its full override set, so a changed spec never
mistakes an old run for a new trial.

A folder holds one sweep: `sweep.json` records it, and a sweep whose trials differ (another
config, base overrides, search space, trial count or seed) never writes into it. With an explicit
folder that is an error saying how to continue; the default folder `runs/sweep-<config>` passes
the new sweep on to a sibling named after it (`runs/sweep-tiny-random8-lr`, see
`resolve_sweep_dir`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.config import ConfigError, load_config
from lmforge.folders import CHECKPOINTS, REPORT, SUMMARY, atomic_write, atomic_write_json, check_target
from lmforge.train.preempt import PREEMPTED_EXIT_CODE

SWEEP_RECORD = "sweep.json"  # the spec and its trials: what this folder's sweep is
RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
SWEEP_PLOT = "sweep.png"
TRIAL_LOG = "train.log"
SWEEP_FILES = (SWEEP_RECORD, RESULTS_JSON, RESULTS_CSV, SWEEP_PLOT, REPORT)
# the SweepSpec fields that decide the trials (the ranking metric only orders them)
_TRIAL_FIELDS = ("config", "base", "space", "random_trials", "seed", "listed")


@dataclass
class Dimension:
    """One swept key: discrete `values`, or a continuous range [low, high] (random search only)."""

    key: str
    values: list[Any] | None = None
    low: float | None = None
    high: float | None = None
    scale: str = "linear"  # 'linear' | 'log' | 'int'

    def sample(self, rng: random.Random) -> Any:
        if self.values is not None:
            return rng.choice(self.values)
        assert self.low is not None and self.high is not None
        if self.scale == "log":
            return float(f"{math.exp(rng.uniform(math.log(self.low), math.log(self.high))):.4g}")
        if self.scale == "int":
            return rng.randint(int(self.low), int(self.high))
        return float(f"{rng.uniform(self.low, self.high):.4g}")


@dataclass
class SweepSpec:
    config: str = "tiny"
    base: dict[str, Any] = field(default_factory=dict)  # overrides applied to every trial
    space: list[Dimension] = field(default_factory=list)
    random_trials: int = 0  # 0 = full grid
    seed: int = 0
    metric: str = "val_loss"
    listed: list[dict[str, Any]] = field(default_factory=list)  # trials given one by one ([[trial]] in a spec
    # file: keys that vary together, e.g. an IsoFLOP grid's model shapes and steps), each x the grid, if any

    def keys(self) -> list[str]:
        """The keys that differ between trials: the listed trials' keys, then the grid's or ranges'."""
        out = list(dict.fromkeys(k for trial in self.listed for k in trial))
        return out + [d.key for d in self.space if d.key not in out]

    def trials(self) -> list[dict[str, Any]]:
        """The trials' overrides, in a deterministic order (same spec + seed -> same list)."""
        if self.listed:
            if self.random_trials:
                raise ConfigError("sweep: listed trials ([[trial]]) take no random search; drop `random` (or the "
                                  "[[trial]] tables).")
            grid = SweepSpec(space=self.space).trials() if self.space else [{}]
            return [{**trial, **combo} for trial in self.listed for combo in grid]
        if not self.space:
            raise ConfigError("sweep: nothing to sweep; give --grid KEY=V1,V2 (or --range KEY=LO:HI with --random N).")
        if self.random_trials:
            rng = random.Random(self.seed)
            seen, out = set(), []
            for _ in range(self.random_trials * 50):
                trial = {d.key: d.sample(rng) for d in self.space}
                sig = json.dumps(trial, sort_keys=True)
                if sig not in seen:
                    seen.add(sig)
                    out.append(trial)
                if len(out) == self.random_trials:
                    break
            return out
        ranged = [d.key for d in self.space if d.values is None]
        if ranged:
            raise ConfigError(f"sweep: {', '.join(ranged)} given as a range; a grid needs value lists "
                              f"(--grid KEY=V1,V2) or use random search (--random N).")
        keys = [d.key for d in self.space]
        return [dict(zip(keys, combo)) for combo in itertools.product(*(d.values for d in self.space))]

    def to_dict(self) -> dict[str, Any]:
        listed = {"listed": self.listed} if self.listed else {}  # (absent: as a sweep.json written before it)
        return {"config": self.config, "base": self.base, "space": [asdict(d) for d in self.space],
                "random_trials": self.random_trials, "seed": self.seed, "metric": self.metric, **listed}


def _trial_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """The trial-defining fields of a spec dict, as they read back from sweep.json."""
    return json.loads(json.dumps({k: spec.get(k) for k in _TRIAL_FIELDS}, default=str, sort_keys=True))


def describe_spec(spec: dict[str, Any]) -> str:
    """'random search, 8 trials (seed 0), over optim.lr, train.global_batch_size; config tiny; base
    train.steps=200' for a spec dict (SweepSpec.to_dict() or a sweep.json)."""
    keys = ", ".join(str(d.get("key")) for d in spec.get("space") or [] if isinstance(d, dict)) or "nothing"
    n = spec.get("random_trials") or 0
    search = f"random search, {n} trials (seed {spec.get('seed', 0)})" if n else "grid"
    listed = spec.get("listed")
    if isinstance(listed, list) and listed:
        varied = ", ".join(dict.fromkeys(str(k) for t in listed if isinstance(t, dict) for k in t))
        search = f"{len(listed)} listed trials over {varied}" + (" x a grid" if spec.get("space") else "")
        keys = keys if spec.get("space") else ""
    base = spec.get("base") or {}
    base_text = "; base " + " ".join(f"{k}={v}" for k, v in base.items()) if isinstance(base, dict) and base else ""
    return f"{search}{' over ' + keys if keys else ''}; config {spec.get('config')}{base_text}"


def read_sweep_record(folder: Path) -> dict[str, Any] | None:
    """The sweep.json of `folder`: None when the folder holds no sweep; {} when it holds sweep
    files whose sweep.json is missing or unreadable (an unknown sweep: never the same as another)."""
    folder = Path(folder)
    path = folder / SWEEP_RECORD
    if not path.is_file():
        return {} if any((folder / f).exists() for f in (RESULTS_JSON, RESULTS_CSV)) else None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def same_sweep(record: dict[str, Any] | None, spec: SweepSpec) -> bool:
    """Whether `folder`'s recorded sweep (read_sweep_record) runs the same trials as `spec`."""
    return record is None or (bool(record) and _trial_fields(record) == _trial_fields(spec.to_dict()))


def check_sweep_dir(spec: SweepSpec, sweep_dir: Path, key: str = "--out") -> None:
    """Refuse (ValueError naming `key`, the folder and how to continue) a folder that is a run,
    dataset or transformers folder, or that holds another sweep: never overwrite its results."""
    sweep_dir = Path(sweep_dir)
    check_target(sweep_dir, "sweep", SWEEP_FILES, key)
    record = read_sweep_record(sweep_dir)
    if same_sweep(record, spec):
        return
    held = (f"another sweep ({describe_spec(record)})" if record else
            f"sweep results without a readable {SWEEP_RECORD}")
    raise ConfigError(
        f"{key} {str(sweep_dir)!r} holds {held}; this sweep is {describe_spec(spec.to_dict())}, and running it "
        f"there would overwrite those results. To continue that sweep, re-run its own command; to run this one, "
        f"choose another {key} (e.g. {str(sweep_dir.with_name(sweep_dir.name + '-' + spec_slug(spec)))!r}).")


def spec_slug(spec: SweepSpec) -> str:
    """A folder-name suffix that says what a sweep searches: 'grid-lr-warmup_steps', 'random8-lr'."""
    search = f"random{spec.random_trials}" + (f"-seed{spec.seed}" if spec.seed else "") if spec.random_trials \
        else f"listed{len(spec.listed)}" if spec.listed else "grid"
    keys = "-".join(k.rsplit(".", 1)[-1] for k in spec.keys())
    slug = "".join(c if c.isalnum() or c in "_.-" else "_" for c in f"{search}-{keys}".strip("-"))
    return slug[:60]


def resolve_sweep_dir(spec: SweepSpec, sweep_dir: Path, explicit: bool, echo=print) -> Path:
    """The folder this sweep runs in. `sweep_dir` itself when it is new or holds this same sweep
    (a resume). When it holds another sweep: an `explicit` folder (--out, or `out` in the spec
    file) is a ConfigError saying how to continue; the default folder passes the sweep on to a
    sibling named after it (`<folder>-<spec_slug>`, plus a hash of the spec when that one holds
    yet another sweep), with a log line. The same command always finds the same folder again."""
    sweep_dir = Path(sweep_dir)
    if explicit or same_sweep(read_sweep_record(sweep_dir), spec):
        check_sweep_dir(spec, sweep_dir)
        return sweep_dir
    digest = hashlib.sha256(json.dumps(_trial_fields(spec.to_dict()), sort_keys=True).encode()).hexdigest()[:8]
    named = sweep_dir.with_name(f"{sweep_dir.name}-{spec_slug(spec)}")
    for candidate in (named, named.with_name(f"{named.name}-{digest}")):
        if same_sweep(read_sweep_record(candidate), spec):
            record = read_sweep_record(sweep_dir)
            held = describe_spec(record) if record else "sweep results"
            echo(f"sweep: {sweep_dir} holds another sweep ({held}); this one ({describe_spec(spec.to_dict())}) "
                 f"runs in {candidate}")
            check_sweep_dir(spec, candidate)
            return candidate
    check_sweep_dir(spec, named.with_name(f"{named.name}-{digest}"))  # raises: names the folder and the fix
    raise AssertionError("unreachable")


def check_trials(spec: SweepSpec, trials: list[dict[str, Any]]) -> None:
    """Every trial's config must load and validate before anything runs (errors name the trial)."""
    for trial in trials:
        try:
            load_config(spec.config, {**spec.base, **trial})
        except ConfigError as exc:
            raise ConfigError(f"sweep trial {trial}: {exc}") from exc


def trial_name(index: int, overrides: dict[str, Any], spec: SweepSpec) -> str:
    full = json.dumps({"config": spec.config, **spec.base, **overrides}, sort_keys=True, default=str)
    return f"t{index:03d}-{hashlib.sha256(full.encode()).hexdigest()[:8]}"


def _cli_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # TOML string: survives parse_override_value unchanged
    return repr(v)


def train_command(spec: SweepSpec, overrides: dict[str, Any], out_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "lmforge", "train", "--config", spec.config]
    for k, v in {**spec.base, **overrides, "train.out_dir": str(out_dir), "train.progress": "lines"}.items():
        cmd += [f"--{k}", _cli_value(v)]
    return cmd


@dataclass
class Trial:
    index: int
    name: str
    params: dict[str, Any]
    out_dir: Path
    status: str = "pending"  # pending | running | done | failed | skipped(done before)
    seconds: float = 0.0
    returncode: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return (self.out_dir / SUMMARY).is_file()

    def load_summary(self) -> None:
        """The trial's summary.json; {} when it is unreadable or not a JSON object (the trial then
        shows no metrics instead of stopping the sweep)."""
        try:
            summary = json.loads((self.out_dir / SUMMARY).read_text())
        except (OSError, ValueError):
            summary = {}
        self.summary = summary if isinstance(summary, dict) else {}


def _metric_text(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def run_sweep(spec: SweepSpec, sweep_dir: Path, parallel: int = 1, threads_per_trial: int | None = None,
              echo=print, report: bool = True) -> list[Trial]:
    """Run the sweep's unfinished trials (`parallel` at a time), then write results and plots."""
    sweep_dir = Path(sweep_dir)
    overrides = spec.trials()
    check_trials(spec, overrides)
    check_sweep_dir(spec, sweep_dir)  # never write into another sweep's (or a run's) folder
    sweep_dir.mkdir(parents=True, exist_ok=True)
    trials = [Trial(i, trial_name(i, o, spec), o, sweep_dir / trial_name(i, o, spec)) for i, o in enumerate(overrides)]
    atomic_write_json(sweep_dir / SWEEP_RECORD, {**spec.to_dict(), "trials": [{"name": t.name, "params": t.params}
                                                                             for t in trials]}, indent=2, default=str)

    todo = []
    for t in trials:
        if t.finished:
            t.status = "skipped"
            t.load_summary()
        else:
            todo.append(t)
    echo(f"sweep: {len(trials)} trials ({len(trials) - len(todo)} already done), {parallel} at a time, "
         f"in {sweep_dir}")
    if threads_per_trial is None and parallel > 1 and "train.threads" not in spec.base:
        threads_per_trial = max(1, (os.cpu_count() or 1) // parallel)

    gpus = visible_gpus() if parallel > 1 else []
    if gpus:
        echo(f"sweep: parallel trials spread over GPU(s) {', '.join(gpus)} (one GPU per trial)")
    running: list[tuple[Trial, subprocess.Popen, float, Any, int]] = []
    free_slots = list(range(parallel))
    queue = list(todo)
    interrupted = False
    previous = _sigterm_interrupts()
    try:
        while queue or running:
            while queue and len(running) < parallel:
                t = queue.pop(0)
                resume = has_checkpoint(t.out_dir)  # an interrupted trial: `lmforge train` resumes it
                if t.out_dir.exists() and not resume:  # a failed or killed attempt: start it over
                    shutil.rmtree(t.out_dir)
                t.out_dir.mkdir(parents=True, exist_ok=True)
                extra = {"train.threads": threads_per_trial} if threads_per_trial else {}
                cmd = train_command(spec, {**t.params, **extra}, t.out_dir)
                logf = open(t.out_dir / TRIAL_LOG, "a" if resume else "w")
                slot = free_slots.pop(0)
                env = {**os.environ, "PYTHONUNBUFFERED": "1"}
                if gpus:  # parallel trials spread over the GPUs, one GPU per trial
                    env["CUDA_VISIBLE_DEVICES"] = gpus[slot % len(gpus)]
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
                t.status = "running"
                running.append((t, proc, time.perf_counter(), logf, slot))
                echo(f"  {'resume' if resume else 'start'} {t.name}: {_params_text(t.params)}")
            time.sleep(0.2)
            for item in list(running):
                t, proc, t0, logf, slot = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                free_slots.append(slot)
                logf.close()
                t.seconds, t.returncode = time.perf_counter() - t0, proc.returncode
                if proc.returncode == 0 and t.finished:
                    t.status = "done"
                    t.load_summary()
                    echo(f"  done  {t.name}: {spec.metric} {_metric_text(t.summary.get(spec.metric, float('nan')))} "
                         f"({t.seconds:.0f} s)")
                elif proc.returncode == PREEMPTED_EXIT_CODE:  # signalled on its own: it saved a checkpoint
                    t.status = "interrupted"
                    echo(f"  interrupted {t.name}: a re-run of the sweep resumes it from its checkpoint")
                else:
                    t.status = "failed"
                    tail = (t.out_dir / TRIAL_LOG).read_text(errors="replace").strip().splitlines()[-3:]
                    echo(f"  FAILED {t.name} (exit {proc.returncode}); see {t.out_dir / TRIAL_LOG}: "
                         + " / ".join(tail))
    except KeyboardInterrupt as exc:
        interrupted = exc
        stop_trials([(t, proc) for t, proc, *_ in running], echo)
        for t, _, _, logf, _ in running:
            logf.close()
        echo("sweep interrupted: re-run the same command to resume (finished trials are kept, interrupted ones "
             "resume from their checkpoints)")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    write_results(trials, sweep_dir, spec)
    if not interrupted:
        try:
            plot_sweep(trials, sweep_dir / SWEEP_PLOT, spec)
            if report and any(t.finished for t in trials):
                from lmforge.report.html import build_report

                build_report([t.out_dir for t in trials if t.finished], sweep_dir / REPORT,
                             title=f"sweep {sweep_dir.name}")
        except ImportError:
            echo("sweep: plots skipped (`pip install matplotlib`)")
    if interrupted:
        raise interrupted
    return trials


class SweepInterrupted(KeyboardInterrupt):
    """SIGTERM to the sweep, handled as Ctrl-C is (`signum`: the process exits 128 + it)."""

    signum = signal.SIGTERM


def _sigterm_interrupts():
    """SIGTERM raises SweepInterrupted in the sweep's main thread, as SIGINT raises
    KeyboardInterrupt; returns the previous handler (None off the main thread: left alone)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise SweepInterrupted()

    return signal.signal(signal.SIGTERM, interrupt)


def stop_trials(running: list[tuple[Trial, subprocess.Popen]], echo=print) -> None:
    """SIGTERM to each running trial's process group: a trial finishes its step, saves a checkpoint and
    exits (lmforge.train.preempt). Wait for them all; a second signal to the sweep meanwhile kills them
    at once. Each is `interrupted` after."""
    if running:
        echo(f"sweep: stopping {len(running)} running trial(s); each saves a checkpoint (a second signal kills "
             f"them at once)")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            for _, proc in running:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            for _, proc in running:
                proc.wait()
            break
        except KeyboardInterrupt:
            continue
    for t, _ in running:
        t.status = "interrupted"


def has_checkpoint(run: Path) -> bool:
    """Whether a trial's run folder holds a finished checkpoint (`step_<N>` under checkpoints/)."""
    folder = Path(run) / CHECKPOINTS
    return folder.is_dir() and any(p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
                                   for p in folder.iterdir())


def visible_gpus() -> list[str]:
    """CUDA device ids the trials may use: CUDA_VISIBLE_DEVICES if set, else all GPUs torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def _params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def ranked(trials: list[Trial], metric: str = "val_loss") -> list[Trial]:
    """Finished trials by ascending metric (non-finite last), then the unfinished ones."""
    def key(t: Trial):
        v = t.summary.get(metric)
        ok = isinstance(v, (int, float)) and math.isfinite(v)
        return (0 if ok else 1, v if ok else 0.0, t.index)

    return sorted(trials, key=key)


RESULT_COLUMNS = ("val_loss", "val_perplexity", "train_loss", "tokens_per_second", "mfu", "seconds")


def write_results(trials: list[Trial], sweep_dir: Path, spec: SweepSpec) -> list[dict[str, Any]]:
    """results.json + results.csv, ranked by the metric; returns the rows."""
    keys = spec.keys()
    rows = []
    for rank, t in enumerate(ranked(trials, spec.metric), 1):
        has = t.status in ("done", "skipped") and spec.metric in t.summary
        rows.append({"rank": rank if has else None, "trial": t.name, **{k: t.params.get(k) for k in keys},
                     **{c: t.summary.get(c) for c in RESULT_COLUMNS}, "status": t.status,
                     "out_dir": str(t.out_dir)})
    atomic_write_json(sweep_dir / RESULTS_JSON, rows, indent=2, default=str)
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["trial"])
    w.writeheader()
    w.writerows(rows)
    atomic_write(sweep_dir / RESULTS_CSV, text.getvalue())
    return rows


def format_table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    """A plain-text table of the ranked results."""
    cols = ["rank", "trial", *keys, "val_loss", "val_perplexity", "tokens_per_second", "status"]

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
        return str(v)

    table = [cols] + [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_sweep(trials: list[Trial], path: Path, spec: SweepSpec) -> Path | None:
    """Left: the metric per trial, ranked (bars). Then one panel per swept key: metric vs value."""
    from lmforge.report.plots import _pyplot

    done = [t for t in ranked(trials, spec.metric) if isinstance(t.summary.get(spec.metric), (int, float))
            and math.isfinite(t.summary[spec.metric])]
    if not done:
        return None
    plt = _pyplot()
    keys = spec.keys()
    fig, axes = plt.subplots(1, 1 + len(keys), figsize=(4.5 * (1 + len(keys)), 4), dpi=100, squeeze=False)
    ax = axes[0][0]
    ax.barh([t.name for t in done][::-1], [t.summary[spec.metric] for t in done][::-1], color="tab:blue")
    ax.set_xlabel(spec.metric)
    ax.set_title(f"trials ranked by {spec.metric}")
    lo = min(t.summary[spec.metric] for t in done)
    hi = max(t.summary[spec.metric] for t in done)
    ax.set_xlim(lo - 0.1 * (hi - lo + 1e-3), hi + 0.05 * (hi - lo + 1e-3))
    for ax, key in zip(axes[0][1:], keys):
        xs = [t.params[key] for t in done]
        ys = [t.summary[spec.metric] for t in done]
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
        if numeric:
            ax.scatter(xs, ys, color="tab:orange")
            if min(xs) > 0 and max(xs) / min(xs) >= 10:
                ax.set_xscale("log")
        else:
            ax.scatter([str(x) for x in xs], ys, color="tab:orange")
        ax.set_xlabel(key)
        ax.set_ylabel(spec.metric)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
