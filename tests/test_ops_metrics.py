"""Operability: metrics files (JSONL + TensorBoard), progress output, health signals, MFU peak, profiler."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from lmforge.config import load_config
from lmforge.report.records import split_metrics
from lmforge.train.metrics import TRAIN_FIELDS, HealthMonitor, MetricsWriter, read_metrics
from lmforge.train.profiler import catalogue_name, catalogue_peak, device_peak, parse_steps
from lmforge.train.progress import Progress, format_line, is_rank0
from lmforge.train.trainer import Trainer

SMALL = {
    "model.vocab_size": 320, "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
    "data.seq_len": 32, "data.tokenizer_vocab_size": 320,
    "train.global_batch_size": 8, "train.micro_batch_size": 4, "train.steps": 12, "train.eval_every": 6,
    "train.eval_sequences": 8, "train.log_every": 5, "train.sample_tokens": 8, "train.precision": "fp32",
    "schedule.warmup_steps": 2, "optim.lr": 3e-3, "train.progress": "lines", "train.profile_steps": "3-4",
    "train.plot": False,
}


@pytest.fixture(scope="module")
def run(small_data, tmp_path_factory):
    """One 12-step run (log every 5: windows of 5, 5 and 2 steps), with its log lines captured."""
    out = tmp_path_factory.mktemp("ops") / "run"
    cfg = load_config("tiny", SMALL)
    logger = logging.getLogger("lmforge.train")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    torch.set_num_threads(1)
    try:
        result = Trainer(cfg, out_dir=out, data=small_data).fit()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return out, result, stream.getvalue()


def test_one_train_record_per_step_with_the_documented_fields(run):
    out, result, _ = run
    train, val, events = split_metrics(read_metrics(out / "metrics.jsonl"))
    raw_steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert raw_steps == list(range(1, 13))  # exactly one record per step, in order, no duplicates
    for rec in train:
        assert set(rec) == set(TRAIN_FIELDS), set(rec) ^ set(TRAIN_FIELDS)
        assert all(isinstance(rec[k], (int, float)) for k in TRAIN_FIELDS)
        assert rec["tokens"] == rec["step"] * 8 * 32
        assert rec["window_tokens_per_s"] > 0 and 0 < rec["window_mfu"] < 5 and rec["mem_gb"] > 0
        assert 0 <= rec["window_data_share"] < 1 and rec["data_s"] >= 0 and rec["window_ckpt_s"] == 0
    # records of one logging window share the window's numbers, and say so: window_* fields and the
    # window's step count (log_every 5 over 12 steps: windows of 5, 5 and 2 steps)
    assert [r["window_steps"] for r in train] == [5] * 10 + [2] * 2
    assert train[0]["window_tokens_per_s"] == train[4]["window_tokens_per_s"]
    assert train[0]["window_elapsed_s"] == train[4]["window_elapsed_s"] < train[5]["window_elapsed_s"]
    assert not {"tokens_per_s", "mfu", "step_time_s", "elapsed_s"} & set(train[0])  # no unqualified window numbers
    assert [r["step"] for r in val] == [0, 6, 12]
    assert all(set(r) == {"step", "val_loss", "val_perplexity"} for r in val)
    # a healthy run reports no spikes or skipped updates; only its final checkpoint
    assert [(e["event"], e["step"]) for e in events] == [("checkpoint", 12)], events
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mfu"] > 0 and summary["peak_flops"] > 0 and "measured" in summary["peak_source"]
    assert summary["hardware"]["torch"] == torch.__version__
    assert summary["checkpoint_s"] > 0  # the final safetensors save is timed


def test_tensorboard_gets_every_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = run
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for name in ("loss", "grad_norm", "lr", "window_tokens_per_s", "window_mfu", "window_data_share", "mem_gb"):
        assert f"train/{name}" in tags, name
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 13))
    assert [e.step for e in acc.Scalars("val/loss")] == [0, 6, 12]


def test_non_tty_progress_is_plain_log_lines(run):
    _, _, text = run
    lines = [ln for ln in text.splitlines() if ln.startswith("step ") and "/12 |" in ln]
    assert [ln.split(" |")[0] for ln in lines] == ["step 5/12", "step 10/12", "step 12/12"]
    for part in ("loss", "lr", "grad norm", "tok/s", "mfu", "mem", "data", "eta"):
        assert f"| {part}" in lines[0] or f" {part} " in lines[0], (part, lines[0])
    assert "\r" not in text and "\x1b[" not in text  # no bar redraws, no colour codes
    assert "MFLOPs/token (6N + 12*L*d*s) against" in text and "measured" in text  # MFU denominator stated


def test_progress_modes_and_rank0(monkeypatch):
    rec = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "window_tokens_per_s": 1234.0, "window_mfu": 0.1,
           "mem_gb": 1.0, "window_data_share": 0.02}
    assert format_line(10, 100, rec, 65).startswith("step 10/100 | loss 2.5000 | lr 1.00e-03 | grad norm 0.50")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = Progress(100, "auto", stream=tty, rank0=True)
    assert p.mode == "bar"
    p.update(10, rec, 65)
    p.close()
    assert "loss=2.5000" in tty.getvalue() and "10/100" in tty.getvalue()
    assert Progress(100, "auto", stream=io.StringIO(), rank0=True).mode == "lines"

    # rank != 0 of an initialised process group: silent, and no metrics files
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert not is_rank0()
    quiet = Tty()
    p = Progress(100, "bar", stream=quiet)
    assert p.mode == "none"
    p.update(10, rec, 65)
    p.write("hello")
    p.close()
    assert quiet.getvalue() == ""


def test_metrics_writer_disabled_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl", enabled=False)
    w.write({"step": 1, "loss": 1.0})
    w.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_health_signals():
    import math
    import random

    rng = random.Random(0)
    mon = HealthMonitor(spike_threshold=0.3, window=20, growth_factor=2.0)
    events = []
    for step in range(1, 201):  # healthy: falling noisy loss, flat grad norm
        events += mon.update(step, 5.0 * math.exp(-step / 80) + 2.0 + 0.05 * rng.random(), 1.0 + 0.2 * rng.random())
    assert events == []
    spike = mon.update(201, 6.0, 1.0)
    assert [e["event"] for e in spike] == ["loss_spike"] and "step 201" in spike[0]["message"]
    growth = []
    for step in range(202, 302):  # grad norm climbing steadily
        growth += mon.update(step, 2.1, 1.0 * 1.03 ** (step - 202))
    kinds = {e["event"] for e in growth}
    assert kinds == {"grad_norm_growth"}, kinds
    assert len(growth) <= 100 // 20  # at most one warning per window
    assert mon.update(400, float("nan"), float("inf")) == []  # non-finite values are not events


def test_mfu_peak_from_catalogue_and_measured_on_cpu():
    assert catalogue_name("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert catalogue_name("NVIDIA H100 PCIe") == "H100-PCIe"
    assert catalogue_name("NVIDIA H200") == "H200"
    assert catalogue_name("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert catalogue_name("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert catalogue_name("NVIDIA GeForce RTX 4090") is None
    assert catalogue_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989e12)
    assert catalogue_peak("NVIDIA H200", "bf16") == pytest.approx(989e12)
    assert catalogue_peak("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 units: not a made-up number
    peak = device_peak(torch.device("cpu"), "fp32")
    assert peak.measured and 1e8 < peak.flops < 1e14 and "measured" in peak.source


def test_profile_steps_trace(run):
    out, _, text = run
    assert parse_steps("3-4") == [3, 4] and parse_steps("2,5-6") == [2, 5, 6] and parse_steps("") == []
    with pytest.raises(ValueError, match="profile_steps"):
        parse_steps("4-2")
    trace = out / "profile" / "trace_steps_3-4.json"
    assert trace.is_file() and (out / "profile" / "summary_steps_3-4.txt").is_file()
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::mm" in str(e.get("name", "")) or "aten::addmm" in str(e.get("name", "")) for e in events)


def test_wandb_sink_is_offline_and_optional(tmp_path, monkeypatch, caplog):
    import sys
    import types

    from lmforge.train.metrics import make_sinks

    calls = {}

    class Run:
        def log(self, data, step):
            calls.setdefault("log", []).append((step, data))

        def finish(self):
            calls["finished"] = True

    def init(**kw):
        calls["init"] = kw
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    w = MetricsWriter(tmp_path / "m.jsonl", make_sinks(tmp_path, tensorboard=False, wandb=True, config={"a": 1}))
    w.write({"step": 3, "loss": 2.0, "grad_norm": 1.0})
    w.write({"step": 3, "val_loss": 2.5, "val_perplexity": 12.2})
    w.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["config"] == {"a": 1}
    assert calls["log"] == [(3, {"train/loss": 2.0, "train/grad_norm": 1.0}),
                            (3, {"val/loss": 2.5, "val/perplexity": 12.2})]
    assert calls["finished"]

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: skipped with a note, no crash
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        assert make_sinks(tmp_path, tensorboard=False, wandb=True) == []
    assert "pip install wandb" in caplog.text
