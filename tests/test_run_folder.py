"""A run folder is never damaged: a refused run and a re-run of a finished run leave every byte as
it was, and a changed command does not continue or overwrite another run by accident."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lmforge.config import ConfigError, load_config
from lmforge.train.trainer import Trainer
from tests.test_ckpt import SMALL


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256), empty folders included."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def finished(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    Trainer(load_config("tiny", SMALL), out_dir=out, data=small_data).fit()
    return out


def test_a_refused_run_writes_nothing(finished, small_data):
    before = snapshot(finished)
    with pytest.raises(ConfigError, match="incompatible with this config .*model.n_layers"):
        Trainer(load_config("tiny", {**SMALL, "model.n_layers": 3}), out_dir=finished, data=small_data).fit()
    with pytest.raises(ValueError, match="data.corpus = .*mycorpsu"):
        Trainer(load_config("tiny", {**SMALL, "data.corpus": str(finished / "mycorpsu")}), out_dir=finished).fit()
    assert snapshot(finished) == before


def test_a_finished_run_is_reported_and_left_exactly_as_it_was(finished, small_data):
    before = snapshot(finished)
    result = Trainer(load_config("tiny", SMALL), out_dir=finished, data=small_data).fit()
    assert snapshot(finished) == before
    assert result.steps == SMALL["train.steps"] and result.seconds > 1e-3 and result.tokens_per_second < 1e7


def test_a_changed_command_gets_its_own_default_folder(small_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = {k: v for k, v in SMALL.items()}
    Trainer(load_config("tiny", base), data=small_data).fit()
    first = tmp_path / "runs" / "tiny"
    before = snapshot(first)
    changed = Trainer(load_config("tiny", {**base, "optim.lr": 1e-3, "train.steps": 8}), data=small_data)
    changed.fit()
    assert changed.out_dir == Path("runs/tiny-lr0.001-steps8")
    assert snapshot(first) == before
    # the same command again continues (here: reports) its own folder; a layout change is the same run
    again = Trainer(load_config("tiny", {**base, "optim.lr": 1e-3, "train.steps": 8, "train.log_every": 2}),
                    data=small_data)
    again.fit()
    assert again.out_dir == Path("runs/tiny-lr0.001-steps8") and again.finished
