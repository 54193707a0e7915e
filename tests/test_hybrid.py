"""Hybrid models (issue 57 item 3, its config part): model.layer_types / full_attention_interval make
blocks Gated DeltaNet (lmforge.model.gated_deltanet) in a one-process model: the blocks built, the
parameter and FLOP accounting, the tiny-hybrid preset training through `lmforge train`, and what is
not supported with linear attention yet refused with its reason, never run wrong."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import ConfigError, ModelConfig, load_config
from lmforge.config.layout_rules import layout_refusals
from lmforge.config.sections import DeltaNetConfig
from lmforge.model.accounting import count_params, flops_per_token, training_flops
from lmforge.model.gated_deltanet import GatedDeltaNet
from lmforge.model.layers import Attention
from lmforge.model.transformer import build_model
from lmforge.plan.params import total_params
from tests.test_parallel_dp import SGD, assert_runs_match, corpus, train, train_runs  # noqa: F401  (module-scoped corpus)

DN3 = {"model.deltanet.key_heads": 3, "model.deltanet.value_heads": 6}  # (3 key heads: not on 2 TP ranks)
HYBRID = dict(vocab_size=97, dim=32, n_layers=4, n_heads=4, max_seq_len=64, attn_gate=True,
              deltanet=DeltaNetConfig(key_heads=2, value_heads=4, chunk_size=8))


@pytest.mark.parametrize("pattern", [{"full_attention_interval": 4},
                                     {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}])
def test_the_3_to_1_pattern_builds_deltanet_then_attention_blocks(pattern):
    cfg = ModelConfig(**HYBRID, **pattern)
    cfg.check()
    model = build_model(cfg, seed=0)
    assert [type(b.attn) for b in model.blocks.values()] == [GatedDeltaNet] * 3 + [Attention]
    assert model.num_params() == count_params(cfg)["total"] == total_params(cfg)
    trainable = {name: p.numel() for name, p in model.named_parameters()}
    assert training_flops(cfg, 64, trainable)["total"] == flops_per_token(cfg, 64)
    loss = model(torch.randint(0, 97, (2, 20)), targets=torch.randint(0, 97, (2, 20)))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_a_linear_block_cannot_see_the_future():
    model = build_model(ModelConfig(**HYBRID, layer_types=["linear_attention"] * 4), seed=0).eval()
    x = torch.randint(0, 97, (1, 19))
    y = x.clone()
    y[0, 11:] = (y[0, 11:] + 1) % 97
    with torch.no_grad():
        assert torch.equal(model(x)[0, :11], model(y)[0, :11])


@pytest.mark.parametrize("edit, match", [
    ({"full_attention_interval": 4, "layer_types": ["full_attention"] * 4}, r"both set the blocks' mixers"),
    ({"layer_types": ["linear_attention"] * 3}, r"model.layer_types has 3 entries but model.n_layers = 4"),
    ({"layer_types": ["linear_attention"] * 3 + ["mamba"]}, r"model.layer_types\[3\] = 'mamba' must be one of"),
    ({"full_attention_interval": 2, "parametrization": "mup", "mup_base_width": 32},
     r"model.parametrization = 'mup' is not supported with linear-attention blocks"),
])
def test_impossible_layer_types_are_refused(edit, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**{**HYBRID, **edit}).check()


@pytest.mark.parametrize("key", ["parallel.tp", "parallel.cp", "parallel.pp", "parallel.ep"])
def test_layouts_that_do_not_split_linear_attention_are_refused_with_the_reason(key):
    """CP refuses Gated DeltaNet blocks with the reason; TP runs them where it divides both head counts
    (tiny-hybrid's 2 and 4 at tp = 2; 3 key heads are refused, naming the degrees that work); PP and EP
    run them."""
    cfg = load_config("tiny-hybrid")
    cfg.parallel = type(cfg.parallel)(**{**cfg.parallel.__dict__, key.split(".")[1]: 2})
    refused = {r.rule: r.message for r in layout_refusals(cfg)}
    if key in ("parallel.pp", "parallel.ep"):
        assert "linear-attention-layouts" not in refused and "tp-divides-deltanet-heads" not in refused
        return
    if key == "parallel.tp":
        assert not refused  # (2 key heads, 4 value heads: one key head and its two value heads per rank)
        three = load_config("tiny-hybrid", DN3)
        three.parallel = cfg.parallel
        three = {r.rule: r.message for r in layout_refusals(three)}
        assert three == {"tp-divides-deltanet-heads": (
            "parallel.tp = 2 must divide the Gated DeltaNet key heads and value heads (3 and 6: each TP rank holds "
            "whole key heads and the value heads they serve); the degrees this model allows are [1], or set "
            "model.deltanet.key_heads / value_heads.")}
        return
    assert "linear-attention-layouts" in refused
    assert "Gated DeltaNet" in refused["linear-attention-layouts"] and f"{key} = 2" in refused["linear-attention-layouts"]
    assert "linear-attention-layouts" not in {r.rule for r in layout_refusals(load_config("tiny-hybrid"))}


@pytest.mark.parametrize("overrides, match", [
    ({"data.attention": "document"}, r"data.attention = 'document' is not supported with linear-attention blocks"),
    ({"optim.name": "muon"}, r"optim.name = 'muon' is not supported with linear-attention blocks"),
])
def test_what_else_linear_attention_does_not_run_with_yet_is_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny-hybrid", overrides)


def test_export_refuses_a_hybrid_model():
    from lmforge.interop.hf import hf_family

    with pytest.raises(ValueError, match="make Gated DeltaNet blocks, which LlamaForCausalLM"):
        hf_family(ModelConfig(**{**HYBRID, "attn_gate": False}, full_attention_interval=4))


def test_the_tiny_hybrid_preset_is_the_3_to_1_pattern():
    m = load_config("tiny-hybrid").model
    assert [m.is_linear_layer(i) for i in range(m.n_layers)] == [True, True, True, False]
    assert (m.attn_gate, m.qk_norm, m.rope_dim, m.deltanet_shape) == (True, True, 8, (2, 4, 48, 48))
    assert count_params(m)["total"] == 2_603_944


@pytest.mark.slow
def test_tiny_hybrid_trains_through_lmforge_train(corpus, tmp_path):  # noqa: F811
    """`lmforge train --config tiny-hybrid` for a few steps (the small test corpus and width; four
    blocks, so the 3:1 pattern stays): the loss falls, and the run's config keeps the pattern."""
    out = tmp_path / "hybrid"
    proc = train(corpus, out, **{"config": "tiny-hybrid", "model.n_layers": 4, "train.steps": 6,
                                 "train.log_every": 1})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in recs if "loss" in r and "val_loss" not in r]
    assert len(loss) == 6 and loss[-1] < loss[0]
    assert "full_attention_interval = 4" in (out / "config.toml").read_text()


