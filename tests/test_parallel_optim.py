"""Optimizers with code of their own, on sharded (DTensor) parameters, against one process.

FSDP2 and tensor parallelism hand the optimizer DTensor parameters. torch's Adafactor crashed on
them (an in-place op on a pending reduction) and so did 8-bit Adam (mixed DTensor / tensor
indexing); LAMB and Muon take norms and matrix products of whole parameters. Here each of them
trains 6 steps with dp_shard 2 x tp 2 (4 processes, 2-D DTensor placements) and in one process
(same seed, data and global batch), and the sharded run's step-3 checkpoint continues in one
process. All runs of a layout share one launch (tests/train_runs_driver.py) to keep this fast.

Plain SGD without clipping (tests/test_parallel_dp.py's `SGD`) runs alongside them: its update
is the gradient itself, so unlike the scale-invariant optimizers above (and AdamW with clipping)
its loss curve sees the scale of the gradient. (It keeps no optimizer state, so it is not resumed.)

Tolerances (relative, per step, for the loss and for the gradient norm before clipping): 1e-5 for
the exact optimizers, SGD included (only reduction order differs; observed <= 1.8e-7 for the loss,
<= 4.4e-7 for the gradient norm); for 8-bit Adam, whose blocks follow each rank's shard, so the
layout changes which elements share an absmax, 2e-4 for the loss (observed 3e-5) and 2e-3 for the
gradient norm (observed 3.2e-4: the norm of the next step's gradient magnifies the small weight
differences). (Lion and torch's Adam/AdamW are elementwise or torch's own DTensor code; by hand
Lion matched one process to 2e-7.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.test_parallel_dp import (SGD, TINY, assert_runs_match, corpus,  # noqa: F401  (module-scoped corpus fixture)
                                    losses, train_runs)

pytestmark = pytest.mark.slow

STATEFUL = ("adam8bit", "adafactor", "lamb", "muon", "muon_fused_qkv")  # trained sharded, then resumed in one process
OPTIMIZERS = (*STATEFUL, "sgd")
DEALT = ("muon", "muon_fused_qkv")  # also trained under FSDP2 alone
OWN = {"sgd": {**SGD, "checkpoint.every_steps": 0},  # plain SGD, no clipping: scale-sensitive; no state to resume
       # Muon on the separate q/k/v projections, and on the fused q/k/v weight (GQA: 2 query heads per kv
       # head), q, k and v orthogonalised apart: under FSDP2 x TP the fused weight is gathered for it and each
       # rank keeps its shard of the update; under FSDP2 alone the matrices are dealt over the ranks
       "muon": {"model.fused_qkv": "false"},
       "muon_fused_qkv": {"optim.name": "muon", "model.fused_qkv": "true", "model.n_kv_heads": 2,
                          "model.ffn_hidden": 102}}  # (102 rows: uneven FSDP2 shards of 26, 26, 26, 24)
TOL = {"adam8bit": {"losses": 2e-4, "grad_norms": 2e-3}}  # per optimizer (and metric); else 1e-5
SETTINGS = {**TINY, "train.steps": 6, "train.log_every": 1, "schedule.warmup_steps": 2,
            "checkpoint.every_steps": 3, "checkpoint.keep_every": 3, "checkpoint.every_minutes": 0,
            "checkpoint.save_final": "false", "train.sample_tokens": 0}


def drive(corpus: Path, nproc: int, groups: list[tuple[Path, tuple[str, ...], dict]]) -> None:
    """One launch of `nproc` processes for every group (OUT, optimizer names, overrides): each optimizer
    of each group, one after another: OUT/<name>/."""
    runs = {out / name: {**extra, "optim.name": name, **OWN.get(name, {})}  # (OWN may name the optimizer)
            for out, names, extra in groups for name in names}
    proc = train_runs(corpus, runs, nproc=nproc, timeout=120 + 60 * len(runs), **SETTINGS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> Path:  # noqa: F811
    """Three launches, one per process count (each pays torch's import and the process-group setup once)."""
    root = tmp_path_factory.mktemp("optim-layouts")
    sharded = {"train.micro_batch_size": 2}
    drive(corpus, 4, [(root / "sharded", OPTIMIZERS, {**sharded, "parallel.dp_shard": 2, "parallel.tp": 2}),
                      # FSDP2 alone (a 1-D mesh of 4) and HSDP (2 replicas x 2 shards): Muon deals the matrices
                      # over the shard ranks (lmforge.optim.muon._dealt_updates)
                      (root / "fsdp4", DEALT, {**sharded, "parallel.dp_shard": 4}),
                      (root / "hsdp2x2", DEALT, {**sharded, "parallel.dp_replicate": 2, "parallel.dp_shard": 2})])
    for name in STATEFUL:
        ckpt = Path("checkpoints") / "step_00000003"
        shutil.copytree(root / "sharded" / name / ckpt, root / "resumed" / name / ckpt)
    one = {"train.micro_batch_size": 4}
    drive(corpus, 1, [(root / "single", OPTIMIZERS, one),
                      (root / "resumed", STATEFUL, {**one, "checkpoint.every_steps": 0})])
    # tensor parallelism alone: column-wise layers sharded by rows, row-wise ones (wo, down) by columns
    drive(corpus, 2, [(root / "tp2", DEALT, {"parallel.tp": 2, "train.micro_batch_size": 4})])
    return root


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_parameters_train_like_one_process(runs, name):
    sharded = runs / "sharded" / name
    assert_runs_match(sharded, runs / "single" / name, f"{name}: dp_shard 2 x tp 2 vs one process",
                      steps=list(range(1, 7)), tol=TOL.get(name, 1e-5))
    assert losses(sharded)[6] < losses(sharded)[1]


@pytest.mark.parametrize("name", STATEFUL)
def test_sharded_optimizer_state_resumes_in_one_process(runs, name):
    """The checkpoint holds the optimizer state by parameter name and in the parameter's shape (8-bit
    Adam's moments dequantised), so one process reads the 4-rank state back and goes on (from the
    step-3 checkpoint, not from scratch)."""
    assert_runs_match(runs / "resumed" / name, runs / "sharded" / name,
                      f"{name}: resumed in one process vs the sharded run", steps=[4, 5, 6], tol=TOL.get(name, 1e-5))


@pytest.mark.parametrize("layout", ["fsdp4", "hsdp2x2", "tp2"])
@pytest.mark.parametrize("name", DEALT)
def test_muon_deals_its_sharded_matrices_over_the_ranks_and_trains_like_one_process(runs, name, layout):
    """Under FSDP2 (4 shards; HSDP: 2 replicas of 2 shards) and under tensor parallelism alone (rows and
    columns) each shard rank gathers its share of the matrices' updates whole, orthogonalises them (q,
    k and v apart for a fused wqkv), and scatters the shards back: the steps of one process."""
    assert_runs_match(runs / layout / name, runs / "single" / name, f"{name}: {layout} vs one process",
                      steps=list(range(1, 7)), tol=1e-5)
