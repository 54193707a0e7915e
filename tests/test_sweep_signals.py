"""`lmforge sweep` owns its trials: SIGTERM or SIGINT to a sweep of two parallel trials ends both
(each saves a checkpoint first), leaves no process behind, records them as interrupted, and the
same command run again resumes them from their checkpoints. Real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 80
BASE = ["--train.steps", str(STEPS), "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
        "--data.seq_len", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
        "--train.eval_every", "0", "--train.eval_sequences", "8", "--train.sample_tokens", "0",
        "--train.log_every", "1", "--train.tensorboard", "false", "--train.plot", "false",
        "--checkpoint.every_minutes", "0", "--train.precision", "fp32"]


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found.update(int(p) for p in task.read_text().split())
    return found


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (the sweep folder: trials and their children)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            raw = cmdline.read_bytes()
        except OSError:
            continue
        if text.encode() in raw and b"pytest" not in raw:
            pids.append(int(cmdline.parent.name))
    return pids


def steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((json.loads(line).get("step", 0) for line in lines if '"loss"' in line), default=0)


def signal_the_sweep(tmp_path: Path, sig: signal.Signals) -> tuple[list[str], dict, list[Path]]:
    """Start a sweep of two parallel trials, send it `sig` once both trials have logged steps; check
    that it exited 128 + sig, leaving no trial process behind and both trials `interrupted`. Returns
    (its command line, its environment, the trial folders)."""
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "lmforge", "sweep", "--grid", "optim.lr=1e-3,3e-3", "--parallel", "2",
           "--threads", "1", "--out", str(out), *BASE]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "sweep.log", "wb")
    # (SIGINT as a terminal's foreground job has it: a test run started in the background of a
    # non-interactive shell, `pytest &`, hands its children SIGINT ignored, and Python then keeps
    # ignoring it: the sweep rightly ran on, as under nohup, and this test failed)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 180
        while not (len(runs := sorted(out.glob("t*-*"))) == 2 and all(steps_logged(r) >= 2 for r in runs)):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "sweep.log").read_text()[-3000:]
            time.sleep(0.05)
        trials = children(proc.pid)
        assert len(trials) == 2, trials
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 128 + sig, (tmp_path / "sweep.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in trials:  # the trials are gone, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert processes_naming(str(out)) == []
    rows = json.loads((out / "results.json").read_text())
    assert [r["status"] for r in rows] == ["interrupted", "interrupted"], rows
    stopped = {r: steps_logged(r) for r in runs}
    assert all(2 <= s < STEPS for s in stopped.values()), stopped
    for run in runs:  # (the sweep hands each trial SIGTERM, whatever it got itself)
        assert (run / "checkpoints").is_dir() and "preempted (SIGTERM)" in (run / "train.log").read_text()
    return cmd, env, runs


@pytest.mark.slow
def test_sigterm_to_the_sweep_ends_its_trials_and_a_rerun_resumes_them(tmp_path):
    cmd, env, runs = signal_the_sweep(tmp_path, signal.SIGTERM)
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert rerun.stdout.count("  resume ") == 2, rerun.stdout
    rows = json.loads((runs[0].parent / "results.json").read_text())
    assert [r["status"] for r in rows] == ["done", "done"], rows
    for run in runs:
        assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
        assert "resumed from" in (run / "train.log").read_text()


@pytest.mark.slow
def test_ctrl_c_to_the_sweep_ends_its_trials(tmp_path):
    signal_the_sweep(tmp_path, signal.SIGINT)
