"""`lmforge sweep`: trial generation, a real 2x2 grid on the tiny preset (default corpus), ranking,
resume, and plain progress lines in each trial's (non-TTY) log."""

from __future__ import annotations

import csv
import json
import math

import pytest

from lmforge.config import ConfigError
from lmforge.cli.sweep import parse_grid, parse_range, parse_sweep_args, sweep_main
from lmforge.sweep.core import SweepSpec, train_command, trial_name

# a very short run of a shrunken tiny preset: the sweep machinery is under test, not the model
BASE = ["--train.steps", "8", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
        "--data.seq_len", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
        "--train.eval_every", "0", "--train.eval_sequences", "16", "--train.sample_tokens", "0",
        "--train.log_every", "4", "--train.tensorboard", "false", "--train.plot", "false",
        "--checkpoint.save_final", "false"]


def test_grid_and_random_trials():
    spec = SweepSpec(space=[parse_grid("optim.lr=1e-3,3e-4"), parse_grid("schedule.warmup_steps=10,20")])
    trials = spec.trials()
    assert trials == [{"optim.lr": 1e-3, "schedule.warmup_steps": 10}, {"optim.lr": 1e-3, "schedule.warmup_steps": 20},
                      {"optim.lr": 3e-4, "schedule.warmup_steps": 10}, {"optim.lr": 3e-4, "schedule.warmup_steps": 20}]
    names = [trial_name(i, t, spec) for i, t in enumerate(trials)]
    assert len(set(names)) == 4 and names == [trial_name(i, t, spec) for i, t in enumerate(spec.trials())]

    rand = SweepSpec(space=[parse_range("optim.lr=1e-4:1e-2:log"), parse_grid("train.global_batch_size=16,32"),
                            parse_range("schedule.warmup_steps=5:50:int")], random_trials=6, seed=3)
    a, b = rand.trials(), rand.trials()
    assert a == b and len(a) == 6  # deterministic for a seed
    assert all(1e-4 <= t["optim.lr"] <= 1e-2 and t["train.global_batch_size"] in (16, 32)
               and isinstance(t["schedule.warmup_steps"], int) for t in a)
    assert SweepSpec(space=rand.space, random_trials=6, seed=4).trials() != a

    with pytest.raises(ConfigError, match="range"):
        SweepSpec(space=[parse_range("optim.lr=1e-4:1e-2:log")]).trials()  # a grid needs lists
    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        parse_grid("optim.lr")
    cmd = train_command(SweepSpec(base={"schedule.name": "wsd"}), {"optim.lr": 1e-3}, "/tmp/x")
    assert cmd[2:] == ["lmforge", "train", "--config", "tiny", "--schedule.name", '"wsd"', "--optim.lr", "0.001",
                       "--train.out_dir", '"/tmp/x"', "--train.progress", '"lines"']


def test_spec_file_and_cli_combine(tmp_path):
    spec_file = tmp_path / "sweep.toml"
    spec_file.write_text('''
config = "tiny"
random = 5
seed = 7
parallel = 2
[base]
"train.steps" = 100
[grid]
"optim.lr" = [1e-3, 3e-4]
[range.schedule]
warmup_steps = [5, 50, "int"]
''')
    spec, parallel, out, threads, report, out_given = parse_sweep_args(
        ["--spec", str(spec_file), "--grid", "optim.weight_decay=0.0,0.1", "--train.log_every", "20"])
    assert parse_sweep_args(["--base", "gpt2-124m", "--grid", "optim.lr=1e-3"]).spec.config == "gpt2-124m"
    assert parallel == 2 and out.name == "sweep-tiny" and threads is None and report and not out_given
    assert parse_sweep_args(["--grid", "optim.lr=1e-3", "--out", "x"]).out_given
    assert spec.base == {"train.steps": 100, "train.log_every": 20}
    assert [d.key for d in spec.space] == ["optim.lr", "schedule.warmup_steps", "optim.weight_decay"]
    trials = spec.trials()
    assert len(trials) == 5 and all(5 <= t["schedule.warmup_steps"] <= 50 for t in trials)
    with pytest.raises(ConfigError, match="range"):
        parse_range("optim.lr=1e-2:1e-4:log")


def test_invalid_trial_is_rejected_before_anything_runs(tmp_path, capsys):
    rc = sweep_main(["--grid", "schedule.warmup_steps=2,50", "--out", str(tmp_path / "s"), "--train.steps", "8"])
    assert rc == 2
    assert "warmup_steps" in capsys.readouterr().err
    assert not list((tmp_path / "s").glob("t*"))


