"""S3 backup against a real S3-compatible server on loopback (moto_server, started here)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from lmforge.ckpt.manager import list_checkpoints
from lmforge.ckpt.s3 import S3Backup
from lmforge.config import load_config
from lmforge.folders import RUN_RECORD, read_run_id
from lmforge.train.trainer import Trainer
from tests.test_ckpt import SMALL, events, weights

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto_server did not start")
            time.sleep(0.2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def bucket(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=s3_server)
    name = f"ckpt-{time.time_ns()}"
    client.create_bucket(Bucket=name)
    return client, name


def test_backup_upload_verify_prune_and_restore(small_data, tmp_path, s3_server, bucket):
    client, name = bucket
    s3 = {"checkpoint.s3_bucket": name, "checkpoint.s3_endpoint": s3_server, "checkpoint.s3_prefix": "team/exp"}
    out = tmp_path / "run"
    straight = Trainer(load_config("tiny", {**SMALL, **s3}), out_dir=out, data=small_data)
    straight.fit()
    ref = weights(straight.model)

    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=name)["Contents"])
    base = f"team/exp/run/{read_run_id(out)}/"  # <prefix>/<run name>/<run id>/
    assert all(k.startswith(base) for k in keys)
    remote = sorted({k[len(base):].split("/")[0] for k in keys} - {RUN_RECORD})
    local = sorted(p.name for _, p in list_checkpoints(out / "checkpoints"))
    assert remote == local == ["step_00000008", "step_00000012"]  # pruned like the local folder
    owner = json.loads(client.get_object(Bucket=name, Key=base + RUN_RECORD)["Body"].read())
    assert owner["run_id"] == read_run_id(out) and owner["out_dir"] == str(out)
    meta = json.loads(client.get_object(Bucket=name, Key=f"{base}step_00000012/meta.json")["Body"].read())
    shard = next(f for f in meta["files"] if f.endswith(".distcp"))
    head = client.head_object(Bucket=name, Key=f"{base}step_00000012/{shard}")
    assert head["Metadata"]["sha256"] == meta["files"][shard]["sha256"]
    done = [e["event"] for e in events(out) if e["event"].startswith("backup")]
    # each checkpoint backed up, or (an upload slower than the rotation: seen under CI load) skipped
    # because keep_last removed it locally first; never failed
    assert len(done) == 3 and done[-1] == "backup" and set(done) <= {"backup", "backup_skipped"}, done

    # the local disk is lost: keep only the step-8 backup remotely, then resume from it
    shutil.rmtree(out / "checkpoints")
    for k in keys:
        if "step_00000012" in k:
            client.delete_object(Bucket=name, Key=k)
    resumed = Trainer(load_config("tiny", {**SMALL, **s3}), out_dir=out, data=small_data)
    resumed.fit()
    assert resumed.resumed_from.name == "step_00000008"
    assert any(e["event"] == "restored_from_backup" for e in events(out))
    for k, v in weights(resumed.model).items():
        assert torch.equal(v, ref[k]), k


def test_a_checkpoint_rotated_away_during_its_upload_is_skipped_not_failed(small_data, tmp_path, s3_server, bucket):
    client, name = bucket
    out = tmp_path / "run"
    Trainer(load_config("tiny", {**SMALL, "train.steps": 8}), out_dir=out, data=small_data).fit()  # (no backup)
    older, newer = [p for _, p in list_checkpoints(out / "checkpoints")]
    seen: list[dict] = []
    backup = S3Backup(name, "", "run", s3_server, on_event=seen.append)
    upload_file = backup.client.upload_file

    def upload_then_rotate(path, *args, **kwargs):  # keep_last removes the older folder mid-upload
        upload_file(path, *args, **kwargs)
        shutil.rmtree(older, ignore_errors=True)

    backup.client.upload_file = upload_then_rotate
    backup.upload(older, keep=[older.name, newer.name])
    backup.wait()
    backup.upload(newer, keep=[newer.name])
    backup.wait()
    assert [e["event"] for e in seen] == ["backup_skipped", "backup"], seen
    assert backup.errors == [] and backup.uploaded == [newer.name]
    remote = {o["Key"].split("/")[1] for o in client.list_objects_v2(Bucket=name).get("Contents", [])}
    assert remote == {newer.name}  # the skipped checkpoint's partial upload is removed too


def test_incomplete_remote_checkpoint_is_not_restored(small_data, tmp_path, s3_server, bucket):
    """A remote folder without meta.json (an upload cut short) or with a bad shard is skipped."""
    client, name = bucket
    s3 = {"checkpoint.s3_bucket": name, "checkpoint.s3_endpoint": s3_server}
    out = tmp_path / "run"
    Trainer(load_config("tiny", {**SMALL, **s3, "train.steps": 8}), out_dir=out, data=small_data).fit()
    shutil.rmtree(out / "checkpoints")
    prefix = f"lmforge/run/{read_run_id(out)}/"
    client.delete_object(Bucket=name, Key=prefix + "step_00000008/meta.json")
    meta = json.loads(client.get_object(Bucket=name, Key=prefix + "step_00000004/meta.json")["Body"].read())
    shard = next(f for f in meta["files"] if f.endswith(".distcp"))
    client.put_object(Bucket=name, Key=prefix + "step_00000004/" + shard, Body=b"garbage")
    trainer = Trainer(load_config("tiny", {**SMALL, **s3, "train.steps": 8}), out_dir=out, data=small_data)
    trainer.setup()
    assert trainer.resumed_from is None and trainer.state.step == 0  # nothing usable: a fresh start


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_start_up_check_says_whether_endpoint_or_bucket_is_wrong(s3_server, bucket, monkeypatch):
    """An unreachable checkpoint.s3_endpoint ended in a 121-line EndpointConnectionError traceback.
    `S3Backup.check()` (called once by the trainer at start-up) is one line naming the key at fault,
    against a real S3 server (moto) and a closed port; a closed port is found in one attempt."""
    from lmforge.ckpt.s3 import S3Backup
    from lmforge.config import ConfigError

    _, name = bucket
    S3Backup(name, "team", "run", s3_server).check()  # endpoint up, bucket there: no error

    with pytest.raises(ConfigError) as err:
        S3Backup("no-such-bucket", "team", "run", s3_server).check()
    assert str(err.value).startswith(f"checkpoint.s3_bucket = 'no-such-bucket' does not exist at "
                                     f"checkpoint.s3_endpoint = '{s3_server}' (the endpoint answered); create "
                                     f"the bucket (e.g. `aws s3 mb s3://no-such-bucket`)")

    closed = f"http://127.0.0.1:{_closed_port()}"
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        S3Backup(name, "team", "run", closed).check()
    assert time.perf_counter() - start < 10  # one attempt, not botocore's retries with back-off
    assert str(err.value).startswith(f"checkpoint.s3_endpoint = '{closed}' cannot be reached "
                                     f"(EndpointConnectionError: ")
    assert "check the URL (scheme, host, port) and that the server is running" in str(err.value)
    assert "\n" not in str(err.value)

    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)  # the endpoint from the environment is named as such
    with pytest.raises(ConfigError, match=r"^\$AWS_ENDPOINT_URL = 'http://127\.0\.0\.1:\d+' cannot be reached"):
        S3Backup(name, "team", "run", "").check()
    with pytest.raises(ConfigError, match=r"^checkpoint.s3_endpoint = 'minio 9000' is not a valid URL"):
        S3Backup(name, "team", "run", "minio 9000")


def test_the_trainer_checks_endpoint_and_bucket_at_start_up(s3_server, small_data, tmp_path):
    """A run with a wrong bucket stops in setup, before training, with the one-line check."""
    from lmforge.config import ConfigError

    cfg = load_config("tiny", {**SMALL, "checkpoint.s3_bucket": "no-such-bucket", "checkpoint.s3_endpoint": s3_server})
    with pytest.raises(ConfigError, match="checkpoint.s3_bucket = 'no-such-bucket' does not exist"):
        Trainer(cfg, out_dir=tmp_path / "run", data=small_data).fit()
