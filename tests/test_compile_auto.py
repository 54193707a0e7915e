"""train.compile = "auto" (lmforge.config.rules.resolve_compile): per-block torch.compile on where it
was measured faster (CUDA with Triton; FSDP2, TP and PP too), off on CPUs (the compile costs a short
run more than it saves) and for Mixture-of-Experts models; an explicit true / false is kept. A CPU run with the
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
from tests.test_parallel_dp import corpus  # noqa: F401  (module-scoped corpus fixture)

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
    assert on == "blocks" and "auto: per block on cuda" in why and "RESULTS.md" in why
    assert resolve_compile(cfg, "cuda")[0]  # capability unknown: on
    off, why = resolve_compile(cfg, "cpu")
    assert not off and "auto: off on cpu" in why and "train.compile = blocks or model" in why
    assert not resolve_compile(cfg, "mps")[0]  # never measured: off


def test_auto_is_off_where_compile_cannot_run_or_is_not_known_to_pay(monkeypatch):
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    moe = load_config("tiny", {**SMALL, **MOE})
    off, why = resolve_compile(moe, "cuda", (9, 0))
    assert not off and "Mixture-of-Experts" in why
    tp = load_config("tiny", {**SMALL, "parallel.tp": 2})
    off, why = resolve_compile(tp, "cuda", (9, 0))  # TP: runs when asked (the slow test below), not measured faster
    assert off is False and "parallel.tp > 1" in why
    assert resolve_compile(load_config("tiny", {**SMALL, "parallel.tp": 2, "train.compile": True}), "cuda")[0] == "blocks"
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


@pytest.mark.parametrize("value, want", [(True, "blocks"), ("blocks", "blocks"), (False, False)])
def test_an_explicit_value_is_kept(monkeypatch, value, want):
    monkeypatch.setattr(rules, "triton_installed", lambda: True)
    for over in (SMALL, {**SMALL, **MOE}, {**SMALL, "parallel.tp": 2}):
        cfg = load_config("tiny", {**over, "train.compile": value})
        for device in ("cpu", "cuda"):
            assert resolve_compile(cfg, device, (6, 1)) == (want, f"train.compile = {str(value).lower()}")


def test_the_whole_model_compiles_where_the_layout_runs_it_in_one_call():
    """train.compile = model: one process and DDP / ZeRO-1 compile the whole forward and loss, a
    pipeline each stage; FSDP2 (per-block gathers, also a pipeline's data-parallel chunks), tensor
    parallelism and MoE models compile per block, and say why."""
    for ok in ({}, {"parallel.dp_replicate": 2, "train.micro_batch_size": 4},
               {"parallel.dp_shard": 2, "parallel.zero_stage": 1, "train.micro_batch_size": 4}):
        assert resolve_compile(load_config("tiny", {**SMALL, **ok, "train.compile": "model"}), "cpu") == \
            ("model", "train.compile = model: the whole forward and loss as one graph")
    for layout, says in (({"parallel.dp_shard": 2, "train.micro_batch_size": 4}, "FSDP2"),
                         ({"parallel.tp": 2}, "tensor parallelism"),
                         ({"parallel.cp": 2, "train.micro_batch_size": 4}, "context parallelism"),
                         ({"parallel.pp": 2, "parallel.dp_replicate": 2, "model.tie_embeddings": False,
                           "train.micro_batch_size": 2}, "FSDP2"),
                         (MOE, "Mixture-of-Experts")):
        what, why = resolve_compile(load_config("tiny", {**SMALL, **layout, "train.compile": "model"}), "cuda")
        assert what == "blocks" and why.startswith("train.compile = model, per block instead: ") and says in why
    pp = load_config("tiny", {**SMALL, "parallel.pp": 2, "model.tie_embeddings": False, "train.micro_batch_size": 4,
                              "train.compile": "model"})
    assert resolve_compile(pp, "cuda") == ("model", "train.compile = model: each pipeline stage's forward as one graph")


def test_cuda_graphs_need_one_micro_batch_per_step():
    """compile_mode = reduce-overhead: torch's CUDA-graph trees overwrite a replay's gradient outputs
    at the next replay, so with gradient accumulation the config is refused, naming the torch issue."""
    load_config("tiny", {**SMALL, "train.compile": "model", "train.compile_mode": "reduce-overhead"})
    with pytest.raises(ConfigError, match=r"reduce-overhead.*2 micro-batches per step.*pytorch/pytorch#169545"):
        load_config("tiny", {**SMALL, "train.micro_batch_size": 4, "train.compile_mode": "reduce-overhead"})


@pytest.mark.parametrize("value", ["sometimes", 1, "yes"])
def test_a_bad_value_names_the_key_and_the_allowed_values(value):
    with pytest.raises(ConfigError, match=rf"train.compile = {value!r} must be true or false, or one of 'auto', "
                                          rf"'blocks', 'model'"):
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
    what = "per-block torch.compile (train.compile = true" if compiled else "off (auto: off on cpu"
    assert len(said) == 1 and said[0].startswith(f"compile: {what}"), said


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_compile_and_match_one_process(corpus, tmp_path):  # noqa: F811
    """TP = 2 + SP with per-block compile (train.compile = true; `auto` keeps it off there until a GPU
    measures it) and PP = 2 (1F1B) with each
    stage compiled as one graph (train.compile = model) train like one eager process: 3 steps, loss
    and gradient norm within 1e-4 (fp32; the compiled kernels reassociate: measured below 1e-6;
    benchmarks/parity_layouts.py --case tp2-sp-compile measured 4.9e-7 / 5.8e-6 with both runs
    compiled). Without `unalias_embedding_output` TP's first backward failed in DTensor's
    redistribute ("'Tensor' object has no attribute '_local_tensor'"). One 2-process launch."""
    from tests.test_parallel_dp import assert_runs_match, train_runs
    from tests.test_parallel_mp import MP

    shared = {**MP, "model.n_layers": 2, "train.steps": 3, "train.log_every": 1, "schedule.warmup_steps": 1,
              "train.sample_tokens": 0}
    proc = train_runs(corpus, {tmp_path / "eager": {}}, **shared)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {tmp_path / "tp": {"parallel.tp": 2, "parallel.sequence_parallel": "true", "train.compile": "true"},
            tmp_path / "pp": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "train.compile": "model"}}
    proc = train_runs(corpus, runs, nproc=2, timeout=900, **shared)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "compile: per-block torch.compile" in log and "each pipeline stage's forward as one graph" in log
    for out in runs:
        assert_runs_match(out, tmp_path / "eager", f"{out.name} compiled vs one eager process", tol=1e-4)


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
    assert "compile: per-block torch.compile (train.compile = true" in proc.stderr + proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["sample"] and (out / "sample.txt").read_text().strip()


def _inductor_kernels(monkeypatch, style: str, whole: bool) -> tuple[set[str], set[str]]:
    """The names of the kernels inductor generates on the CPU for the forward and the backward of a one-block
    model of `style`, compiled per block (`block.compile()`, as train.compile = blocks does) or whole."""
    import re

    import torch
    from torch._inductor.graph import GraphLowering

    from lmforge.model.transformer import build_model

    codes: list[str] = []
    lower = GraphLowering.compile_to_module

    def keep(self, *a, **k):
        mod = lower(self, *a, **k)
        codes.append(Path(mod.__file__).read_text())
        return mod

    monkeypatch.setattr(GraphLowering, "compile_to_module", keep)
    torch._dynamo.reset()
    extra = {"model.pos_emb": "learned", "model.norm": "layernorm", "model.activation": "gelu", "model.bias": True} \
        if style == "gpt2" else {}
    cfg = load_config("tiny", {**SMALL, **extra, "model.n_layers": 2}).model
    model = build_model(cfg, "cpu", seed=0)
    for block in ([] if whole else model.blocks.values()):
        block.compile()
    run = torch.compile(lambda x: model(x).float().logsumexp(-1).mean()) if whole else \
        (lambda x: model(x).float().logsumexp(-1).mean())
    # (a cached graph is not lowered again: inductor's and AOTAutograd's caches off)
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        run(torch.randint(0, cfg.vocab_size, (2, 32))).backward()
    forward, backward = (set(re.findall(r"\b(cpp_fused_\w+_\d+)\b", code)) for code in codes[:2])
    return forward, backward


def _bare_adds(kernels: set[str]) -> set[str]:
    import re

    return {k for k in kernels if re.fullmatch(r"cpp_fused_(_unsafe_view_)?add(_view)?_\d+", k)}


@pytest.mark.slow
@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_compiled_blocks_fuse_the_residual_add_with_the_next_norm(style, monkeypatch):
    """Issue 55 item 3, what inductor makes of lmforge's blocks (kernel names from its generated code, CPU):
    compiled per block (train.compile = blocks), the attention's residual add and the MLP's norm are one
    kernel (RMSNorm's add-mean-rsqrt; LayerNorm's statistics), the activation one kernel with its
    neighbours, and the backward adds the residual gradient inside the norms' backward; what is left is the
    block's output add (the next block's norm is in the next graph): one bare add pass per block. Compiled
    whole (train.compile = model) that add fuses too: no bare add at all, llm.c's hand-fused residual +
    LayerNorm."""
    norm = "mean_mul_pow_rsqrt" if style == "llama" else "native_layer_norm"
    act = "silu" if style == "llama" else "gelu"
    forward, backward = _inductor_kernels(monkeypatch, style, whole=False)
    assert any("add" in k and norm in k for k in forward), forward  # the attention's residual add + the MLP's norm
    assert any(act in k for k in forward) and not _bare_adds(backward), (forward, backward)
    assert len(_bare_adds(forward)) == 1, forward  # (the block's output add, in each of the 2 blocks' graphs)
    forward, backward = _inductor_kernels(monkeypatch, style, whole=True)
    assert not _bare_adds(forward | backward), (forward, backward)
    assert sum("add" in k and norm in k for k in forward) >= 3, forward  # (every residual add meets a norm)
