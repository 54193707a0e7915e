"""Expert parallelism (parallel.ep; lmforge.parallel.expert_parallel) on CPU/gloo against one process.

A Mixture-of-Experts model (2 blocks, 4 routed experts, top-2, a shared expert, the aux loss and
the z-loss on) trains plain SGD without clipping (tests/test_parallel_dp.py's `SGD`: the steps are
the gradient itself, so a gradient off by any factor shows in the loss curve) under EP2 (dp_shard
inferred from the 2 processes, as typed: `--parallel.ep 2` alone), EP2 x FSDP2, EP2 x HSDP (2
replica groups of dp_shard 2 = ep 2: every group holds all experts, gradients averaged across the
groups too), EP2 x PP2 (1F1B and the zero-bubble ZB-H1, whose split backward runs the all-to-all's
backward in the input pass and the experts' weight gradients later), EP2 with TP2 on attention
(with and without sequence parallelism) and EP2 x CP2, and must match the one-process run in every step's
loss and gradient norm (before clipping) to 1e-5 relative: fp32, the same seed, data and global
batch; only the reduction order differs. Every layout has 2 micro-batches per step whose union over
the data-parallel ranks is the one-process micro-batch (the loader's global sample order), so the
global-batch aux loss is the same objective. The EMA of the weights (the experts' EP x FSDP2 shards
among them), an in-loop task and merging the checkpoints match too (test_parallel_dp.py's
`assert_extras_match`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmforge.config import ConfigError, load_config
from tests.test_parallel_dp import (EMA, SGD, assert_extras_match, assert_runs_match, corpus,  # noqa: F401
                                    losses, tasks, train_runs)

MOE = {"model.n_layers": 2, "model.tie_embeddings": "false", "model.moe.num_experts": 4, "model.moe.top_k": 2,
       "model.moe.expert_hidden": 64, "model.moe.shared_experts": 1, "model.moe.aux_loss_coef": 0.05,
       "model.moe.z_loss_coef": 0.001, **SGD, "train.steps": 8, "train.log_every": 1}
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("ep-single") / "sgd"
    proc = train_runs(corpus, {out: {**EMA, **tasks(corpus)}}, **MOE, **{"train.micro_batch_size": 4})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(losses(out)) == list(range(1, 9))
    return out


LAYOUTS = {  # name: (processes, overrides); 2 micro-batches of 4 sequences over all data-parallel ranks
    "ep2": (2, {"parallel.ep": 2, "train.micro_batch_size": 2}),  # (dp_shard 2 inferred from the launch)
    "ep2xfsdp2": (4, {"parallel.dp_shard": 4, "parallel.ep": 2, "train.micro_batch_size": 1}),
    "ep2xhsdp2": (4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.ep": 2,
                      "train.micro_batch_size": 1}),
    "ep2xpp2": (4, {"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.pp": 2, "train.micro_batch_size": 2}),
    "ep2xpp2-zb": (4, {"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.pp": 2, "parallel.pp_schedule": "interleaved-zb",
                       "train.micro_batch_size": 2}),
    "ep2-tp2": (4, {"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.tp": 2, "train.micro_batch_size": 2}),
    "ep2-tp2-sp": (4, {"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true",
                       "train.micro_batch_size": 2}),
    "ep2xcp2": (4, {"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.cp": 2, "train.micro_batch_size": 2}),
}


@pytest.fixture(scope="module")
def launches(corpus, tmp_path_factory) -> tuple[Path, dict[Path, str]]:  # noqa: F811
    """Every layout's run (ROOT/<layout>), one launch per process count (2 and 4: each launch pays
    torch's import and the process-group setup once for all its layouts); ROOT and each run's log."""
    from tests.test_parallel_dp import run_logs

    root, logs = tmp_path_factory.mktemp("ep-layouts"), {}
    for nproc in sorted({n for n, _ in LAYOUTS.values()}):
        runs = {root / layout: {**MOE, **EMA, **tasks(corpus), **extra}
                for layout, (n, extra) in LAYOUTS.items() if n == nproc}
        proc = train_runs(corpus, runs, nproc=nproc, timeout=120 + 120 * len(runs))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logs.update(run_logs(proc, runs))
    return root, logs


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layout_matches_one_process(reference, launches, layout):
    extra = LAYOUTS[layout][1]
    root, logs = launches
    out = root / layout
    log = logs[out]
    assert "expert parallel: 4 experts per MoE layer over ep = 2 ranks (2 each)" in log
    assert ("parallel.dp_shard -> 2: inferred from the 2 processes" in log) == (layout == "ep2")
    if extra.get("parallel.dp_replicate"):
        assert "HSDP (2 replicas x 2 shards)" in log and "replicated over dp_replicate = 2 replica groups" in log
    assert_runs_match(out, reference, f"{layout}, SGD without clipping, vs one process", tol=TOL)
    assert_extras_match(out, reference, f"{layout} vs one process", tol=TOL)  # the EMA of the experts' shards too
    from lmforge.ckpt.export import load_run

    _, model = load_run(out)  # the streamed weights: every expert, gathered from the EP ranks
    assert model.blocks["0"].mlp.experts.w_gate.shape == (4, 64, 64)


LAUNCHED = (2, "torchrun started 2 processes")
EP_MODEL = {"model.moe.num_experts": 4, "train.global_batch_size": 8, "train.micro_batch_size": 2}


def test_dp_shard_is_inferred_from_the_launch_for_expert_parallelism():
    """`--parallel.ep 2` under torchrun with 2 processes: EP borrows dp_shard's ranks and adds none, so
    dp_shard = world / (dp_replicate x cp x tp x pp), logged among the config's adjustments; only when
    launched, only with ep > 1, never over a dp_shard the user chose, and not where the other degrees
    do not divide the world (the process-count rule names that)."""
    cfg = load_config("tiny", {**EP_MODEL, "parallel.ep": 2}, launch=LAUNCHED)
    assert cfg.parallel.dp_shard == 2 and cfg.parallel.world_size == 2
    assert cfg.adjustments[0].startswith("parallel.dp_shard -> 2: inferred from the 2 processes started")
    cfg = load_config("tiny", {**EP_MODEL, "parallel.ep": 2, "parallel.dp_replicate": 2, "train.micro_batch_size": 1},
                      launch=(8, "torchrun started 8 processes"))
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard) == (2, 4)
    with pytest.raises(ConfigError, match=re.escape("parallel.ep = 2 borrows its ranks from the FSDP2 shard "
                                                    "dimension: it must divide parallel.dp_shard = 1")):
        load_config("tiny", {**EP_MODEL, "parallel.ep": 2})  # (not launched: one process, nothing to infer from)
    with pytest.raises(ConfigError, match=re.escape("it must divide parallel.dp_shard = 1")):
        load_config("tiny", {**EP_MODEL, "parallel.ep": 2, "parallel.dp_shard": 1}, launch=LAUNCHED)  # (typed)
    with pytest.raises(ConfigError, match=re.escape("needs 4 processes")):
        load_config("tiny", {**EP_MODEL, "parallel.ep": 2, "parallel.dp_shard": 4}, launch=LAUNCHED)
    cfg = load_config("tiny", {**EP_MODEL}, launch=(1, "torchrun started 1 process"))
    assert cfg.parallel.dp_shard == 1 and not any("inferred" in n for n in cfg.adjustments)  # (ep = 1)
    with pytest.raises(ConfigError, match=re.escape("needs 1 process")):  # (dense, ep = 1: no inference)
        load_config("tiny", {**EP_MODEL}, launch=LAUNCHED)


def test_expert_parallelism_combines_with_replicas():
    cfg = load_config("tiny", {**EP_MODEL, "parallel.ep": 2, "parallel.dp_shard": 2, "parallel.dp_replicate": 2,
                               "train.micro_batch_size": 1})
    assert cfg.parallel.world_size == 4
    with pytest.raises(ConfigError, match="not combined with async_sgd"):
        load_config("tiny", {**EP_MODEL, "parallel.ep": 2, "parallel.dp_shard": 2, "parallel.dp_replicate": 2,
                             "parallel.async_sgd": True})
