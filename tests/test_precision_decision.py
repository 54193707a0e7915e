"""train.precision decided once (issue 31, part 6): `auto` from the hardware (CPU flags, CUDA bf16
support), never from a timing; rank 0 decides for every rank; the checkpoint records it and a
resumed `auto` run keeps it; the fp16 rule of TP / PP sees what `auto` resolved to; MFU never
exceeds 100%. The CPU's hardware is told through the `lmforge.train.precision.cpu_flags` seam."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from lmforge.config import ConfigError, load_config
from lmforge.config.rules import check_resolved_precision
from lmforge.train import precision as precision_module
from lmforge.spec.precision import cpu_bf16_units, cpu_flags, hardware_precision
from lmforge.train.precision import resolve_precision
from lmforge.train.trainer import Trainer
from tests.test_gpu_semantics import run_driver
from tests.test_parallel_dp import corpus  # noqa: F401  (module-scoped corpus fixture)
from tests.test_train import SMALL

CPU = torch.device("cpu")
SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ZEN4 = {"avx2", "avx512f", "avx512_bf16"}
AVX2_ONLY = {"avx", "avx2", "fma", "f16c"}


def tell_cpu(monkeypatch, flags: set[str]) -> None:
    monkeypatch.setattr(precision_module, "cpu_flags", lambda: set(flags))


def test_cpu_flags_decide_auto(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16", "amx_tile"}  # the first CPU's line
    assert cpu_flags(tmp_path / "missing") == set()  # (not Linux: unknown, so auto stays fp32)
    assert cpu_bf16_units(SAPPHIRE_RAPIDS) == ["AMX-BF16", "AVX512-BF16"]
    assert cpu_bf16_units(ZEN4) == ["AVX512-BF16"] and cpu_bf16_units(AVX2_ONLY) == []
    assert hardware_precision("cpu", flags=SAPPHIRE_RAPIDS).name == "bf16"
    assert hardware_precision("cpu", flags=ZEN4).name == "bf16"
    assert hardware_precision("cpu", flags=AVX2_ONLY).name == "fp32"
    assert hardware_precision("cpu").name == "fp32"
    assert hardware_precision("cuda", cuda_bf16=True).name == "bf16-pure"  # A100, H100: measured faster
    assert hardware_precision("cuda", cuda_bf16=False).name == "fp16"  # V100, T4


def test_auto_reads_the_flags_and_takes_no_timing(monkeypatch):
    from lmforge.train import profiler

    monkeypatch.setattr(profiler, "measure_matmul_flops", lambda *a, **k: pytest.fail("auto timed a matmul"))
    tell_cpu(monkeypatch, AVX2_ONLY)
    assert resolve_precision("auto", CPU).name == "fp32"
    tell_cpu(monkeypatch, ZEN4)
    got = resolve_precision("auto", CPU)
    assert got.name == "bf16" and "AVX512-BF16" in got.reason and not got.slow


def test_checkpoint_precision_kept_under_auto_and_overridden_explicitly(monkeypatch):
    tell_cpu(monkeypatch, AVX2_ONLY)  # this machine alone would choose fp32
    kept = resolve_precision("auto", CPU, saved="bf16")
    assert kept.name == "bf16" and kept.slow and not kept.changed  # (emulated here: flagged)
    assert "resumed checkpoint trained in bf16" in kept.reason and "would choose fp32" in kept.reason
    explicit = resolve_precision("fp32", CPU, saved="bf16")
    assert explicit.name == "fp32" and explicit.changed and "overrides the bf16" in explicit.reason
    same = resolve_precision("fp32", CPU, saved="fp32")
    assert same.name == "fp32" and not same.changed and same.reason == "as configured"


def test_bf16_pure_is_chosen_explicitly_and_kept_on_resume(monkeypatch):
    """`auto` picks bf16-pure on CUDA only (measured faster than autocast on an H100; on the CPU it was
    measured no faster than autocast: benchmarks/RESULTS.md); an explicit bf16-pure is used, flagged where bf16 is
    emulated; a checkpoint trained in it is resumed in it under `auto`, or in bf16 autocast (its
    fp32 masters are the same state) when that is asked for."""
    for flags in (SAPPHIRE_RAPIDS, ZEN4, AVX2_ONLY):
        tell_cpu(monkeypatch, flags)
        assert resolve_precision("auto", CPU).name != "bf16-pure"
        got = resolve_precision("bf16-pure", CPU)
        assert got.name == "bf16-pure" and got.slow == (flags == AVX2_ONLY)
    assert hardware_precision("cuda", cuda_bf16=True).name == "bf16-pure"
    kept = resolve_precision("auto", CPU, saved="bf16-pure")
    assert kept.name == "bf16-pure" and not kept.changed
    other = resolve_precision("bf16", CPU, saved="bf16-pure")
    assert other.name == "bf16" and other.changed and "overrides the bf16-pure" in other.reason


def test_fp16_rule_checks_the_resolved_precision(monkeypatch):
    """`auto` on a V100 resolves to fp16, which TP / PP refuse: a config rule cannot see that, so it
    is checked once resolved (the trainer's decide_precision), naming the key, the value and the fix."""
    for layout in ({"parallel.tp": 2}, {"parallel.pp": 2, "model.tie_embeddings": False, "train.micro_batch_size": 4}):
        cfg = load_config("tiny", {**SMALL, "train.precision": "auto", **layout})  # (valid as a config)
        with pytest.raises(ConfigError, match=r"train.precision = 'auto' resolved to 'fp16' \(GPU lacks bf16.*"
                                              r"train.precision = 'fp32'"):
            check_resolved_precision(cfg, "fp16", hardware_precision("cuda", cuda_bf16=False).reason)
        check_resolved_precision(cfg, "bf16")
        check_resolved_precision(cfg, "fp32")
    with pytest.raises(ConfigError, match="train.precision = 'fp16', but fp16"):  # the early, literal check
        load_config("tiny", {**SMALL, "train.precision": "fp16", "parallel.tp": 2})

    # the trainer's decision runs the rule (on every rank, after rank 0's answer is broadcast)
    trainer = Trainer(load_config("tiny", {**SMALL, "train.precision": "auto", "parallel.tp": 2}))
    trainer.dist, trainer.device, trainer.resumed_from = SimpleNamespace(distributed=False), CPU, None
    monkeypatch.setattr(precision_module, "detect_hardware_precision",
                        lambda device: hardware_precision("cuda", cuda_bf16=False))  # a V100's answer
    with pytest.raises(ConfigError, match="resolved to 'fp16'"):
        trainer.decide_precision()


def test_a_resumed_run_keeps_the_checkpoints_precision(small_data, tmp_path, monkeypatch, caplog):
    """bf16 chosen on a machine with bf16 units is recorded in the checkpoint; resumed under `auto` on
    one without them the run stays bf16; an explicit train.precision wins, with a warning."""
    run = tmp_path / "run"
    tiny = {**SMALL, "train.precision": "auto", "train.steps": 2, "train.sample_tokens": 0, "train.eval_sequences": 8,
            "schedule.warmup_steps": 1, "train.plot": False, "train.tensorboard": False}
    tell_cpu(monkeypatch, ZEN4)
    first = Trainer(load_config("tiny", tiny), out_dir=run, data=small_data)
    first.fit()
    assert first.precision.name == "bf16"
    meta = json.loads(next((run / "checkpoints").glob("*/meta.json")).read_text())
    assert meta["precision"] == "bf16"

    tell_cpu(monkeypatch, AVX2_ONLY)  # (bf16 kept here is emulated: that warns too)
    for setting, want, says in (("auto", "bf16", "the resumed checkpoint trained in bf16"),
                                ("fp32", "fp32", "overrides the bf16 the resumed checkpoint trained in")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmforge.train"):
            again = Trainer(load_config("tiny", {**tiny, "train.steps": 4, "train.precision": setting}), out_dir=run,
                            data=small_data)
            again.setup()
            again.ckpt.close()
        assert again.resumed_from is not None and again.precision.name == want, setting
        lines = [r for r in caplog.records if r.getMessage().startswith("precision:")]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING and says in lines[0].getMessage(), lines


def test_mfu_never_exceeds_100_percent():
    from lmforge.train.metrics import ThroughputWindow, Timers
    from lmforge.train.profiler import Peak

    peak = Peak(100.0, "measured fp32 matmul", "cpu", True)
    assert peak.utilisation(50.0) == 0.5 and peak.utilisation(100.0, devices=2) == 0.5
    assert peak.utilisation(800.0, devices=2) == 1.0  # a probe that read low: the peak rises to the run's rate
    assert peak.flops == 400.0 and peak.raised_from == 100.0 and "raised from" in peak.source
    assert peak.utilisation(200.0) == 0.5  # later windows against the raised peak
    window = ThroughputWindow(flops_per_token=1e12, peak=Peak(1e9, "measured", "cpu", True), world_size=2,
                              device=CPU, timers=Timers())
    window.add_step(tokens=10_000, data_s=0.0)
    assert window.take()["window_mfu"] == 1.0


@pytest.mark.slow
def test_every_rank_trains_in_rank_0s_precision(corpus, tmp_path):  # noqa: F811
    """Two FSDP2 ranks, told different hardware (rank 0 has AVX512-BF16, rank 1 does not): both
    train in rank 0's bf16 (the FSDP all-gathers in one dtype) and divide MFU by rank 0's peak.
    Deciding per rank, rank 1 chose fp32 and the job died in gloo."""
    ranks = run_driver("precision", corpus, tmp_path, 2, **{"train.precision": "auto", "parallel.dp_shard": 2,
                                                            "train.steps": 2, "schedule.warmup_steps": 1,
                                                            "checkpoint.resume": "none"})
    assert [r["precision"] for r in ranks] == ["bf16", "bf16"], ranks
    assert [r["told"] for r in ranks] == ["bf16", "fp32"] and ranks[0]["peak"] == ranks[1]["peak"], ranks
    assert all(r["loss"] == ranks[0]["loss"] for r in ranks), ranks
    assert all(r["copied"] == 0 for r in ranks), ranks  # FSDP2 gathers in bf16 itself: the step copies nothing
