"""A slow or stuck rank is named, never silent (issue 49): the straggler report
(lmforge/train/stragglers.py) and the hang watchdog (lmforge/train/watchdog.py), in units and with
real gloo ranks: a slowed rank is named with its phase, an even run names none, a rank stuck
before a collective leaves every rank's stacks and a `hang` event and exits 76 long before the
collective timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmforge.train.stragglers import PHASES, StragglerMonitor, own_seconds, slowest_phase
from lmforge.train.watchdog import EXIT_HANG, HangWatchdog
from tests.test_parallel_dp import corpus, free_port, launcher, overrides, run_logs  # noqa: F401 - fixture reuse

HERE = Path(__file__).parent


def row(data=0.01, compute=0.10, optimizer=0.01, sync=0.0):
    return [data, compute, optimizer, sync, data + compute + optimizer + sync]


def monitor(table_source, ratio=1.2, windows=3) -> StragglerMonitor:
    m = StragglerMonitor(ratio, windows)
    m.hosts = [f"host{r}" for r in range(8)]
    m.gather = lambda _row: table_source()  # (the ranks' rows, as the host group's all-gather gives them)
    return m


def test_own_time_counts_waits_as_the_waiters_and_names_the_slow_phase():
    # rank 2's loader takes 0.2 s more; the others wait for it in the compute phase's reduction
    slow_data = [row(compute=0.30), row(compute=0.30), row(data=0.21), row(compute=0.30)]
    own = own_seconds(slow_data)
    assert own[2] == pytest.approx(0.32) and own[0] == own[1] == own[3] == pytest.approx(0.12)
    assert slowest_phase(slow_data, 2) == "data"
    # rank 1's optimizer step takes 0.2 s more; the others wait for it in the step's last all-reduce
    slow_optim = [row(sync=0.2), row(optimizer=0.21), row(sync=0.2), row(sync=0.2)]
    own = own_seconds(slow_optim)
    assert max(range(4), key=own.__getitem__) == 1 and slowest_phase(slow_optim, 1) == "optimizer"


def test_a_rank_is_named_after_enough_windows_once_and_again_after_it_recovered():
    table = [[row(compute=0.3), row(compute=0.3), row(data=0.21), row(compute=0.3)]]
    m = monitor(lambda: table[0])
    for window in range(2):
        fields, events = m.window(row())
        assert events == [] and fields["window_slowest_rank"] == 2 and fields["window_rank_ratio"] > 2
    fields, events = m.window(row())
    assert [(e["event"], e["rank"], e["host"], e["phase"]) for e in events] == [("straggler", 2, "host2", "data")]
    assert "rank 2 on host2" in events[0]["message"] and "'data'" in events[0]["message"]
    assert m.window(row())[1] == []  # named once per run of slow windows
    table[0] = [row()] * 4  # recovered
    fields, events = m.window(row())
    assert events == [] and fields["window_rank_ratio"] == pytest.approx(1.0)
    table[0] = [row(compute=0.3), row(compute=0.3), row(data=0.21), row(compute=0.3)]
    assert [m.window(row())[1] for _ in range(3)][-1][0]["rank"] == 2  # slow again: named again


def test_even_ranks_within_the_ratio_are_never_named():
    jitter = [[row(data=0.010 + 0.003 * (r == w % 4)) for r in range(4)] for w in range(20)]
    it = iter(jitter)
    m = monitor(lambda: next(it))
    assert all(m.window(row())[1] == [] for _ in range(20))


def test_one_process_has_nothing_to_compare():
    assert StragglerMonitor(1.2, 3).window(row()) == ({}, [])
    assert PHASES == ("data", "compute", "optimizer", "sync")


def test_the_watchdog_dumps_every_thread_and_reports_a_stuck_step(tmp_path):
    events = []
    dog = HangWatchdog(tmp_path, rank=3, factor=5, min_s=0.6, action="wait", on_hang=events.append, poll_s=0.05)
    dog.start()
    try:
        for step in range(1, 4):  # warm-up steps: never watched
            dog.step_begin(step)
            time.sleep(0.01)
            dog.step_end()
        assert dog.limit() == pytest.approx(0.6)  # (5 x the ~0.01 s median is below the floor)
        dog.step_begin(4)
        with dog.paused():  # validation inside a step: not a hang however long
            time.sleep(1.0)
        assert events == []
        helper = threading.Thread(target=time.sleep, args=(2,), name="a-helper-thread")
        helper.start()
        time.sleep(1.2)  # stuck
        assert [e["step"] for e in events] == [4] and events[0]["rank"] == 3
        text = (tmp_path / "hang" / "3.txt").read_text()
        assert text.startswith("rank 3, pid ") and "step 4 has not finished" in text
        assert "test_the_watchdog_dumps_every_thread" in text  # the stuck main thread's stack
        assert text.count("hread 0x") >= 3  # every thread: main, the helper, the watchdog's own ("Current thread")
        time.sleep(0.5)
        assert len(events) == 1  # once per stuck step
        dog.step_end()
        helper.join()
    finally:
        dog.stop()


@pytest.mark.slow
def test_a_slowed_rank_is_named_and_an_even_run_names_none(corpus, tmp_path):  # noqa: F811
    """4 gloo ranks (DDP); rank 2 sleeps 0.25 s at the start of every step (a slow loader): named
    within a few log windows with its phase; the same run without the sleep names nobody."""
    driver = str(HERE / "slow_rank_driver.py")
    runs = {"slow": ("2", "0.25"), "even": ("-1", "0")}
    args = [[rank, seconds, overrides(corpus, tmp_path / name, **{
        "parallel.dp_replicate": 4, "train.steps": 24, "train.log_every": 4, "train.straggler_windows": 2,
        "train.sample_tokens": 0, "train.global_batch_size": 8})] for name, (rank, seconds) in runs.items()]
    # both runs in one launch (one process group): torch's import and the group's set-up paid once, and
    # warm (tests/warm_start.py: nothing here is killed or signalled)
    cmd = launcher(4, torchrun=True) + [driver, json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = run_logs(proc, {tmp_path / name: None for name in runs})
    for name in runs:
        out = tmp_path / name
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        named = [r for r in recs if r.get("event") == "straggler"]
        windows = [r for r in recs if "window_slowest_rank" in r]
        assert windows and all("window_rank_ratio" in r and "window_fastest_rank" in r for r in windows)
        if name == "slow":
            assert [(e["rank"], e["phase"]) for e in named] == [(2, "data")], named
            assert named[0]["step"] <= 16, named  # within a few windows
            assert "straggler: rank 2 on " in logs[out]
            assert all(r["window_slowest_rank"] == 2 for r in windows)
        else:
            assert named == [] and "straggler:" not in logs[out], named


@pytest.mark.slow
def test_a_rank_stuck_before_a_collective_leaves_every_ranks_stacks_and_exits(corpus, tmp_path):  # noqa: F811
    """Rank 1 sleeps (for good) before step 6; rank 0 waits in that step's first collective. Each
    rank's watchdog fires after train.hang_min_s = 3 s (the collective timeout is 120 s), writes
    hang/<rank>.txt, rank 0 logs the `hang` event, and the ranks exit 76."""
    marker = tmp_path / "asleep"
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(HERE / "stall_driver.py"), "1", "6", "100000", str(marker)] + overrides(
        corpus, out, **{"parallel.dp_replicate": 2, "parallel.timeout_s": 120, "train.hang_min_s": 3,
                        "train.steps": 20, "train.log_every": 1})
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    elapsed = time.time() - float(marker.read_text())
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"exitcode: {EXIT_HANG}" in text, text[-3000:]
    assert elapsed < 60, elapsed  # far under the collective timeout (120 s)
    stacks = {r: (out / "hang" / f"{r}.txt").read_text() for r in (0, 1)}
    assert "in stalled" in stacks[1] and "time.sleep" not in stacks[0], stacks[1][-2000:]  # where rank 1 is stuck
    assert "step 6 has not finished" in stacks[0] and "step 6 has not finished" in stacks[1]
    hang = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"hang"' in line]
    assert hang and hang[0]["rank"] == 0 and hang[0]["step"] == 6 and hang[0]["action"] == "exit"
    assert time.time() - t0 < 110
