"""μP (model.parametrization = "mup", lmforge.model.mup): the coordinate check (activation changes
flat across widths under μP, growing under SP), the per-class init scales and learning-rate
multipliers (Adam family, SGD, Muon), the 1/head_dim attention scale, the logits multiplier, μP at
the base width being SP exactly, HF export folding the multipliers (transformers' logits = lmforge's),
checkpoints refusing to resume across parametrizations, multi-token prediction under μP (the shared
head's multiplier), the config errors (no rule for LAMB / Adafactor, MLA refused), and sharded layouts
(ZeRO-1, FSDP2, TP, PP) training a μP model as one process does (loss and gradient norm). (The CPU LR-transfer experiment: benchmarks/mup_transfer.py.)"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.ckpt.checkpointer import check_compatible
from lmforge.config import Config, ConfigError, ModelConfig, OptimConfig, ScheduleConfig, load_config
from lmforge.config.sections import MoEConfig
from lmforge.model import mup
from lmforge.model.transformer import build_model
from lmforge.optim.optimizers import build_optimizer, schedule_lr
from lmforge.optim.schedules import build_scheduler
from lmforge.train.coord_check import coordinate_check, growth_exponents
from tests.test_parallel_dp import assert_runs_match, corpus, train_runs  # noqa: F401  (module-scoped corpus fixture)

BASE = ModelConfig(vocab_size=128, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, mup_base_width=32)
WIDE = replace(BASE, dim=128, parametrization="mup")  # m = 4; head_dim 32 against the base's 8
MOE = replace(WIDE, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=96))


def _steps(model, optimizer, n: int = 3, seed: int = 0) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (4, 17), generator=gen)
    out = []
    for _ in range(n):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


# ---- the coordinate check ------------------------------------------------------------------------

WIDTHS = [64, 128, 256, 512]
COORD = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, mup_base_width=64)
COORD_OPTIM = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.0)


@pytest.mark.slow
def test_coordinate_check_is_flat_under_mup_and_grows_under_sp():
    """6 AdamW steps at lr 1e-2 on one batch, widths 64..512 (GQA, SwiGLU, fused q/k/v, tied embeddings):
    the exponent of each layer's activation change against width. Measured (seeds 0-3): μP -0.38 .. -0.05
    (flat: the base is small, so the narrowest models move slightly more), SP 0.8 (logits) to 3 (the
    blocks). Without μP's init scales the blocks' exponents are 0.5-0.9, without its logits multiplier the
    logits' 1.0: the bounds below catch both (checked by mutation); the attention scale shows in the
    attention scores' exponent by only ~+0.45 over so few steps, so it is tested exactly below."""
    torch.set_num_threads(1)
    exps = {p: growth_exponents(coordinate_check(replace(COORD, parametrization=p), WIDTHS, COORD_OPTIM))
            for p in ("sp", "mup")}
    print("\ngrowth exponents:", {p: {k: round(v, 2) for k, v in e.items()} for p, e in exps.items()})
    assert set(exps["mup"]) == {"logits", *(f"block{i}.{k}" for i in range(2)
                                            for k in ("attn_scores", "attn", "mlp", "out"))}
    assert all(-0.5 < e < 0.25 for e in exps["mup"].values()), exps["mup"]
    assert exps["sp"]["logits"] > 0.5, exps["sp"]
    assert all(exps["sp"][f"block{i}.{k}"] > 1.0 for i in range(2) for k in ("attn", "mlp", "out")), exps["sp"]


# ---- the parametrization itself ------------------------------------------------------------------

@pytest.mark.parametrize("optim", ["adamw", "sgd", "muon"])
def test_mup_at_its_base_width_is_sp_exactly(optim):
    sp = build_model(BASE, seed=3)
    mp = build_model(replace(BASE, parametrization="mup"), seed=3)
    assert all(torch.equal(a, b) for a, b in zip(sp.state_dict().values(), mp.state_dict().values()))
    cfg = OptimConfig(name=optim, lr=0.05 if optim == "sgd" else 3e-3)
    assert _steps(sp, build_optimizer(cfg, sp)) == _steps(mp, build_optimizer(cfg, mp))
    assert all(torch.equal(a, b) for a, b in zip(sp.state_dict().values(), mp.state_dict().values()))


