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


def test_the_auto_folder_name_carries_every_typed_override_layout_keys_included():
    from lmforge.train.run_folder import auto_folder_name

    assert auto_folder_name("tiny", ()) == "tiny"
    assert auto_folder_name("tiny", (("parallel.dp_replicate", 2),)) == "tiny-dp_replicate2"
    typed = (("parallel.dp_shard", 2), ("parallel.zero_stage", 1), ("optim.lr", 1e-3), ("train.progress", "lines"),
             ("checkpoint.resume", "none"), ("train.out_dir", "x"))  # how it prints / resumes: not in the name
    assert auto_folder_name("tiny", typed) == "tiny-dp_shard2-zero_stage1-lr0.001"
    many = tuple((f"model.key{i}", i) for i in range(30))
    name = auto_folder_name("tiny", many)
    assert len(name) <= 90 and name != auto_folder_name("tiny", many[:-1])  # cut, with a digest of them all


def test_a_typed_layout_trains_its_own_folder_and_the_same_command_continues_it(small_data, tmp_path, monkeypatch,
                                                                                 caplog):
    """`--parallel.dp_replicate 2` used to land in the finished runs/tiny and only report it."""
    monkeypatch.chdir(tmp_path)
    Trainer(load_config("tiny", SMALL), data=small_data).fit()
    cfg = load_config("tiny", {**SMALL, "parallel.dp_replicate": 1})
    cfg.named_by, cfg.command = (("parallel.dp_replicate", 1),), "lmforge train --parallel.dp_replicate 1"
    first = Trainer(cfg, data=small_data)
    first.fit()
    assert first.out_dir == Path("runs/tiny-dp_replicate1") and not first.finished
    again = Trainer(cfg, data=small_data)
    with caplog.at_level("INFO", logger="lmforge.train"):
        again.fit()
    assert again.out_dir == first.out_dir and again.finished
    said = [r.getMessage() for r in caplog.records if "nothing trained" in r.getMessage()]
    steps = SMALL["train.steps"]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith(f"nothing trained: runs/tiny-dp_replicate1 holds this run, already complete ({steps} "
                              f"of {steps} steps"), said
    assert said[0].endswith(f"Train it further: lmforge train --parallel.dp_replicate 1 --train.out_dir "
                            f"runs/tiny-dp_replicate1 --train.steps {2 * steps}; start it over: lmforge train "
                            f"--parallel.dp_replicate 1 --checkpoint.resume none"), said


def test_a_refused_resume_answers_before_any_data_or_hardware_work(finished, monkeypatch):
    """The incompatible-checkpoint error came after data preparation and the precision probe (13-18 s)."""
    import lmforge.train.trainer as trainer_module

    def too_early(*args, **kwargs):
        raise AssertionError("data or precision work before the config was checked against the checkpoint")

    monkeypatch.setattr(trainer_module, "prepare_data_once", too_early)
    monkeypatch.setattr(trainer_module.auto, "resolve_auto", too_early)
    monkeypatch.setattr(trainer_module, "build_loaders", too_early)
    with pytest.raises(ConfigError, match="incompatible with this config .*model.n_layers"):
        Trainer(load_config("tiny", {**SMALL, "model.n_layers": 3}), out_dir=finished).fit()


def test_a_summary_counts_the_whole_run_across_resumes(small_data, tmp_path, monkeypatch):
    """Issue 50 item 2: a run stopped twice (a preemption after steps 16 and 18 of 20) and resumed
    reports what the uninterrupted run reports: the same steps, tokens, losses and initial
    validation loss (the run's first, not the last leg's), and its time and tokens/s over all legs.
    Before, the last leg's 2 steps' time made tokens/s ~10x too high and the initial loss was the
    resumed leg's. Fields that describe the last process (its checkpoints, memory, hardware) are
    listed and checked as such."""
    import json

    from lmforge.train.preempt import Preempted, Preemption

    cfg = {**SMALL, "train.steps": 20, "train.log_every": 2, "train.eval_every": 0}
    straight = Trainer(load_config("tiny", cfg), out_dir=tmp_path / "straight", data=small_data).fit()
    stops = iter([16, 18])
    stop_at = [next(stops)]

    def requested(self):  # a scheduler's signal, seen after step `stop_at` (every rank alike: one process)
        return self_trainer[0].state.step == stop_at[0]

    monkeypatch.setattr(Preemption, "requested", requested)
    self_trainer = [None]
    for leg in range(3):
        trainer = Trainer(load_config("tiny", cfg), out_dir=tmp_path / "resumed", data=small_data)
        self_trainer[0] = trainer
        if leg < 2:
            with pytest.raises(Preempted):
                trainer.fit()
            stop_at[0] = next(stops, -1)
        else:
            resumed = trainer.fit()
    a = json.loads((tmp_path / "straight" / "summary.json").read_text())
    b = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    for key in ("steps", "tokens", "train_loss", "val_loss", "val_perplexity", "initial_val_loss", "unigram_entropy",
                "flops_per_token", "n_params", "layout", "loss_spikes", "grad_norm_warnings", "skipped_updates",
                "rollbacks", "peak_flops", "peak_source", "sample"):
        assert b[key] == a[key], key
    # rates and times: over the whole run (the bug: the last leg's 2 of 20 steps' time, ~10x the rate)
    for key in ("seconds", "tokens_per_second"):
        assert 1 / 3 < b[key] / a[key] < 3, (key, a[key], b[key])
    assert resumed.seconds == b["seconds"] and straight.initial_val_loss == resumed.initial_val_loss
    # what the last process did, by definition its own
    assert b["checkpoints"]["resumed_from"] and a["checkpoints"]["resumed_from"] is None
    per_process = {"mfu", "data_share", "checkpoint_s", "peak_mem_gb", "hardware", "checkpoints", "out_dir"}
    assert set(a) == set(b) and set(a) - per_process - {"steps", "tokens", "train_loss", "val_loss", "val_perplexity",
                                                       "initial_val_loss", "unigram_entropy", "flops_per_token",
                                                       "n_params", "layout", "loss_spikes", "grad_norm_warnings",
                                                       "skipped_updates", "rollbacks", "peak_flops", "peak_source",
                                                       "sample", "seconds", "tokens_per_second"} == set()


