"""lmforge.plan with context parallelism (parallel.cp): the activation estimate against the bytes a
CP rank really saves, the step's CP traffic and attention work, model states over dp x cp, the
layout search for long sequences, and the errors for bad cp values.

The exact check reuses the memory probe of tests/test_parallel_cp.py (tests/cp_driver.py `probe`:
its model, batch and `saved_activation_bytes` helper) in this process, without torchrun: the
all-gather is replaced by a local copy of the rank's own K/V into every slot, which changes the
values gathered but not a single byte of what autograd saves.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from lmforge.config import ModelConfig, load_config
from lmforge.spec.parallel import cp_activation_bytes, cp_comm_bytes, cp_kv_bytes, recomputed_layers
from lmforge.plan import Layout, estimate_memory, estimate_step, parse_cluster, search_layouts
from lmforge.cli.plan import plan_main
from lmforge.plan.flops import cp_comm
from lmforge.plan.op_time import op_times
from tests.test_parallel_cp import PROBE

# Saved bytes per rank that the 4-process torchrun probe measured (benchmarks/RESULTS.md, "Context
# parallelism": GQA model, 2 layers, 4 heads, 1 KV head, batch 2 x 128 tokens, fp32). Without the
# two cached additive masks the attention kept before (4 B x c^2 (2cp + 1): 20,480 B at cp 2,
# 9,216 B at cp 4), which the mask-free attention no longer builds.
PROBE_MEASURED = {2: 1_716_740, 4: 891_140}

# A Llama-3-8B-like model (32 layers, d 4096, GQA 32/8, SwiGLU 14336, 128k vocabulary) from the
# mistral-7b preset, at 128k tokens.
LLAMA3_8B = {"model.vocab_size": 128256, "data.tokenizer_vocab_size": 128256, "model.max_seq_len": 131072,
             "model.rope_theta": 500000.0}


def _probe(monkeypatch, cp: int, rank: int, precision: str = "fp32", ac: str = "none") -> tuple[int, dict[str, int]]:
    """cp_driver.probe's measurement for one CP rank, in this process: the bytes autograd saves in
    forward, and the K/V collectives of a forward and backward as `SequenceSharding` counts them
    (`ac`: activation checkpointing of every block, or of block 0 under every_k)."""
    import lmforge.parallel.context_parallel as context_parallel
    from lmforge.model.loss import token_nll_sum
    from lmforge.model.transformer import build_model
    from lmforge.parallel.activation_ckpt import apply_activation_checkpointing, saved_activation_bytes
    from lmforge.parallel.context_parallel import SequenceSharding

    def gather_own(out: torch.Tensor, local: torch.Tensor, group=None) -> None:
        out.view(-1, *local.shape).copy_(local.expand(out.shape[0] // local.shape[0], *local.shape))

    def scatter_own(out: torch.Tensor, send: torch.Tensor, op=None, group=None) -> None:
        out.copy_(send[:out.shape[0]])

    monkeypatch.setattr(context_parallel, "_all_gather", gather_own)
    monkeypatch.setattr(context_parallel, "_reduce_scatter", scatter_own)
    model = build_model(ModelConfig(**PROBE["model"]), seed=0)
    apply_activation_checkpointing(model.blocks, ac, every=2)
    b, t = PROBE["batch"], PROBE["seq_len"]
    tokens = torch.randint(0, model.cfg.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(1))
    sharding = SequenceSharding(None, rank, cp, torch.device("cpu"))
    x, y = sharding.local(tokens[:, :-1]), sharding.local(tokens[:, 1:])
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())

    def loss(backward: bool = False):
        with autocast, sharding.sharded(t):  # (the trainer holds it around forward and backward)
            out = token_nll_sum(model(x), y)
            if backward:
                out.backward()
            return out

    saved = saved_activation_bytes(loss, exclude=list(model.parameters()))
    sharding.comm = dict.fromkeys(sharding.comm, 0)
    loss(backward=True)
    return saved, sharding.comm


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_activation_estimate_equals_the_probes_saved_bytes(monkeypatch, cp):
    """fp32 (the probe's precision): the saved bytes of a CP rank, first and last rank (equal: the
    chunks balance memory too), = the figure the 2- and 4-process torchrun probe recorded in
    benchmarks/RESULTS.md = the planner's activations, byte for byte (tolerance 0): the attention
    keeps no mask and no score matrix, and the planner counts no mask buffer. Under bf16 autocast as
    well, with autocast's 16-bit weight copies (saved by the matmuls) on top."""
    cfg, b, t = ModelConfig(**PROBE["model"]), PROBE["batch"], PROBE["seq_len"]
    fp32 = estimate_memory(cfg, Layout(micro_batch=b, cp=cp, precision="fp32", compile=False), "adamw", t)
    assert not any("mask" in key for key in fp32.detail), fp32.detail
    for rank in (0, cp - 1):
        assert _probe(monkeypatch, cp, rank)[0] == PROBE_MEASURED[cp] == fp32.activations
    bf16 = estimate_memory(cfg, Layout(micro_batch=b, cp=cp, precision="bf16", compile=False), "adamw", t)
    assert _probe(monkeypatch, cp, 0, "bf16")[0] == bf16.activations + bf16.detail["autocast_weight_copies"]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("ac", ["full", "every_k", "selective"])