MOE = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 128}


@pytest.mark.slow
def test_tiny_hybrid_under_ddp_fsdp2_tensor_pipeline_and_expert_parallelism_matches_one_process(corpus, tmp_path):  # noqa: F811
    """The layouts a hybrid model runs under give one process's per-step losses and gradient norms:
    DDP, FSDP2 and a 2-stage pipeline (1F1B: blocks 1-2 Gated DeltaNet, then one of each) with AdamW;
    TP over 2 ranks (tiny-hybrid's 2 key heads and 4 value heads: one key head and its two value heads
    per rank) with AdamW and its sample drawn on the sharded model, and TP + sequence parallelism with
    plain SGD (tests/test_parallel_dp.py's `SGD`: a gradient of the wrong scale changes the curve;
    the gated norm's weight gradient, summed over the ranks' heads, and the sharded convolutions' and
    gates' gradients all count in it); and with MoE blocks (4 experts, top-2) expert parallelism over
    2 ranks with SGD."""
    shared = {"config": "tiny-hybrid", "model.n_layers": 4, "train.steps": 6, "train.log_every": 1}
    # (EP: 2 micro-batches of 4 sequences over the ranks, as one process's: the balance loss is per micro-batch)
    singles = {tmp_path / "single": {}, tmp_path / "single-moe-sgd": {**MOE, **SGD, "train.micro_batch_size": 4},
               tmp_path / "single-sgd": SGD}
    proc = train_runs(corpus, singles, **shared)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {tmp_path / "ddp2": {"parallel.dp_replicate": 2}, tmp_path / "fsdp2": {"parallel.dp_shard": 2},
            tmp_path / "pp2": {"parallel.pp": 2},
            tmp_path / "ep2-moe-sgd": {**MOE, **SGD, "parallel.dp_shard": 2, "parallel.ep": 2, "train.micro_batch_size": 2},
            tmp_path / "tp2": {"parallel.tp": 2},
            tmp_path / "tp2-sp-sgd": {**SGD, "parallel.tp": 2, "parallel.sequence_parallel": "true"}}
    proc = train_runs(corpus, runs, nproc=2, timeout=400, **shared)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for out in runs:
        ref = "single" + ("-moe" if "moe" in out.name else "") + ("-sgd" if "sgd" in out.name else "")
        assert_runs_match(out, tmp_path / ref, f"tiny-hybrid, {out.name} vs one process")
    # the TP run's sample, drawn on the sharded model with each rank's DeltaNet state, is one process's
    assert sample(tmp_path / "tp2") == sample(tmp_path / "single") != ""


def sample(run) -> str:
    """The sample a run printed at its end (its summary's)."""
    return json.loads((run / "summary.json").read_text()).get("sample", "")


@pytest.mark.slow
def test_the_plan_of_a_hybrid_under_tensor_parallelism_is_certified(monkeypatch, capsys):
    """`lmforge plan --verify` of tiny-hybrid at tp = 2: the toy keeps a Gated DeltaNet block and a
    full-attention one, trains like one process, resumes in one, and each rank holds the bytes the planner
    counts for it (the DeltaNet projections, convolutions and gates split, the gated norm whole)."""
    from lmforge.cli.plan import plan_main
    from tests import warm_start

    warm_start.warm_exec(monkeypatch)
    code = plan_main("--model tiny-hybrid --gpus 2xH100 --layout dp=1,tp=2 --precision fp32 --verify".split())
    out = capsys.readouterr().out
    out = out[out.index("verify:"):]
    assert code == 0 and "verify: PASS (3 checks)" in out, out
    assert "blocks linear_attention / full_attention" in out and "PASS  memory per rank" in out, out
