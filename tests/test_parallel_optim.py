"""Optimizers with code of their own, on sharded (DTensor) parameters, against one process.

FSDP2 and tensor parallelism hand the optimizer DTensor parameters. torch's Adafactor crashed on
them (an in-place op on a pending reduction) and so did 8-bit Adam (mixed DTensor / tensor
indexing); LAMB and Muon take norms and matrix products of whole parameters. Here each of them
trains 6 steps with dp_shard 2 x tp 2 (4 processes, 2-D DTensor placements) and in one process
(same seed, data and global batch), and the sharded run's step-3 checkpoint continues in one
process. All runs of a layout share one launch (tests/optim_layout_driver.py) to keep this fast.

Tolerances (relative, per step): 1e-5 for the exact optimizers (only reduction order differs;
observed <= 2e-7); 2e-4 for 8-bit Adam, whose blocks follow each rank's shard, so the layout
changes which elements share an absmax (observed 3e-5). (Lion, SGD and torch's Adam/AdamW are
elementwise or torch's own DTensor code; by hand Lion matched one process to 2e-7.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_parallel_dp import TINY, corpus, free_port, losses  # noqa: F401  (module-scoped corpus fixture)

pytestmark = pytest.mark.slow

OPTIMIZERS = ("adam8bit", "adafactor", "lamb", "muon")
TOL = {"adam8bit": 2e-4}
DRIVER = str(Path(__file__).with_name("optim_layout_driver.py"))
SETTINGS = {**TINY, "train.steps": 6, "train.log_every": 1, "schedule.warmup_steps": 2,
            "checkpoint.every_steps": 3, "checkpoint.keep_every": 3, "checkpoint.every_minutes": 0,
            "checkpoint.save_final": "false", "train.sample_tokens": 0}


def drive(corpus: Path, out: Path, nproc: int, **extra) -> None:
    launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                  str(nproc), "--master-port", str(free_port())]
    pairs = [f"{k}={v}" for k, v in {**SETTINGS, **extra}.items()]
    proc = subprocess.run(launch + [DRIVER, str(corpus), str(out), ",".join(OPTIMIZERS), *pairs],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> Path:  # noqa: F811
    root = tmp_path_factory.mktemp("optim-layouts")
    drive(corpus, root / "single", 1, **{"train.micro_batch_size": 4})
    drive(corpus, root / "sharded", 4, **{"parallel.dp_shard": 2, "parallel.tp": 2, "train.micro_batch_size": 2})
    for name in OPTIMIZERS:
        ckpt = Path("checkpoints") / "step_00000003"
        shutil.copytree(root / "sharded" / name / ckpt, root / "resumed" / name / ckpt)
    drive(corpus, root / "resumed", 1, **{"train.micro_batch_size": 4, "checkpoint.every_steps": 0})
    return root


def worst(got: dict[int, float], want: dict[int, float]) -> float:
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in got)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_parameters_train_like_one_process(runs, name):
    single, sharded = losses(runs / "single" / name), losses(runs / "sharded" / name)
    assert sorted(sharded) == list(range(1, 7)) and sharded.keys() == single.keys()
    print(f"\n{name}: dp_shard 2 x tp 2 vs one process, max relative loss difference {worst(sharded, single):.1e}")
    assert worst(sharded, single) < TOL.get(name, 1e-5), (sharded, single)
    assert sharded[6] < sharded[1]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_optimizer_state_resumes_in_one_process(runs, name):
    """The checkpoint holds the optimizer state by parameter name and in the parameter's shape (8-bit
    Adam's moments dequantised), so one process reads the 4-rank state back and goes on."""
    sharded, resumed = losses(runs / "sharded" / name), losses(runs / "resumed" / name)
    assert sorted(resumed) == [4, 5, 6]  # it started from the step-3 checkpoint, not from scratch
    print(f"\n{name}: resumed in one process vs the sharded run, max relative difference {worst(resumed, sharded):.1e}")
    assert worst(resumed, sharded) < TOL.get(name, 1e-5), (resumed, sharded)
