"""Fault tolerance with real processes: SIGKILL at random moments, resharded resume, elastic restart.

Every job is a real `python -m lmforge train` (or `torchrun ... -m lmforge train`) on a tiny
prepared corpus; processes are killed with SIGKILL from outside, at whatever point they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.ckpt.manager import list_checkpoints, verify_checkpoint
from tests.test_parallel_dp import (assert_runs_match, corpus,  # noqa: F401 - fixture reuse
                                    free_port, grad_norms, losses, overrides, train_runs)

pytestmark = pytest.mark.slow

FAULT = {"checkpoint.every_steps": 2, "train.log_every": 1, "train.steps": 16}


def launch(corpus: Path, out: Path, nproc: int = 1, extra_torchrun: tuple = (), **extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lmforge"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        *(extra_torchrun or ("--master-port", str(free_port()))), "-m", "lmforge"]
    log = open(out.parent / f"{out.name}.log", "ab")
    # torch issue #135712: torchrun's shared rendezvous store hands restarted workers the previous
    # round's addresses; separate stores make --max-restarts work (set it for elastic jobs)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd + ["train"] + overrides(corpus, out, **{**FAULT, **extra}), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)


def finish(proc: subprocess.Popen, out: Path, timeout: int = 240) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a launch and return once none of its processes holds anything: torchrun's workers first
    (they have sessions of their own, so killing the agent's group leaves them running), then the
    agent's group. A SIGKILLed worker is an orphan nobody here can reap, and it lets go of its files
    (the run folder's lock among them) only once the kernel has torn it down, which on a loaded machine
    is not yet done when the signal call returns: wait until each is gone or a zombie."""
    workers = [int(pid) for pid in
               subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()]
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60
    for pid in workers:
        while time.time() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                break
            if state in ("Z", "X"):
                break
            time.sleep(0.02)
        else:
            raise TimeoutError(f"worker {pid} of launch {proc.pid} still alive 60 s after SIGKILL")


def newest_step(out: Path) -> int:
    found = list_checkpoints(out / "checkpoints")
    return found[0][0] if found else 0


