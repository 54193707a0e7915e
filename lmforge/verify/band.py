"""Run-to-run parity of two runs' metrics (loss and gradient norm per step), within a band: the library
behind `lmforge plan --verify`'s 16-bit parity check and `lmforge compare RUN_A RUN_B`.

The band of a 16-bit run is measured, not guessed (`measure_band`): the reference run trained again in
one process, K times, with the rounding of every 16-bit matmul output re-drawn (lmforge/verify/perturb.py).
Each rerun is a run a correct layout could have produced: a layout differs from one process by where its
16-bit partial results are rounded (TP's partial sums, FSDP's gathered copies), by about one unit in the
last place per matmul output, which is what a rerun perturbs. Seeds were not used: a different seed draws
other initial weights and data, a spread of another kind and 10-100x wider than rounding, which would let a
lost factor through.

The statistic, per step s, over the K reruns and the steps t <= s:

    band_loss(s)      = BAND_FACTOR * max_{k, t<=s} |loss_k(t) - loss_ref(t)|                    (absolute)
    band_grad_norm(s) = BAND_FACTOR * max_{k, t<=s} |gnorm_k(t) - gnorm_ref(t)| / gnorm_ref(t)   (relative)

Per step, because rounding differences compound over steps (step 1's band is the tightest: there a lost
factor shows before any update); the running max over earlier steps because a spread reached is not
taken back (on a few steps the max of K draws is itself noisy: measured on the toys, a step's spread can
be 10x its neighbour's).

and a run passes at step s when |loss(s) - loss_ref(s)| <= band_loss(s) and |gnorm(s) - gnorm_ref(s)| /
gnorm_ref(s) <= band_grad_norm(s). BAND_FACTOR = 3 and K = 5: the max over 5 reruns is a small sample
of the spread (another draw exceeds it with probability 1/6), and a layout rounds at places the reruns
do not; the bugs the band is for move the loss or norm much further than rounding does (measured
on the toy in bf16: a gradient summed instead of averaged moves the grad norm ~1000x the band at step 1;
correct layouts, FSDP and FSDP x TP, sit at 0.2-0.4 of it: docs/planning.md).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.folders import METRICS

BAND_FACTOR = 3.0
BAND_RERUNS = 5  # perturbed one-process reruns of a 16-bit reference
KEYS = ("loss", "grad_norm")


def read_metrics(run: str | Path) -> dict[int, dict[str, float]]:
    """{step: {"loss", "grad_norm"}} of a run folder's metrics.jsonl (the last record of a step wins)."""
    out: dict[int, dict[str, float]] = {}
    path = Path(run) / METRICS
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "grad_norm" in rec and "event" not in rec:
            out[rec["step"]] = {"loss": rec["loss"], "grad_norm": rec["grad_norm"]}
    return out


@dataclass
class Band:
    """Per step, the largest |loss difference| (absolute) and |grad norm difference| / reference grad norm
    (relative) that a correct run may show; `per_step[key][step]`, or `fixed[key]` for every step."""

    how: str
    per_step: dict[str, dict[int, float]] = field(default_factory=dict)
    fixed: dict[str, float] = field(default_factory=dict)

    def at(self, key: str, step: int) -> float:
        return self.per_step[key][step] if key in self.per_step else self.fixed[key]

    def describe(self, steps: list[int]) -> str:
        if self.fixed:
            return f"{self.how}: loss {self.fixed['loss']:.1e} (absolute), grad norm {self.fixed['grad_norm']:.1e} (relative)"
        return (f"{self.how}: loss " + " ".join(f"{self.at('loss', s):.1e}" for s in steps)
                + " (absolute), grad norm " + " ".join(f"{self.at('grad_norm', s):.1e}" for s in steps)
                + f" (relative), steps {steps[0]}-{steps[-1]}")


def distance(got: dict, want: dict, key: str, step: int) -> float:
    """|got - want| at `step` of `key`: absolute for the loss, relative to `want` for the grad norm."""
    diff = abs(got[step][key] - want[step][key])
    return diff / abs(want[step][key]) if key == "grad_norm" else diff


