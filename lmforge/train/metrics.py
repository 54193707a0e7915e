"""Metrics on disk (JSONL, TensorBoard, optional Weights & Biases), health signals, timers.

`metrics.jsonl` in the run folder holds one JSON object per line, of three kinds:

Train records: exactly one per optimizer step, written at each log line (the trainer reads loss
and grad norm back from the device only every `train.log_every` steps, so the records of a
logging window are written together). Fields named `window_*` are measured over the record's
logging window (the `window_steps` steps that end at the window's last step, this one among
them: every record of a window carries the same values); the others are the step's own.
Fields:

| field           | unit        | meaning                                                                 |
|-----------------|-------------|-------------------------------------------------------------------------|
| `step`          | -           | optimizer step, 1-based                                                 |
| `loss`          | nats/token  | mean next-token cross-entropy of the step (all micro-batches)          |
| `grad_norm`     | -           | global L2 norm of the gradients before clipping                        |
| `lr`            | -           | learning rate used by the step (first parameter group)                 |
| `tokens`        | tokens      | tokens consumed so far, including this step                            |
| `window_steps`  | steps       | steps in the record's logging window (the window fields average them)  |
| `window_tokens_per_s` | tokens/s | global throughput (all ranks) over the window, eval excluded      |
| `window_mfu`    | fraction    | window_tokens_per_s x flops_per_token / (peak FLOP/s per device x world), <= 1 |
| `window_step_time_s` | s      | mean wall time per step over the window                                 |
| `data_s`        | s           | host time this step waited for its batches: blocked on the prefetch queue (data.prefetch > 0) or drawing them (0) |
| `window_data_share` | fraction | share of the window's wall time spent waiting for batches             |
| `window_ckpt_s` | s           | time the window spent blocked on checkpoint saves (0 when none)        |
| `mem_gb`        | GB (1e9 B)  | peak device memory so far (CUDA), or the process's peak RSS on CPU     |
| `window_elapsed_s` | s        | wall time from the first step's start to the window's end (excludes the initial eval) |

Validation records: `{"step", "val_loss", "val_perplexity"}` at step 0 (before training), every
`train.eval_every` steps and at the end; a prepared mixture of several sources adds `val_loss/<source>`,
each source's held-out loss (lmforge.train.validation); with train.ema_decay also `val_loss_ema` and
`val_perplexity_ema`, the same validation of the EMA of the weights (lmforge.train.ema), once it has
started. Task records (train.eval_tasks, lmforge.train.eval_tasks): `{"step", "task/<name>/acc",
"task/<name>/acc_norm", "task/<name>/n", "task/<name>/chance", "eval_tasks_s"}`. Event records: `{"step", "event", "message", ...}` for health signals:
`loss_spike` (loss above (1 + `train.spike_threshold`) x its running mean) and
`grad_norm_growth` (median grad norm of the last `train.health_window` steps above
`train.grad_growth_factor` x the lowest such median of the run, and still rising).

TensorBoard (`tb/` in the run folder) gets the same numbers as scalars `train/<field>`,
`val/loss`, `val/perplexity`, `val/loss/<source>` (`val/loss_ema`, ...), `tasks/<name>/acc`, ..., flushed at every log line; W&B (offline mode) gets the same dicts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

from lmforge.folders import TENSORBOARD
from lmforge.report.records import TASK_PREFIX, record_kind

log = logging.getLogger("lmforge.train")

TRAIN_FIELDS: dict[str, str] = {
    "step": "optimizer step, 1-based",
    "loss": "mean next-token cross-entropy of the step (nats/token)",
    "grad_norm": "global L2 gradient norm before clipping",
    "lr": "learning rate of the step",
    "tokens": "tokens consumed so far, including this step",
    "window_steps": "steps in the record's logging window (the window_* fields are over them)",
    "window_tokens_per_s": "throughput over the logging window",
    "window_mfu": "model FLOPs utilisation over the logging window (fraction of the device peak)",
    "window_step_time_s": "mean wall seconds per step over the logging window",
    "data_s": "host seconds this step waited for its batches (blocked on the prefetch queue when data.prefetch > 0, "
              "else drawing them)",
    "window_data_share": "fraction of the window's wall time spent waiting for batches",
    "window_ckpt_s": "seconds the window spent blocked on checkpoint saves",
    "mem_gb": "peak device memory (CUDA) or peak process RSS (CPU), GB",
    "window_elapsed_s": "wall seconds from the first step's start to the end of the logging window",
}
VAL_FIELDS: dict[str, str] = {"step": "step of the evaluation", "val_loss": "validation loss (nats/token)",
                              "val_perplexity": "exp(val_loss)",
                              "val_loss/<source>": "one source's validation loss (a prepared mixture of several)",
                              "val_loss_ema": "validation loss of the EMA of the weights (train.ema_decay)",
                              "val_perplexity_ema": "exp(val_loss_ema)"}
EVENT_FIELDS: dict[str, str] = {"step": "step the event was seen at", "event": "loss_spike | grad_norm_growth",
                                "message": "human-readable explanation"}


class Sink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """TensorBoard / W&B tags of a record's numeric fields."""
    kind = record_kind(record)
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind == "val":
            out[f"val/{key.removeprefix('val_')}"] = float(value)
        elif kind == "tasks":
            out[f"tasks/{key.removeprefix(TASK_PREFIX)}"] = float(value)
        elif kind == "event":
            out[f"events/{record['event']}/{key}"] = float(value)
        else:
            out[f"train/{key}"] = float(value)
    return out