def _fake_trials(monkeypatch):
    """Trials as a fast stand-in process (no torch) that writes the summary.json a finished
    `lmforge train` leaves: the folder logic of the sweep is under test here, not training."""
    import sys

    from lmforge.sweep import core

    code = ("import json, sys, pathlib; p = json.loads(sys.argv[2]); "
            "pathlib.Path(sys.argv[1], 'summary.json').write_text(json.dumps({'val_loss': 5 + p['optim.lr']}))")
    monkeypatch.setattr(core, "train_command", lambda spec, overrides, out_dir: [
        sys.executable, "-c", code, str(out_dir), json.dumps({"optim.lr": overrides["optim.lr"]})])


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_a_different_sweep_never_overwrites_a_folder(tmp_path, monkeypatch, capsys):
    """`lmforge sweep --random` after a `--grid` sweep used to overwrite the grid's results.csv/json in
    the shared default folder runs/sweep-tiny. Now the default folder passes a different sweep on to
    one named after it, an explicit --out that holds another sweep is an error that says how to
    continue, and the same command still resumes in its own folder."""
    _fake_trials(monkeypatch)
    monkeypatch.chdir(tmp_path)
    grid = ["--grid", "optim.lr=1e-3,3e-3", "--no-report"]
    rand = ["--random", "2", "--range", "optim.lr=1e-4:1e-2:log", "--no-report"]
    assert sweep_main(grid) == 0
    first = tmp_path / "runs" / "sweep-tiny"
    grid_files = _files(first)
    assert len(json.loads(grid_files["results.json"])) == 2
    capsys.readouterr()

    assert sweep_main(rand) == 0
    out = capsys.readouterr().out
    second = tmp_path / "runs" / "sweep-tiny-random2-lr"
    assert f"runs/sweep-tiny holds another sweep (grid over optim.lr; config tiny); this one (random search, 2 " \
           f"trials (seed 0) over optim.lr; config tiny) runs in runs/sweep-tiny-random2-lr" in out
    assert _files(first) == grid_files  # untouched
    rows = json.loads((second / "results.json").read_text())
    assert len(rows) == 2 and all(1e-4 <= r["optim.lr"] <= 1e-2 for r in rows)

    # the same commands resume in their own folders
    assert sweep_main(grid) == 0 and "2 trials (2 already done)" in capsys.readouterr().out
    grid_files = _files(first)  # the resume rewrote its own results (status "skipped")
    assert sweep_main(rand) == 0
    out = capsys.readouterr().out
    assert "2 trials (2 already done)" in out and "runs in runs/sweep-tiny-random2-lr" in out
    # the same grid with another base override is another sweep too
    assert sweep_main(grid + ["--train.steps", "100"]) == 0
    assert "runs in runs/sweep-tiny-grid-lr" in capsys.readouterr().out
    assert _files(first) == grid_files

    # an explicit --out that holds another sweep: an error that says how to continue, nothing written
    assert sweep_main(rand + ["--out", str(first)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (f"--out '{first}' holds another sweep (grid over optim.lr; config tiny); this sweep is random search"
            in err and "re-run its own command" in err and f"choose another --out (e.g. '{first}-random2-lr')" in err)
    assert _files(first) == grid_files
    # nor into a run folder (its report/ would be replaced)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("")
    assert sweep_main(grid + ["--out", str(tmp_path / "run")]) == 2
    assert "is an lmforge run folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.toml"]

    # a garbled summary.json of a finished trial: no metrics for it, no traceback
    (second / rows[0]["trial"] / "summary.json").write_text("[5.0")
    assert sweep_main(rand) == 0
    assert "2 trials (2 already done)" in capsys.readouterr().out
    after = {r["trial"]: r for r in json.loads((second / "results.json").read_text())}
    assert after[rows[0]["trial"]]["val_loss"] is None and after[rows[0]["trial"]]["rank"] is None
    assert after[rows[1]["trial"]]["rank"] == 1


@pytest.mark.slow
def test_2x2_sweep_on_tiny_is_ranked_and_resumable(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["--grid", "optim.lr=1e-3,3e-3", "--grid", "schedule.warmup_steps=2,4", "--parallel", "2",
            "--out", str(out), *BASE]
    assert sweep_main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 trials (0 already done)" in printed and "results ranked by val_loss" in printed

    rows = json.loads((out / "results.json").read_text())
    assert [r["rank"] for r in rows] == [1, 2, 3, 4]
    losses = [r["val_loss"] for r in rows]
    assert losses == sorted(losses) and all(math.isfinite(v) for v in losses)
    assert {(r["optim.lr"], r["schedule.warmup_steps"]) for r in rows} == {(1e-3, 2), (1e-3, 4), (3e-3, 2), (3e-3, 4)}
    for r in rows:  # each trial is a run folder whose summary matches the table
        summary = json.loads((out / r["trial"] / "summary.json").read_text())
        assert summary["val_loss"] == r["val_loss"] and summary["steps"] == 8
        assert "optim.lr" not in summary
        assert f"lr = {r['optim.lr']!r}" in (out / r["trial"] / "config.toml").read_text()
    with open(out / "results.csv") as fh:
        assert [row["trial"] for row in csv.DictReader(fh)] == [r["trial"] for r in rows]
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report" / "index.html").is_file()

    # a trial's stdout went to a file (not a TTY): plain progress lines, no bar redraws
    log = (out / rows[0]["trial"] / "train.log").read_text()
    assert "step 4/8 | loss" in log and "step 8/8 | loss" in log and "tok/s" in log and "mfu" in log
    assert "\r" not in log

    # resume: an interrupted trial (no summary.json) is re-run; finished ones are skipped
    (out / rows[3]["trial"] / "summary.json").unlink()
    assert sweep_main(argv) == 0
    printed = capsys.readouterr().out
    assert "4 trials (3 already done)" in printed and printed.count("  start ") == 1
    rows2 = json.loads((out / "results.json").read_text())
    assert {r["trial"]: r["status"] for r in rows2}[rows[3]["trial"]] == "done"
    assert sorted(r["status"] for r in rows2) == ["done", "skipped", "skipped", "skipped"]