def wait_for_checkpoint(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> bool:
    """True once a checkpoint >= step exists; False if the process ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if newest_step(out) >= step:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise TimeoutError(f"no checkpoint >= {step} in {out} after {timeout}s")


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), f"max abs difference {worst}"


KILLED = {"train.steps": 24}  # the SIGKILL test's run: long enough that its last kill lands before the end


# Mixture-of-Experts with expert parallelism over 2 ranks (lmforge.parallel.expert_parallel): expert
# weights split over the EP ranks, their optimizer state, the aux-loss-free selection bias
MOE_EP2 = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 64,
           "model.moe.bias_update_rate": 0.01, "parallel.dp_shard": 2, "parallel.ep": 2, "train.micro_batch_size": 2}
SIGKILL_LAYOUTS = {"1-process": (1, {}), "ep2-moe": (2, MOE_EP2)}


@pytest.mark.parametrize("layout", list(SIGKILL_LAYOUTS))
def test_sigkill_at_random_moments_then_resume_is_bit_exact(corpus, runs, tmp_path, layout):  # noqa: F811
    """Three SIGKILLs at random moments (mid-step, mid-save, whatever), a resume after each: the
    final weights equal the uninterrupted run's bit for bit. Each kill comes 0-0.15 s (a few steps
    of this model, or a save's write) after a checkpoint shows up, and the kills aim at checkpoints
    at least 12 steps before the end: a quiet CPU runs a few more steps while an asynchronous save
    is written and validated, and with 16 steps, kills aimed up to 2 steps before the end and up to
    0.4 s late, the third kill landed after the run's last checkpoint. Under torchrun (the EP layout)
    the workers are killed first, then the agent's group (killing the agent alone leaves them running)."""
    nproc, extra = SIGKILL_LAYOUTS[layout]
    reference = runs / f"sigkill-{layout}"
    rng = random.Random(int(os.environ.get("LMFORGE_FAULT_SEED", "1234")))
    out = tmp_path / "run"
    steps = KILLED["train.steps"]
    kills = 0
    for _ in range(3):
        proc = launch(corpus, out, nproc=nproc, **KILLED, **extra)
        target = min(newest_step(out) + rng.choice([2, 4]), steps - 12)
        if not wait_for_checkpoint(proc, out, target):
            break
        time.sleep(rng.uniform(0.0, 0.15))  # somewhere inside the following steps or the save
        kill_launch(proc)
        kills += 1
    assert kills == 3
    killed_at = newest_step(out)
    assert 2 <= killed_at < steps
    proc = launch(corpus, out, nproc=nproc, **KILLED, **extra)
    finish(proc, out)
    log = (tmp_path / "run.log").read_text()
    assert log.count("resumed from") == 3, log[-3000:]  # (rank 0 alone prints it)
    assert_bitwise(final_weights(out), final_weights(reference))
    # every step's loss and gradient norm after a resume equal the reference's (the last record of a
    # step wins)
    assert losses(out) == losses(reference)
    assert grad_norms(out) == grad_norms(reference)


UNTIED = {"model.tie_embeddings": "false"}  # (pipeline stages cannot share a weight)
WRITERS = {  # name: the 2-rank run whose step-8 checkpoint the tests below resume elsewhere (16 steps, every 8)
    "fsdp2": {"parallel.dp_shard": 2},  # FSDP2: sharded parameters and optimizer state
    "zero1": {"parallel.dp_shard": 2, "parallel.zero_stage": 1},
    "tp-2": {**UNTIED, "parallel.tp": 2, "train.micro_batch_size": 2},
    "pp-2": {**UNTIED, "parallel.pp": 2, "train.micro_batch_size": 2},
}
WORLD_SIZES = {"1-process": (1, {}), "fsdp-4": (4, {"parallel.dp_shard": 4, "train.micro_batch_size": 2}),
               "ddp-4": (4, {"parallel.dp_replicate": 4, "train.micro_batch_size": 2}),
               "tp-2": (2, {"parallel.tp": 2, "train.micro_batch_size": 2})}
UNTIED_3D = {**UNTIED, "parallel.dp_shard": 2, "parallel.tp": 2, "parallel.pp": 2, "train.micro_batch_size": 2}
DDP2 = {"parallel.dp_replicate": 2, "train.micro_batch_size": 2}  # the elastic test's layout
FORKED_DRIVER = str(Path(__file__).with_name("forked_runs_driver.py"))


def forked_runs(corpus: Path, runs: dict[Path, dict], nproc: int, timeout: int = 900,  # noqa: F811
                **shared) -> subprocess.CompletedProcess:
    """tests/test_parallel_dp.py's `train_runs` (several runs in one process group), its ranks forked from
    one process that imported torch once (tests/forked_runs_driver.py) instead of started by torchrun:
    for the runs whose point is the layout, not the launcher."""
    if nproc == 1:
        return train_runs(corpus, runs, timeout=timeout, **shared)
    args = [overrides(corpus, out, **{**shared, **own}) for out, own in runs.items()]
    return subprocess.run([sys.executable, FORKED_DRIVER, str(nproc), json.dumps(args)], capture_output=True,
                          text=True, timeout=timeout)


def at_step_8(run: Path) -> dict:
    """Overrides that start a run from `run`'s step-8 checkpoint (read in place: the writer's folder is
    not touched) and save no checkpoints of their own."""
    return {"checkpoint.resume": str(run / "checkpoints" / "step_00000008"), "checkpoint.every_steps": 0}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> Path:  # noqa: F811
    """Every uninterrupted run of this module, in one launch per process count (`forked_runs`: each launch
    pays torch's import and the process group once, not once per run or rank):

    * 2 ranks: ROOT/<writer> for each of `WRITERS` (their step-8 checkpoints are kept), then
      ROOT/fsdp2-tp-2 (fsdp2's step 8 continued under TP), ROOT/ddp2 (the elastic test's reference) and
      ROOT/sigkill-ep2-moe (the SIGKILL test's EP reference);
    * 8 ranks: ROOT/3d (dp_shard 2 x tp 2 x pp 2, a step-8 checkpoint);
    * 1 process: ROOT/fsdp2-1-process and ROOT/<writer>-1 (step 8 of the 2-rank writers continued),
      ROOT/single (the 3-D run's one-process twin), ROOT/3d-1 (the 3-D step 8 continued) and
      ROOT/sigkill-1-process;
    * 4 ranks: ROOT/fsdp2-<world> (fsdp2's step 8 continued under FSDP and under DDP).

    The references save no checkpoints (or few): a save never changes the training (the SIGKILL test
    holds resumed runs to them bit for bit)."""
    root = tmp_path_factory.mktemp("runs")
    writers = {**FAULT, "checkpoint.every_steps": 8, "checkpoint.keep_every": 8}
    launches = {
        2: {**{root / name: {**writers, **own} for name, own in WRITERS.items()},
            root / "fsdp2-tp-2": {**FAULT, **WORLD_SIZES["tp-2"][1], **at_step_8(root / "fsdp2")},
            root / "ddp2": {**FAULT, **DDP2, "checkpoint.every_steps": 0},
            root / "sigkill-ep2-moe": {**FAULT, **KILLED, **MOE_EP2, "checkpoint.every_steps": 0}},
        8: {root / "3d": {**FAULT, **UNTIED_3D, "checkpoint.every_steps": 8}},
        1: {**{root / f"{name}-1": {**FAULT, **(UNTIED if "model.tie_embeddings" in own else {}),
                                     **at_step_8(root / name)} for name, own in WRITERS.items() if name != "fsdp2"},
            root / "fsdp2-1-process": {**FAULT, **at_step_8(root / "fsdp2")},
            root / "single": {**FAULT, **UNTIED, "checkpoint.every_steps": 0},
            root / "3d-1": {**FAULT, **UNTIED, **at_step_8(root / "3d")},
            root / "sigkill-1-process": {**FAULT, **KILLED, "checkpoint.every_steps": 0}},
        4: {root / f"fsdp2-{world}": {**FAULT, **layout, **at_step_8(root / "fsdp2")}
            for world, (nproc, layout) in WORLD_SIZES.items() if nproc == 4},
    }
    for nproc, own in launches.items():
        proc = forked_runs(corpus, own, nproc)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.mark.parametrize("world", list(WORLD_SIZES))
def test_checkpoint_from_2_ranks_resumes_on_another_world_size(runs, world):
    """The step-8 checkpoint written by 2 FSDP ranks continues on 1 process and on 4 ranks (DCP
    reshards by name); steps 9-16 match the 2-rank run (fp32; only reduction order differs)."""
    nproc, layout = WORLD_SIZES[world]
    assert_runs_match(runs / f"fsdp2-{world}", runs / "fsdp2", f"2 FSDP ranks -> {nproc} ({layout})",
                      steps=list(range(9, 17)))


def test_elastic_restart_after_a_rank_is_killed(corpus, runs, tmp_path):  # noqa: F811
    """torchrun --max-restarts 1: SIGKILL one DDP worker after the step-6 checkpoint; torchrun restarts
    the group, which resumes from the newest checkpoint by itself and finishes the run."""
    ddp, ref = DDP2, runs / "ddp2"
    out = tmp_path / "run"
    # elastic jobs use the c10d rendezvous: each restart round gets a fresh store namespace
    elastic = ("--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}")
    proc = launch(corpus, out, nproc=2, extra_torchrun=elastic, **ddp)
    assert wait_for_checkpoint(proc, out, 6)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGKILL)
    finish(proc, out)
    log = (tmp_path / "run.log").read_text()
    assert "resumed from" in log, log[-3000:]
    assert_bitwise(final_weights(out), final_weights(ref))
    verify_checkpoint(list_checkpoints(out / "checkpoints")[0][1], test_load=True)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoints"]["resumed_from"] is not None


