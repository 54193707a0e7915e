"""No rank ever holds the whole model: at start-up, at evaluation and at the final save, each rank's
memory grows by its own share of the model, which falls as 1/n with the number of ranks that split
it, plus a working set of a few parameters or blocks.

tests/memory_phases_driver.py measures each phase's peak resident growth per rank (the kernel's
high-water mark, reset before each phase) for a 52M-parameter model (208 MB in fp32: 16 blocks of
13 MB, no parameter over 2.9 MB), so that one whole model per rank, which the layouts held at
start-up, at every validation under TP / PP and at the final save before, would stand out by
hundreds of MB. glibc's malloc keeps freed heap memory and reuses it unevenly (the resident size
then says more about fragmentation than about the tensors alive), so the launches fix its mmap
threshold (MALLOC_MMAP_THRESHOLD_): every tensor of 64 kB or more is its own mapping, returned on
free. DDP, which replicates the model by design, is the check that the measurement sees a whole
model where there is one (its gradient buckets are a second one).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.test_parallel_dp import corpus, launcher  # noqa: F401  (module-scoped corpus fixture)

DRIVER = str(Path(__file__).with_name("memory_phases_driver.py"))
MODEL = {"model.vocab_size": 512, "model.dim": 512, "model.n_layers": 16, "model.n_heads": 8, "model.max_seq_len": 64,
         "model.tie_embeddings": False, "data.seq_len": 64, "data.tokenizer_vocab_size": 320,
         "train.precision": "fp32", "train.threads": 1}
MB = 2**20


def measure(corpus: Path, tmp: Path, nproc: int, cases: dict) -> dict:  # noqa: F811
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    cases = {name: {**MODEL, **c} for name, c in cases.items()}
    # (plain interpreters: a warm start's fork would hold its server's pages, which count in resident memory)
    proc = subprocess.run(launcher(nproc, torchrun=True, warm=False) + [DRIVER, str(corpus), str(tmp),
                                                                        json.dumps(cases)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return {name: [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(nproc)] for name in cases}


def check_sharded(name: str, ranks: list[dict], split: int, plan: dict) -> None:
    """Start-up: this rank's 1/split of the model plus a few parameters; evaluation: a few blocks (FSDP2
    gathers one block at a time, and prefetches the next); the final save: a few parameters. And
    `lmforge plan`'s phases (lmforge.plan.memory.phase_peaks) agree: the start-up growth is the planned
    device bytes plus at most the planned host working set of the initialisation; the validation and
    save growth are at most the planned working sets plus one block (FSDP2's all-gather buffer of
    the prefetched block, which the plan does not count) and 16 MB of allocator and process noise.
    The EMA of the weights (lmforge.train.ema) is this rank's share too, as planned (`ema`), and a
    validation with it swapped in holds what a plain one does (the exchange: one tensor at a time)."""
    for r, rec in enumerate(ranks):
        model, largest, block = rec["model_bytes"], rec["largest_param"], rec["model_bytes"] / MODEL["model.n_layers"]
        assert rec["init"] < model / split + 4 * largest + 16 * MB, (name, r, rec["init"] / MB, model / split / MB)
        assert rec["eval"] < 4 * block + 16 * MB, (name, r, rec["eval"] / MB, block / MB)
        assert rec["save"] < 4 * largest + 16 * MB, (name, r, rec["save"] / MB, largest / MB)
        assert plan["startup"] <= rec["init"] <= plan["startup"] + plan["startup_host"] + 16 * MB, (name, r, rec, plan)
        assert rec["eval"] <= plan["validation_working_set"] + block + 16 * MB, (name, r, rec, plan)
        assert rec["save"] <= plan["final_save_working_set"] + 16 * MB, (name, r, rec, plan)
        assert plan["ema"] - 16 * MB <= rec["ema"] <= plan["ema"] + 16 * MB, (name, r, rec["ema"] / MB, plan["ema"] / MB)
        assert rec["ema_eval"] <= plan["validation_working_set"] + block + largest + 16 * MB, (name, r, rec, plan)


def planned(layout: str) -> dict:
    """`lmforge plan`'s phases (lmforge convention) for MODEL under a layout (lmforge.plan.memory.Layout)."""
    from lmforge.config import load_config
    from lmforge.plan.memory import Layout, estimate_memory

    cfg = load_config("tiny", MODEL).model
    plan_layout = Layout.parse(layout, precision="fp32", micro_batch=1, grad_accum=1, ema=True)
    mem = estimate_memory(cfg, plan_layout, "adamw", MODEL["data.seq_len"], weights="lmforge")
    return {**mem.phases, "ema": mem.ema}


@pytest.mark.slow
def test_two_ranks_hold_half_the_model_at_start_up_evaluation_and_save(corpus, tmp_path):  # noqa: F811
    got = measure(corpus, tmp_path, 2, {
        "fsdp2": {"parallel.dp_shard": 2},
        "tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "pp2": {"parallel.pp": 2},
        "ddp2": {"parallel.dp_replicate": 2},
    })
    for name, plan in (("fsdp2", "dp=2,zero=3"), ("tp2-sp", "tp=2,sp=true"), ("pp2", "pp=2")):
        check_sharded(name, got[name], 2, planned(plan))
    for rec in got["ddp2"]:  # whole replicas by design: the measurement does see a whole model (twice: + buckets)
        assert rec["init"] > 1.9 * rec["model_bytes"], rec
        assert rec["ema"] > 0.95 * rec["model_bytes"], rec  # (and a whole EMA, as the weights are whole)


@pytest.mark.slow
def test_four_ranks_hold_a_quarter_of_the_model(corpus, tmp_path):  # noqa: F811
    got = measure(corpus, tmp_path, 4, {
        "fsdp4": {"parallel.dp_shard": 4},
        "fsdp2xtp2": {"parallel.dp_shard": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
        "tp2xpp2": {"parallel.tp": 2, "parallel.pp": 2},
    })
    for name, plan in (("fsdp4", "dp=4,zero=3"), ("fsdp2xtp2", "dp=2,zero=3,tp=2,sp=true"), ("tp2xpp2", "tp=2,pp=2")):
        check_sharded(name, got[name], 4, planned(plan))