def test_init_scales_follow_the_table():
    """At m = 4 the hidden matrices start at init_std / 2 (residual projections / sqrt(2 n_layers) too),
    the router at init_std / 4, the embedding (tied head) at init_std: measured on the tensors."""
    sp, mp = build_model(replace(MOE, parametrization="sp"), seed=0), build_model(MOE, seed=0)
    std = lambda m, name: m.get_parameter(name).float().std().item()  # noqa: E731
    for name, factor in [("blocks.0.attn.wqkv.weight", 0.5), ("blocks.0.attn.wo.weight", 0.5),
                         ("blocks.1.mlp.experts.w_gate", 0.5), ("blocks.1.mlp.experts.w_down", 0.5),
                         ("blocks.0.mlp.router.weight", 0.25), ("tok_emb.weight", 1.0)]:
        assert std(mp, name) == pytest.approx(factor * std(sp, name), rel=0.03), name
    assert std(mp, "blocks.0.attn.wo.weight") == pytest.approx(0.02 / 2 / math.sqrt(4), rel=0.05)
    # the fused q/k/v weight starts as the separate projections would, under μP too
    separate = build_model(replace(MOE, fused_qkv=False), seed=0)
    from lmforge.model.layers import fuse_qkv

    attn = separate.blocks["0"].attn
    assert torch.equal(mp.blocks["0"].attn.wqkv.weight, fuse_qkv(MOE, attn.wq.weight, attn.wk.weight, attn.wv.weight))


def _lr_by_name(optimizer) -> dict[str, tuple[float, float]]:
    return {n: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for n in g["param_names"]}


@pytest.mark.parametrize("optim,hidden,vector,router,decay", [
    ("adamw", 1 / 4, 1, 1 / 4, True), ("adam", 1 / 4, 1, 1 / 4, False), ("lion", 1 / 4, 1, 1 / 4, True),
    ("adam8bit", 1 / 4, 1, 1 / 4, True), ("sgd", 1, 4, 1 / 4, False), ("momentum", 1, 4, 1 / 4, False)])
def test_learning_rate_multipliers_per_class(optim, hidden, vector, router, decay):
    """Each parameter's lr = optim.lr x its class's multiplier (m = 4); decoupled decay divided by it; the
    schedule multiplies every group alike, and the logged lr is the schedule's."""
    model = build_model(replace(MOE, tie_embeddings=False), seed=0)
    opt = build_optimizer(OptimConfig(name=optim, lr=1e-3, weight_decay=0.1), model)
    lrs = _lr_by_name(opt)
    want = {"blocks.0.attn.wqkv.weight": hidden, "blocks.1.mlp.experts.w_up": hidden, "blocks.0.mlp.router.weight": router,
            "tok_emb.weight": vector, "lm_head.weight": vector, "norm.weight": vector}
    for name, mult in want.items():
        assert lrs[name][0] == pytest.approx(1e-3 * mult), name
    wd = lrs["blocks.0.attn.wqkv.weight"][1]
    assert wd == pytest.approx(0.1 / hidden if decay else 0.1)
    assert {g["group"] for g in opt.param_groups} >= {"decay.hidden", "decay.readout", "no_decay"}
    sched = build_scheduler(ScheduleConfig(warmup_steps=2), opt, 1e-3, 10)
    for _ in range(4):
        opt.step()
        sched.step()
        now = _lr_by_name(opt)
        for name, mult in want.items():
            assert now[name][0] == pytest.approx(schedule_lr(opt) * mult), name
    assert schedule_lr(opt) == pytest.approx(sched.get_last_lr()[-1] / opt.param_groups[-1]["lr_mult"])