def test_cp_estimate_under_activation_checkpointing(monkeypatch, cp, ac):
    """With recompute, in the same probe: the K/V all-gathers and reduce-scatters of a forward and
    backward = the planner's CP traffic for one micro-batch (`cp_comm`: one more all-gather per
    recomputed block, selective included), and the saved bytes = the planner's activations, byte for
    byte. Selective
    recompute keeps its saved outputs in the checkpoint's own cache, out of reach of the saved-tensor
    hooks: its bytes are not measured here."""
    cfg, b, t = ModelConfig(**PROBE["model"]), PROBE["batch"], PROBE["seq_len"]
    layout = Layout(micro_batch=b, cp=cp, precision="fp32", ac=ac, ac_every=2, compile=False)
    saved, comm = _probe(monkeypatch, cp, 0, ac=ac)
    want = cp_comm(cfg, layout, t)
    assert (comm["all_gather_bytes"], comm["reduce_scatter_bytes"], comm["all_gather_calls"] + comm["reduce_scatter_calls"]
            ) == (want["all_gather_bytes"], want["reduce_scatter_bytes"], want["calls"])
    assert comm["all_gather_calls"] == cfg.n_layers + recomputed_layers(ac, cfg.n_layers, 2)
    if ac != "selective":
        mem = estimate_memory(cfg, layout, "adamw", t)
        assert saved == mem.activations


def test_cp_blocks_follow_the_formula_in_every_convention():
    """Per layer (A - KV)/cp + KV (spec.parallel.cp_activation_bytes), A and KV of the whole sequence;
    full recompute A/cp; model states sharded over dp x cp as over dp x cp data-parallel ranks."""
    cfg = load_config("mistral-7b", LLAMA3_8B).model
    s = 131072
    for conv, kv_bytes in (("lmforge", 2), ("megatron", 2), ("zero-paper", 2)):
        one = estimate_memory(cfg, Layout(tp=8, micro_batch=1), "adamw", s, weights=conv)
        kv = cfg.n_layers * cp_kv_bytes(1, s, cfg.kv_heads, cfg.head_dim, kv_bytes, tp=8)
        for cp in (2, 16):
            got = estimate_memory(cfg, Layout(tp=8, cp=cp, micro_batch=1), "adamw", s, weights=conv)
            assert got.detail["activations_blocks"] == pytest.approx(
                cp_activation_bytes(one.detail["activations_blocks"], kv, cp))
            full = estimate_memory(cfg, Layout(tp=8, cp=cp, ac="full"), "adamw", s, weights=conv)
            whole = estimate_memory(cfg, Layout(tp=8, ac="full"), "adamw", s, weights=conv)
            assert full.detail["activations_blocks"] == pytest.approx(whole.detail["activations_blocks"] / cp)
        for zero in (1, 3):
            cp_lay = estimate_memory(cfg, Layout(dp=2, cp=4, zero=zero), "adamw", s, weights=conv)
            dp_lay = estimate_memory(cfg, Layout(dp=8, zero=zero), "adamw", s, weights=conv)
            assert cp_lay.model_states == dp_lay.model_states


