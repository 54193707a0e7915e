"""A layout that does not fit the processes started is named first, in one line (issue 50 item 1),
and `lmforge launch` (torch's torchrun, in-process) reports a run's end as an exit status a
scheduler can act on, without the launcher's traceback (issue 49 item 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmforge.config import ConfigError, load_config
from lmforge.launch import exit_status, split_argv

ROOT = Path(__file__).resolve().parents[1]
TWO = (2, "torchrun started 2 processes")


@pytest.mark.parametrize("typed, first_rule_otherwise", [
    ({"parallel.tp": 3}, "must divide model.vocab_size"),  # was the first error: pad the vocabulary
    ({"parallel.dp_replicate": 3}, "global_batch_size"),  # was: change the global batch
])
def test_the_process_count_is_checked_before_any_model_or_batch_rule(typed, first_rule_otherwise):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", typed, launch=TWO)
    msg = str(exc.value)
    assert msg.startswith(f"{next(iter(typed))} = 3 needs 3 processes"), msg
    assert "torchrun started 2 processes" in msg and "--nproc-per-node 3" in msg
    assert first_rule_otherwise not in msg
    with pytest.raises(ConfigError, match=first_rule_otherwise):  # the rule that used to come first is still there
        load_config("tiny", typed, launch=(3, "torchrun started 3 processes"))


def test_the_layouts_offered_fit_the_world_and_the_model():
    """tp = 3 on 2 processes: tp 2 first (closest to what was typed), then data parallel; each offered
    layout loads on 2 processes (this model allows it)."""
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", {"parallel.tp": 3}, launch=TWO)
    offered = str(exc.value).split("a layout of 2 processes: ")[1].rstrip(".").split("; ")
    assert offered[0] == "--parallel.tp 2" and "--parallel.dp_shard 2" in offered
    for layout in offered:
        words = layout.split()
        overrides = {w[2:]: int(v) for w, v in zip(words[::2], words[1::2])}
        load_config("tiny", overrides, launch=TWO)  # no error
    # a model whose heads forbid tp 2 is offered no tp 2 (6 heads, 3 kv heads: tp 3 or 1)
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", {"parallel.tp": 4, "model.n_heads": 6, "model.n_kv_heads": 3, "model.dim": 192},
                    launch=TWO)
    assert "--parallel.tp 2" not in str(exc.value) and "--parallel.dp_shard 2" in str(exc.value)


def test_a_single_process_is_told_to_launch_or_drop_the_degrees():
    with pytest.raises(ConfigError, match="this is a single process .*--nproc-per-node 4.*every parallel degree to 1"):
        load_config("tiny", {"parallel.tp": 2, "parallel.pp": 2, "model.tie_embeddings": False},
                    launch=(1, "this is a single process (not launched by torchrun)"))


def failure(exitcode: int, t: int = 0, local_rank: int = 0):
    return SimpleNamespace(exitcode=exitcode, timestamp=t, local_rank=local_rank, pid=100 + local_rank)


def test_exit_statuses_map_the_workers_end():
    assert exit_status({0: failure(2), 1: failure(2, local_rank=1)}) == (2, [])  # a config error: said once
    assert exit_status({0: failure(75), 1: failure(75, local_rank=1)}) == (75, [])  # preempted
    assert exit_status({1: failure(74, local_rank=1)}) == (74, [])  # storage
    status, lines = exit_status({0: failure(-9, t=1), 1: failure(1, t=2, local_rank=1)})
    assert status == 137 and len(lines) == 2
    assert "rank 0 (local rank 0, pid 100" in lines[0] and "killed by SIGKILL (first)" in lines[0]
    assert "rank 1" in lines[1] and "exited with status 1" in lines[1]


def test_split_argv_finds_the_sub_command_after_torchrun_options():
    subs = {"train", "prepare"}
    assert split_argv(["--nproc-per-node", "2", "train", "--parallel.tp", "2"], subs) == (
        ["--nproc-per-node", "2"], ["train", "--parallel.tp", "2"])
    assert split_argv(["--standalone", "--nproc-per-node=2", "prepare", "--config", "p.toml"], subs) == (
        ["--standalone", "--nproc-per-node=2"], ["prepare", "--config", "p.toml"])
    with pytest.raises(ValueError, match="no lmforge sub-command"):
        split_argv(["--nproc-per-node", "2"], subs)



@pytest.mark.parametrize("argv, error", [
    ([], "no lmforge sub-command given (one of: compare, config, eval, "),  # was: the help, exit 0
    (["--nproc-per-node", "2", "trian", "--config", "c.toml"], "unknown lmforge sub-command 'trian' (one of: "),
    (["--nproc-per-node", "2"], "no lmforge sub-command in ['--nproc-per-node', '2']"),
])
def test_a_missing_or_unknown_sub_command_is_a_usage_error(argv, error, capsys):
    """Issue 61 item 2: one error line, then the help's first lines; exit 2; nothing launched."""
    from lmforge.cli import main

    assert main(["launch", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert not out and lines[0].startswith(f"lmforge launch: error: {error}"), err
    assert lines[1].startswith("usage: lmforge launch [torchrun options] SUBCOMMAND") and "--nproc-per-node 2 train" \
        in lines[2] and "Traceback" not in err, err
    assert main(["launch", "--help"]) == 0  # (the help itself is still an answer)
    assert "exit statuses" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "lmforge launch"])
def test_a_wrong_process_count_under_torchrun_is_the_first_error(launcher, tmp_path):
    """What issue 50 typed: `torchrun --nproc-per-node 2 -m lmforge train --parallel.tp 3`. Its first
    error is the process count (torchrun's own failure report follows it: its agent raises
    ChildFailedError on any worker failure); under `lmforge launch` it is the only output after
    torchrun's banner, with exit status 2 and no traceback."""
    head = ([sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun" else
            [sys.executable, "-m", "lmforge", "launch"])
    cmd = head + ["--nproc-per-node", "2", "--master-port", "0"] + (
        ["-m", "lmforge"] if launcher == "torchrun" else []) + [
        "train", "--parallel.tp", "3", "--train.out_dir", str(tmp_path / "run")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert errors and errors[0].startswith("config error: parallel.tp = 3 needs 3 processes"), proc.stderr
    assert "torchrun started 2 processes" in errors[0]
    if launcher == "lmforge launch":
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
        assert "lmforge launch --nproc-per-node 3 train" in errors[0]
        assert len(errors) == 1, proc.stderr
    else:
        assert proc.returncode != 0
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "lmforge launch"])
def test_a_run_folder_in_use_is_one_line_under_lmforge_launch(launcher, tmp_path):
    """Issue 61 item 6, what the docs say: a second trainer on a run folder in use prints lmforge's
    one-line refusal; bare torchrun adds its agent's ~30-line ChildFailedError traceback and exits 1,
    `lmforge launch` prints the line alone and exits 2."""
    import signal

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from lmforge.train.run_folder import RunLock; "
                               "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)", "run"],
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        head = ([sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun" else
                [sys.executable, "-m", "lmforge", "launch"])
        cmd = head + ["--nproc-per-node", "1", "--master-port", "0"] + (
            ["-m", "lmforge"] if launcher == "torchrun" else []) + ["train", "--train.out_dir", "run"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    refusal = f"error: train.out_dir = 'run' is in use by another trainer (pid {holder.pid} on host "
    lines = proc.stderr.strip().splitlines()
    assert [ln for ln in lines if ln.startswith(refusal)], proc.stderr
    if launcher == "lmforge launch":
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    else:
        assert proc.returncode == 1 and "ChildFailedError" in proc.stderr and len(lines) > 20, proc.stderr
