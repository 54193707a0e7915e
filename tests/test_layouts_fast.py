"""The fast tier's multi-process check: one small run per layout family against one process.

`python -m pytest -m "not slow"` runs this file and none of the long parity files (test_parallel_dp,
_mp, _cp, _ep, test_ckpt_fault: all `slow`), so this is where the fast tier sees every layout family:
DDP, FSDP2, TP + SP, PP (1F1B), CP and EP (MoE), and a checkpoint resumed under another layout. Two
launches in all (tests/train_runs_driver.py: several runs per process group): one process trains
the references, 2 ranks train every layout one after another.

Every run trains 4 steps of plain SGD without clipping (tests/test_parallel_dp.py's `SGD`: the update
is the gradient itself) with `data.mask_doc_boundaries = true` (TINY's: the ranks hold unequal target
counts), and each step's loss and gradient norm (before clipping) must match one process's to 1e-5
relative. So this fails when a layout averages gradients without the x dp of the loss (grad norm
halved), when the loss is normalised by a rank's own target count instead of the global step's, or
when a resumed run reads its data from the wrong position (steps 3-4's losses are other batches').
"""

from __future__ import annotations

import pytest

from tests.test_parallel_dp import SGD, assert_runs_match, corpus, losses, train_runs  # noqa: F401  (fixture)

STEPS = {**SGD, "train.steps": 4, "train.log_every": 1, "checkpoint.save_final": "false",
         "checkpoint.every_minutes": 0}
DENSE = {"model.tie_embeddings": "false", "model.fused_qkv": "false"}  # (pipeline stages cannot share a weight;
# separate q/k/v: tests/test_parallel_mp.py's MP says why TP holds 1e-5 then)
MOE = {**DENSE, "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 64,
       "model.moe.shared_experts": 1, "model.moe.aux_loss_coef": 0.05}
TOL = 1e-5

# name: (the one-process reference it matches, its overrides). Each rank's micro-batches together
# make up the reference's (global batch 8: tests/test_parallel_dp.py's TINY), so only the reduction
# order differs; the MoE runs keep 2 micro-batches per step on both sides (the aux loss is per micro-batch).
LAYOUTS = {
    "ddp": ("dense", {"parallel.dp_replicate": 2}),
    "fsdp2": ("dense", {"parallel.dp_shard": 2, "checkpoint.every_steps": 2}),  # (its step-2 checkpoint: below)
    "tp2-sp": ("dense", {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),
    "pp2-1f1b": ("dense", {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    "cp2": ("dense", {"parallel.cp": 2}),
    "ep2": ("moe", {**MOE, "parallel.dp_shard": 2, "parallel.ep": 2}),
}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    """ROOT/single/{dense,moe}: one process; ROOT/<layout>: 2 ranks; ROOT/resumed: FSDP2's step-2
    checkpoint continued under DDP (DCP reshards by name) for steps 3-4."""
    root = tmp_path_factory.mktemp("layouts")
    single = {root / "single" / "dense": {"train.micro_batch_size": 4},
              root / "single" / "moe": {**MOE, "train.micro_batch_size": 4}}
    proc = train_runs(corpus, single, **DENSE, **STEPS)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    layouts = {root / name: own for name, (_, own) in LAYOUTS.items()}
    resumed = {root / "resumed": {"parallel.dp_replicate": 2,
                                  "checkpoint.resume": str(root / "fsdp2" / "checkpoints" / "step_00000002")}}
    proc = train_runs(corpus, {**layouts, **resumed}, nproc=2, timeout=300, **DENSE, **STEPS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, proc.stdout + proc.stderr


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_family_matches_one_process(runs, layout):
    root, _ = runs
    reference = root / "single" / LAYOUTS[layout][0]
    assert sorted(losses(reference)) == [1, 2, 3, 4]
    assert_runs_match(root / layout, reference, f"{layout}, SGD without clipping, vs one process", tol=TOL)


def test_checkpoint_resumes_at_its_step_and_data_position_under_another_layout(runs):
    root, log = runs
    assert "resumed from" in log, log[-3000:]
    assert_runs_match(root / "resumed", root / "single" / "dense", "FSDP2 step-2 checkpoint -> DDP, steps 3-4",
                      steps=[3, 4], tol=TOL)