def test_cp_traffic_and_balanced_attention_in_the_time_model():
    cfg = load_config("mistral-7b", LLAMA3_8B).model
    s, cluster = 131072, parse_cluster("16x8xH100")
    lay = Layout(dp=1, zero=3, cp=16, tp=8, micro_batch=1, grad_accum=2, ac="full")
    kv = cp_kv_bytes(1, s, cfg.kv_heads, cfg.head_dim, 2, tp=8)
    want = cp_comm_bytes(kv, 16, cfg.n_layers, 2, recomputed_layers=cfg.n_layers)  # the RESULTS row: 2.0 GiB each way per micro-batch
    got = cp_comm(cfg, lay, s)
    assert {k: got[k] for k in want} == want and kv * cfg.n_layers == 2 * 2**30
    step = estimate_step(cfg, lay, cluster, s)
    assert step.comm_s["cp"] > 0 and "cp" not in estimate_step(cfg, Layout(dp=16, zero=3, tp=8), cluster, s).comm_s
    # every rank computes the same c^2 (2cp + 1) (query, key) scores (spec.parallel.cp_score_elements): at
    # equal GPUs and tokens the attention time and the matmuls' FLOP time are the same with or without CP
    # (CP's 16 x more, smaller micro-batches pay the fixed cost per GEMM 16 x more often)
    flat_lay = Layout(dp=16, zero=3, tp=8, micro_batch=1, grad_accum=2, ac="full")
    cp_lay = Layout(dp=1, zero=3, cp=16, tp=8, micro_batch=1, grad_accum=32, ac="full")
    flat, cp_step = (estimate_step(cfg, lay, cluster, s) for lay in (flat_lay, cp_lay))
    assert cp_step.tokens_per_step == flat.tokens_per_step
    assert cp_step.time_by_kind["attention"] == pytest.approx(flat.time_by_kind["attention"])
    t0 = cluster.device.calibration.gemm_fixed_s
    flops_time = [sum(g.count * (g.seconds - t0) for g in op_times(cfg, lay, s, cluster.device).groups
                      if g.kind == "matmul") for lay in (flat_lay, cp_lay)]
    assert flops_time[1] == pytest.approx(flops_time[0])


def _search(seq_len: int, sequences: int, gpus: str = "8x8xH100", **kw):
    cfg = load_config("mistral-7b", {**LLAMA3_8B, "data.seq_len": seq_len})
    return search_layouts(cfg.model, parse_cluster(gpus), sequences, seq_len, config=cfg, **{"top": 5, **kw})


@pytest.mark.slow
def test_search_picks_cp_at_128k_tokens_and_not_for_short_sequences():
    """A Llama-3-8B-like model at 128k tokens on 64 H100s, 64 sequences (8.4M tokens) per step:
    without CP the best layout needs TP4 x PP2 and full recompute and is over 20% slower (observed:
    1,326 against 942 tok/s/GPU); CP leads. At 8k tokens (CP=2 tried) and 4k (not tried) plain
    data parallelism wins."""
    long = _search(131072, 64, top=None)
    assert long[0].fits and long[0].layout.cp > 1, [c.layout.short() for c in long[:5]]
    assert f"cp={long[0].layout.cp}" in long[0].layout.short() and "CP=" in long[0].reason
    assert long[0].layout.world_size == 64
    no_cp = next(c for c in long if c.fits and c.layout.cp == 1)
    assert no_cp.layout.pp > 1 and no_cp.layout.ac == "full", no_cp.layout.short()
    assert long[0].step.tokens_per_s > 1.2 * no_cp.step.tokens_per_s
    for seq_len, tried in ((8192, True), (4096, False)):
        short = _search(seq_len, 1024)
        assert short[0].layout.cp == 1, short[0].layout.short()
        assert any(c.layout.cp > 1 for c in short) == tried


