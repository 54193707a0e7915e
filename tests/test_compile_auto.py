"""train.compile = "auto" (lmforge.config.rules.resolve_compile): per-block torch.compile on where it
was measured faster (CUDA with Triton), off on CPUs (the compile costs a short run more than it
saves) and for Mixture-of-Experts models; an explicit true / false is kept. A CPU run with the
default compiles nothing and says so in its log."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import ConfigError, load_config
from lmforge.config import rules
from lmforge.config.rules import resolve_compile
from lmforge.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"model.vocab_size": 320, "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
         "data.seq_len": 32, "data.tokenizer_vocab_size": 320, "train.global_batch_size": 8,
         "train.micro_batch_size": 8, "train.precision": "fp32", "train.eval_sequences": 8, "train.sample_tokens": 0}
MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2}


def test_auto_is_on_on_cuda_and_off_on_cpu(monkeypatch):
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    cfg = load_config("tiny", SMALL)
    assert cfg.train.compile == "auto"  # the default
    on, why = resolve_compile(cfg, "cuda", (9, 0))
    assert on and "auto: on" in why and "RESULTS.md" in why
    assert resolve_compile(cfg, "cuda")[0]  # capability unknown: on
    off, why = resolve_compile(cfg, "cpu")
    assert not off and "auto: off on cpu" in why and "train.compile = true" in why
    assert not resolve_compile(cfg, "mps")[0]  # never measured: off


def test_auto_is_off_where_compile_cannot_run_or_is_not_known_to_pay(monkeypatch):
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    moe = load_config("tiny", {**SMALL, **MOE})
    off, why = resolve_compile(moe, "cuda", (9, 0))
    assert not off and "Mixture-of-Experts" in why
    tp = load_config("tiny", {**SMALL, "parallel.tp": 2})
    off, why = resolve_compile(tp, "cuda", (9, 0))  # (compiled blocks failed under TP: parity_layouts.py)
    assert not off and "parallel.tp > 1" in why
    fsdp = load_config("tiny", {**SMALL, "parallel.dp_shard": 2, "train.micro_batch_size": 4})
    assert resolve_compile(fsdp, "cuda", (9, 0))[0]  # FSDP2: on (parity_layouts.py --case fsdp2-compile)
    off, why = resolve_compile(load_config("tiny", SMALL), "cuda", (6, 1))  # Pascal: Triton needs >= 7.0
    assert not off and "compute capability 6.1" in why
    monkeypatch.setattr(rules, "triton_installed", lambda: False)
    off, why = resolve_compile(load_config("tiny", SMALL), "cuda", (9, 0))
    assert not off and "triton" in why


def test_the_chunked_loss_compiles_where_compile_can(monkeypatch):
    """The chunked loss's compiled elementwise part (lmforge.model.loss.use_compiled_chunk) follows the
    same check as train.compile = "auto" (rules.gpu_compile_blocker): a CUDA device, Triton, and a
    compute capability of at least 7.0; never on the CPU."""
    import torch

    from lmforge.model.loss import use_compiled_chunk

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert use_compiled_chunk(cuda) and not use_compiled_chunk(cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    assert not use_compiled_chunk(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(rules, "triton_installed", lambda: False)
    assert not use_compiled_chunk(cuda)


@pytest.mark.parametrize("value", [True, False])
def test_an_explicit_value_is_kept(monkeypatch, value):
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    for over in (SMALL, {**SMALL, **MOE}, {**SMALL, "parallel.tp": 2}):
        cfg = load_config("tiny", {**over, "train.compile": value})
        for device in ("cpu", "cuda"):
            assert resolve_compile(cfg, device, (6, 1)) == (value, f"train.compile = {str(value).lower()}")


@pytest.mark.parametrize("value", ["sometimes", 1, "yes"])
def test_a_bad_value_names_the_key_and_the_allowed_values(value):
    with pytest.raises(ConfigError, match=rf"train.compile = {value!r} must be true or false, or 'auto'"):
        load_config("tiny", {"train.compile": value})
    assert load_config("tiny", {"train.compile": "auto"}).train.compile == "auto"


@pytest.mark.parametrize("setting, compiled", [("auto", False), (True, True)])
def test_a_cpu_run_with_the_default_compiles_no_block(small_data, tmp_path, caplog, setting, compiled):
    """nn.Module.compile() sets each block's _compiled_call_impl (compiling lazily, at the first
    forward: this test pays no compile); the default leaves every block eager on the CPU."""
    cfg = load_config("tiny", {**SMALL, "train.device": "cpu", "train.compile": setting})
    trainer = Trainer(cfg, out_dir=tmp_path / "run", data=small_data)
    with caplog.at_level(logging.INFO, logger="lmforge.parallel"):
        trainer.setup()
    blocks = list(trainer.model.blocks.values())
    assert blocks and all((b._compiled_call_impl is not None) == compiled for b in blocks)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compile:")]
    why = "auto: off on cpu" if setting == "auto" else "train.compile = true"
    assert len(said) == 1 and said[0].startswith(f"compile: per-block torch.compile {'on' if compiled else 'off'} ({why}")


@pytest.mark.slow
def test_lmforge_train_with_compile_true_trains_validates_and_samples_on_the_cpu(tmp_path):
    """`lmforge train --train.compile true` end to end with sampling on (the GPU suite's training rows
    pin compile off, so this is where compiled blocks meet evaluation and generation, whose shapes
    change token by token): the run finishes, says its blocks are compiled, and writes its sample."""
    out = tmp_path / "run"
    args = ["--train.compile", "true", "--train.sample_tokens", "8", "--train.steps", "2", "--model.n_layers", "1",
            "--model.dim", "64", "--model.n_heads", "2", "--data.seq_len", "32", "--train.micro_batch_size", "4",
            "--train.global_batch_size", "4", "--train.eval_sequences", "8", "--train.eval_every", "0",
            "--checkpoint.every_steps", "0", "--train.plot", "false", "--train.progress", "lines",
            "--train.device", "cpu", "--train.precision", "fp32", "--train.threads", "1", "--train.out_dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lmforge", "train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "compile: per-block torch.compile on (train.compile = true" in proc.stderr + proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["sample"] and (out / "sample.txt").read_text().strip()
