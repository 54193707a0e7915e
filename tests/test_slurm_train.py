"""examples/slurm_train.sh runs as written: under stand-ins for sbatch, srun and scontrol
(tests/fake_slurm.py, one node of 2 CPU "GPUs") it starts torchrun with the c10d rendezvous on the
allocation's first node and trains the layout given on its command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fake_slurm, warm_start
from tests.test_parallel_dp import TINY, corpus, free_port  # noqa: F401  (module-scoped corpus fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_slurm_train_script_trains_the_layout_on_its_command_line(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    args = {**TINY, "data.corpus": str(corpus), "train.out_dir": str(out), "train.steps": 4, "train.sample_tokens": 0,
            "schedule.warmup_steps": 1, "parallel.dp_shard": 2}
    env = {**fake_slurm.install(tmp_path / "bin"), "CONFIG": "tiny", "GPUS_PER_NODE": "2", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    env["PATH"] = f"{env['PATH']}:{Path(sys.executable).parent}"  # python (torchrun) of this environment
    env = warm_start.shared().env(env)  # `torchrun` and its workers warm (tests/warm_start.py: nothing signalled here)
    proc = subprocess.run(["sbatch", str(ROOT / "examples" / "slurm_train.sh"),
                           *[a for k, v in args.items() for a in (f"--{k}", str(v))]],
                          cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["hardware"]["world_size"] == 2, summary
    assert summary["layout"].startswith("fsdp"), summary["layout"]
    assert (tmp_path / "logs").is_dir()  # the script's own log folder (#SBATCH --output)


@pytest.mark.slow
def test_slurm_preemption_notice_checkpoints_every_rank(corpus, tmp_path):  # noqa: F811
    """What `#SBATCH --signal=B:USR1@120` does: SIGUSR1 to the batch shell. Its trap hands it on as
    SIGTERM through srun and torchrun to the workers, which checkpoint their step; the job exits 75."""
    import signal
    import time

    out = tmp_path / "run"
    args = {**TINY, "data.corpus": str(corpus), "train.out_dir": str(out), "train.steps": 400, "train.log_every": 1,
            "train.sample_tokens": 0, "parallel.dp_replicate": 2, "checkpoint.every_minutes": 0}
    env = {**fake_slurm.install(tmp_path / "bin"), "CONFIG": "tiny", "GPUS_PER_NODE": "2", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    env["PATH"] = f"{env['PATH']}:{Path(sys.executable).parent}"
    script = str(ROOT / "examples" / "slurm_train.sh")
    assert "#SBATCH --signal=B:USR1@" in Path(script).read_text()
    log = open(tmp_path / "job.log", "wb")
    proc = subprocess.Popen(["sbatch", script, *[a for k, v in args.items() for a in (f"--{k}", str(v))]], cwd=tmp_path,
                            env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while not ((out / "metrics.jsonl").is_file() and '"loss"' in (out / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.05)
        batch_shell = [p for p in Path("/proc").glob("[0-9]*") if (p / "cmdline").is_file()
                       and (p / "cmdline").read_bytes().startswith(b"bash\0" + script.encode())]
        assert len(batch_shell) == 1
        os.kill(int(batch_shell[0].name), signal.SIGUSR1)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = (tmp_path / "job.log").read_text()
    assert rc == 75, text[-3000:]
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "preempted" in line]
    assert len(events) == 1 and events[0]["signal"] == "SIGTERM", text[-3000:]
    assert list((out / "checkpoints").glob("step_*")) and "SIGKILL" not in text
