"""Preemption is a checkpoint (lmforge/train/preempt.py), with real processes and real signals.

A run that gets SIGTERM / SIGINT / SIGUSR1 mid-run finishes its step, saves a checkpoint, logs a
`preempted` event and exits with PREEMPTED_EXIT_CODE; running it again resumes and ends with the
same weights, bit for bit, as a run that was never interrupted. One process, and two ranks under
torchrun, whose agent gets the signal and forwards it to its workers (as a scheduler's SIGTERM
reaches a torchrun job). Ctrl-C prints no traceback; a second signal exits at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.ckpt.manager import list_checkpoints
from lmforge.train.preempt import PREEMPTED_EXIT_CODE
from tests.test_ckpt_fault import assert_bitwise, final_weights
from tests.test_parallel_dp import corpus, free_port, grad_norms, losses, overrides  # noqa: F401 - fixture reuse

pytestmark = pytest.mark.slow

RUN = {"train.steps": 60, "train.log_every": 1, "checkpoint.every_minutes": 0, "train.sample_tokens": 0,
       "train.eval_sequences": 4}


def launch(corpus: Path, out: Path, nproc: int = 1, launcher: str = "torchrun", **extra) -> subprocess.Popen:  # noqa: F811
    """`lmforge train` (under torchrun, or `lmforge launch`, for nproc > 1) in a session of its own,
    output to out.log."""
    cmd = [sys.executable, "-m", "lmforge"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port",
        str(free_port()), "-m", "lmforge"] if launcher == "torchrun" else [
        sys.executable, "-m", "lmforge", "launch", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
    log = open(out.parent / f"{out.name}.log", "ab")
    return subprocess.Popen(cmd + ["train"] + overrides(corpus, out, **{**RUN, **extra}), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def output(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text()


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((json.loads(line).get("step", 0) for line in path.read_text().splitlines() if '"loss"' in line),
               default=0)


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def events(out: Path, name: str) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("event") == name]


def finish(proc: subprocess.Popen, out: Path, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):  # noqa: F811
    """Uninterrupted runs: one process, and two DDP ranks under torchrun."""
    root = tmp_path_factory.mktemp("preempt_ref")
    runs = {1: root / "one", 2: root / "two"}
    procs = {n: launch(corpus, out, nproc=n, **({"parallel.dp_replicate": 2} if n == 2 else {}))
             for n, out in runs.items()}
    for n, proc in procs.items():
        assert finish(proc, runs[n]) == 0, output(runs[n])[-3000:]
    return runs


def preempt_then_resume(corpus, reference, tmp_path, nproc: int, sig: signal.Signals) -> Path:  # noqa: F811
    out = tmp_path / "run"
    extra = {"parallel.dp_replicate": 2} if nproc == 2 else {}
    proc = launch(corpus, out, nproc=nproc, **extra)
    wait_for(lambda: steps_logged(out) >= 3, proc, "3 logged steps")
    proc.send_signal(sig)  # (under torchrun: to the agent, which forwards it to its workers)
    rc = finish(proc, out, timeout=120)
    text = output(out)
    stopped = events(out, "preempted")
    assert len(stopped) == 1, text[-3000:]
    step = stopped[0]["step"]
    assert 3 <= step < RUN["train.steps"], stopped
    assert stopped[0]["signal"] == sig.name
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [step], text[-3000:]
    assert text.count(f"preempted ({sig.name}) at step {step} of {RUN['train.steps']}") == 1, text[-3000:]
    assert "Traceback" not in text.split("death signal")[0], text[-3000:]  # (torchrun's agent: see below)
    if nproc == 1:
        assert rc == PREEMPTED_EXIT_CODE, text[-3000:]
    else:  # torchrun's agent re-raises the signal it forwarded; its workers exited with the code
        assert rc != 0 and "Received 15 death signal" in text and "SIGKILL" not in text, text[-3000:]
    assert not (out / "model.safetensors").exists()

    proc = launch(corpus, out, nproc=nproc, **extra)
    assert finish(proc, out) == 0, output(out)[-3000:]
    assert f"resumed from {out / 'checkpoints'}" in output(out)
    want = reference[nproc]
    assert_bitwise(final_weights(out), final_weights(want))
    assert losses(out) == losses(want) and grad_norms(out) == grad_norms(want)
    return out


def test_sigterm_mid_run_checkpoints_and_resumes_bit_identically(corpus, reference, tmp_path):  # noqa: F811
    preempt_then_resume(corpus, reference, tmp_path, 1, signal.SIGTERM)


def test_sigterm_to_torchrun_checkpoints_every_rank_and_resumes_bit_identically(corpus, reference,  # noqa: F811
                                                                               tmp_path):
    out = preempt_then_resume(corpus, reference, tmp_path, 2, signal.SIGTERM)
    assert output(out).count("preempted (SIGTERM)") == 1  # rank 0's line alone


LAUNCHED = ("launcher", "process group")  # where the scheduler's SIGTERM goes, in the order `launched` sends it


@pytest.fixture(scope="module")
def launched(corpus, reference, tmp_path_factory):  # noqa: F811
    """One 2-rank job under `lmforge launch`, preempted once per entry of `LAUNCHED` (SIGTERM to the
    launcher alone, then, rerun, to the whole process group), then rerun to its end: {to: (exit status,
    that attempt's output, its preempted step, the checkpoints after it)}, and the run folder. One job
    for both: the second attempt starts from the first one's checkpoint, and the last from the second's,
    so the final weights prove both resumes (one launch fewer than a job per case)."""
    out = tmp_path_factory.mktemp("launched") / "run"
    ddp, attempts, stopped_at = {"parallel.dp_replicate": 2}, {}, 0
    for to in LAUNCHED:
        start = len(output(out)) if (out.parent / f"{out.name}.log").is_file() else 0
        proc = launch(corpus, out, nproc=2, launcher="lmforge launch", **ddp)
        wait_for(lambda: steps_logged(out) >= stopped_at + 3, proc, "3 logged steps")  # (this attempt's)
        if to == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        rc = finish(proc, out, timeout=120)
        stopped_at = events(out, "preempted")[-1]["step"]
        attempts[to] = rc, output(out)[start:], stopped_at, [s for s, _ in list_checkpoints(out / "checkpoints")]
    proc = launch(corpus, out, nproc=2, launcher="lmforge launch", **ddp)
    assert finish(proc, out) == 0, output(out)[-3000:]
    return attempts, out


@pytest.mark.parametrize("to", LAUNCHED)
def test_sigterm_to_lmforge_launch_exits_75_without_a_traceback_and_resumes_bit_identically(launched, reference, to):
    """Issue 49 item 3: `lmforge launch` (torch's torchrun in-process) ends a preempted job with 75,
    the code its workers exited with, and no traceback, whether the scheduler's SIGTERM reaches the
    launcher alone (it forwards it) or the whole process group (the workers get it twice)."""
    attempts, out = launched
    rc, text, step, checkpoints = attempts[to]
    assert rc == PREEMPTED_EXIT_CODE, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    # its checkpoint is the preempted step's (after the earlier attempts' own)
    assert checkpoints == [a[2] for a in reversed(attempts.values()) if a[2] <= step], text[-3000:]
    assert_bitwise(final_weights(out), final_weights(reference[2]))
    assert losses(out) == losses(reference[2])


def test_ctrl_c_checkpoints_without_a_traceback(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    proc = launch(corpus, out)
    wait_for(lambda: steps_logged(out) >= 2, proc, "2 logged steps")
    proc.send_signal(signal.SIGINT)
    assert finish(proc, out, timeout=120) == PREEMPTED_EXIT_CODE, output(out)[-3000:]
    text = output(out)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "preempted (SIGINT)" in text and list_checkpoints(out / "checkpoints")


def test_a_second_signal_exits_at_once_without_a_checkpoint(corpus, tmp_path):  # noqa: F811
    """The first signal lands during set-up (the run would stop after its first step); the second
    one, once the first is acknowledged, ends the process at once: 128 + SIGTERM, nothing saved."""
    out = tmp_path / "run"
    proc = launch(corpus, out, **{"train.steps": 400})
    wait_for(lambda: "precision:" in output(out), proc, "the precision line")
    proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: "SIGUSR1 received" in output(out), proc, "the first signal's acknowledgement")
    proc.send_signal(signal.SIGTERM)
    assert finish(proc, out, timeout=30) == 128 + signal.SIGTERM, output(out)[-3000:]
    assert "stopping now, without a checkpoint" in output(out)
    assert not list_checkpoints(out / "checkpoints")


def test_sigterm_to_an_async_sgd_job_stops_server_and_workers(corpus, tmp_path):  # noqa: F811
    """Asynchronous SGD (parameter server + 2 workers): the server stops every worker after the update
    in progress and all exit promptly, with the preempted event (async SGD keeps no checkpoint)."""
    out = tmp_path / "run"
    proc = launch(corpus, out, nproc=3, **{"parallel.dp_replicate": 3, "parallel.async_sgd": "true",
                                           "train.global_batch_size": 6, "train.steps": 5000})
    wait_for(lambda: steps_logged(out) >= 3, proc, "3 logged updates")
    proc.send_signal(signal.SIGTERM)
    finish(proc, out, timeout=60)
    text = output(out)
    stopped = events(out, "preempted")
    assert len(stopped) == 1 and 3 <= stopped[0]["step"] < 5000, text[-3000:]
    assert text.count("preempted (SIGTERM) at update") == 1 and "SIGKILL" not in text, text[-3000:]
    assert "Traceback" not in text.split("death signal")[0], text[-3000:]
