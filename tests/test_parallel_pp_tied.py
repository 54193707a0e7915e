"""Pipelines with tied embeddings (issue 59, Megatron's embedding group) against one process.

The first stage holds the embedding, the last stage the head with its own copy of the same weight
(named tok_emb.weight there too), both materialised from the same initial values; their gradients
are summed over the 2-rank group of the first- and last-stage ranks before clipping, so the copies
stay bit-equal; in a V (zbv, dualpipev) rank 0 holds both stages and one parameter. Every schedule
in one 2-rank launch (tests/pp_tied_driver.py, which also checks after each run that the copies
and their AdamW moments are bit-equal) against one process: per-step losses and gradient norms of
10 steps within tests/test_parallel_mp.py's TOL. A checkpoint (one tensor, tok_emb.weight) written
under pp = 2 continues in one process and one written in one process continues under pp = 2.
Four launches in all (`single`, `launches`, and the one-process resume): the checkpoint runs ride along
in the others.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lmforge.config import load_config
from tests.test_parallel_dp import STEPS, assert_runs_match, corpus, launcher, losses, overrides, train_runs  # noqa: F401
from tests.test_parallel_mp import TOL

# `STEPS` (10, not TINY's 20): a copy that drifts from its twin differs bit-wise from the first step that
# updates one and not the other, and a wrong gradient scale shows in step 1's gradient norm
TIED = {"model.n_layers": 4, "model.tie_embeddings": "true", "model.fused_qkv": "false", **STEPS}
PP = {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}
CHECKPOINTED = {"train.steps": 8, "train.log_every": 1}  # the checkpoint test's runs: written at step 4, resumed
WRITES = {"checkpoint.every_steps": 4}
SCHEDULES = {
    "gpipe": {"parallel.pp_schedule": "gpipe"},
    "1f1b": {"parallel.pp_schedule": "1f1b"},
    "interleaved-v2": {"parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": 2},
    "interleaved-zb": {"parallel.pp_schedule": "interleaved-zb"},
    "zbv": {"parallel.pp_schedule": "zbv"},  # (V: rank 0 holds stages 0 and 3, the embedding and the head)
    "dualpipev": {"parallel.pp_schedule": "dualpipev"},
}
DRIVER = str(Path(__file__).with_name("pp_tied_driver.py"))


def test_tied_pipelines_are_accepted():
    """The tiny preset (tied) pipelines under every schedule, and TP + SP with learned positions."""
    for schedule in SCHEDULES.values():
        cfg = load_config("tiny", {"parallel.pp": 2, "model.n_layers": 4, "train.global_batch_size": 16,
                                   "train.micro_batch_size": 2, **schedule})
        assert cfg.model.tie_embeddings and cfg.parallel.pp == 2
    cfg = load_config("gpt2-124m", {"parallel.tp": 2, "parallel.sequence_parallel": True})
    assert cfg.model.pos_emb == "learned" and cfg.parallel.sequence_parallel


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory) -> Path:  # noqa: F811
    """One launch of one process: ROOT/single (the reference) and ROOT/checkpoint/written-1 (the checkpoint
    test's one-process writer)."""
    root = tmp_path_factory.mktemp("tied-single")
    proc = train_runs(corpus, {root / "single": {}, root / "checkpoint" / "written-1": {**CHECKPOINTED, **WRITES}},
                      **TIED)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(losses(root / "single")) == list(range(1, STEPS["train.steps"] + 1))
    return root


@pytest.fixture(scope="module")
def reference(single) -> Path:
    return single / "single"


def resume_from(written: Path) -> dict:
    return {**CHECKPOINTED, "checkpoint.resume": str(written / "checkpoints" / "step_00000004"),
            "checkpoint.every_steps": 0}


def tied_launch(corpus: Path, runs: dict[Path, dict], nproc: int) -> str:  # noqa: F811
    """`runs` in one launch of tests/pp_tied_driver.py; its output."""
    args = [overrides(corpus, out, **{**TIED, **own}) for out, own in runs.items()]
    proc = subprocess.run(launcher(nproc) + [DRIVER, json.dumps(args)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def launches(corpus, single, tmp_path_factory) -> tuple[Path, dict[int, str]]:  # noqa: F811
    """ROOT/pp2-<schedule> for every schedule, the checkpoint test's pipelined runs (ROOT/checkpoint/written-2,
    and resumed-2 from `single`'s written-1) in one 2-process launch, ROOT/fsdp2xpp2-{1f1b,zbv} in one
    4-process launch; ROOT and each launch's output."""
    root = tmp_path_factory.mktemp("tied-layouts")
    fsdp = {"parallel.dp_shard": 2, "parallel.pp": 2, "train.micro_batch_size": 1}
    two = {**{root / f"pp2-{name}": {"parallel.pp": 2, **schedule} for name, schedule in SCHEDULES.items()},
           root / "checkpoint" / "written-2": {**PP, **CHECKPOINTED, **WRITES},
           root / "checkpoint" / "resumed-2": {**PP, **resume_from(single / "checkpoint" / "written-1")}}
    four = {root / "fsdp2xpp2-1f1b": {**fsdp, **SCHEDULES["1f1b"]}, root / "fsdp2xpp2-zbv": {**fsdp, **SCHEDULES["zbv"]}}
    return root, {2: tied_launch(corpus, two, 2), 4: tied_launch(corpus, four, 4)}


def bit_equal(output: str) -> list[str]:
    """The driver's lines saying a run's copies were bit-equal after `STEPS` steps (the checkpoint runs: 8)."""
    steps = STEPS["train.steps"]
    return [line for line in output.splitlines() if line.startswith(f"tied copies bit-equal after {steps} steps")]


@pytest.mark.slow
def test_every_schedule_with_tied_embeddings_matches_one_process(reference, launches):
    root, output = launches
    for name in SCHEDULES:
        assert_runs_match(root / f"pp2-{name}", reference, f"tied, pp2-{name} vs one process", tol=TOL)
    checked = bit_equal(output[2])
    assert len(checked) == 4, checked  # (the V schedules hold one parameter)
    from safetensors.torch import load_file

    saved = load_file(str(root / "pp2-1f1b" / "model.safetensors"))
    assert "tok_emb.weight" in saved and "lm_head.weight" not in saved  # (exported once)


@pytest.mark.slow
def test_tied_pipelines_under_fsdp2_match_one_process(reference, launches):
    """With FSDP2 (dp_shard = 2): 1F1B sums the two copies' local shards over the embedding group;
    zbv's rank 0 holds one parameter in two stage chunks, which FSDP2 leaves whole (its gradient
    averaged over dp by the pipeline)."""
    root, output = launches
    for name in ("fsdp2xpp2-1f1b", "fsdp2xpp2-zbv"):
        assert_runs_match(root / name, reference, f"tied, {name} vs one process", tol=TOL)
    assert len(bit_equal(output[4])) == 1  # (1f1b; each embedding group checks its copies)


@pytest.mark.slow
def test_tied_checkpoint_moves_between_a_pipeline_and_one_process(corpus, single, launches):  # noqa: F811
    """Step 4's checkpoint of a pp = 2 (1f1b) run continues in one process, and one process's under
    pp = 2: steps 5-8 match the run that wrote it."""
    root, output = launches
    resumed = root / "checkpoint" / "resumed-1"
    written = {1: single / "checkpoint" / "written-1", 2: root / "checkpoint" / "written-2"}
    proc = train_runs(corpus, {resumed: resume_from(written[2])}, **TIED)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    logs = {1: proc.stdout + proc.stderr, 2: output[2]}
    for nproc, other_nproc in [(2, 1), (1, 2)]:
        assert f"resumed from {written[nproc] / 'checkpoints' / 'step_00000004'}" in logs[other_nproc], \
            logs[other_nproc][-3000:]
        assert_runs_match(root / "checkpoint" / f"resumed-{other_nproc}", written[nproc],
                          f"tied checkpoint, {nproc} -> {other_nproc} process(es)", steps=[5, 6, 7, 8], tol=TOL)