def test_one_trainer_per_run_folder(small_data, tmp_path):
    """Issue 50 item 3: a second trainer on a folder in use stops at start-up with one line naming
    the holder (pid, host), the command line says it before torch is imported, the first run is
    undisturbed (its weights equal an undisturbed run's), and the lock of a dead process never
    blocks (the kernel drops it: SIGKILL of the holder)."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys

    from lmforge.folders import TRAIN_LOCK
    from lmforge.train.run_folder import RunFolderInUse, RunLock

    folder = tmp_path / "run"
    cfg = {**SMALL, "train.steps": 6}
    holder_code = ("import sys, time; from lmforge.train.run_folder import RunLock; RunLock(sys.argv[1]).acquire(); "
                   "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", holder_code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderInUse, match=f"in use by another trainer \\(pid {holder.pid} on host "
                                                 f"{socket.gethostname()}"):
            Trainer(load_config("tiny", cfg), out_dir=folder, data=small_data).fit()
        assert sorted(p.name for p in folder.iterdir()) == [TRAIN_LOCK]  # the refused trainer wrote nothing
        # the command line refuses it before the heavy imports
        code = ("import sys; from lmforge.cli import main; rc = main(['train', '--train.out_dir', sys.argv[1]]); "
                "print(rc, 'torch' in sys.modules)")
        proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=120)
        assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr
        assert proc.stderr.strip().count("\n") == 0 and f"pid {holder.pid}" in proc.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without releasing: its file remains, its lock does not
    assert json.loads((folder / TRAIN_LOCK).read_text())["pid"] == holder.pid
    Trainer(load_config("tiny", cfg), out_dir=folder, data=small_data).fit()
    assert not (folder / TRAIN_LOCK).exists()  # released (and removed) at the end
    # a run in progress is not disturbed by a second trainer: the lock holds while the first trains
    undisturbed = tmp_path / "undisturbed"
    Trainer(load_config("tiny", cfg), out_dir=undisturbed, data=small_data).fit()
    first = Trainer(load_config("tiny", cfg), out_dir=tmp_path / "first", data=small_data)
    real_step = first.train_step
    refusals = []

    def step_and_intrude(batches):
        out = real_step(batches)
        if first.state.step == 2:  # mid-run, a second trainer on the same folder
            with pytest.raises(RunFolderInUse, match=f"pid {os.getpid()}"):
                Trainer(load_config("tiny", cfg), out_dir=tmp_path / "first", data=small_data).fit()
            refusals.append(first.state.step)
        return out

    first.train_step = step_and_intrude
    first.fit()
    assert refusals == [2]
    from safetensors.torch import load_file

    a, b = load_file(undisturbed / "model.safetensors"), load_file(tmp_path / "first" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # a refused new folder leaves no folder behind
    with RunLock(tmp_path / "held") as held:
        held.running = True  # (one that is not training hands the folder over: the next test)
        with pytest.raises(RunFolderInUse):
            RunLock(tmp_path / "held").acquire()
    assert not (tmp_path / "held").exists()


def test_a_trainer_set_up_but_not_training_hands_its_folder_to_the_next_in_the_same_process(tmp_path):
    """A notebook cell run again (or a test driving train_step by hand) builds a second trainer on
    the folder of one that is not training: it takes the lock over; the first's release no longer
    drops it. One that is training keeps it (see test above), and another process is refused."""
    import subprocess
    import sys

    from lmforge.folders import TRAIN_LOCK
    from lmforge.train.run_folder import RunFolderInUse, RunLock

    folder = tmp_path / "run"
    first = RunLock(folder).acquire()
    second = RunLock(folder).acquire()  # first is not running: handed over
    first.release()  # a no-op now: the second holds it
    assert (folder / TRAIN_LOCK).is_file()
    probe = ("import sys; from lmforge.train.run_folder import RunLock, RunFolderInUse\n"
             "try:\n    RunLock(sys.argv[1]).acquire(); print('took')\n"
             "except RunFolderInUse:\n    print('refused')")
    other = lambda: subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True,  # noqa: E731
                                   timeout=60).stdout.strip()
    assert other() == "refused"
    second.running = True
    with pytest.raises(RunFolderInUse):
        RunLock(folder).acquire()
    second.release()
    assert not (folder / TRAIN_LOCK).exists() and other() == "took"
