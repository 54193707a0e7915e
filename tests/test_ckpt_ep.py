"""Expert-parallel checkpoints reshard on resume: a run of a Mixture-of-Experts model with its experts
split over 2 EP ranks (lmforge.parallel.expert_parallel) saves DTensor shards by name (DCP); its
step-8 checkpoint continues in one process (EP2 -> EP1) and on 2 FSDP2 ranks without expert
parallelism (EP -> FSDP), and steps 9-16 match the EP run's losses and gradient norms (fp32, AdamW
state resharded too; only the reduction order differs). The resumed layouts keep 2 micro-batches of
4 sequences per step, so the global-batch aux loss is the same objective."""

from __future__ import annotations

import shutil

import pytest

from tests.test_ckpt_fault import finish, launch
from tests.test_parallel_dp import assert_runs_match, corpus  # noqa: F401  (module-scoped corpus fixture)

pytestmark = pytest.mark.slow

MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 64,
       "model.moe.shared_experts": 1, "model.moe.bias_update_rate": 0.01, "model.moe.z_loss_coef": 0.001}


@pytest.fixture(scope="module")
def ep2(corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("ep2") / "run"
    finish(launch(corpus, out, nproc=2, **MOE, **{"parallel.dp_shard": 2, "parallel.ep": 2,
                                                  "train.micro_batch_size": 2, "checkpoint.keep_every": 8}), out)
    return out


@pytest.mark.parametrize("nproc, layout", [(1, {"train.micro_batch_size": 4}),
                                           (2, {"parallel.dp_shard": 2, "train.micro_batch_size": 2})],
                         ids=["ep1-one-process", "fsdp2-no-ep"])
def test_expert_parallel_checkpoint_resumes_on_another_layout(corpus, ep2, tmp_path, nproc, layout):  # noqa: F811
    out = tmp_path / "run"
    shutil.copytree(ep2 / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000008")
    finish(launch(corpus, out, nproc=nproc, **MOE, **{"checkpoint.every_steps": 0, **layout}), out)
    assert "resumed from" in (tmp_path / "run.log").read_text()
    assert_runs_match(out, ep2, f"EP2 -> {layout}", steps=list(range(9, 17)))