class TensorBoardSink:
    """Scalars to `<run>/tb` with torch's SummaryWriter (needs the `tensorboard` package)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=3600)  # we flush at log lines

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        for tag, value in _scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step)
        if record_kind(record) == "event":
            self.writer.add_text(f"events/{record['event']}", str(record.get("message", "")), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases in offline mode (`wandb sync` later uploads it); files under `<run>/wandb`."""

    def __init__(self, out_dir: Path, config: dict[str, Any], name: str):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        self._wandb = wandb
        self.run = wandb.init(project="lmforge", name=name, dir=str(out_dir), config=config, mode="offline",
                              reinit=True)

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=int(record.get("step", 0)))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def make_sinks(out_dir: Path, tensorboard: bool, wandb: bool, config: dict[str, Any] | None = None,
               name: str = "run") -> list[Sink]:
    """The optional sinks that are enabled and installed; says in the log which are not."""
    sinks: list[Sink] = []
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(Path(out_dir) / TENSORBOARD))
        except ImportError:
            log.info("metrics: TensorBoard off (`pip install tensorboard` to enable; train.tensorboard)")
    if wandb:
        try:
            sinks.append(WandbSink(Path(out_dir), config or {}, name))
        except ImportError:
            log.info("metrics: Weights & Biases off (`pip install wandb` to enable; train.wandb)")
    return sinks


def _drop_partial_last_line(path: Path) -> None:
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as fh:
        fh.seek(-1, 2)
        if fh.read(1) == b"\n":
            return
        data = fh.seek(0) or fh.read()
        fh.truncate(data.rfind(b"\n") + 1)


