"""`lmforge scale sweep`: an IsoFLOP grid laid out from a preset's family and run as a `lmforge sweep` of
listed trials (keys that vary together: width, depth, heads, steps)."""

from __future__ import annotations

import json
import math

import pytest

from lmforge.config import ConfigError, load_config
from lmforge.model.accounting import count_params
from lmforge.cli.scale import SPEC_FILE, default_budgets, scale_main
from lmforge.scale.grid import isoflop_grid, parse_models, shape_overrides
from lmforge.cli.sweep import parse_sweep_args
from lmforge.sweep.core import Dimension, SweepSpec, describe_spec, same_sweep

SMALL = {"data.seq_len": 32, "train.global_batch_size": 8, "train.micro_batch_size": 8}


def test_listed_trials_vary_together_and_cross_the_grid():
    listed = [{"model.dim": 32, "train.steps": 40}, {"model.dim": 64, "train.steps": 10}]
    spec = SweepSpec(listed=listed, space=[Dimension("optim.lr", values=[1e-3, 3e-3])])
    assert spec.trials() == [{**t, "optim.lr": lr} for t in listed for lr in (1e-3, 3e-3)]
    assert spec.keys() == ["model.dim", "train.steps", "optim.lr"]
    assert SweepSpec(listed=listed).trials() == listed
    assert "2 listed trials over model.dim, train.steps x a grid over optim.lr" in describe_spec(spec.to_dict())
    with pytest.raises(ConfigError, match="no random search"):
        SweepSpec(listed=listed, random_trials=3).trials()
    # a sweep.json written before listed trials existed (no "listed" key) is still the same sweep
    plain = SweepSpec(space=[Dimension("optim.lr", values=[1e-3])])
    assert "listed" not in plain.to_dict() and same_sweep(plain.to_dict(), plain)
    assert not same_sweep(plain.to_dict(), SweepSpec(space=plain.space, listed=listed))


def test_the_grid_spends_each_budget_and_keeps_the_family():
    models = parse_models("32x1,64x2,96x3")
    points, notes = isoflop_grid("tiny", SMALL, models, [3e10, 1e11], min_steps=40)
    batch = 8 * 32
    for p in points:
        cfg = load_config("tiny", {**SMALL, **p.overrides})
        assert p.n_params == count_params(cfg.model)["non_embedding"]
        assert p.tokens == cfg.train.steps * batch and cfg.model.head_dim == 32
        assert abs(p.flops / p.budget - 1) <= 0.5 / 40 + 1e-9  # steps rounded: at most half a step of >= 40
        assert cfg.schedule.warmup_steps <= cfg.train.steps // 10
    assert not notes and {(p.dim, p.budget) for p in points} == {(d, c) for d in (32, 64, 96) for c in (3e10, 1e11)}
    gqa = load_config("llama3.1-8b")  # 32 query heads on 8 key/value heads of width 128
    assert shape_overrides(gqa, 512, 2) == {"model.dim": 512, "model.n_layers": 2, "model.n_heads": 4,
                                            "model.n_kv_heads": 1}
    with pytest.raises(ConfigError, match="query heads per key/value head"):
        shape_overrides(gqa, 256, 2)
    with pytest.raises(ConfigError, match="DIMxLAYERS"):
        parse_models("64,128x2")


def test_budgets_of_fitted_runs_group_their_rounded_6nd():
    assert default_budgets([2.98e12, 3.01e12, 3.04e12, 1.0e13, 0.99e13]) == [3e12, 1e13]


def test_the_dry_run_writes_a_sweep_spec_that_lmforge_sweep_reads(tmp_path, capsys):
    out = tmp_path / "grid"
    argv = ["sweep", "--models", "32x1,64x2", "--budgets", "3e10,1e11", "--min-steps", "40", "--out", str(out),
            "--dry-run", *[a for k, v in SMALL.items() for a in (f"--{k}", str(v))]]
    assert scale_main(argv) == 0
    printed = capsys.readouterr().out
    assert "IsoFLOP grid of 'tiny': 4 runs" in printed and f"sweep spec: {out / SPEC_FILE}" in printed
    points, _ = isoflop_grid("tiny", SMALL, parse_models("32x1,64x2"), [3e10, 1e11], min_steps=40)
    parsed = parse_sweep_args(["--spec", str(out / SPEC_FILE)])
    assert parsed.spec.trials() == [p.overrides for p in points]
    assert parsed.spec.base == SMALL and parsed.out == out and not (out / "sweep.json").exists()


@pytest.mark.slow
def test_scale_sweep_trains_the_grid_as_a_sweep(tmp_path, capsys):
    out = tmp_path / "grid"
    brief = {**SMALL, "model.vocab_size": 4096, "train.eval_every": 0, "train.eval_sequences": 8,
             "train.sample_tokens": 0, "train.tensorboard": "false", "train.plot": "false",
             "checkpoint.save_final": "false", "train.threads": 1}
    argv = ["sweep", "--models", "32x1", "--budgets", "1.5e9", "--min-steps", "5", "--out", str(out),
            *[a for k, v in brief.items() for a in (f"--{k}", str(v))]]
    assert scale_main(argv) == 0, capsys.readouterr()
    rows = json.loads((out / "results.json").read_text())
    assert [r["model.dim"] for r in rows] == [32] and all(math.isfinite(r["val_loss"]) for r in rows)  # (one trial: CI time)
    for r in rows:  # each trial trained its grid point's steps at its shape
        summary = json.loads((out / r["trial"] / "summary.json").read_text())
        assert summary["steps"] == r["train.steps"] and summary["tokens"] == r["train.steps"] * 8 * 32
