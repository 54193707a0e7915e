"""train.micro_batch_size = "auto" (lmforge.plan.micro_batch): the largest micro-batch the layout can
run whose planned peak fits in 85% of the memory free at run start; on a CPU at most 16; chosen by
the trainer before its loaders (lmforge.train.micro_batch) and logged, by `lmforge plan` for the GPUs it
plans."""

from __future__ import annotations

import logging

import pytest

from lmforge.config import ConfigError, load_config
from lmforge.config.rules import valid_micro_batches
from lmforge.cli.plan import plan_main
from lmforge.plan.memory import estimate_memory
from lmforge.plan.micro_batch import AUTO_HEADROOM, CPU_MAX_MICRO_BATCH, choose_micro_batch, layout_for_config

SMALL = {"model.vocab_size": 320, "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
         "data.seq_len": 32, "data.tokenizer_vocab_size": 320, "train.global_batch_size": 8,
         "train.micro_batch_size": "auto", "train.precision": "fp32", "train.eval_sequences": 8, "train.sample_tokens": 0}


def _planned(cfg, m: int, precision: str = "bf16", device: str = "cuda") -> float:
    return estimate_memory(cfg.model, layout_for_config(cfg, precision, device, m), cfg.optim.name,
                           cfg.data.seq_len).total


def test_auto_takes_the_largest_micro_batch_that_fits():
    """The 1B preset (512 sequences of 2048 tokens a step) on one GPU: the largest divisor of 512 whose
    plan fits in 85% of the memory free; the next larger one does not. Less memory, a smaller size."""
    cfg = load_config("llama-1b", {"train.micro_batch_size": "auto"})
    sizes = valid_micro_batches(cfg)
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    for free in (80e9, 40e9):
        choice = choose_micro_batch(cfg, "bf16", "cuda", free)
        budget = AUTO_HEADROOM * free
        assert choice.budget_bytes == budget and choice.planned_bytes == _planned(cfg, choice.size) <= budget
        bigger = sizes[sizes.index(choice.size) + 1]
        assert _planned(cfg, bigger) > budget
        assert f"auto -> {choice.size}" in choice.reason and f"{bigger} would need" in choice.reason
    assert choose_micro_batch(cfg, "bf16", "cuda", 40e9).size < choose_micro_batch(cfg, "bf16", "cuda", 80e9).size
    tiny = choose_micro_batch(cfg, "bf16", "cuda", 1e9)  # not even one sequence fits: the smallest, said so
    assert tiny.size == 1 and "does NOT fit" in tiny.reason


def test_auto_divides_the_batch_per_rank_and_fills_the_pipeline():
    """Only sizes the layout can run: divisors of global / dp, >= pp micro-batches a step (a multiple of
    pp interleaved); the CPU caps at 16; no valid size is a config error naming the key."""
    cfg = load_config("tiny", {**SMALL, "train.global_batch_size": 96, "parallel.dp_replicate": 2})
    assert valid_micro_batches(cfg) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert choose_micro_batch(cfg, "fp32", "cpu", 20e9).size == CPU_MAX_MICRO_BATCH
    assert choose_micro_batch(cfg, "fp32", "cuda", 80e9).size == 48
    piped = load_config("tiny", {**SMALL, "train.global_batch_size": 16, "parallel.pp": 2,
                                 "model.tie_embeddings": False})
    assert valid_micro_batches(piped) == [1, 2, 4, 8]  # >= 2 micro-batches of the 16 sequences
    with pytest.raises(ConfigError, match=r"train.micro_batch_size = 'auto'.*train.global_batch_size = 9"):
        load_config("tiny", {**SMALL, "train.global_batch_size": 9, "parallel.dp_replicate": 2})
    with pytest.raises(ConfigError, match=r"train.micro_batch_size = 'fast' must be an integer, or 'auto'"):
        load_config("tiny", {**SMALL, "train.micro_batch_size": "fast"})
    with pytest.raises(ConfigError, match=r"train.micro_batch_size = 0 must be >= 1"):
        load_config("tiny", {**SMALL, "train.micro_batch_size": 0})


def test_a_run_chooses_its_micro_batch_before_its_loaders_and_logs_why(small_data, tmp_path, caplog, monkeypatch):
    from lmforge.train import micro_batch
    from lmforge.train.trainer import Trainer

    cfg = load_config("tiny", {**SMALL, "train.device": "cpu"})
    trainer = Trainer(cfg, out_dir=tmp_path / "run", data=small_data)
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        trainer.setup()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train.micro_batch_size:")]
    assert len(said) == 1 and "auto -> 8" in said[0] and "free on the cpu device" in said[0]
    assert trainer.cfg.train.micro_batch_size == 8 and trainer.cfg.grad_accum_steps == 1
    assert trainer.loader.next_batch()[0].shape[0] == 8
    trainer.close()
    # little memory free: a smaller size that fits
    need = _planned(load_config("tiny", {**SMALL, "train.micro_batch_size": 8}), 2, "fp32", "cpu")
    monkeypatch.setattr(micro_batch, "free_memory_bytes", lambda device: need / AUTO_HEADROOM)
    small = Trainer(load_config("tiny", {**SMALL, "train.device": "cpu"}), out_dir=tmp_path / "run2", data=small_data)
    small.setup()
    assert small.cfg.train.micro_batch_size == 2 and small.cfg.grad_accum_steps == 4
    small.close()


def test_lmforge_plan_fits_an_auto_micro_batch_on_the_gpus_it_plans(capsys):
    assert plan_main(["--model", "llama-1b", "--gpus", "H100", "--set", "train.micro_batch_size=auto",
                      "--weights", "lmforge"]) == 0
    out = capsys.readouterr().out
    assert "note: train.micro_batch_size = auto ->" in out and "85% of 80 GB" in out
    cfg = load_config("llama-1b", {"train.micro_batch_size": "auto"})
    chosen = choose_micro_batch(cfg, "bf16", "cuda", 80e9).size
    assert f"mb={chosen}," in out.splitlines()[0]