class MetricsWriter:
    """Append-only JSONL metrics file (flushed after each record, so a crash loses nothing), fanned
    out to optional sinks (TensorBoard, W&B), which are flushed only by `flush()`."""

    def __init__(self, path: Path, sinks: list[Sink] | None = None, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled  # False on ranks other than 0: every call is a no-op
        self._fh = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_partial_last_line(self.path)  # a process killed mid-write (the run then resumed)
            self._fh = open(self.path, "a", encoding="utf-8")
        self.sinks = list(sinks or []) if enabled else []

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        for sink in self.sinks:
            sink.log(record)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        self.flush()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ----------------------------------------------------------------------------------------------
# health signals
# ----------------------------------------------------------------------------------------------


class HealthMonitor:
    """Loss spikes and sustained grad-norm growth, from values already on the host.

    - loss spike: loss > (1 + spike_threshold) x the exponential moving average of the loss
      (decay 0.9), after `warmup` steps. A falling loss never triggers it.
    - grad-norm growth: the median grad norm of the last `window` steps exceeds `growth_factor` x
      the lowest such median seen so far, and the window's second half is above its first half (a
      sustained rise, not one burst). Reported at most once per `window` steps; each warning moves
      the baseline up, so a steady climb warns once per further factor of growth.
    """

    def __init__(self, spike_threshold: float = 0.3, window: int = 50, growth_factor: float = 2.0,
                 warmup: int = 10):
        if spike_threshold < 0 or growth_factor < 0 or window < 1:
            raise ValueError(f"train.spike_threshold = {spike_threshold} and train.grad_growth_factor = "
                             f"{growth_factor} must be >= 0 (0 = off), train.health_window = {window} >= 1.")
        self.spike_threshold = spike_threshold
        self.window = max(2, window)
        self.growth_factor = growth_factor
        self.warmup = warmup
        self.loss_ema: float | None = None
        self.seen = 0
        self.grad_norms: deque[float] = deque(maxlen=self.window)
        self.baseline: float | None = None
        self.last_growth_step = -(10**9)
        self.n_spikes = 0
        self.n_growth = 0

    def update(self, step: int, loss: float, grad_norm: float) -> list[dict[str, Any]]:
        events = []
        self.seen += 1
        if math.isfinite(loss):
            if (self.loss_ema is not None and self.seen > self.warmup and self.spike_threshold > 0
                    and loss > (1 + self.spike_threshold) * self.loss_ema):
                self.n_spikes += 1
                events.append({"step": step, "event": "loss_spike", "loss": loss, "loss_ema": self.loss_ema,
                               "message": f"loss spike at step {step}: {loss:.4f} vs running mean "
                                          f"{self.loss_ema:.4f} (x{loss / self.loss_ema:.2f})"})
            self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        if math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
        w = self.window
        if self.growth_factor > 0 and len(self.grad_norms) == w:
            vals = list(self.grad_norms)
            now = statistics.median(vals)
            self.baseline = now if self.baseline is None else min(self.baseline, now)
            rising = statistics.median(vals[w // 2:]) > statistics.median(vals[:w // 2])
            if (now > self.growth_factor * self.baseline and rising and step - self.last_growth_step >= w):
                events.append({"step": step, "event": "grad_norm_growth", "grad_norm_median": now,
                               "baseline_median": self.baseline,
                               "message": f"grad norm growing: median {now:.3g} over the last {w} steps vs "
                                          f"{self.baseline:.3g} at its lowest (x{now / self.baseline:.1f}); "
                                          f"consider a lower optim.lr or tighter optim.grad_clip"})
                self.last_growth_step = step
                self.n_growth += 1
                self.baseline = now  # warn again only if it grows by the factor once more
        return events


# ----------------------------------------------------------------------------------------------
# timers and memory
# ----------------------------------------------------------------------------------------------


class Timers:
    """Named wall-clock accumulators: `with timers("checkpoint"): save()`; `take()` reads and resets."""

    def __init__(self) -> None:
        self.window: dict[str, float] = {}
        self.total: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.window[name] = self.window.get(name, 0.0) + seconds
        self.total[name] = self.total.get(name, 0.0) + seconds

    def take(self, name: str) -> float:
        return self.window.pop(name, 0.0)


class ThroughputWindow:
    """Throughput over the steps since the last log line: tokens/s and MFU of the training time
    (validation excluded), step time, the loader's share, checkpoint blocking and peak memory."""

    def __init__(self, flops_per_token: float, peak, world_size: int, device, timers: Timers):
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak = peak  # lmforge.train.profiler.Peak: MFU = its `utilisation` of the window's FLOP/s
        self.device, self.timers = device, timers
        self.start = self.window_start = time.perf_counter()
        self.tokens = self.steps = 0
        self.data_s = self.eval_s = 0.0

    def add_step(self, tokens: int, data_s: float) -> None:
        self.tokens += tokens
        self.steps += 1
        self.data_s += data_s

    def add_eval(self, seconds: float) -> None:
        self.eval_s += seconds

    def take(self) -> dict[str, float]:
        """This window's numbers; starts the next window."""
        now = time.perf_counter()
        busy = max(now - self.window_start - self.eval_s, 1e-9)
        tok_s = self.tokens / busy
        stats = {"window_steps": self.steps, "window_tokens_per_s": tok_s,
                 "window_mfu": self.peak.utilisation(tok_s * self.flops_per_token, self.world_size),
                 "window_step_time_s": busy / max(self.steps, 1), "window_data_share": self.data_s / busy,
                 "window_ckpt_s": self.timers.take("checkpoint"), "mem_gb": memory_gb(self.device),
                 "window_elapsed_s": now - self.start}
        self.window_start, self.tokens, self.steps, self.data_s, self.eval_s = now, 0, 0, 0.0, 0.0
        return stats


def memory_gb(device) -> float:
    """Peak CUDA memory allocated on `device`, or this process's peak resident set size on CPU (GB)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):
        return float("nan")


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h >= 48:
        d, h = divmod(h, 24)
        return f"{d}d{h:02d}h{m:02d}m"
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
