"""A Mixture-of-Experts model through `lmforge train` in one process: per-layer expert metrics in
metrics.jsonl and TensorBoard, the expert-load plot in the run report, and the aux-loss-free bias
saved with the weights."""

from __future__ import annotations

import json

import pytest

from tests.test_parallel_dp import corpus, train  # noqa: F401  (module-scoped corpus fixture)

MOE = {"model.n_layers": 3, "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 64,
       "model.moe.first_dense": 1, "model.moe.router": "sigmoid", "model.moe.aux_loss_coef": 0.0,
       "model.moe.bias_update_rate": 0.01, "model.moe.capacity_factor": 1.0, "train.steps": 6,
       "train.log_every": 3, "train.tensorboard": "true", "train.plot": "true"}


@pytest.mark.slow
def test_moe_metrics_reach_metrics_jsonl_tensorboard_and_the_report(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "moe"
    proc = train(corpus, out, **MOE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "step" in r and "val_loss" not in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    tokens = 8 * 32  # global batch x seq_len, every step
    for r in steps:
        for layer in (1, 2):  # block 0 is dense (first_dense = 1)
            load = r[f"moe/{layer}/tokens_per_expert"]
            assert len(load) == 4 and sum(load) == tokens * 2  # every token's top-2 assignments
            assert r[f"moe/{layer}/max_load"] == pytest.approx(max(load) / (sum(load) / 4))
            capacity = 64 * 2 // 4  # per micro-batch of 2 x 32 tokens: ceil(1.0 x 64 x 2 / 4); 4 micro-batches
            assert r[f"moe/{layer}/dropped"] >= sum(max(c - 4 * capacity, 0) for c in load)
            assert 0 <= r[f"moe/{layer}/dropped_frac"] < 1 and r[f"moe/{layer}/aux_loss"] > 0
        assert "moe/0/max_load" not in r

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    for name in ("max_load", "aux_loss", "dropped", "dropped_frac"):
        assert [e.step for e in acc.Scalars(f"train/moe/1/{name}")] == list(range(1, 7)), name
    assert (out / "report" / "expert_load.png").stat().st_size > 10_000
    from lmforge.cli.report import report_main

    assert report_main([str(out), "--out", str(tmp_path / "report")]) == 0  # the run report shows it too
    assert "<img src='expert_load.png'" in (tmp_path / "report" / "index.html").read_text()

    from safetensors.torch import load_file

    bias = load_file(str(out / "model.safetensors"))["blocks.1.mlp.expert_bias"]
    assert bias.abs().sum() > 0  # moved by the aux-loss-free update, saved with the weights
