"""The S3 backup belongs to one run (issue 34, items 2 and 3), with real `lmforge train` processes
against a real S3-protocol server on loopback (moto_server, tests/test_ckpt_s3.py's fixture).

* Two runs in different local folders with the same last name and the same bucket/prefix: the second
  neither restores the first's checkpoint nor deletes its objects (it stops, naming both run ids and
  both folders); the first, extended later with its local checkpoints gone, restores its own state;
  with `checkpoint.s3_adopt = true` another run takes the first's backup over on purpose.
* A corrupt object in the newest remote checkpoint: the restore falls back to the older one and its
  log line names the bad object.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from lmforge.folders import RUN_RECORD
from tests.test_ckpt_s3 import bucket, s3_server  # noqa: F401  (fixtures)
from tests.test_parallel_dp import corpus, train  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

BACKED = {"checkpoint.every_steps": 4, "checkpoint.every_minutes": 0, "train.steps": 8, "train.sample_tokens": 0}


def objects(client, name: str) -> dict[str, str]:
    """Every key in the bucket with its ETag."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def run_id(folder: Path) -> str:
    return json.loads((folder / RUN_RECORD).read_text())["run_id"]


@pytest.fixture(scope="module")
def first(corpus, s3_server, tmp_path_factory):  # noqa: F811
    """The first run: `.../a/run`, 8 steps, checkpoints at 4 and 8 backed up to its own bucket."""
    import os

    import boto3

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    client = boto3.client("s3", endpoint_url=s3_server)
    name = f"identity-{os.getpid()}"
    client.create_bucket(Bucket=name)
    s3 = {**BACKED, "checkpoint.s3_bucket": name, "checkpoint.s3_endpoint": s3_server}
    folder = tmp_path_factory.mktemp("identity") / "a" / "run"
    done = train(corpus, folder, **s3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before = objects(client, name)
    first_id = run_id(folder)
    assert before and all(k.startswith(f"lmforge/run/{first_id}/") for k in before)  # the key holds the run id
    assert {k.split("/")[3] for k in before} >= {"step_00000004", "step_00000008"}
    return client, name, s3, folder, first_id, before


# (the three tests below run in this order on the first run's bucket)
def test_a_second_run_with_the_same_folder_name_is_refused_and_touches_nothing(corpus, first, tmp_path):  # noqa: F811
    """The reproduction: another run, other settings, in another folder with the same last name and
    the same bucket/prefix. The old code restored the first run's step 8 into it ('no valid local
    checkpoint; restored step_00000008 from s3://...', then 'with changed settings: optim.lr ...')
    and its rotation deleted the first run's objects."""
    client, name, s3, first_folder, first_id, before = first
    second = tmp_path / "b" / "run"
    other = train(corpus, second, **{**s3, "optim.lr": 1e-3, "train.steps": 12})
    text = other.stdout + other.stderr
    assert other.returncode != 0, text[-3000:]
    assert "restored" not in text
    error = next(line for line in text.splitlines() if "s3_adopt" in line)
    assert first_id in error and str(first_folder) in error and str(second) in error, error
    second_id = re.search(r"this run \(run id ([0-9a-f]{32})", error).group(1)
    assert second_id != first_id
    assert objects(client, name) == before  # nothing deleted, nothing overwritten
    assert not list((second / "checkpoints").glob("step_*"))


def test_the_first_run_extended_restores_its_own_state(corpus, first):  # noqa: F811
    client, name, s3, folder, first_id, _ = first
    shutil.rmtree(folder / "checkpoints")  # its local checkpoints are lost
    more = train(corpus, folder, **{**s3, "train.steps": 12})
    text = more.stdout + more.stderr
    assert more.returncode == 0, text[-3000:]
    assert f"restored step_00000008 from s3://{name}/lmforge/run/{first_id}/" in text
    assert "changed settings: train.steps 8 -> 12\n" in text  # its own state: none of another run's settings
    assert run_id(folder) == first_id


def test_adopting_another_runs_backup_on_purpose(corpus, first, tmp_path):  # noqa: F811
    client, name, s3, _, first_id, _ = first
    second = tmp_path / "c" / "run"
    adopted = train(corpus, second, **{**s3, "train.steps": 12, "checkpoint.s3_adopt": "true"})
    text = adopted.stdout + adopted.stderr
    assert adopted.returncode == 0, text[-3000:]
    assert f"adopting run {first_id}" in text and re.search(r"restored step_000000(08|12)", text)
    assert run_id(second) == first_id


def test_restore_falls_back_past_a_corrupt_object(corpus, tmp_path, s3_server, bucket):  # noqa: F811
    client, name = bucket
    s3 = {**BACKED, "checkpoint.s3_bucket": name, "checkpoint.s3_endpoint": s3_server}
    out = tmp_path / "run"
    done = train(corpus, out, **s3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    base = f"lmforge/run/{run_id(out)}/"
    meta = json.loads(client.get_object(Bucket=name, Key=base + "step_00000008/meta.json")["Body"].read())
    shard = next(f for f in meta["files"] if f.endswith(".distcp"))
    bad = f"{base}step_00000008/{shard}"
    body = bytearray(client.get_object(Bucket=name, Key=bad)["Body"].read())
    body[len(body) // 2] ^= 0xFF  # one flipped byte, same size: only the sha256 tells
    client.put_object(Bucket=name, Key=bad, Body=bytes(body))
    shutil.rmtree(out / "checkpoints")  # the local disk is lost

    resumed = train(corpus, out, **{**s3, "train.steps": 12})
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text[-3000:]
    assert f"s3://{name}/{bad}" in next(line for line in text.splitlines() if "sha256" in line)
    assert "restored step_00000004" in text and "resuming at step 4 of 12" in text
