"""Expert-parallel checkpoints reshard on resume: a run of a Mixture-of-Experts model with its experts
split over 2 EP ranks (lmforge.parallel.expert_parallel) saves DTensor shards by name (DCP); its
step-8 checkpoint continues in one process (EP2 -> EP1) and on 2 FSDP2 ranks without expert
parallelism (EP -> FSDP), and steps 9-16 match the EP run's losses and gradient norms (fp32, AdamW
state resharded too; only the reduction order differs). The resumed layouts keep 2 micro-batches of
4 sequences per step, so the global-batch aux loss is the same objective."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_ckpt_fault import FAULT, forked_runs
from tests.test_parallel_dp import assert_runs_match, corpus, run_logs  # noqa: F401  (corpus: fixture)

pytestmark = pytest.mark.slow

MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 64,
       "model.moe.shared_experts": 1, "model.moe.bias_update_rate": 0.01, "model.moe.z_loss_coef": 0.001}
RESUMED = {"ep1-one-process": (1, {"train.micro_batch_size": 4}),
           "fsdp2-no-ep": (2, {"parallel.dp_shard": 2, "train.micro_batch_size": 2})}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> tuple[Path, dict[Path, str]]:  # noqa: F811
    """ROOT/ep2 (16 steps, its step-8 checkpoint kept) and each of `RESUMED` started from that checkpoint
    (ROOT/<name>), in one launch per process count (tests/test_ckpt_fault.py's `forked_runs`: the 2-rank
    continuation runs in the EP run's launch, after it); ROOT and each run's log."""
    root, logs = tmp_path_factory.mktemp("ep"), {}
    resume = {"checkpoint.resume": str(root / "ep2" / "checkpoints" / "step_00000008"), "checkpoint.every_steps": 0}
    launches = {2: {root / "ep2": {"parallel.dp_shard": 2, "parallel.ep": 2, "train.micro_batch_size": 2,
                                   "checkpoint.every_steps": 8, "checkpoint.keep_every": 8}}, 1: {}}
    for name, (nproc, layout) in RESUMED.items():
        launches[nproc][root / name] = {**layout, **resume}
    for nproc, runs in launches.items():
        proc = forked_runs(corpus, runs, nproc, timeout=600, **FAULT, **MOE)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logs |= run_logs(proc, runs)
    return root, logs


@pytest.mark.parametrize("name", list(RESUMED))
def test_expert_parallel_checkpoint_resumes_on_another_layout(runs, name):
    root, logs = runs
    out = root / name
    assert f"resumed from {root / 'ep2' / 'checkpoints' / 'step_00000008'}" in logs[out]
    assert_runs_match(out, root / "ep2", f"EP2 -> {RESUMED[name][1]}", steps=list(range(9, 17)))
