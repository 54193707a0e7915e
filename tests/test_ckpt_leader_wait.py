"""Checkpoint validation never holds the other ranks in a training-timeout collective (issue 31
part 5): rank 0 re-hashes and test-loads a new checkpoint while the others wait on the manager's
wait group, with a timeout sized to the checkpoint (`leader_wait_s`), not parallel.timeout_s.

Two real gloo ranks save one checkpoint through `CheckpointManager` with a training timeout of
3 s; rank 0's validation is made slow (a sleep before `verify_checkpoint`, standing in for a
checkpoint of hundreds of GB) and LEADER_BYTES_PER_S low, so the sized timeout of this small
checkpoint is ~20 s or ~3.2 s:

* validation 6 s, sized timeout ~20 s: the save succeeds on both ranks. Before, rank 1 waited in a
  barrier of the manager's group with the 3 s training timeout, timed out, and counted the
  checkpoint as failed (and its next collectives fell out of step with rank 0's);
* validation 8 s, sized timeout ~3.2 s: rank 1 gives up after the sized timeout, with an error
  that names it (the wait is bounded: a stuck leader is still detected).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest

from tests.test_parallel_dp import free_port

TRAINING_TIMEOUT_S = 3.0
NBYTES = 4 * 250_000  # the checkpoint's one fp32 tensor; its files hold a little more


def _worker(rank: int, port: int, folder: str, out: str, validate_s: float, bytes_per_s: float) -> None:
    import torch
    import torch.distributed as dist

    import lmforge.ckpt.manager as manager_mod
    from lmforge.ckpt.manager import CheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TRAINING_TIMEOUT_S))
    wait_pg = dist.new_group(backend="gloo", timeout=manager_mod.WAIT_GROUP_TIMEOUT)
    manager_mod.LEADER_BYTES_PER_S = bytes_per_s
    real_verify = manager_mod.verify_checkpoint

    def slow_verify(*args, **kwargs):  # a big checkpoint, as far as the waiting ranks can tell
        time.sleep(validate_s)
        return real_verify(*args, **kwargs)

    manager_mod.verify_checkpoint = slow_verify
    events: list[dict] = []
    manager = CheckpointManager(Path(folder), rank=rank, world_size=2, process_group=pg, wait_group=wait_pg,
                                timeout_s=TRAINING_TIMEOUT_S, on_event=events.append)
    manager.prepare()
    tensors = {"w": torch.full((NBYTES // 4,), float(rank + 1))}  # (each rank: its own copy, deduplicated)
    t0 = time.perf_counter()
    manager.save(1, tensors, {"step": 1}, {"note": "test"})
    manager.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "failures": manager.failures, "saves": manager.saves, "seconds": time.perf_counter() - t0,
        "events": [e.get("message", "") for e in events]}))
    dist.barrier()  # (the default group, 60 s: rank 0 may still be validating)
    dist.destroy_process_group()


# name: (rank 0's validation seconds, LEADER_BYTES_PER_S)
SCENARIOS = {"longer-than-training-timeout": (2 * TRAINING_TIMEOUT_S, 2 * NBYTES / 17),  # sized: ~20 s
             "slower-than-sized-timeout": (8.0, 1e7)}  # sized: 2 MB / 10 MB/s + 3 s = ~3.2 s


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """Each of `SCENARIOS` on its own two ranks, both pairs at once (they spend their time waiting for
    rank 0's sleep, not computing): {name: (its folder, each rank's record)}."""
    import torch.multiprocessing as mp

    started = {}
    for name, (validate_s, bytes_per_s) in SCENARIOS.items():
        folder = tmp_path_factory.mktemp(name)
        started[name] = folder, mp.spawn(_worker, args=(free_port(), str(folder / "ckpt"), str(folder), validate_s,
                                                        bytes_per_s), nprocs=2, join=False)
    for _, context in started.values():
        while not context.join():
            pass
    return {name: (folder, [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)])
            for name, (folder, _) in started.items()}


def test_the_wait_is_sized_to_the_checkpoint():
    from lmforge.ckpt.manager import LEADER_BYTES_PER_S, leader_wait_s

    assert leader_wait_s(0, 600) == 600
    # a 700 GB checkpoint, validated (read twice): hours, not the training timeout's 10 minutes
    assert leader_wait_s(2 * 700e9, 600) == 2 * 700e9 / LEADER_BYTES_PER_S + 600 > 3600 * 10


@pytest.mark.slow
def test_a_validation_longer_than_the_training_timeout_does_not_fail_the_checkpoint(scenarios):
    folder, ranks = scenarios["longer-than-training-timeout"]
    assert [r["failures"] for r in ranks] == [0, 0], ranks
    assert ranks[0]["saves"] == 1 and (folder / "ckpt" / "step_00000001" / "meta.json").is_file()
    assert ranks[1]["seconds"] >= 2 * TRAINING_TIMEOUT_S - 0.5  # rank 1 did wait for the validation


@pytest.mark.slow
def test_a_leader_slower_than_the_sized_timeout_is_given_up_on(scenarios):
    _, ranks = scenarios["slower-than-sized-timeout"]
    assert ranks[1]["failures"] == 1, ranks
    message = next(m for m in ranks[1]["events"] if "failed" in m)
    assert "waited 3 s for the checkpoint leader to publish and validate step_00000001" in message, message
    assert ranks[1]["seconds"] < 8.0  # it gave up before the leader finished
