"""Secondary checkpoint backup to S3-compatible object storage (AWS S3, MinIO, Ceph, R2, ...).

Rank 0 uploads each finished, validated checkpoint in a background thread: the shard files first,
`meta.json` last (a remote checkpoint without its meta.json is incomplete and ignored), each object
carrying its sha256 as user metadata; every upload is verified (size and checksum of the stored
object) and remote checkpoints that were rotated away locally are deleted. When no valid local
checkpoint exists, `restore_latest` downloads the newest remote one, verifies every checksum and
publishes it atomically into the local folder.

Credentials come from the environment / boto3's usual sources; the endpoint from the config or
$AWS_ENDPOINT_URL. `check()`, called once at start-up, says whether the endpoint or the bucket
is wrong before anything runs.

One run's objects (`<s3_prefix>/<run name>/<run id>/step_NNNNNNNN/...`, plus `run.json`, the owner
record: run id, run folder, host) are its own: the run id (lmforge.folders.RUN_RECORD, created with
the run folder) is part of every key, so a run restores, overwrites and rotates only its own objects.
`claim()`, called at start-up, refuses a run whose folder name (the last part of train.out_dir) under
the prefix already holds another run's backup, naming both runs and both folders, unless the user
adopts that run (checkpoint.s3_adopt): two runs in `a/run` and `b/run` would otherwise share
`<prefix>/run/`. Checkpoints of an lmforge from before run ids (`<prefix>/<run name>/step_*`
directly) are left alone: neither restored nor deleted, with a warning. (The owner record is written
with a run's first upload: two runs started under one name before either uploaded do not see each
other, but their keys differ by run id, so neither touches the other's objects; the next start of
either names both.)

A restore verifies every object against the sha256 and size its meta.json records; a checkpoint
with a bad object is skipped (the log names the object) and the next older one is tried, as the
local store does.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import socket
import threading
from pathlib import Path
from typing import Any, Callable

from lmforge.ckpt.manager import META, STEP_DIR, verify_checkpoint
from lmforge.ckpt.safe_io import check_relative
from lmforge.config import ConfigError
from lmforge.folders import RUN_ID, RUN_RECORD, fsync_dir, sha256_file

log = logging.getLogger("lmforge.ckpt.s3")


class S3Backup:
    def __init__(self, bucket: str, prefix: str, run_name: str, endpoint: str = "",
                 on_event: Callable[[dict], None] | None = None, run_id: str = "", out_dir: str = ""):
        try:
            import boto3
        except ImportError as e:
            raise ValueError("checkpoint.s3_bucket is set but boto3 is not installed: `pip install boto3` "
                             "(or `pip install lmforge[s3]`).") from e
        self.bucket = bucket
        self.name_prefix = "/".join(p for p in (prefix.strip("/"), run_name) if p) + "/"  # <prefix>/<run name>/
        self.run_id = run_id  # '' = the keys have no run id (a tool's own backup, not a run's)
        self.out_dir = out_dir  # this run's folder, recorded in the owner record and named in errors
        self._owned = False  # the owner record is written (with the first upload)
        # where the endpoint came from, for error messages: the config key, the environment, or AWS
        self.endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or ""
        self._endpoint_key = ("checkpoint.s3_endpoint" if endpoint else "$AWS_ENDPOINT_URL" if self.endpoint
                              else "the AWS S3 endpoint")
        try:
            self.client = boto3.client("s3", endpoint_url=self.endpoint or None)
        except ValueError as exc:  # botocore: "Invalid endpoint: ..."
            raise ConfigError(f"{self._endpoint_key} = {self.endpoint!r} is not a valid URL ({exc}); give "
                              f"one like http://minio:9000 or https://s3.example.com.") from None
        self.on_event = on_event or (lambda e: None)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.uploaded: list[str] = []
        self.errors: list[str] = []

    # ---- start-up check --------------------------------------------------------------------------
    def check(self, timeout_s: float = 10.0) -> None:
        """Check once, before training starts, that the endpoint answers and the bucket exists and is
        accessible (one HEAD request, one attempt, `timeout_s` per connect/read). A ConfigError (a
        ValueError) says in one line which one is wrong and how to fix it, instead of a backup that
        fails later in the background or a restore's long traceback."""
        import boto3
        from botocore.config import Config as BotoConfig
        from botocore.exceptions import BotoCoreError, ClientError
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError, NoCredentialsError, ParamValidationError

        where = f"{self._endpoint_key} = {self.endpoint!r}" if self.endpoint else self._endpoint_key
        bucket = f"checkpoint.s3_bucket = {self.bucket!r}"
        client = boto3.client("s3", endpoint_url=self.endpoint or None, config=BotoConfig(
            connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1, "mode": "standard"}))
        try:
            client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError:
            raise ConfigError(f"{bucket}: no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                              f"(or AWS_PROFILE) in the environment.") from None
        except ParamValidationError:
            raise ConfigError(f"{bucket} is not a valid bucket name; S3 bucket names are 3-63 lowercase letters, "
                              f"digits, dots and hyphens.") from None
        except ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("404", "NoSuchBucket") or status == 404:
                raise ConfigError(f"{bucket} does not exist at {where} (the endpoint answered); create the bucket "
                                  f"(e.g. `aws s3 mb s3://{self.bucket}`) or fix checkpoint.s3_bucket.") from None
            if code in ("403", "AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch") \
                    or status == 403:
                raise ConfigError(f"{bucket} at {where}: access denied ({code}); check the credentials "
                                  f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and the bucket's permissions.") from None
            raise ConfigError(f"{bucket} at {where}: the endpoint refused the bucket check ({code or status}: "
                              f"{err.get('Message', exc)}); is it an S3-compatible server, and is the bucket name "
                              f"right?") from None
        except (BotoConnectionError, HTTPClientError, OSError) as exc:  # refused, timed out, DNS, TLS, proxy: the endpoint
            raise ConfigError(f"{where} cannot be reached ({type(exc).__name__}: {exc}); check the URL "
                              f"(scheme, host, port) and that the server is running"
                              + ("" if self.endpoint else ", or set checkpoint.s3_endpoint for a non-AWS store")
                              + ".") from None
        except BotoCoreError as exc:
            raise ConfigError(f"{bucket} at {where}: the start-up check failed ({type(exc).__name__}: {exc}).") from None

    @property
    def prefix(self) -> str:
        """Where this run's checkpoints are: `<prefix>/<run name>/<run id>/`."""
        return self.name_prefix + (f"{self.run_id}/" if self.run_id else "")

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key}"

    # ---- run identity ----------------------------------------------------------------------------
    def claim(self, adopt: bool = False) -> str:
        """Check, before anything is restored or uploaded, that `<prefix>/<run name>/` holds no other
        run's backup; returns the run id to use (this run's, or with `adopt` the one other run's,
        whose backup this run then continues). A ConfigError names both runs and both folders."""
        ids, legacy = set(), []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.name_prefix,
                                                                          Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                part = cp["Prefix"][len(self.name_prefix):].rstrip("/")
                if RUN_ID.match(part):
                    ids.add(part)
                elif STEP_DIR.match(part):
                    legacy.append(part)
        if legacy:
            log.warning("checkpoint: %s holds %d checkpoint(s) written by an lmforge without run ids (%s, ...); this "
                        "run neither restores nor deletes them", self.url(self.name_prefix), len(legacy), legacy[0])
        others = sorted(ids - {self.run_id})
        if not others:
            return self.run_id
        where = self.url(self.name_prefix)
        if adopt and len(others) == 1 and self.run_id not in ids:
            previous, self.run_id = self.run_id, others[0]
            log.warning("checkpoint: adopting run %s (train.out_dir %s) and its backup at %s%s/ as "
                        "checkpoint.s3_adopt = true says: this run (run id %s until now) continues it, restoring "
                        "and rotating its checkpoints", self.run_id, self._owner(self.run_id), where, self.run_id,
                        previous)
            self.on_event({"event": "backup_adopted", "run_id": self.run_id, "previous_run_id": previous,
                           "message": f"adopted run {self.run_id}'s backup at {where}{self.run_id}/"})
            return self.run_id
        owners = "; ".join(f"run id {i} (train.out_dir {self._owner(i)})" for i in others)
        mine = f"this run (run id {self.run_id}, train.out_dir {self.out_dir!r})"
        if adopt:
            why = (f"checkpoint.s3_adopt = true cannot choose among {len(others)} runs" if len(others) > 1 else
                   "checkpoint.s3_adopt = true, but this run has a backup there of its own")
            raise ConfigError(f"checkpoint.s3_bucket: {where} holds the backups of {owners}, and {mine}; {why}. Delete "
                              f"the backups not wanted, or set another checkpoint.s3_prefix.")
        raise ConfigError(
            f"checkpoint.s3_bucket: {where} holds the backup of another run: {owners}; {mine} has the same folder "
            f"name and checkpoint.s3_prefix, and would restore and rotate that run's checkpoints. Give this run "
            f"another train.out_dir name or checkpoint.s3_prefix; or, if it continues that run (its run folder was "
            f"lost or moved), set checkpoint.s3_adopt = true.")

    def _owner(self, run_id: str) -> str:
        """'host:/path/of/run' from a run's owner record (or 'unknown' without one)."""
        try:
            rec = json.loads(self.client.get_object(Bucket=self.bucket,
                                                    Key=f"{self.name_prefix}{run_id}/{RUN_RECORD}")["Body"].read())
            return repr(f"{rec.get('host', '?')}:{rec.get('out_dir', '?')}")
        except Exception:  # noqa: BLE001 - a record that is missing or unreadable names nothing
            return "unknown"

    def _write_owner(self) -> None:
        """The owner record `<prefix>/<run name>/<run id>/run.json`, once, before the first upload."""
        if self._owned or not self.run_id:
            return
        import datetime

        rec = {"run_id": self.run_id, "out_dir": self.out_dir, "host": socket.gethostname(),
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + RUN_RECORD, Body=json.dumps(rec).encode())
        self._owned = True

    # ---- upload (background) -----------------------------------------------------------------
    def upload(self, folder: Path, keep: list[str]) -> None:
        """Queue `folder` for upload; afterwards delete remote checkpoints not named in `keep`."""
        with self._lock:  # (the worker leaves under the same lock: a queued folder always has a worker)
            self._queue.put((Path(folder), list(keep)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="lmforge-s3", daemon=True)
                self._thread.start()

    def wait(self) -> None:
        self._queue.join()

    def _worker(self) -> None:
        while True:
            try:
                folder, keep = self._queue.get(timeout=5)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                self._upload(folder)
                self._prune(keep)
            except FileNotFoundError:
                # A checkpoint is validated before it is queued, so a file gone since means the local
                # rotation (keep_last) removed it while its upload waited or ran: newer checkpoints
                # supersede it and the remote copy must not keep it either. Skipped, not failed.
                self._delete_remote(folder.name)
                log.info("checkpoint: %s was rotated away locally before its backup finished; skipped", folder.name)
                self.on_event({"event": "backup_skipped", "path": str(folder),
                               "message": f"{folder.name} rotated away locally before its backup finished"})
            except Exception as e:  # noqa: BLE001 - a failed backup must not stop training
                msg = f"S3 backup of {folder.name} failed: {type(e).__name__}: {e}"
                self.errors.append(msg)
                log.error(msg)
                self.on_event({"event": "backup_failed", "path": str(folder), "message": msg})
            finally:
                self._queue.task_done()

    def _upload(self, folder: Path) -> None:
        meta = json.loads((folder / META).read_text())
        self.upload_files(folder, sorted(meta["files"]))
        self.upload_files(folder, [META])  # meta.json last: it marks the remote copy complete

    def upload_files(self, folder: Path, names: list[str], keep: list[str] | None = None) -> None:
        """Upload `names` of checkpoint `folder` now (this thread), each verified (size and sha256 of
        the stored object); with meta.json among them the remote checkpoint is complete, and remote
        checkpoints not in `keep` are then deleted. Node-local disks: each node uploads its own
        files, rank 0 meta.json last."""
        meta = json.loads((folder / META).read_text())
        self._write_owner()
        for name in names:
            path = folder / name
            digest = meta["files"][name]["sha256"] if name in meta["files"] else sha256_file(path)
            key = self.prefix + folder.name + "/" + name
            self.client.upload_file(str(path), self.bucket, key, ExtraArgs={"Metadata": {"sha256": digest}})
            head = self.client.head_object(Bucket=self.bucket, Key=key)
            if head["ContentLength"] != path.stat().st_size or head.get("Metadata", {}).get("sha256") != digest:
                raise IOError(f"s3://{self.bucket}/{key}: stored object does not match the local file")
        if META in names:
            self.uploaded.append(folder.name)
            log.info("checkpoint: %s backed up to s3://%s/%s%s/", folder.name, self.bucket, self.prefix, folder.name)
            self.on_event({"event": "backup", "path": f"s3://{self.bucket}/{self.prefix}{folder.name}/",
                           "message": f"backed up {folder.name}"})
            if keep is not None:
                self._prune(keep)

    def remote_checkpoints(self) -> list[str]:
        """Names of remote checkpoint folders (step_NNNNNNNN), newest first."""
        names = set()
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                name = cp["Prefix"][len(self.prefix):].rstrip("/")
                if STEP_DIR.match(name):
                    names.add(name)
        return sorted(names, reverse=True)

    def remote_bytes(self, name: str | None = None) -> int:
        """Bytes stored under remote checkpoint `name`, or under every checkpoint of the run: what a
        restore may download (the other ranks' wait for it is sized by this)."""
        prefix = self.prefix + (f"{name}/" if name else "")
        total = 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            total += sum(int(o.get("Size", 0)) for o in page.get("Contents", []))
        return total

    def _prune(self, keep: list[str]) -> None:
        for name in self.remote_checkpoints():
            if name not in keep:
                self._delete_remote(name)

    def _delete_remote(self, name: str) -> None:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}{name}/"):
            objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objs:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objs})

    # ---- restore -----------------------------------------------------------------------------
    def _download(self, key: str, dest: Path, rec: dict) -> None:
        """Download object `key` to `dest` and check it against its meta.json record (size and sha256):
        a ValueError names the object."""
        self.client.download_file(self.bucket, key, str(dest))
        size = dest.stat().st_size
        if size != rec.get("bytes"):
            raise ValueError(f"{self.url(key)} has {size} bytes, its meta.json says {rec.get('bytes')} (truncated?)")
        if sha256_file(dest) != rec.get("sha256"):
            raise ValueError(f"{self.url(key)} fails its sha256 checksum (corrupted)")

    def fetch(self, name: str, root: Path) -> Path:
        """Make `root/name` a complete copy of the remote checkpoint `name`: files already there with
        their recorded sha256 are kept, the others downloaded (node-local disks: each node gets the
        other nodes' shards). Published atomically; raises ValueError if a checksum fails."""
        base, final, tmp = f"{self.prefix}{name}/", root / name, root / (name + ".fetch")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            self.client.download_file(self.bucket, base + META, str(tmp / META))
            meta: dict[str, Any] = json.loads((tmp / META).read_text())
            for fname, rec in meta.get("files", {}).items():
                have = check_relative(final, fname)
                if have.is_file() and have.stat().st_size == rec.get("bytes") and sha256_file(have) == rec.get("sha256"):
                    shutil.copy2(have, check_relative(tmp, fname))
                else:
                    self._download(base + fname, check_relative(tmp, fname), rec)
            verify_checkpoint(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
        log.info("checkpoint: %s fetched from s3://%s/%s into %s", name, self.bucket, base, root)
        return final

    def complete_checkpoints(self) -> list[str]:
        """Remote checkpoints whose meta.json (uploaded last) is there, newest first."""
        done = []
        for name in self.remote_checkpoints():
            try:
                self.client.head_object(Bucket=self.bucket, Key=f"{self.prefix}{name}/{META}")
                done.append(name)
            except Exception:  # noqa: BLE001 - incomplete (or being uploaded)
                continue
        return done

    def restore_latest(self, root: Path) -> Path | None:
        """Download the newest complete, checksum-valid remote checkpoint into `root`; a checkpoint with
        a missing or corrupt object is skipped (the log names the object) for the next older one."""
        for name in self.remote_checkpoints():
            tmp = root / (name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                base = f"{self.prefix}{name}/"
                try:
                    self.client.download_file(self.bucket, base + META, str(tmp / META))
                except Exception as e:  # noqa: BLE001 - no meta.json = incomplete upload
                    raise ValueError(f"no {META} ({type(e).__name__})") from e
                meta: dict[str, Any] = json.loads((tmp / META).read_text())
                for fname, rec in meta.get("files", {}).items():
                    self._download(base + fname, check_relative(tmp, fname), rec)
                verify_checkpoint(tmp)
                final = root / name
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                fsync_dir(root)
                log.warning("checkpoint: no valid local checkpoint; restored %s from s3://%s/%s", name,
                            self.bucket, base)
                self.on_event({"event": "restored_from_backup", "path": str(final),
                               "message": f"restored {name} from s3://{self.bucket}/{base}"})
                return final
            except Exception as e:  # noqa: BLE001 - try the next older one
                log.warning("checkpoint: remote %s unusable, trying an older one: %s", name, e)
                self.on_event({"event": "backup_invalid", "path": self.url(f"{self.prefix}{name}/"),
                               "error": str(e), "message": f"remote checkpoint {name} unusable: {e}"})
                shutil.rmtree(tmp, ignore_errors=True)
        return None
