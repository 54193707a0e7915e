"""Sequence parallelism with learned positions (issue 59: GPT-2 / GPT-3) against one process.

Each TP rank adds the position rows of its own sequence shard to the scattered token embedding
(lmforge.parallel.tensor_parallel.positions_of_sequence_shard); the replicated position weight's
gradient is the sum of the ranks' rows, reduced over the TP group. A GPT-2-shaped tiny model
(learned positions, LayerNorm, GELU, biases, tied embeddings) under TP = 2 + SP, and under
Megatron's GPT-3 layout in small, TP = 2 + SP x PP = 2 with the tied head on the last stage: per-step
losses and gradient norms (before clipping) of 10 AdamW steps (tests/test_parallel_dp.py's `STEPS`: a
position gradient reduced twice or not at all shows in step 1's gradient norm) within
tests/test_parallel_mp.py's TOL.
"""

from __future__ import annotations

import pytest

from tests.test_parallel_dp import STEPS, assert_runs_match, corpus, train_runs  # noqa: F401
from tests.test_parallel_mp import TOL

GPT2 = {"model.n_layers": 4, "model.pos_emb": "learned", "model.norm": "layernorm", "model.activation": "gelu",
        "model.bias": "true", "model.tie_embeddings": "true", "model.fused_qkv": "false", **STEPS}
SP = {"parallel.tp": 2, "parallel.sequence_parallel": "true"}


@pytest.mark.slow
def test_learned_positions_under_sequence_parallelism_match_one_process(corpus, tmp_path):  # noqa: F811
    ref = tmp_path / "single"
    proc = train_runs(corpus, {ref: {}}, **GPT2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for nproc, name, layout in [(2, "tp2-sp", SP), (4, "tp2-sp-pp2", {**SP, "parallel.pp": 2})]:
        out = tmp_path / name
        proc = train_runs(corpus, {out: layout}, nproc=nproc, timeout=600, **GPT2)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert_runs_match(out, ref, f"GPT-2 shape, learned positions, {name} vs one process", tol=TOL)
