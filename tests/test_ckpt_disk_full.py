"""A full disk is said and acted on (issue 34, item 4), on a real full file system.

The most real full disk available without root: a small tmpfs mounted in a user + mount namespace
(`unshare --user --map-root-user --mount`, which an unprivileged user may create where the kernel
allows it) over the checkpoint folder. Writes there fail in the kernel with ENOSPC, exactly as on a
full disk; nothing is mocked or injected. (RLIMIT_FSIZE gives EFBIG + SIGXFSZ instead, a loop
device needs root, and filling a shared /dev/shm would break other processes.) Where namespaces are
not allowed the tests skip, saying so.

* a DCP write that fails mid-file (the free space passed the pre-check, the real write did not fit):
  the failure names ENOSPC, the bytes free and the bytes needed;
* a run whose checkpoints stop fitting: `checkpoint.max_failed_saves` failures in a row stop it
  with exit status 74, failed.json says why, and a rerun reports it, resumes and clears it;
* a run whose final checkpoint fails exits 74 and writes no summary (a rerun would resume).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lmforge.ckpt.manager import EXIT_CHECKPOINT_FAILED
from lmforge.folders import FAILED_RECORD, SUMMARY
from tests.test_parallel_dp import corpus, overrides  # noqa: F401  (fixture)

# mount a tmpfs of size $1 on $2, then run the rest of the command line in that namespace
MOUNT = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'


def on_small_disk(folder: Path, size: str, cmd: list[str]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", MOUNT, "sh", size, str(folder), *cmd]


@pytest.fixture(scope="module")
def small_disks(tmp_path_factory):
    probe = tmp_path_factory.mktemp("probe")
    try:
        ok = subprocess.run(on_small_disk(probe, "64k", ["true"]), capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip("no user + mount namespaces here (unshare --user --map-root-user --mount): no small real disk")


def test_a_write_that_runs_out_of_space_names_enospc_free_and_needed(small_disks, tmp_path):
    """The pre-check passes (the tensors' bytes fit), the real DCP write does not (its format adds
    a header per tensor and an index): DCP's CheckpointException is unwrapped to the ENOSPC."""
    disk = tmp_path / "disk"
    script = textwrap.dedent(f"""
        import json, torch
        from lmforge.ckpt.manager import CheckpointManager
        events = []
        m = CheckpointManager({str(disk)!r}, async_save=False, validate=False, on_event=events.append)
        tensors = {{f"t{{i}}": torch.zeros(8) for i in range(3000)}}  # 96 KB of tensors, ~1 MB of files
        m.save(1, tensors, {{"s": 1}}, {{}})
        left = sorted(p.name for p in m.root.iterdir())
        print(json.dumps({{"events": events, "failures": m.failures, "left": left}}))
    """)
    proc = subprocess.run(on_small_disk(disk, "256k", [sys.executable, "-c", script]), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failures"] == 1 and out["left"] == []  # the half-written .tmp folder is gone
    error = out["events"][-1]["error"]
    assert "disk full (ENOSPC)" in error and "bytes free" in error and "96,000 bytes needed" in error, error
    assert "No space left on device" in error, error  # the underlying error, not a DCP traceback
    assert "\n" not in error


@pytest.mark.slow
def test_failing_checkpoints_stop_the_run_and_the_rerun_says_why(small_disks, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    ckpts = tmp_path / "ckpts"
    args = {"checkpoint.dir": str(ckpts), "checkpoint.every_steps": 2, "checkpoint.every_minutes": 0,
            "train.steps": 20, "train.log_every": 2, "train.sample_tokens": 0}
    cmd = [sys.executable, "-m", "lmforge", "train"] + overrides(corpus, out, **args)
    # ~1.8 MB per checkpoint: the first fits, the second does not (the first is kept until it validates)
    proc = subprocess.run(on_small_disk(ckpts, "3m", cmd), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CHECKPOINT_FAILED, text[-3000:]
    failed = [line for line in text.splitlines() if line.startswith("checkpoint at step")]
    assert [line.split()[3] for line in failed] == ["4", "6", "8"], failed  # three in a row, then it stops
    assert all("disk full (ENOSPC)" in line and "bytes free" in line and "bytes needed" in line for line in failed)
    assert "checkpoint error: 3 checkpoints in a row failed (checkpoint.max_failed_saves = 3)" in proc.stderr
    assert "step 10/" not in text  # it did not train on unprotected
    record = json.loads((out / FAILED_RECORD).read_text())
    assert record["step"] == 8 and "disk full (ENOSPC)" in record["error"]
    assert not (out / SUMMARY).exists()

    # the rerun (the small disk is gone with its namespace: an empty folder on the big one) says what happened
    proc = subprocess.run(cmd + ["--train.steps", "4"], capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert f"the previous attempt in {out} stopped at step 8" in text and "disk full (ENOSPC)" in text
    assert not (out / FAILED_RECORD).exists() and (out / SUMMARY).is_file()


@pytest.mark.slow
def test_a_failed_final_checkpoint_exits_non_zero(small_disks, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    ckpts = tmp_path / "ckpts"
    args = {"checkpoint.dir": str(ckpts), "checkpoint.every_steps": 0, "checkpoint.every_minutes": 0,
            "train.steps": 4, "train.sample_tokens": 0}
    cmd = [sys.executable, "-m", "lmforge", "train"] + overrides(corpus, out, **args)
    proc = subprocess.run(on_small_disk(ckpts, "1m", cmd), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_CHECKPOINT_FAILED, text[-3000:]
    assert "training reached step 4, but the last checkpoint failed (step 4: disk full (ENOSPC)" in proc.stderr
    assert not (out / SUMMARY).exists()  # not "complete": a rerun trains again and saves
    assert "disk full (ENOSPC)" in json.loads((out / FAILED_RECORD).read_text())["error"]
