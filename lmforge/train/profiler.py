"""Device peak FLOP/s for MFU, and the torch profiler switch (`train.profile_steps`).

MFU = tokens/s x flops_per_token / peak, with flops_per_token = 6N + 12*L*d*s (PaLM convention,
`lmforge.model.transformer.flops_per_token`). The peak comes from:

- CUDA: the hardware catalogue (`lmforge.plan.hardware`), dense tensor-core peak of the detected
  GPU (`torch.cuda.get_device_name`) at the run's precision. A GPU the catalogue does not know is
  measured instead (see below), and the log says so.
- CPU: no spec sheet gives a usable number, so it is measured, once per run, on rank 0 (the trainer
  broadcasts rank 0's `Peak`, so every rank divides by the same number): the best of a few timed
  1024^3 matmuls in the run's compute dtype (bf16 under bf16 autocast, else fp32) on the threads
  torch uses, or this machine's best earlier figure where that is higher (kept with its date in the
  user's cache folder: `lmforge.train.peak`, so a busy start-up cannot lower the peak and inflate
  MFU). MFU on CPU is therefore "fraction of what a big matmul achieves here".

MFU never exceeds 100% (`Peak.utilisation`). A measured peak is a lower bound of the machine's
peak: a probe timed while the machine is busy reads low (a run once printed `mfu 173.6%` against
one). Where a logging window computes faster than the peak, the peak is raised to the rate the run
reached, for that window (MFU 100%) and every later one, and its source (in the log and in
summary.json's `peak_source`) says so. That is the honest choice over clamping each window at 100%:
clamping would keep dividing the other windows by a peak the run has shown to be too low, and so
overstate them. Nothing here decides the run's precision (lmforge.train.precision decides that
from the hardware, not from a timing).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.config.rules import compute_precision
from lmforge.folders import PROFILE
from lmforge.plan.hardware import get_device
from lmforge.train.peak import REPS, machine_peak
from lmforge.train.events import Handler

log = logging.getLogger("lmforge.train")

def format_flops(flops: float) -> str:
    """1.23e14 -> '123.0 TFLOP/s'; 4.3e10 -> '43.0 GFLOP/s'."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= scale:
            return f"{flops / scale:.1f} {unit}"
    return f"{flops / 1e6:.1f} MFLOP/s"


@dataclass
class Peak:
    flops: float  # FLOP/s
    source: str  # where the number comes from, for the log line
    device_name: str
    measured: bool
    raised_from: float | None = None  # the first peak, once a run computed faster than it

    def utilisation(self, flops_per_s: float, devices: int = 1) -> float:
        """MFU of a run computing `flops_per_s` on `devices` devices, never above 1: a rate per device
        above the peak raises the peak to it (module docstring)."""
        achieved = flops_per_s / devices
        if achieved > self.flops:
            if self.raised_from is None:
                log.info("mfu: the run computes %s per device, faster than the %s peak (%s): the peak is raised to "
                         "the rate reached, so MFU reads 100%% there and is measured against it from now on",
                         format_flops(achieved), format_flops(self.flops), self.source)
                self.raised_from = self.flops
                self.source += f"; raised from {format_flops(self.flops)} to the rate the run reached"
            self.flops = achieved
        return min(1.0, flops_per_s / (self.flops * devices))  # (min: rounding of the division above)


def catalogue_name(gpu_name: str) -> str | None:
    """Map a CUDA device name ('NVIDIA H100 80GB HBM3', 'NVIDIA A100-SXM4-40GB') to a catalogue name."""
    n = gpu_name.lower()
    if "b200" in n:
        return "B200"
    if "h200" in n:
        return "H200"
    if "h100" in n:
        return "H100-PCIe" if "pcie" in n else "H100-SXM"
    if "a100" in n:
        return "A100-40GB" if "40gb" in n.replace(" ", "").replace("-", "") else "A100-80GB"
    if "v100" in n:
        return "V100"
    return None


