"""Pipelines with tied embeddings (issue 59, Megatron's embedding group) against one process.

The first stage holds the embedding, the last stage the head with its own copy of the same weight
(named tok_emb.weight there too), both materialised from the same initial values; their gradients
are summed over the 2-rank group of the first- and last-stage ranks before clipping, so the copies
stay bit-equal; in a V (zbv, dualpipev) rank 0 holds both stages and one parameter. Every schedule
in one 2-rank launch (tests/pp_tied_driver.py, which also checks after each run that the copies
and their AdamW moments are bit-equal) against one process: per-step losses and gradient norms of
20 steps within tests/test_parallel_mp.py's TOL. A checkpoint (one tensor, tok_emb.weight) written
under pp = 2 continues in one process and one written in one process continues under pp = 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from lmforge.config import load_config
from tests.test_parallel_dp import assert_runs_match, corpus, launcher, losses, overrides, train_runs  # noqa: F401
from tests.test_parallel_mp import TOL

TIED = {"model.n_layers": 4, "model.tie_embeddings": "true", "model.fused_qkv": "false"}
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
def reference(corpus, tmp_path_factory) -> Path:  # noqa: F811
    ref = tmp_path_factory.mktemp("tied-single") / "single"
    proc = train_runs(corpus, {ref: {}}, **TIED)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(losses(ref)) == list(range(1, 21))
    return ref


def run_tied(corpus: Path, runs: dict[Path, dict], nproc: int, reference: Path) -> list[str]:  # noqa: F811
    """`runs` in one launch of tests/pp_tied_driver.py, each matched against one process; returns the
    driver's lines saying the copies were bit-equal after the 20 steps."""
    args = [overrides(corpus, out, **{**TIED, **own}) for out, own in runs.items()]
    proc = subprocess.run(launcher(nproc) + [DRIVER, json.dumps(args)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for out in runs:
        assert_runs_match(out, reference, f"tied, {out.name} vs one process", tol=TOL)
    return [line for line in proc.stdout.splitlines() if line.startswith("tied copies bit-equal after 20 steps")]


@pytest.mark.slow
def test_every_schedule_with_tied_embeddings_matches_one_process(corpus, reference, tmp_path):  # noqa: F811
    runs = {tmp_path / f"pp2-{name}": {"parallel.pp": 2, **schedule} for name, schedule in SCHEDULES.items()}
    checked = run_tied(corpus, runs, 2, reference)
    assert len(checked) == 4, checked  # (the V schedules hold one parameter)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "pp2-1f1b" / "model.safetensors"))
    assert "tok_emb.weight" in saved and "lm_head.weight" not in saved  # (exported once)


@pytest.mark.slow
def test_tied_pipelines_under_fsdp2_match_one_process(corpus, reference, tmp_path):  # noqa: F811
    """With FSDP2 (dp_shard = 2): 1F1B sums the two copies' local shards over the embedding group;
    zbv's rank 0 holds one parameter in two stage chunks, which FSDP2 leaves whole (its gradient
    averaged over dp by the pipeline)."""
    fsdp = {"parallel.dp_shard": 2, "parallel.pp": 2, "train.micro_batch_size": 1}
    runs = {tmp_path / "fsdp2xpp2-1f1b": {**fsdp, **SCHEDULES["1f1b"]},
            tmp_path / "fsdp2xpp2-zbv": {**fsdp, **SCHEDULES["zbv"]}}
    assert len(run_tied(corpus, runs, 4, reference)) == 1  # (1f1b; each embedding group checks its copies)


@pytest.mark.slow
def test_tied_checkpoint_moves_between_a_pipeline_and_one_process(corpus, tmp_path):  # noqa: F811
    """Step 8's checkpoint of a pp = 2 (1f1b) run continues in one process, and one process's under
    pp = 2: steps 9-16 match the run that wrote it."""
    from tests.test_ckpt_fault import finish, launch

    pp = {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}
    for nproc, layout, other_nproc, other in [(2, pp, 1, {}), (1, {}, 2, pp)]:
        ref = tmp_path / f"written-{nproc}"
        finish(launch(corpus, ref, nproc=nproc, **{**TIED, **layout, "checkpoint.keep_every": 8}), ref)
        out = tmp_path / f"resumed-{other_nproc}"
        shutil.copytree(ref / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000008")
        finish(launch(corpus, out, nproc=other_nproc, **{**TIED, **other, "checkpoint.every_steps": 0}), out)
        assert "resumed from" in (tmp_path / f"{out.name}.log").read_text()
        assert_runs_match(out, ref, f"tied checkpoint, {nproc} -> {other_nproc} process(es)",
                          steps=list(range(9, 17)), tol=TOL)
