"""Tensor, pipeline and 2-D/3-D parallelism, and async SGD, on CPU/gloo against one process.

Real `torchrun` jobs of `lmforge train` on a tiny prepared corpus (4 layers so that interleaved
1F1B has 2 ranks x 2 chunks; untied: tests/test_parallel_pp_tied.py pipelines tied ones). Every
layout sees the same seed, data and global batch (8 sequences of 32
tokens per step, micro-batches of 2; 4 in the 2-process TP runs: `TP_MICRO`) as the one-process reference, which runs once per module; the
per-step training losses and gradient norms (before clipping) of 10 steps (`STEPS`) must agree to 1e-5
relative (fp32; only the reduction order differs), and so must the validation losses (computed on
the sharded model itself, lmforge.parallel.inference), the EMA of the weights, its validation loss
and the scores of an in-loop multiple-choice task (tests/test_parallel_dp.py's `assert_extras_match`). `data.mask_doc_boundaries = true` makes
micro-batches hold unequal token counts, so the global-token-count normalisation is exercised. These runs use AdamW clipped at 1.0,
whose loss curve sees the overall scale of the gradient only weakly; the gradient norm sees it
directly, and the launches of `WITH_SGD` also train 6 steps of plain SGD without clipping
(tests/test_parallel_dp.py's `SGD`), whose steps are the gradient itself.

The zero-bubble schedules (interleaved-zb at v = 1 and 2, zbv, dualpipev: 4 stages on 2 ranks, a V
for the last two) run without and with activation checkpointing, and composed
with FSDP2, HSDP's replicas, TP and CP in one 4-rank launch (`ALSO`); a zbv checkpoint resumes under
another schedule's placement and in one process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lmforge.config import ConfigError, load_config
from tests.test_parallel_dp import (EMA, SGD, STEPS, assert_extras_match, assert_runs_match,  # noqa: F401
                                    corpus, docs_corpus, docs_run, losses, run_logs, tasks, train,  # (corpus,
                                    train_runs)  # docs_corpus: module-scoped fixtures)

# The separate q/k/v projections (model.fused_qkv = false): at this seed the fused layout's one
# larger matmul rounds differently in one process and in TP's halves, and step 7's gradient-norm
# spike (4.8, twice its neighbours) amplifies that to 1.2e-5 relative in TP=2's gradient norm
# (steps 4-13, back to ~1e-7 by step 14; losses within 7e-7; seeds 1 and 2: 4.5e-7, as separate).
# The fused layout under TP, SP, CP and FSDP2 x TP is held to the same tolerance against one
# process in tests/test_fused_qkv.py.
MP = {"model.n_layers": 4, "model.tie_embeddings": "false", "model.fused_qkv": "false"}
TOL = 1e-5  # relative, per step
# The AdamW runs' length, tests/test_parallel_dp.py's `STEPS` (10): they take in step 7's gradient-norm spike
# (the step that amplifies reordered sums most). (Not in MP: other files' runs take MP and set their own steps.)


def val_losses(run: Path) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in recs if "val_loss" in r]


@pytest.fixture(scope="module")
def reference(corpus, docs_corpus, tmp_path_factory) -> Path:  # noqa: F811
    """One process: ROOT/adamw (the preset's optimizer, `STEPS`), ROOT/sgd (`SGD`) and ROOT/docs (document
    masking on best-fit rows: tests/test_parallel_dp.py's `DOCS`), and the one-process side of the other
    tests' comparisons (ROOT/pairs/<name> of `PAIRS`, ROOT/family/single: `FAMILY`), one launch."""
    root = tmp_path_factory.mktemp("mp-single")
    proc = train_runs(corpus, {root / "adamw": {**MP, **STEPS, **EMA, **tasks(corpus)}, root / "sgd": {**MP, **SGD},
                               root / "docs": {**MP, **docs_run(docs_corpus)},
                               **{root / "pairs" / name: own for name, own in PAIRS.items()},
                               root / "family" / "single": FAMILY}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(losses(root / "adamw")) == list(range(1, STEPS["train.steps"] + 1))
    return root


LAYOUTS = {  # name: (processes, overrides)
    "tp2": (2, {"parallel.tp": 2}),
    "tp2-sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": "true"}),
    "pp2-gpipe": (2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    "pp2-1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    "pp2-interleaved-v2": (2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                               "parallel.pp_virtual_stages": 2}),
    "fsdp2xtp2": (4, {"parallel.dp_shard": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true"}),
    "tp2xpp2": (4, {"parallel.tp": 2, "parallel.pp": 2}),
    "dp2xpp2": (4, {"parallel.dp_replicate": 2, "parallel.pp": 2}),
    # the zero-bubble schedules (split backward: input gradients first, weight gradients later)
    "pp2-zb-h1": (2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-zb"}),
    "pp2-interleaved-zb-v2": (2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-zb",
                                  "parallel.pp_virtual_stages": 2}),
    "pp2-zbv": (2, {"parallel.pp": 2, "parallel.pp_schedule": "zbv"}),  # (V: rank 0 holds stages 0 and 3)
    "pp2-dualpipev": (2, {"parallel.pp": 2, "parallel.pp_schedule": "dualpipev"}),
    # ... composed with FSDP2, HSDP's replicas, TP and CP (4 ranks; one micro-batch per data-parallel rank)
    "fsdp2xpp2-zbv": (4, {"parallel.dp_shard": 2, "parallel.pp": 2, "parallel.pp_schedule": "zbv",
                          "train.micro_batch_size": 1}),
}

WITH_SGD = ("tp2-sp", "pp2-1f1b", "fsdp2xtp2", "tp2xpp2", "dp2xpp2")  # also train `SGD` in their launch
# Tensor parallelism on the CPU costs per micro-batch (DTensor's dispatch and ~20 gloo collectives each:
# a TP=2 step ~12x one process's CPU time), so its 2-process runs (the TP layouts' and `PAIRS`) take the
# global batch in 2 micro-batches of 4 instead of 4 of 2: the step still accumulates micro-batches of
# unequal token counts, against the one-process reference's 4 (only the accumulation's grouping differs).
TP_MICRO = {"train.micro_batch_size": 4}
TP_ONLY = ("tp2", "tp2-sp")
# more runs in the same launch, each against the one-process reference (run name: its overrides):
# activation checkpointing under each zero-bubble schedule (recomputed once for the input-gradient
# pass, the graph kept for the weight pass), and the zero-bubble schedules' other compositions
ZB_CHECKPOINTED = {"pp2-zb-h1": "every_k", "pp2-interleaved-zb-v2": "full", "pp2-zbv": "full", "pp2-dualpipev": "full"}
ALSO = {layout: {f"ac-{mode}": {**LAYOUTS[layout][1], "train.activation_checkpoint": mode}}
        for layout, mode in ZB_CHECKPOINTED.items()}
ALSO["fsdp2xpp2-zbv"] = {
    "tp2xpp2-dualpipev": {"parallel.tp": 2, "parallel.pp": 2, "parallel.pp_schedule": "dualpipev"},
    "cp2xpp2-interleaved-zb-v2": {"parallel.cp": 2, "parallel.pp": 2, "parallel.pp_schedule": "interleaved-zb",
                                  "parallel.pp_virtual_stages": 2},
    "dp2xpp2-dualpipev-ac-full": {"parallel.dp_replicate": 2, "parallel.pp": 2, "parallel.pp_schedule": "dualpipev",
                                  "train.micro_batch_size": 1, "train.activation_checkpoint": "full"}}


def layout_runs(root: Path, layout: str, corpus: Path, docs_corpus: Path) -> dict[Path, dict]:  # noqa: F811
    """The runs of `layout` under ROOT/<layout>: the AdamW run (EMA, tasks), `SGD` (the `WITH_SGD`
    layouts), `DOCS` and the `ALSO` runs, each with the layout's own overrides."""
    extra, folder = {**LAYOUTS[layout][1], **(TP_MICRO if layout in TP_ONLY else {})}, root / layout
    return {folder / layout: {**MP, **STEPS, **extra, **EMA, **tasks(corpus)},
            **({folder / "sgd": {**MP, **extra, **SGD}} if layout in WITH_SGD else {}),
            folder / "docs": {**MP, **extra, **docs_run(docs_corpus)},
            **{folder / name: {**MP, **STEPS, **own} for name, own in ALSO.get(layout, {}).items()}}


@pytest.fixture(scope="module")
def launches(corpus, docs_corpus, tmp_path_factory) -> tuple[Path, dict[Path, str]]:  # noqa: F811
    """Every layout's runs (`layout_runs`) and the multi-process side of the other tests' comparisons
    (ROOT/pairs/<name>: `PAIRS` under TP=2 + SP; ROOT/family/<layout>: `FAMILY` under `FAMILY_LAYOUTS`),
    one launch per process count (2 and 4: each launch pays torch's import and the process-group setup
    once for all its runs); ROOT and each run's log."""
    root, logs = tmp_path_factory.mktemp("mp-layouts"), {}
    for nproc in sorted({n for n, _ in LAYOUTS.values()}):
        runs = {run: own for layout, (n, _) in LAYOUTS.items() if n == nproc
                for run, own in layout_runs(root, layout, corpus, docs_corpus).items()}
        if nproc == 2:
            runs |= {root / "pairs" / name: {**own, **TP2_SP, **TP_MICRO} for name, own in PAIRS.items()}
            runs |= zero_bubble_checkpoint_runs(root / "zbv-checkpoint")
        runs |= {root / "family" / name: {**FAMILY, **own} for name, (n, own) in FAMILY_LAYOUTS.items() if n == nproc}
        proc = train_runs(corpus, runs, nproc=nproc, timeout=120 + 60 * len(runs))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logs.update(run_logs(proc, runs))
    return root, logs


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_model_parallel_layout_matches_one_process(corpus, docs_corpus, reference, launches, layout):  # noqa: F811
    extra = LAYOUTS[layout][1]
    root, logs = launches
    runs = layout_runs(root, layout, corpus, docs_corpus)
    folder = root / layout
    out, sgd, docs = folder / layout, folder / "sgd", folder / "docs"
    also = [run for run in runs if run not in (out, sgd, docs)]
    assert_runs_match(out, reference / "adamw", f"{layout} vs one process", tol=TOL)
    assert_extras_match(out, reference / "adamw", f"{layout} vs one process", tol=TOL)  # EMA, tasks, merge
    # the document ids (and restarted positions) reach every TP rank, every pipeline stage, every chunk
    assert_runs_match(docs, reference / "docs", f"{layout}, document masking + best-fit, vs one process", tol=TOL)
    if layout in WITH_SGD:
        assert_runs_match(sgd, reference / "sgd", f"{layout}, SGD without clipping, vs one process", tol=TOL)
    for run in also:
        assert_runs_match(run, reference / "adamw", f"{run.name} ({layout}'s launch) vs one process", tol=TOL)
    for run, ref in ((out, reference / "adamw"), (docs, reference / "docs")):
        ref_val = val_losses(ref)
        val = val_losses(run)  # evaluation on the sharded model (no rank gathers it), initial and final
        assert len(val) == len(ref_val) and all(abs(a - b) / b < TOL for a, b in zip(val, ref_val)), (val, ref_val)
    if extra.get("parallel.pp"):
        assert "bubble fraction" in logs[out], logs[out][-3000:]
    for name in ("metrics.jsonl", "model.safetensors", "summary.json", "sample.txt"):
        assert (out / name).is_file(), name
    from lmforge.ckpt.export import load_run

    _, model = load_run(out)  # the streamed weights load into one unsharded model
    assert len(model.blocks) == 4


# a zbv run that writes a checkpoint at step 4 of 8 (rank 0 holds blocks 0 and 3, rank 1 blocks 1 and 2), and
# the same run resumed from it under interleaved-zb's loop (rank 0: blocks 0 and 2) and in one process
ZBV_CHECKPOINT = {**MP, "train.steps": 8, "train.log_every": 1}
ZBV_WRITER = {"parallel.pp": 2, "parallel.pp_schedule": "zbv", "checkpoint.every_steps": 4}
ZBV_RESUMERS = {"resumed-2": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-zb", "parallel.pp_virtual_stages": 2},
                "resumed-1": {}}


def zero_bubble_checkpoint_runs(root: Path, nproc: int = 2) -> dict[Path, dict]:
    """The runs of `ZBV_CHECKPOINT` in a launch of `nproc` processes: the writer and the resumer under another
    schedule (2; after the writer, in the same launch), or the one-process resumer (1)."""
    resume = {"checkpoint.resume": str(root / "zbv" / "checkpoints" / "step_00000004"), "checkpoint.every_steps": 0}
    if nproc == 1:
        return {root / "resumed-1": {**ZBV_CHECKPOINT, **resume}}
    return {root / "zbv": {**ZBV_CHECKPOINT, **ZBV_WRITER},
            root / "resumed-2": {**ZBV_CHECKPOINT, **ZBV_RESUMERS["resumed-2"], **resume}}


@pytest.mark.slow
def test_zero_bubble_checkpoint_resumes_under_another_schedule_and_in_one_process(corpus, launches):  # noqa: F811
    """A checkpoint written under zbv continues under interleaved-zb's loop (in the module's 2-process
    launch) and in one process: the stages save their parameters and optimizer state under the whole
    model's names, so DCP reshards them; steps 5-8 match the zbv run's."""
    root, logs = launches[0] / "zbv-checkpoint", dict(launches[1])
    runs = zero_bubble_checkpoint_runs(root, nproc=1)
    proc = train_runs(corpus, runs, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs.update(run_logs(proc, runs))
    for name, layout in ZBV_RESUMERS.items():
        out = root / name
        assert "resumed from" in logs[out], logs[out][-3000:]
        assert_runs_match(out, root / "zbv", f"zbv checkpoint -> {layout or 'one process'}", steps=[5, 6, 7, 8], tol=TOL)


TP2_SP = {"parallel.tp": 2, "parallel.sequence_parallel": "true"}
LORA = {"model.n_layers": 2, "finetune.lora_rank": 4, "finetune.lora_targets": "wq,wk,wv,wo,gate,up,down",
        "train.steps": 6, "schedule.warmup_steps": 2, "train.log_every": 1}


def one_process_vs_tp2_sp(reference: Path, launches: tuple, name: str, what: str) -> tuple[Path, Path]:
    """The `PAIRS` run `name` in one process and under TP=2 + SP (trained in the module's launches, TINY
    plus its overrides, no MP); per-step losses and gradient norms must agree to TOL."""
    ref_out, out = reference / "pairs" / name, launches[0] / "pairs" / name
    assert_runs_match(out, ref_out, f"{what} tp2-sp vs one process", tol=TOL)
    return ref_out, out


@pytest.mark.slow
def test_tied_embeddings_under_tensor_parallel(reference, launches):
    """Embedding and head both vocab-sharded: the head is re-pointed at the embedding's DTensor, so the
    tie (one parameter, two gradient contributions) holds. TP=2 + SP against one process, tied."""
    from safetensors.torch import load_file

    _, out = one_process_vs_tp2_sp(reference, launches, "tied", "tied")

    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))  # stored once, as tok_emb.weight


@pytest.mark.slow
def test_lora_under_tensor_and_sequence_parallel_matches_one_process(reference, launches):
    """LoRA adapters on every block linear follow their layer's TP split (column-parallel: A replicated,
    B split; row-parallel: A split, B replicated), and the frozen norm weights stay frozen under
    sequence parallelism (torch's SequenceParallel re-creates them trainable; lmforge re-freezes
    them). TP=2 + SP against one process: same losses, and the same merged weights saved."""
    from safetensors.torch import load_file

    ref_out, out = one_process_vs_tp2_sp(reference, launches, "lora", "LoRA")
    got = losses(out)
    assert sorted(got) == list(range(1, 7)) and got[6] < got[1]
    want, have = load_file(str(ref_out / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert want.keys() == have.keys() and not any("lora" in k for k in have)  # merged on save
    for key in want:
        torch.testing.assert_close(have[key], want[key], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_async_sgd_parameter_server_learns_and_reports_staleness(corpus, tmp_path):  # noqa: F811
    out, steps = tmp_path / "async", 12  # (loss ~5.8 -> ~4.2 by step 12; 20 steps: ~3.5)
    proc = train(corpus, out, nproc=3, timeout=300, **{
        **MP, "parallel.dp_replicate": 3, "parallel.async_sgd": "true", "parallel.max_staleness": 1,
        "train.global_batch_size": 6, "train.steps": steps})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = losses(out)
    assert sorted(got) == list(range(1, steps + 1))
    assert got[steps] < got[1] - 1.0, got  # it learns
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in recs if "loss" in r]
    assert all(0 <= r["staleness"] <= 1 for r in updates)  # applied gradients respect the bound
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["async_sgd"]
    assert stats["workers"] == 2 and stats["received"] == steps + stats["dropped"]
    # its own layout and MFU (were "single" and 0.0: the synchronous loop's windows): the workers'
    # model FLOPs over the 3 processes' peak and the run's time
    assert summary["layout"] == "async-sgd (parameter server + 2 workers)"
    expected = summary["tokens"] * summary["flops_per_token"] / (3 * summary["peak_flops"] * summary["seconds"])
    assert summary["mfu"] == pytest.approx(expected, rel=0.05) and summary["mfu"] > 0
    assert stats["staleness_max"] >= stats["staleness_mean"] >= 0
    val = val_losses(out)
    assert val[-1] < val[0] - 1.0, val


BATCH = {"train.global_batch_size": 64, "train.micro_batch_size": 4}


@pytest.mark.parametrize("bad, message", [
    ({"parallel.tp": 4}, "parallel.tp = 4 must divide model.n_heads = 6 and the kv heads = 6 (each TP rank holds whole heads); "
                        "the degrees this model allows are [1, 2]."),
    ({"parallel.tp": 2, "model.n_kv_heads": 3}, "kv heads = 3"),
    ({"parallel.tp": 2, "model.vocab_size": 4097}, "pad model.vocab_size"),
    ({"parallel.tp": 2, "model.ffn_hidden": 101}, "MLP hidden size"),
    ({"parallel.tp": 2, "parallel.dp_replicate": 2}, "parallel.dp_shard = 2"),
    ({"parallel.sequence_parallel": True}, "needs parallel.tp >= 2"),
    ({"parallel.pp": 3}, "must divide model.n_layers"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": 4,
      "model.tie_embeddings": False}, "pp_virtual_stages = 4 = 8 pipeline stages must divide"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "model.tie_embeddings": False},
     "pp_virtual_stages >= 2"),
    ({"parallel.pp_virtual_stages": 2}, "applies to pp_schedule = 'interleaved' or 'interleaved-zb' only"),
    ({"parallel.pp": 4, "train.global_batch_size": 8, "model.tie_embeddings": False}, "fewer than the stages"),
    ({"parallel.pp": 4, "train.global_batch_size": 24, "parallel.pp_schedule": "interleaved",
      "parallel.pp_virtual_stages": 1, "model.tie_embeddings": False, "model.n_layers": 4}, "pp_virtual_stages >= 2"),
    ({"parallel.pp": 2, "train.global_batch_size": 12, "parallel.pp_schedule": "interleaved",
      "parallel.pp_virtual_stages": 2, "model.tie_embeddings": False}, "must be a multiple of"),
    ({"parallel.tp": 2, "train.precision": "fp16"}, "fp16"),
    # (ZeRO-1 runs under TP and PP through FSDP2, tests/test_parallel_zero1.py; it still needs dp_shard ranks)
    ({"parallel.tp": 2, "parallel.zero_stage": 1}, "zero_stage = 1 shards the optimizer state over the parallel.dp_shard"),
    ({"parallel.async_sgd": True}, "dp_replicate = world size >= 2"),
    ({"parallel.async_sgd": True, "parallel.dp_replicate": 2, "parallel.dp_shard": 2}, "tp = pp = dp_shard = 1"),
    ({"parallel.max_staleness": -1}, "max_staleness"),
])
def test_model_parallel_config_validation(bad, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny", {**BATCH, **bad})


def test_valid_model_parallel_configs_and_degenerate_cases(monkeypatch):
    from lmforge.parallel.mesh import check_layout
    from lmforge.spec.parallel import pipeline_bubble as bubble_fraction
    from lmforge.spec.parallel import stage_layers

    for ok in ({"parallel.tp": 2, "parallel.sequence_parallel": True},
               {"parallel.tp": 1, "parallel.pp": 1},  # degenerate: one process
               {"parallel.pp": 2, "model.tie_embeddings": False},
               {"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.pp_virtual_stages": 2,
                "model.tie_embeddings": False},
               {"parallel.dp_shard": 2, "parallel.tp": 2, "parallel.pp": 2, "model.tie_embeddings": False}):
        cfg = load_config("tiny", {**BATCH, **ok})
        check_layout(cfg, cfg.parallel.world_size, cuda=False)
    cfg = load_config("tiny", {**BATCH, "parallel.tp": 2, "parallel.pp": 2, "model.tie_embeddings": False})
    with pytest.raises(ConfigError, match=r"needs 4 processes \(dp_replicate 1 x dp_shard 1 x cp 1 x tp 2 x pp 2\)"):
        check_layout(cfg, 2, cuda=False)
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(2, 4, 2) == pytest.approx(1 / 9)
    assert [stage_layers(8, 4, s) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


# the attention options of the Llama 3.x / Qwen2.5 / Qwen3 / Mistral families (issue 37), each alone
ATTENTION_OPTIONS = {
    "qkv_bias": {"model.qkv_bias": "true"},  # Qwen2.5: biases on q/k/v only, column-split with their weights
    "qk_norm": {"model.qk_norm": "true"},  # Qwen3: replicated head_dim weights on the rank's heads
    "sliding_window": {"model.sliding_window": 8},  # Mistral: 8 < data.seq_len 32, the masked path
    "rope_llama3": {"model.rope_scaling": "llama3", "model.rope_factor": 4, "model.rope_original_max_seq_len": 16},
    "gate_partial_rope": {"model.attn_gate": "true", "model.rope_fraction": 0.5},  # Qwen3-Next (issue 57)
}


FAMILY_STEPS = {"train.steps": 10, "schedule.warmup_steps": 2}  # (each launch pays torch's import once)


# name: the overrides of a one-process run and of its TP=2 + SP twin (`one_process_vs_tp2_sp`): tied embeddings
# (2 layers), LoRA, and each family attention option alone (2 layers, GQA with 2 kv heads: one per rank)
PAIRS = {"tied": {"model.n_layers": 2, "model.tie_embeddings": "true", **FAMILY_STEPS}, "lora": LORA,
         **{f"attention-{name}": {"model.n_layers": 2, "model.n_kv_heads": 2, **FAMILY_STEPS, **option}
            for name, option in ATTENTION_OPTIONS.items()},
         # QK-norm with plain SGD (`SGD`): a QK-norm weight gradient twice its size under TP + SP (not summed
         # right over the ranks' heads) moves the losses 6.6e-5 and the gradient norms 3.6e-4 here, where
         # the AdamW pair above moves 2.4e-5 (measured with the gradient doubled on purpose)
         "attention-qk_norm-sgd": {"model.n_layers": 2, "model.n_kv_heads": 2, **ATTENTION_OPTIONS["qk_norm"], **SGD}}
# all the options at once on the MP model, under FSDP2 x TP (2 x 2, SP), PP=2 (1F1B) and CP=2
FAMILY = {**MP, "model.n_kv_heads": 2, **{k: v for option in ATTENTION_OPTIONS.values() for k, v in option.items()},
          **FAMILY_STEPS}
FAMILY_LAYOUTS = {"fsdp2xtp2": LAYOUTS["fsdp2xtp2"], "pp2-1f1b": LAYOUTS["pp2-1f1b"], "cp2": (2, {"parallel.cp": 2})}


@pytest.mark.slow
def test_attention_options_under_tensor_and_sequence_parallel_match_one_process(reference, launches):
    """Each family option alone under TP=2 + SP (GQA, 2 kv heads: one per rank) against one process:
    same per-step losses and gradient norms (the gradient of a replicated QK-norm weight is summed
    over the ranks' heads, also with plain SGD, whose curve follows its scale; a bias is split like its
    weight; the attention gate by heads, like q)."""
    for name in [*ATTENTION_OPTIONS, "qk_norm-sgd"]:
        one_process_vs_tp2_sp(reference, launches, f"attention-{name}", name)


@pytest.mark.slow
def test_family_options_together_under_fsdp_tp_pipeline_and_context_parallel_match_one_process(reference, launches):
    """All the options at once under FSDP2 x TP (2 x 2, SP), under PP=2 (1F1B) and under CP=2 (the
    8-token window inside 32-token sequences cut into 4 chunks of 8: the windowed chunk attention)
    against one process: the new weights compose with FSDP2's sharding and the pipeline split, and
    the window is exact across the CP ranks' chunks."""
    for name in FAMILY_LAYOUTS:
        assert_runs_match(launches[0] / "family" / name, reference / "family" / "single",
                          f"family options, {name} vs one process", tol=TOL)
