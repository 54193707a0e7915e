"""A CPU's MFU peak that a busy machine cannot pull down: the best matmul rate this machine has shown.

A measured peak is a lower bound of what the machine can do, and a timing taken while other
processes share the cores reads low: one run on a 2-core machine printed `mfu 100.0%` and then
`mfu 83.2%` against such a peak, where the same run measured 36-45% on a quiet machine. So each
start-up measurement (the best of at least REPS short matmuls, spread over 0.15 s) is compared
with the best figure this machine gave before, kept with its date in a small JSON file in the user's
cache folder (`$LMFORGE_CACHE/peak.json`, default `~/.cache/lmforge/peak.json`), keyed by CPU model,
thread count and dtype; the higher of the two is the peak, and the run header says which it is:

    mfu: ... against 127.3 GFLOP/s per device (CPU has no spec-sheet peak: fp32 matmul on 2 threads,
         best of 5+, cached 2026-11-29 in ~/.cache/lmforge/peak.json; measured now 48% of it, the machine is busy)

The machine is measured once a day per key: a start-up on a day whose check is already recorded
(`checked` in the file) takes the cached best as it is, without the ~0.3 s of matmuls per dtype
(a day of short CPU runs, a sweep's trials or a test suite's hundreds, pays it once).

The cache is a convenience, never a condition: a folder that cannot be read or written (read-only
home, a full disk, a corrupt file) leaves the run with its own measurement. `LMFORGE_PEAK_CACHE=off`
turns it off, and deleting the file forgets a figure (e.g. after a hardware change under the same
CPU model name).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Callable

log = logging.getLogger("lmforge.train")

REPS = 5  # timed matmuls per measurement; the best counts
CACHE_FILE = "peak.json"
BUSY = 0.8  # a measurement below this fraction of the cached figure is called out in the header


def cache_path() -> Path | None:
    """Where the per-machine figures live; None where LMFORGE_PEAK_CACHE=off."""
    own = os.environ.get("LMFORGE_PEAK_CACHE")
    if own is not None:
        return None if own.strip().lower() in ("", "off", "0", "none") else Path(own).expanduser()
    return Path(os.environ.get("LMFORGE_CACHE", "~/.cache/lmforge")).expanduser() / CACHE_FILE


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # none yet, unreadable or corrupt: as if empty
        return {}


def _write(path: Path, key: str, entry: dict) -> bool:
    """Record `entry` for `key`; False (and the run goes on) where the file cannot be written."""
    from lmforge.folders import atomic_write_json  # (atomic: two runs starting at once do not mix files)

    try:
        data = _read(path)
        data[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data, indent=1, sort_keys=True)
        return True
    except OSError as exc:
        log.debug("mfu: peak cache %s not written (%s); the run uses its own measurement", path, exc)
        return False


def machine_peak(key: str, measure: Callable[[], float], today: datetime.date | None = None) -> tuple[float, str]:
    """The peak FLOP/s for `key` (CPU model | threads | dtype) and how it was obtained: `measure()`
    now (the best of at least REPS matmuls), or the machine's best cached figure where that is higher."""
    day = (today or datetime.date.today()).isoformat()
    path = cache_path()
    if path is None:
        return measure(), f"best of {REPS}+ now (peak cache off)"
    shown = str(path).replace(str(Path.home()), "~", 1) if str(path).startswith(str(Path.home())) else str(path)
    entry = _read(path).get(key)
    cached = entry.get("flops") if isinstance(entry, dict) else None
    if not isinstance(cached, (int, float)):
        cached = None
    if cached is not None and entry.get("checked") == day:  # measured today already: the best as it is
        return float(cached), f"best of {REPS}+, cached {entry.get('date', '?')} in {shown} (checked today)"
    now = measure()
    if cached is not None and cached > now:
        busy = f"; measured now {now / cached:.0%} of it, the machine is busy" if now < BUSY * cached else ""
        _write(path, key, {**entry, "checked": day})
        return float(cached), f"best of {REPS}+, cached {entry.get('date', '?')} in {shown}{busy}"
    written = _write(path, key, {"flops": now, "date": day, "best_of": REPS, "checked": day})
    return now, f"best of {REPS}+, measured now" + (f" (cached in {shown})" if written else "")
