"""A slow rank is named: each rank times the phases of its own steps, and every log window rank 0
compares them across ranks and names a rank that stays slower than the others.

Phases of a step (`PHASES`): `data` (drawing the micro-batches: host time), `compute` (forward and
backward of every micro-batch), `optimizer` (clipping, the update, zeroing) and `sync` (the
loop's per-step host all-reduce, where a rank waits for the last one to finish its step). On a
CPU each phase is host time (time.perf_counter). On CUDA the host runs ahead of the device, so
`compute` and `optimizer` are CUDA events on the current stream, read when the window closes
(the log line's synchronize has completed them): no device sync is added to any step.

Who is slow. In a synchronous layout every rank's step takes as long as the slowest rank's: the
others wait for it in the first collective after its slow part. A rank's *own* time
(`own_seconds`) is therefore counted as: its `data` and `optimizer` seconds (rank-local work:
the loader, the update; a slow one shows as the others' `sync` wait, which is not counted), plus
the quickest rank's `compute` seconds (the compute phase ends in the gradient reduction, DDP's
all-reduce, FSDP2's reduce-scatter or the pipeline's last exchange, so a rank's compute above the
quickest rank's is time spent waiting there for a slower one). A rank whose own time is more
than `train.straggler_ratio` x the median rank's, for `train.straggler_windows` windows in a
row, is named on rank 0's console and as a `straggler` event, with its host and the phase where
it exceeds the median most. What host timing cannot see (said in the README): a rank slow
*inside* the compute phase (a throttled GPU) makes every rank's compute phase equally long, its
waits being inside the collectives; naming it needs device kernel timing per rank.

Every window's slowest and fastest rank and their ratio go to metrics.jsonl and TensorBoard
(`window_slowest_rank`, `window_fastest_rank`, `window_rank_ratio`). The exchange is one
all-gather of five floats per rank on the host group, at log steps (every rank logs at the same
steps), never inside a step.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Iterator

import torch

PHASES = ("data", "compute", "optimizer", "sync")
WAITING_PHASES = ("compute",)  # phases that end in a collective: a rank's excess there is a wait


DEVICE_PHASES = ("compute", "optimizer")  # timed with CUDA events on a GPU


class PhaseClock:
    """One rank's phase seconds since the window began (host clock on a CPU, CUDA events on a GPU
    for the device phases)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.steps = 0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if self.cuda and phase in DEVICE_PHASES:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.events.append((phase, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds

    def step_done(self) -> None:
        self.steps += 1

    def take(self) -> list[float]:
        """[data, compute, optimizer, sync, window seconds] since the last take; resets. On CUDA the
        events must be complete (the caller synchronized)."""
        for phase, start, end in self.events:
            self.totals[phase] += start.elapsed_time(end) / 1e3
        now = time.perf_counter()
        out = [self.totals[p] for p in PHASES] + [now - self.started]
        self.totals, self.events, self.started, self.steps = dict.fromkeys(PHASES, 0.0), [], now, 0
        return out


def own_seconds(table: list[list[float]]) -> list[float]:
    """Each rank's own time in a window (rows: ranks; columns: PHASES): its rank-local phases, plus
    the quickest rank's time in the phases that end in a collective (the rest of a rank's time
    there is a wait for a slower rank); `sync` is all wait."""
    quickest = {p: min(row[i] for row in table) for i, p in enumerate(PHASES)}
    return [sum(quickest[p] if p in WAITING_PHASES else row[i] for i, p in enumerate(PHASES) if p != "sync")
            for row in table]


def slowest_phase(table: list[list[float]], rank: int) -> str:
    """The phase where `rank` exceeds the median rank the most (the rank-local phases: a waiting
    phase's excess is another rank's slowness), else the compute phase."""
    def excess(i: int) -> float:
        return table[rank][i] - statistics.median(row[i] for row in table)

    local = [i for i, p in enumerate(PHASES) if p not in WAITING_PHASES and p != "sync"]
    best = max(local, key=excess)
    return PHASES[best] if excess(best) > 0 else WAITING_PHASES[0]


class StragglerMonitor:
    """Rank 0's verdicts over the windows (every rank calls `window` at the same log steps)."""

    def __init__(self, ratio: float, windows: int, group=None, distributed: bool = False):
        self.ratio, self.windows, self.group, self.distributed = ratio, windows, group, distributed
        self.hosts = [socket.gethostname()]
        self.streak: dict[int, int] = {}
        self.named: set[int] = set()
        if distributed:
            hosts: list = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(hosts, socket.gethostname(), group=group)
            self.hosts = hosts

    def gather(self, row: list[float]) -> list[list[float]]:
        if not self.distributed:
            return [row]
        mine = torch.tensor(row, dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(self.group))]
        torch.distributed.all_gather(rows, mine, group=self.group)
        return [r.tolist() for r in rows]

    def window(self, row: list[float]) -> tuple[dict, list[dict]]:
        """This window's metrics fields and the events to log (a rank named once per run of slow
        windows), from every rank's [data, compute, optimizer, sync, window seconds]."""
        table = self.gather(row)
        if len(table) < 2:
            return {}, []
        own = own_seconds(table)
        slow, fast = max(range(len(own)), key=own.__getitem__), min(range(len(own)), key=own.__getitem__)
        median = statistics.median(own)
        fields = {"window_slowest_rank": slow, "window_fastest_rank": fast,
                  "window_rank_ratio": own[slow] / own[fast] if own[fast] > 0 else 1.0}
        events = []
        for rank, t in enumerate(own):
            if median > 0 and t > self.ratio * median:
                self.streak[rank] = self.streak.get(rank, 0) + 1
            else:
                self.streak.pop(rank, None)
                self.named.discard(rank)
            if self.streak.get(rank, 0) >= self.windows and rank not in self.named:
                self.named.add(rank)
                phase = slowest_phase(table, rank)
                events.append({
                    "event": "straggler", "rank": rank, "host": self.hosts[rank], "phase": phase,
                    "ratio": t / median, "windows": self.streak[rank],
                    "message": (f"straggler: rank {rank} on {self.hosts[rank]} is {t / median:.2f}x the median rank's "
                                f"own step time for {self.streak[rank]} log windows (train.straggler_ratio "
                                f"{self.ratio}); most of it in '{phase}'")})
        return fields, events