@pytest.mark.parametrize("seq_len", [32768, 131072])
def test_on_one_node_cp_is_the_fastest_and_at_128k_the_only_layout_that_fits(seq_len):
    """The same model on 8 H100s, 16 sequences per step. At 32k tokens CP=4 beats the best layout
    without CP (TP=4) by over 5% (observed 12%); at 128k no layout without CP fits in 72 GB, not even
    TP=8 with full recompute and ZeRO-3, and the search finds CP ones that do."""
    found = _search(seq_len, 16, "8xH100", top=None)
    assert found[0].fits and found[0].layout.cp > 1, found[0].layout.short()
    no_cp = [c for c in found if c.fits and c.layout.cp == 1]
    if seq_len == 32768:
        assert found[0].step.tokens_per_s > 1.05 * no_cp[0].step.tokens_per_s
    else:
        assert not no_cp
        assert not _search(seq_len, 16, "8xH100", cp_min_tokens=seq_len + 1)  # CP left out: nothing fits


def test_plan_cli_set_plans_a_long_context_run_and_the_search_picks_cp(capsys):
    """README's long-context planning line: `--set` raises the preset's context; at 128k tokens the
    search's first layout uses CP, and every layout it shows carries a cp degree."""
    argv = ["--model", "mistral-7b", "--set", "model.max_seq_len=131072", "--set", "data.seq_len=131072",
            "--global-batch-tokens", "8388608", "--gpus", "8x8xH100", "--search", "--top", "3"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "seq 131072" in out
    first = re.search(r"^  1  (\S+)", out, flags=re.M).group(1)
    assert int(re.search(r"cp=(\d+)", first).group(1)) > 1, first
    assert "Context parallelism splits each 131,072-token sequence" in out


def test_plan_cli_takes_cp_in_the_layout_and_shows_it(tmp_path, capsys):
    toml = tmp_path / "llama3-8b-128k.toml"
    toml.write_text('[model]\nvocab_size = 128256\ndim = 4096\nn_layers = 32\nn_heads = 32\nn_kv_heads = 8\n'
                    'ffn_hidden = 14336\nmax_seq_len = 131072\nrope_theta = 500000.0\ntie_embeddings = false\n'
                    '[data]\ntokenizer = "bpe"\ntokenizer_vocab_size = 128256\nseq_len = 131072\n'
                    '[train]\nglobal_batch_size = 64\nmicro_batch_size = 1\nprecision = "bf16"\n')
    argv = ["--model", str(toml), "--gpus", "8x8xH100", "--weights", "lmforge"]
    assert plan_main(argv + ["--layout", "zero=3,cp=16,tp=4,ac=full"]) == 0
    out = capsys.readouterr().out
    assert "dp=1,zero=3,cp=16,tp=4,pp=1" in out and "CP communication" in out
    assert plan_main(argv + ["--layout", "cp=16,tp=4", "--json"]) == 0
    assert '"cp": 16' in capsys.readouterr().out


@pytest.mark.parametrize("layout, seq_len, message", [
    ("cp=0", 4096, "layout cp = 0 must be an integer >= 1"),
    ("cp=x", 4096, "layout cp = 'x' must be an integer"),
    ("cp=3", 4096, "layout cp = 3 must divide seq_len / 2 = 2048"),
    ("cp=4,tp=4,sp=1", 8, r"each CP rank's 2 tokens \(seq_len / cp\) must be divisible by tp = 4"),
])
def test_bad_cp_values_are_clear_errors(layout, seq_len, message):
    cfg = load_config("tiny", {"model.n_heads": 4}).model
    with pytest.raises(ValueError, match=message):
        estimate_memory(cfg, Layout.parse(layout), "adamw", seq_len)


@pytest.mark.parametrize("layout, message", [
    ("cp=3", "layout cp = 3 must divide seq_len / 2 = 64"),
    ("cp=16", r"cp x tp x pp = 16 x 1 x 1 = 16 does not divide the 8 GPUs"),
    ("dp=2,cp=2", r"dp x cp x tp x pp = 2 x 2 x 1 x 1 = 4 GPUs but --gpus gives 8"),
])
def test_plan_cli_refuses_bad_cp(layout, message, capsys):
    assert plan_main(["--model", "tiny", "--gpus", "8xH100", "--layout", layout]) == 2
    assert re.search(message, capsys.readouterr().err)
