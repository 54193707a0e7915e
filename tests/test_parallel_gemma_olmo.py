"""Gemma 3's and OLMo 2 / 3's block options (model.norm_placement, embed_scale, GeGLU, attn_scale_dim,
QK-norm per head or over the projection, interleaved sliding / full attention with their own RoPE bases)
under every layout, against one process: per-step losses and gradient norms (before clipping) within
1e-5. One single-process launch holds both references, one 2-process launch every layout run; what a
layout cannot run yet is refused by its named rule (config/layout_rules.py)."""

from __future__ import annotations

import pytest

from lmforge.config import load_config
from lmforge.config.layout_rules import layout_refusals
from tests.test_parallel_dp import assert_runs_match, corpus, train_runs  # noqa: F401  (module-scoped corpus)

TYPES = ["sliding_attention", "full_attention"]  # (TINY's 2 layers; windows of 8 of its 32-token sequences)
GEMMA3ISH = {"model.norm_placement": "sandwich", "model.embed_scale": "true", "model.activation": "geglu",
             "model.qk_norm": "true", "model.attn_scale_dim": 12, "model.sliding_window": 8,
             "model.layer_types": TYPES, "model.rope_local_theta": 100.0}
OLMOISH = {"model.norm_placement": "post", "model.qk_norm": "true", "model.qk_norm_scope": "projection",
           "model.sliding_window": 8, "model.layer_types": TYPES, "model.tie_embeddings": "false"}
SHARED = {"train.steps": 4, "train.log_every": 1}
# (DDP runs the model as FSDP2 does, whole on each rank: FSDP2 stands for both. OLMo's blocks differ from
# Gemma's in what a layout does not see (norms on the outputs only, QK-norm over the projection), and its
# QK-norm sums over every head: no TP, rule qk-norm-projection-tp)
LAYOUTS = {
    "gemma3": {"fsdp2": {"parallel.dp_shard": 2}, "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
               "pp2": {"parallel.pp": 2}, "cp2": {"parallel.cp": 2}},
    "olmo": {"fsdp2": {"parallel.dp_shard": 2}},
}
FAMILIES = {"gemma3": GEMMA3ISH, "olmo": OLMOISH}


@pytest.mark.slow
def test_gemma3_and_olmo_blocks_match_one_process_under_every_layout(corpus, tmp_path):  # noqa: F811
    singles = {tmp_path / f"{family}-single": {**FAMILIES[family]} for family in FAMILIES}
    proc = train_runs(corpus, singles, **SHARED)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {tmp_path / f"{family}-{name}": {**FAMILIES[family], **own}
            for family, layouts in LAYOUTS.items() for name, own in layouts.items()}
    proc = train_runs(corpus, runs, nproc=2, timeout=400, **SHARED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for out in runs:
        family = out.name.split("-")[0]
        assert_runs_match(out, tmp_path / f"{family}-single", f"{family} blocks, {out.name} vs one process")


def test_tensor_parallelism_refuses_qk_norm_over_the_projection():
    cfg = load_config("olmo2-7b", {"parallel.tp": 2, "parallel.dp_shard": 1}, validate=False)
    assert [r.rule for r in layout_refusals(cfg)] == ["qk-norm-projection-tp"]
    assert "sums over every head" in layout_refusals(cfg)[0].message
