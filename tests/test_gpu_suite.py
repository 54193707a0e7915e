"""benchmarks/gpu/suite.py, the GPU proof suite, runs its steps end to end (tiny, on the CPU), so
the first session lent a GPU spends its time measuring, not debugging the script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_suite_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "suite"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "suite.py"), "--cpu-smoke", "--out", str(out),
                           "--budget-min", "15"], capture_output=True, text=True, timeout=1000, cwd=tmp_path)
    table = (out / "gpu_suite.md").read_text() if (out / "gpu_suite.md").is_file() else proc.stdout
    assert proc.returncode == 0, table + proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| step")}
    assert set(rows) == {"env", "tiny-bf16", "ddp-1", "fsdp-1", "async-2", "throughput-quick", "optim"}, rows
    assert all(status == "ok" for status in rows.values()), table
    assert "all 21 torch APIs present" in table and "ddp: val loss" in table and "fsdp: val loss" in table