def test_muon_keeps_its_own_scale_and_trains_under_mup():
    """Muon's matrices keep optim.muon_lr (its sqrt(max(1, rows/cols)) scale already meets the spectral
    condition); the router (a readout in a Muon group) takes 1/sqrt(m), the AdamW part the Adam column.
    A few steps of a μP MoE model with fused q/k/v (q, k, v orthogonalised apart) train."""
    model = build_model(MOE, seed=0)
    opt = build_optimizer(OptimConfig(name="muon", lr=1e-3, muon_lr=0.02), model)
    lrs = _lr_by_name(opt)
    assert lrs["blocks.0.attn.wqkv.weight"][0] == lrs["blocks.0.attn.wo.weight"][0] == 0.02
    assert lrs["blocks.0.mlp.router.weight"][0] == pytest.approx(0.02 / 2)
    assert lrs["tok_emb.weight"][0] == lrs["norm.weight"][0] == 1e-3
    qkv = [g for g in opt.param_groups if g.get("qkv_heads")]
    assert qkv and all(g["group"] == "muon.hidden" for g in qkv)
    losses = _steps(model, opt, n=5)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_scale_is_sqrt_base_head_dim_over_head_dim(qk_norm):
    """Attention under μP equals SDPA with scale sqrt(base head_dim) / head_dim (8 and 32 here: 1/ (2 sqrt 32)),
    computed from the SP layer's q, k, v: μP's 1/head_dim attention, equal to SP at the base width."""
    cfg = replace(WIDE, qk_norm=qk_norm, init_std=0.2)
    attn = build_model(cfg, seed=0).blocks["0"].attn
    x = torch.randn(2, 10, cfg.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = attn(x, None)
        attn.q_scale = 1.0  # (the plain projections)
        q, k, v = attn.project(x)

        def attend(scale):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
            return attn.wo(out.transpose(1, 2).reshape(2, 10, -1))

        assert torch.allclose(got, attend(math.sqrt(8) / 32), atol=1e-6)
        assert not torch.allclose(got, attend(1 / math.sqrt(32)), atol=1e-3)


def test_logits_multiplier_and_fused_loss():
    """The logits are the head's output of the final norm x 1/m; the fused chunked loss sees the same."""
    model = build_model(WIDE, seed=0)
    tokens = torch.randint(0, WIDE.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = model.norm(model.blocks["1"](model.blocks["0"](model.tok_emb(tokens), (model.rope_cos, model.rope_sin)),
                                         (model.rope_cos, model.rope_sin)))
        assert torch.allclose(model(tokens), model.lm_head(h) / 4, atol=1e-6)
        targets = tokens.roll(-1, 1)
        plain = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum")
        assert model(tokens, targets=targets, loss_chunk=5).item() == pytest.approx(plain.item(), rel=1e-5)


def test_multi_token_prediction_under_mup():
    """model.mtp_depth: the MTP depths share the head, so their head inputs take the logits multiplier 1/m
    too (each depth's NLL against the formula written out); their projection (2 dim -> dim) and blocks are
    hidden matrices: init x 1/sqrt(m), Adam lr x 1/m; their norms vector-like."""
    cfg = replace(WIDE, dim=64, tie_embeddings=False, mtp_depth=2)  # m = 2
    model = build_model(cfg, seed=0).train()
    x, y = torch.randint(0, cfg.vocab_size, (2, 12)), torch.randint(0, cfg.vocab_size, (2, 12))
    model(x, targets=y)
    got = model.mtp.take_stats()[:, 0]
    rope = (model.rope_cos, model.rope_sin)
    with torch.no_grad():
        h = model.tok_emb(x)
        for block in model.blocks.values():
            h = block(h, rope)
        for k, module in enumerate(model.mtp.values(), start=1):
            h = module(model.tok_emb(x.roll(-k, 1)), h, rope)
            logits = model.lm_head(module.norm(h)) / 2
            want = F.cross_entropy(logits[:, :-k].flatten(0, 1), y[:, k:].flatten(), reduction="sum")
            assert got[k - 1].item() == pytest.approx(want.item(), rel=1e-5), k
    sp = build_model(replace(cfg, parametrization="sp"), seed=0)
    std = lambda m, name: m.get_parameter(name).float().std().item()  # noqa: E731
    for name in ("mtp.0.proj.weight", "mtp.1.block.attn.wqkv.weight"):
        assert std(model, name) == pytest.approx(std(sp, name) / math.sqrt(2), rel=0.03), name
    lrs = _lr_by_name(build_optimizer(OptimConfig(name="adamw", lr=1e-3), model))
    assert lrs["mtp.0.proj.weight"][0] == lrs["mtp.1.block.mlp.up.weight"][0] == pytest.approx(1e-3 / 2)
    assert lrs["mtp.0.emb_norm.weight"][0] == lrs["mtp.1.norm.weight"][0] == 1e-3


def test_config_rules():
    with pytest.raises(ConfigError, match="model.mup_base_width"):
        ModelConfig(parametrization="mup").check()
    with pytest.raises(ConfigError, match="mup_base_head_dim"):
        ModelConfig(dim=96, n_heads=6, parametrization="mup", mup_base_width=64).check()
    with pytest.raises(ConfigError, match="optim.name = 'lamb'"):
        load_config("tiny", {"model.parametrization": "mup", "model.mup_base_width": 96, "optim.name": "lamb"})
    with pytest.raises(ConfigError, match=r"multi-head latent attention \(model.mla.kv_lora_rank = 16\)"):
        load_config("tiny", {"model.parametrization": "mup", "model.mup_base_width": 96, "model.mla.kv_lora_rank": 16})
    cfg = load_config("tiny", {"model.parametrization": "mup", "model.mup_base_width": 96})
    assert mup.width_mult(cfg.model) == 2.0 and mup.attention_factor(cfg.model) == pytest.approx(math.sqrt(0.5))


def test_plan_verify_toy_keeps_mup_at_m_2():
    """`lmforge plan --verify`'s toy model of a μP config stays μP, its base width half the toy width."""
    from lmforge.plan.layout import Layout
    from lmforge.verify.toy import toy_run

    cfg = load_config("llama3.1-8b", {"model.parametrization": "mup", "model.mup_base_width": 1024})
    toy = toy_run(cfg, Layout.parse("dp=2,zero=3,tp=2,pp=2"))
    toy.config.validate()
    m = toy.config.model
    assert m.parametrization == toy.reference.model.parametrization == "mup"
    assert mup.width_mult(m) == 2.0 and mup.attention_factor(m) == pytest.approx(math.sqrt(0.5))


def test_checkpoints_record_the_parametrization_and_refuse_the_other(tmp_path):
    """A μP checkpoint does not resume as SP (nor the reverse); a checkpoint written before the key existed
    is SP; under SP the μP base shapes do not matter."""
    sp = load_config("tiny")
    mp = load_config("tiny", {"model.parametrization": "mup", "model.mup_base_width": 96})
    meta = lambda cfg: {"config": cfg.to_dict(), "optimizer": cfg.optim.name}  # noqa: E731
    with pytest.raises(ConfigError, match="model.parametrization: checkpoint 'mup', config 'sp'"):
        check_compatible(meta(mp), sp, tmp_path)
    with pytest.raises(ConfigError, match="model.parametrization: checkpoint 'sp', config 'mup'"):
        check_compatible(meta(sp), mp, tmp_path)
    with pytest.raises(ConfigError, match="model.mup_base_width"):
        check_compatible(meta(load_config("tiny", {"model.parametrization": "mup", "model.mup_base_width": 48})),
                         mp, tmp_path)
    old = meta(sp)
    for key in ("parametrization", "mup_base_width", "mup_base_head_dim"):
        del old["config"]["model"][key]
    check_compatible(old, sp, tmp_path)
    check_compatible(meta(load_config("tiny", {"model.mup_base_width": 48})), sp, tmp_path)
    assert isinstance(Config().model.parametrization, str)


# ---- HF export: the multipliers folded into a standard model -----------------------------------------

EXPORTS = {
    "llama_gqa_untied": dict(tie_embeddings=False),
    "llama_tied_separate_qkv_bias": dict(bias=True, fused_qkv=False),
    "qwen3_qk_norm": dict(qk_norm=True),
    "gpt2": dict(n_kv_heads=None, pos_emb="learned", norm="layernorm", activation="gelu", bias=True),
    "mixtral": dict(tie_embeddings=False, ffn_hidden=64, moe=MoEConfig(num_experts=4, top_k=2)),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_hf_export_folds_the_multipliers(name, tmp_path):
    pytest.importorskip("transformers")
    from lmforge.interop.hf import export_hf
    from tests.test_interop_hf import _hf_logits, _tokens

    cfg = replace(WIDE, init_std=0.2, **EXPORTS[name])
    model = build_model(cfg, seed=0).eval()
    with torch.no_grad():  # random norm gains and biases: a fold into the wrong tensor shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    export_hf(model, tmp_path / "hf")
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
    theirs = _hf_logits(tmp_path / "hf", tokens)
    assert (ours - theirs).abs().max().item() < 1e-4 * max(1.0, ours.abs().max().item())
    assert (ours - theirs).abs().max().item() < 1e-2 * ours.std().item()


# ---- sharded layouts train a μP model as one process does -----------------------------------------

MUP_RUN = {"model.parametrization": "mup", "model.mup_base_width": 32, "model.tie_embeddings": "false",
           "train.steps": 8, "train.log_every": 1, "schedule.warmup_steps": 2, "train.sample_tokens": 0,
           "checkpoint.every_steps": 0, "checkpoint.save_final": "false"}
LAYOUTS = {"zero1": {"parallel.dp_shard": 2, "parallel.zero_stage": 1},
           "fsdp": {"parallel.dp_shard": 2, "parallel.zero_stage": 3},
           "tp": {"parallel.tp": 2}, "pp": {"parallel.pp": 2}}


@pytest.mark.slow
def test_sharded_layouts_train_a_mup_model_like_one_process(corpus, tmp_path):  # noqa: F811
    """ZeRO-1 (rebuilds the param groups per rank), FSDP2 (DTensor shards, sharded init), tensor parallelism
    (splits groups by DTensor) and the pipeline (its last stage applies the logits multiplier) against one process: same losses and gradient
    norms (1e-5 relative) over 8 steps of a μP model at m = 2; the μP run differs from the SP one."""
    single = {tmp_path / "one": {}, tmp_path / "sp": {"model.parametrization": "sp"}}
    proc = train_runs(corpus, single, **{**MUP_RUN, "train.micro_batch_size": 4})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {tmp_path / name: layout for name, layout in LAYOUTS.items()}
    proc = train_runs(corpus, runs, nproc=2, timeout=600, **MUP_RUN)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in LAYOUTS:
        assert_runs_match(tmp_path / name, tmp_path / "one", f"μP {name} vs one process")
    from tests.test_parallel_dp import losses

    assert losses(tmp_path / "one") != losses(tmp_path / "sp")
    assert load_config(str(Path(tmp_path / "one" / "config.toml"))).model.parametrization == "mup"
