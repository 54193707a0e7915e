"""ZeRO-1 under tensor and pipeline parallelism (Megatron's distributed optimizer; issue 59 item 3):
`parallel.zero_stage = 1` with tp or pp > 1 runs as FSDP2 on dp_shard with the parameters kept gathered
for the whole step and the gradients reduced once per step (lmforge.config.sections.zero1_through_fsdp).

One 4-process launch (tests/cp_driver.py: several `Trainer(cfg).fit()` in one process group) runs, on
tests/test_parallel_cp.py's corpus and base settings, each against a one-process run of the same:
* TP 2 x dp_shard 2 and PP 2 x dp_shard 2 (tied embeddings over the two stages), both ZeRO-1, 6 steps
  of plain SGD without clipping (tests/test_parallel_dp.py's `SGD`: a gradient of the wrong scale
  changes the loss curve), per-step loss and gradient norm within `TOL`;
* TP 2 x dp_shard 2 ZeRO-1 with AdamW for 12 steps, checkpointing at step 6; its step-6 checkpoint
  resumes under PP 2 x dp_shard 2 ZeRO-1 (another layout, in the same launch) and in one process
  (another world size), both continuing the one-process run's curve.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cp_driver import run_trainings
from tests.test_parallel_cp import BASE, TOL, corpus, finish, launch, records, worst  # noqa: F401  (fixture)
from tests.test_parallel_dp import SGD

ZERO1 = {"parallel.dp_shard": 2, "parallel.zero_stage": 1}
LAYOUTS = {"tp2-zero1": {"parallel.tp": 2, **ZERO1}, "pp2-zero1": {"parallel.pp": 2, **ZERO1}}
ADAMW = {"train.steps": 12, "checkpoint.every_steps": 6}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> Path:  # noqa: F811
    root = tmp_path_factory.mktemp("zero1")
    base = {**BASE, "data.corpus": str(corpus)}
    resume = {**base, **ADAMW, "checkpoint.resume": str(root / "adamw-tp2-zero1" / "checkpoints" / "step_00000006")}
    four = launch(root, 4, {**{f"sgd-{n}": {**base, **SGD, **o} for n, o in LAYOUTS.items()},
                            "adamw-tp2-zero1": {**base, **ADAMW, **LAYOUTS["tp2-zero1"]},
                            "resumed-pp2-zero1": {**resume, **LAYOUTS["pp2-zero1"]}})
    try:
        run_trainings({"out": str(root), "runs": [{"name": "single-sgd", "overrides": {**base, **SGD}},
                                                  {"name": "single-adamw", "overrides": {**base, **ADAMW}}]})
        finish(four)
        run_trainings({"out": str(root), "runs": [{"name": "resumed-single", "overrides": resume}]})
    finally:
        if four[0].poll() is None:
            four[0].terminate()
            four[0].wait(timeout=60)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero1_under_tensor_and_pipeline_parallelism_scales_the_gradient_like_one_process(runs, layout):
    ref, got = records(runs / "single-sgd"), records(runs / f"sgd-{layout}")
    assert sorted(got) == list(range(1, 7)) and got.keys() == ref.keys()
    loss, norm = worst(got, ref)
    print(f"\n{layout}: max relative difference vs one process over 6 SGD steps: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < TOL and norm < TOL, (layout, loss, norm, got, ref)
    summary = json.loads((runs / f"sgd-{layout}" / "summary.json").read_text())
    assert summary["layout"] == {"tp2-zero1": "fsdp+tp", "pp2-zero1": "pp"}[layout], summary["layout"]
    assert "ZeRO-1 (optimizer state and fp32 weights sharded" in (runs / "launch4.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("run", ["adamw-tp2-zero1", "resumed-pp2-zero1", "resumed-single"])
def test_zero1_checkpoint_resumes_under_another_layout_and_world_size(runs, run):
    ref, got = records(runs / "single-adamw"), records(runs / run)
    assert sorted(got) == (list(range(1, 13)) if run.startswith("adamw") else list(range(7, 13)))
    loss, norm = worst(got, ref)
    print(f"\n{run}: max relative difference vs one process: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < TOL and norm < TOL, (run, loss, norm, got, ref)
