"""`lmforge compare RUN_A RUN_B` (lmforge/cli/compare.py over lmforge/verify/band.py): two runs' loss and
gradient norm per step within a band, given (--band) or measured from reference runs (--reference);
exit 0 within, 1 outside (one line per step outside), 2 on bad input. The runs are small real runs of
the tiny model: the reference, the same training cut into two micro-batches (another order of the fp32
sums: within), two other seeds (the measured band), and the reference at 10x the learning rate (outside
from step 2: step 1's loss and gradient are taken before the first update)."""

from __future__ import annotations

import pytest

from lmforge.cli import main
from lmforge.verify.band import Band, measure_band, parse_band, within_band
from tests.test_ckpt import run

STEPS = {"train.steps": 4, "train.log_every": 1, "checkpoint.every_steps": 0}


def metrics(*rows):
    return {s: {"loss": loss, "grad_norm": g} for s, (loss, g) in enumerate(rows, 1)}


def test_the_band_is_the_largest_rerun_distance_up_to_each_step_times_the_factor():
    ref = metrics((5.0, 2.0), (4.0, 1.0))
    band = measure_band(ref, [metrics((5.001, 2.02), (4.0, 1.0)), metrics((4.998, 2.0), (4.01, 1.1))], factor=2)
    assert band.at("loss", 1) == pytest.approx(2 * 0.002) and band.at("loss", 2) == pytest.approx(2 * 0.01)
    assert band.at("grad_norm", 1) == pytest.approx(2 * 0.01) and band.at("grad_norm", 2) == pytest.approx(2 * 0.1)
    # (a spread reached is kept: step 2's smaller one does not narrow the band)
    assert measure_band(ref, [metrics((5.01, 2.0), (4.001, 1.0))], factor=1).at("loss", 2) == pytest.approx(0.01)
    parity = within_band(metrics((5.003, 2.0), (4.03, 1.0)), ref, band)
    assert [(o.step, o.key) for o in parity.outside] == [(2, "loss")] and not parity.ok
    assert parity.step_lines() == ["step 2: loss 4.03 vs 4, difference 3.00e-02 (absolute) outside the band 2.00e-02 (1.5x)"]
    assert parity.worst["loss"] == (pytest.approx(1.5), 2) and parity.worst["grad_norm"][0] == 0.0


@pytest.mark.parametrize("text, error", [("loss=1e-3", "give both"), ("loss=x,grad_norm=1", "'x' is not a number"),
                                         ("los=1,grad_norm=1", "unknown key 'los'")])
def test_a_bad_band_is_refused_with_the_fix(text, error):
    with pytest.raises(ValueError, match=error):
        parse_band(text)
    assert isinstance(parse_band("loss=1e-3,grad-norm=1e-2"), Band)


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    kinds = {"ref": {}, "split": {"train.micro_batch_size": 2}, "seed1": {"train.seed": 1},
             "seed2": {"train.seed": 2}, "lr10": {"optim.lr": 3e-2}}
    for name, overrides in kinds.items():
        run(small_data, root / name, **STEPS, **overrides)
    return {name: str(root / name) for name in kinds}


@pytest.mark.slow
def test_compare_within_a_measured_band_passes_and_a_changed_run_fails_per_step(runs, capsys):
    assert main(["compare", runs["split"], runs["ref"], "--reference", runs["seed1"], runs["seed2"]]) == 0
    out = capsys.readouterr().out
    assert "band measured from 2 reference run(s) x 3" in out and "PASS: loss at" in out and "outside" not in out
    assert main(["compare", runs["lr10"], runs["ref"], "--reference", runs["seed1"], runs["seed2"]]) == 1
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("  step ")]
    assert steps and all("outside the band" in line for line in steps), out
    assert len(steps) == len({line.split(":")[0] for line in steps}), out  # one line per step
    assert not any(line.startswith("  step 1:") for line in steps), out  # (step 1: before the first update)
    assert out.splitlines()[-1].startswith("FAIL: ") and "step(s) outside the band" in out


@pytest.mark.slow
def test_compare_with_a_given_band_and_bad_input(runs, capsys, tmp_path):
    assert main(["compare", runs["split"], runs["ref"], "--band", "loss=1e-4,grad_norm=1e-4"]) == 0
    assert main(["compare", runs["lr10"], runs["ref"], "--band", "loss=1e-4,grad_norm=1e-4"]) == 1
    capsys.readouterr()
    assert main(["compare", runs["ref"], str(tmp_path), "--band", "loss=1,grad_norm=1"]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    assert main(["compare", runs["ref"], runs["ref"], "--band", "loss=1"]) == 2
