"""Live progress of a run: a tqdm bar on a terminal, plain log lines otherwise; rank 0 only.

    progress = Progress(total_steps, mode="auto")       # 'auto' | 'bar' | 'lines' | 'none'
    progress.update(step, record)                      # at each log line, with the metrics record
    progress.write("step 50: val loss ...")            # messages that must not break the bar
    progress.close()

`auto` draws the bar only when stdout is a TTY; under a pipe, a file, CI or SLURM it prints one
calm line per log interval:

    step 10/250 | loss 6.1234 | lr 1.00e-03 | grad norm 1.23 | 12,345 tok/s | mfu 12.3% | mem 0.41 GB | data 2% | eta 1m05s

On ranks other than 0 of a torch.distributed job, everything is silent.
"""

from __future__ import annotations

import io
import logging
import math
import sys
from typing import Any, TextIO

from lmforge.train.metrics import format_duration

log = logging.getLogger("lmforge.train")


def is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def _terminal_columns(stream) -> int | None:
    """Width of the terminal behind `stream`: 0 for a pseudo-terminal without a size (a bar would
    be invisible there), None when unknown (a test double)."""
    import os

    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def format_line(step: int, total: int, rec: dict[str, Any], eta_s: float) -> str:
    """The plain progress line (also what the e2e tests grep for: 'step N/T | loss')."""
    parts = [f"step {step}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}",
             f"grad norm {rec['grad_norm']:.2f}", f"{rec['window_tokens_per_s']:,.0f} tok/s"]
    if math.isfinite(rec.get("window_mfu", float("nan"))):
        parts.append(f"mfu {100 * rec['window_mfu']:.1f}%")
    if math.isfinite(rec.get("mem_gb", float("nan"))):
        parts.append(f"mem {rec['mem_gb']:.2f} GB")
    if "window_data_share" in rec:
        parts.append(f"data {100 * rec['window_data_share']:.0f}%")
    if rec.get("window_ckpt_s"):
        parts.append(f"ckpt {rec['window_ckpt_s']:.1f}s")
    parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


class Progress:
    def __init__(self, total_steps: int, mode: str = "auto", stream: TextIO | None = None,
                 rank0: bool | None = None, initial: int = 0):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.rank0 = is_rank0() if rank0 is None else rank0
        if mode not in ("auto", "bar", "lines", "none"):
            raise ValueError(f"train.progress = {mode!r}: use 'auto', 'bar', 'lines' or 'none'.")
        if mode == "auto":
            isatty = getattr(self.stream, "isatty", lambda: False)
            mode = "bar" if isatty() and _terminal_columns(self.stream) != 0 else "lines"
        self.mode = mode if self.rank0 else "none"
        self._bar = None
        if self.mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is a dependency
                self.mode = "lines"
            else:
                self._bar = tqdm(total=total_steps, initial=initial, file=self.stream, unit="step", dynamic_ncols=True,
                                 smoothing=0.1, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
                                                           "[{elapsed}<{remaining}]{postfix}")

    def update(self, step: int, rec: dict[str, Any], eta_s: float) -> None:
        if self.mode == "none":
            return
        if self._bar is not None:
            post = {"loss": f"{rec['loss']:.4f}", "lr": f"{rec['lr']:.1e}", "gnorm": f"{rec['grad_norm']:.2f}",
                    "tok/s": f"{rec['window_tokens_per_s']:,.0f}"}
            if math.isfinite(rec.get("window_mfu", float("nan"))):
                post["mfu"] = f"{100 * rec['window_mfu']:.1f}%"
            if math.isfinite(rec.get("mem_gb", float("nan"))):
                post["mem"] = f"{rec['mem_gb']:.2f}GB"
            if "window_data_share" in rec:
                post["data"] = f"{100 * rec['window_data_share']:.0f}%"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            log.info("%s", format_line(step, self.total, rec, eta_s))

    def write(self, message: str, level: int = logging.INFO) -> None:
        """A message above the bar (or a log line); silent on ranks other than 0."""
        if not self.rank0:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
            log.debug("%s", message)
        else:
            log.log(level, "%s", message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