def test_zero1_checkpoint_resumes_in_one_process(runs):
    """ZeRO-1 keeps each rank's optimizer partition in its local optimizer: every rank writes its own
    part, and one process reads all of it back by name (the next steps' losses match)."""
    assert_runs_match(runs / "zero1-1", runs / "zero1", "ZeRO-1 -> 1 process", steps=list(range(9, 17)))


@pytest.mark.parametrize("layout", ["tp-2", "pp-2"])
def test_model_parallel_checkpoint_resumes_in_one_process(runs, layout):
    """Tensor-parallel shards (DTensor) and pipeline stages (each rank its own layers) are written by
    name: one process reads the whole model and optimizer back and continues the run."""
    assert_runs_match(runs / f"{layout}-1", runs / layout, f"{WRITERS[layout]} -> 1 process",
                      steps=list(range(9, 17)))


def test_3d_layout_matches_one_process_and_its_checkpoint_resumes_in_one(runs):
    """dp_shard 2 x tp 2 x pp 2 = 8 processes on one DeviceMesh: per-step losses equal one process's
    (fp32; observed ~2e-7 relative), and its step-8 checkpoint (FSDP x TP shards of each pipeline stage)
    continues in one process."""
    assert_runs_match(runs / "3d", runs / "single", "3-D (dp_shard 2 x tp 2 x pp 2) vs one process",
                      steps=list(range(1, 17)))
    assert_runs_match(runs / "3d-1", runs / "single", "3-D step-8 checkpoint -> 1 process", steps=list(range(9, 17)))
