"""Under torchrun rank 0 alone prints the run's lines; the other ranks print only what is about
them (their warnings and errors, prefixed with their rank). A config error found after the launch
(every rank checks the same layout) is printed once."""

from __future__ import annotations

import collections
import os
import subprocess
from pathlib import Path

import pytest

from tests.test_parallel_dp import TINY, corpus, launcher  # noqa: F401 - fixture reuse

ROOT = Path(__file__).resolve().parents[1]
RUN_LINES = ("distributed:", "config:", "run folder:", "data:", "final:", "model:", "batch:", "precision:")


def torchrun(args: list[str], cwd: Path, warm: bool = False) -> subprocess.CompletedProcess:
    """A 2-rank `lmforge train`; `warm` (tests/warm_start.py) where the run ends on its own: a failed launch
    runs on plain interpreters (lmforge.cli's wait for the sibling ranks walks the launcher's children)."""
    return subprocess.run(launcher(2, warm=warm) + ["-m", "lmforge", "train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_a_two_rank_run_prints_each_run_line_once(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    # (no micro-batch size: the tiny preset's is fitted to the global batch over dp 2, in a `config:` line)
    args = {**{k: v for k, v in TINY.items() if k != "train.micro_batch_size"}, "data.corpus": corpus,
            "train.out_dir": out, "parallel.dp_replicate": 2, "train.steps": 4, "train.sample_tokens": 0}
    proc = torchrun([a for k, v in args.items() for a in (f"--{k}", str(v))], tmp_path, warm=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RUN_LINES)]
    for prefix in ("distributed:", "config:", "run folder:", "data:", "final:"):
        assert any(line.startswith(prefix) for line in lines), (prefix, proc.stdout)
    twice = {line: n for line, n in collections.Counter(lines).items() if n > 1}
    assert not twice, proc.stdout  # each was printed by both ranks
    assert len(proc.stdout.splitlines()) < 25, proc.stdout
    assert all(line.startswith("rank 1: ") for line in proc.stdout.splitlines() if "rank 1" in line)


@pytest.mark.slow
def test_a_config_error_found_after_the_launch_is_printed_once(tmp_path):
    """The layout is checked against the launch inside the run (every rank, alike): bf16
    compression needs CUDA. Each rank printed `rank N of 2: config error: ...`."""
    proc = torchrun(["--parallel.dp_replicate", "2", "--parallel.ddp_comm_hook", "bf16"], tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("parallel.ddp_comm_hook = 'bf16'") == 1, output
    assert "rank 1" not in output, output
