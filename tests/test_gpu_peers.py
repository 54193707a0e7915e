"""The GPU suite's peer rows (benchmarks/gpu/peers.py, issue 55): a peer's files come from a local checkout
(a work tree or a bare git directory) with the commit copied, never from the tree; each peer's own step
lines are read; llm.c's token files carry its header; and nanoGPT's real train.py runs beside lmforge's
throughput row in the CPU smoke, where a checkout is at hand (LMFORGE_NANOGPT, or the workplace's mirror
beside this checkout; CI has none, so that test is skipped there and its row is skipped with the reason
in test_gpu_suite's smoke)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.test_gpu_plan import args, module, prepare, rows, suite

ROOT = Path(__file__).resolve().parents[1]
peers = module("peers")


def nanogpt_checkout() -> Path | None:
    for where in (os.environ.get("LMFORGE_NANOGPT", ""), str(ROOT.parent / ".mirror" / "karpathy+nanoGPT" / "repo")):
        if where and Path(where).exists():
            return Path(where)
    return None


def git(*a: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *a], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_a_peer_is_copied_from_a_work_tree_or_a_bare_git_directory_with_its_commit(tmp_path):
    src = tmp_path / "llm.c"
    (src / "llmc").mkdir(parents=True)
    for f, text in (("train_gpt2.cu", "// cu"), ("Makefile", "all:"), ("llmc/adamw.cuh", "// h"), ("README", "x")):
        (src / f).write_text(text)
    git("init", "-q", cwd=src)
    git("add", ".", cwd=src)
    git("commit", "-q", "-m", "c", cwd=src)
    head = git("rev-parse", "HEAD", cwd=src)
    git("clone", "-q", "--bare", str(src), str(tmp_path / "bare.git"), cwd=tmp_path)
    for source in (src, tmp_path / "bare.git"):
        dest = tmp_path / "out" / source.name
        assert peers.copy_peer("llmc", source, dest) == head
        assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
            "COMMIT", "Makefile", "llmc/adamw.cuh", "train_gpt2.cu"]  # (only what the row needs)
        assert (dest / "COMMIT").read_text() == f"{head} karpathy/llm.c\n" and peers.peer_commit(dest) == head
    with pytest.raises(peers.PeerError, match=r"--nanogpt .*: neither a checkout with train.py nor a git directory"
                                               r".*pass a checkout of https://github.com/karpathy/nanoGPT"):
        peers.copy_peer("nanogpt", src, tmp_path / "n")
    (src / "Makefile").unlink()
    with pytest.raises(peers.PeerError, match="no Makefile there"):
        peers.copy_peer("llmc", src, tmp_path / "m")
    assert not (tmp_path / "m").exists() and not (tmp_path / "n").exists()  # (refused before anything is written)


def test_each_peers_own_step_lines_are_read_and_a_diverged_loss_fails():
    shape = peers.Shape(12, 12, 768, 1024, 50304, True, 16, 4, True, "bfloat16")
    nano = "".join(f"iter {i}: loss 10.9{i}, time {t}ms, mfu -100.00%\n"
                   for i, t in enumerate((9000.5, 160.0, 150.0, 152.0, 151.0)))
    got = peers.steady(peers.read_steps("step 0: train loss nan, val loss nan\n" + nano, peers.NANOGPT_ITER), 1, shape)
    assert got["step_ms_median"] == 151.5 and got["steps_timed"] == 4 and got["last_loss"] == 10.94
    assert got["tokens_per_s"] == pytest.approx(65536 / 0.1515)
    llmc = "".join(f"step {i:4d}/25 | loss 10.{i}00000 (+0.00z)| norm 5.1234 (+0.00z)| lr 3.00e-04 | {t:.2f} ms | "
                   f"38.1% bf16 MFU | 431234 tok/s\n" for i, t in ((1, 800.0), (2, 140.0), (3, 142.0)))
    steps = peers.read_steps("val loss 10.9\n" + llmc, peers.LLMC_STEP)
    assert steps == [(1, 10.1, 800.0), (2, 10.2, 140.0), (3, 10.3, 142.0)]
    assert peers.steady(steps, 1, shape)["step_ms_median"] == 141.0
    with pytest.raises(peers.PeerError, match="none after the 5 warm-up steps"):
        peers.steady(steps, 5, shape)
    with pytest.raises(peers.PeerError, match="loss is nan at step 3"):
        peers.steady(steps[:2] + [(3, float("nan"), 140.0)], 1, shape)


def test_llmc_token_files_carry_its_header_and_only_runs_gpt2_shapes(tmp_path):
    tokens = np.array([0, 7, 50256, 50257, 50303], dtype=np.int64)
    peers.write_llmc_tokens(tmp_path / "t.bin", tokens)
    raw = (tmp_path / "t.bin").read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    assert list(header[:3]) == [20240520, 1, 5] and not header[3:].any()
    assert list(np.frombuffer(raw[1024:], dtype=np.uint16)) == [0, 7, 50256, 0, 46]
    gpt2 = peers.Shape(12, 12, 768, 1024, 50304, True, 16, 4, True, "bfloat16")
    peers.llmc_check(gpt2)
    build, run = peers.llmc_commands(gpt2, 25)
    assert build[:2] == ["make", "train_gpt2cu"] and "USE_CUDNN=0" in build
    assert run[run.index("-e") + 1] == "d12" and run[run.index("-d") + 1] == str(16 * 1024 * 4)
    with pytest.raises(peers.PeerError, match="llm.c trains GPT-2 shapes only"):
        peers.llmc_check(peers.Shape(4, 6, 192, 128, 4096, False, 8, 1, True, "bfloat16"))


def test_the_peer_rows_are_skipped_with_the_fix_without_a_prepared_peer_and_the_device_command_passes_them(tmp_path):
    s = suite.Suite(args(tmp_path, peers=""))
    spec = next(r for r in rows.ROWS if r.name == "peer-nanogpt")
    s.run_rows([spec])
    assert s.rows[0].status == "skipped" and "suite.py --prepare DIR --nanogpt PATH" in s.rows[0].result
    assert s.passed()
    command, _ = prepare.run_call(".gpu-window", carried=True, budget_min=9, with_peers=True)
    assert "--budget-min 9 --peers .gpu-window/peers;" in command and len(command) <= prepare.COMMAND_LIMIT


@pytest.mark.slow
@pytest.mark.skipif(nanogpt_checkout() is None, reason="no nanoGPT checkout here (LMFORGE_NANOGPT)")
def test_nanogpt_trains_beside_lmforge_at_the_same_shape_in_the_cpu_smoke(tmp_path):
    commit = peers.copy_peer("nanogpt", nanogpt_checkout(), tmp_path / "peers" / "nanogpt")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "suite.py"), "--cpu-smoke", "--out",
                           str(out), "--rows", "throughput-quick,peer-nanogpt", "--peers", str(tmp_path / "peers"),
                           "--budget-min", "10", "--limit-scale", "3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    row = json.loads((out / "gpu_suite.json").read_text())["rows"][1]
    assert row["status"] == "ok", row
    d = row["detail"]
    assert d["commit"] == commit and d["like"] == "throughput-quick" and d["steps_timed"] == 5
    assert 0 < d["lmforge_over_peer"]["throughput-quick"] < 100 and 0 < d["mfu"]
    assert abs(d["first_loss"] - np.log(4096)) < 0.3  # (uniform tokens over the tiny vocabulary)
    log = (out / "peer-nanogpt.log").read_text()  # nanoGPT's own configurator took the row's shape
    for line in ("batch_size = 8", "block_size = 128", "n_layer = 4", "n_head = 6", "n_embd = 192",
                 "gradient_accumulation_steps = 1", "found vocab_size = 4096"):
        assert line in log, line