def measure_band(reference: dict, reruns: list[dict], factor: float = BAND_FACTOR,
                 how: str = "") -> Band:
    """The band of `reference` from its perturbed `reruns` (module docstring: the statistic)."""
    steps = sorted(reference)
    missing = [s for r in reruns for s in steps if s not in r]
    if not reruns or missing:
        raise ValueError(f"a band needs reruns with every step of the reference; missing steps {sorted(set(missing))}")
    per_step = {key: {s: factor * max(distance(r, reference, key, t) for r in reruns for t in steps if t <= s)
                      for s in steps} for key in KEYS}
    return Band(how or f"{factor:g} x the largest difference of {len(reruns)} reruns", per_step=per_step)


def parse_band(text: str) -> Band:
    """`loss=1e-3,grad_norm=1e-2` (absolute loss, relative grad norm, every step) -> a fixed Band."""
    fixed = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in KEYS:
            raise ValueError(f"--band: unknown key {key!r} in {text!r}; give loss=ABS,grad_norm=REL")
        try:
            fixed[key] = float(value)
        except ValueError:
            raise ValueError(f"--band: {key}={value!r} is not a number; e.g. loss=1e-3,grad_norm=1e-2") from None
    if set(fixed) != set(KEYS):
        raise ValueError(f"--band {text!r} names {sorted(fixed)}; give both: loss=ABS,grad_norm=REL")
    return Band("given", fixed=fixed)


@dataclass
class Outside:
    step: int
    key: str
    got: float
    want: float
    distance: float
    band: float

    def part(self) -> str:
        kind = "relative" if self.key == "grad_norm" else "absolute"
        return (f"{self.key.replace('_', ' ')} {self.got:.6g} vs {self.want:.6g}, difference {self.distance:.2e} "
                f"({kind}) outside the band {self.band:.2e} ({self.distance / self.band:.1f}x)" if self.band > 0 else
                f"{self.key.replace('_', ' ')} {self.got:.6g} vs {self.want:.6g}, difference {self.distance:.2e} "
                f"({kind}); the band is 0")


@dataclass
class Parity:
    """`got` against `want` within `band` over `steps`: the steps outside, and where the worst step falls."""

    steps: list[int]
    outside: list[Outside]
    worst: dict[str, tuple[float, int]]  # key -> (distance / band, step)
    missing: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.outside and not self.missing

    def step_lines(self) -> list[str]:
        """One line per step outside the band: `step S: loss ...; grad norm ...`."""
        steps = sorted({o.step for o in self.outside})
        return [f"step {s}: " + "; ".join(o.part() for o in self.outside if o.step == s) for s in steps]

    def summary(self) -> str:
        if self.missing:
            return f"steps {self.missing} missing from the metrics"
        return ", ".join(f"{k.replace('_', ' ')} at {frac:.2f} of the band at worst (step {s})"
                         for k, (frac, s) in self.worst.items())


def within_band(got: dict, want: dict, band: Band, steps: list[int] | None = None) -> Parity:
    """Each step's loss and grad norm of `got` against `want`, within `band` (the library's one check)."""
    steps = sorted(want) if steps is None else steps
    missing = [s for s in steps if s not in got or s not in want]
    if missing:
        return Parity(steps, [], {}, missing)
    outside, worst = [], {}
    for key in KEYS:
        fracs = []
        for s in steps:
            d, b = distance(got, want, key, s), band.at(key, s)
            frac = d / b if b > 0 else (0.0 if d == 0 else math.inf)
            fracs.append((frac, s))
            if frac > 1:
                outside.append(Outside(s, key, got[s][key], want[s][key], d, b))
        worst[key] = max(fracs)
    outside.sort(key=lambda o: (o.step, o.key))
    return Parity(steps, outside, worst)


def compare_runs(run_a: str | Path, run_b: str | Path, band: Band) -> Parity:
    """RUN_A's metrics against RUN_B's (the reference) over RUN_B's steps, within `band`."""
    a, b = read_metrics(run_a), read_metrics(run_b)
    if not b:
        raise ValueError(f"{run_b} has no {METRICS} with loss and grad_norm per step: is it a run folder?")
    return within_band(a, b, band)