def catalogue_peak(gpu_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a known GPU at `precision` ('bf16' | 'fp16' | 'fp32'), else None."""
    name = catalogue_name(gpu_name)
    if name is None:
        return None
    try:
        return get_device(name).peak_flops(precision)
    except ValueError:  # the catalogue has no peak for this precision (e.g. bf16 on a V100)
        return None


_MEASURED: dict[tuple[str, torch.dtype, int], float] = {}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024, reps: int = REPS,
                         budget_s: float = 0.5) -> float:
    """Best-of-`reps` FLOP/s of an n^3 matmul on `device` (cached per device, dtype and thread count).
    A short pause between the timed matmuls spreads them over scheduler slices, so one quiet moment
    on a busy machine is enough (lmforge.train.peak).

    A 256^3 probe runs first; where the full size would take longer than `budget_s` per matmul
    (e.g. bf16 emulated on a CPU without AMX/AVX512-BF16), the probe's rate is the answer.
    """
    key = (str(device), dtype, torch.get_num_threads())
    if key in _MEASURED:
        return _MEASURED[key]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def best_rate(size: int, times: int) -> float:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
        a @ b  # warm-up
        sync()
        best, done, start = float("inf"), 0, time.perf_counter()
        # On a CPU shared with other work one busy core stalls every thread of a matmul (a 2-core machine
        # measured 1, 64 and 101 GFLOP/s in three calls), so the timings spread over `window_s` with short
        # pauses: one quiet moment is enough, the best counts.
        window_s = 0.15 if device.type == "cpu" else 0.0
        while done < times or (time.perf_counter() - start < window_s and done < 20 * times):
            time.sleep(0.002 if device.type == "cpu" else 0.0)
            t0 = time.perf_counter()
            a @ b
            sync()
            best, done = min(best, time.perf_counter() - t0), done + 1
        return 2.0 * size**3 / max(best, 1e-9)

    flops = best_rate(256, reps)  # (a probe that read low on a busy machine would skip the full size)
    if n > 256 and 2.0 * n**3 / flops <= budget_s:
        flops = max(flops, best_rate(n, reps))
    _MEASURED[key] = flops
    return flops


def cpu_name() -> str:
    """The CPU model ('Intel(R) Xeon(R) ...') from /proc/cpuinfo where there is one."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_peak(device: torch.device, precision: str) -> Peak:
    """The MFU denominator for this device and precision ('fp32', 'bf16', 'fp16'; 'bf16-pure' computes
    in bf16), with its source."""
    precision = compute_precision(precision)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = catalogue_peak(name, precision)
        if peak:
            return Peak(peak, f"catalogue dense {precision} peak of {catalogue_name(name)}", name, False)
        flops = measure_matmul_flops(device, dtype, n=4096)
        return Peak(flops, f"{name} is not in the hardware catalogue: measured {precision} 4096^3 matmul "
                           f"(add it with a devices TOML for a spec-sheet MFU)", name, True)
    if device.type == "cpu":
        name = cpu_name()
        # The faster of the compute dtype and fp32: where bf16/fp16 are emulated (no AMX), fp32 is
        # the machine's real peak, and the run is then measured against what it could have had.
        # Each is the machine's best figure so far where a busy start-up measures low (lmforge.train.peak).
        threads = torch.get_num_threads()
        fp32, fp32_how = machine_peak(f"{name} | {threads} threads | fp32",
                                      lambda: measure_matmul_flops(device, torch.float32))
        low, low_how = (machine_peak(f"{name} | {threads} threads | {precision}", lambda: measure_matmul_flops(device, dtype))
                        if dtype != torch.float32 else (0.0, ""))
        label = "fp32" if fp32 >= low else ("bf16" if dtype == torch.bfloat16 else "fp16")
        note = f" (faster than {precision} here)" if dtype != torch.float32 and label == "fp32" else ""
        return Peak(max(fp32, low), f"CPU has no spec-sheet peak: measured {label} matmul{note} on {threads} threads, "
                                    f"{fp32_how if label == 'fp32' else low_how}", name, True)
    flops = measure_matmul_flops(device, dtype)
    return Peak(flops, f"measured {precision} 1024^3 matmul on {device}", str(device), True)


# ----------------------------------------------------------------------------------------------
# torch profiler
# ----------------------------------------------------------------------------------------------


def parse_steps(spec: str) -> list[int]:
    """'5' -> [5]; '5-7' -> [5, 6, 7]; '3,5-6' -> [3, 5, 6]. Empty -> []."""
    steps: set[int] = set()
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"train.profile_steps = {spec!r}: use step numbers and ranges like '5-7' or '3,10'.")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo < 1 or hi < lo:
            raise ValueError(f"train.profile_steps = {spec!r}: ranges must be 1-based and increasing.")
        steps.update(range(lo, hi + 1))
    return sorted(steps)


class StepProfiler:
    """Profile chosen (1-based) optimizer steps with torch.profiler.

    Each contiguous run of chosen steps becomes one Chrome/Perfetto trace,
    `<run>/profile/trace_steps_A-B.json` (open in https://ui.perfetto.dev or chrome://tracing), plus
    `summary_steps_A-B.txt`, the ops ranked by total time. Steps outside the set run unprofiled.
    """

    def __init__(self, steps: list[int] | str, out_dir: Path, device: torch.device):
        self.steps = set(parse_steps(steps) if isinstance(steps, str) else steps)
        self.out_dir = Path(out_dir)
        self.device = device
        self._prof = None
        self._first = 0
        self.traces: list[Path] = []

    @property
    def enabled(self) -> bool:
        return bool(self.steps)

    def step_begin(self, step: int) -> None:
        if step not in self.steps or self._prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=acts, record_shapes=True, profile_memory=True, with_stack=False)
        self._prof.__enter__()
        self._first = step

    def step_end(self, step: int) -> None:
        if self._prof is None:
            return
        self._prof.step()
        if step + 1 in self.steps:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tag = f"{self._first}-{step}"
        trace = self.out_dir / f"trace_steps_{tag}.json"
        prof.export_chrome_trace(str(trace))
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        (self.out_dir / f"summary_steps_{tag}.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        self.traces.append(trace)
        log.info("profiler: steps %s traced to %s", tag, trace)

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None


class Profiling(Handler):
    """The StepProfiler of train.profile_steps as a handler of the loop's events (lmforge.train.events):
    a traced step runs from `step_begin` to `update_end`."""

    def __init__(self) -> None:
        self.profiler: StepProfiler | None = None

    def run_start(self, trainer) -> None:
        self.profiler = StepProfiler(trainer.cfg.train.profile_steps, trainer.out_dir / PROFILE, trainer.device)

    def step_begin(self, trainer, step: int) -> None:
        self.profiler.step_begin(step)

    def update_end(self, trainer, step: int) -> None:
        self.profiler.step_end(step)

    def run_end(self, trainer) -> None:
        self.profiler.close()
