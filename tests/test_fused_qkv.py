"""Fused QKV (model.fused_qkv): one `attn.wqkv` matmul in kv-head-grouped rows against the separate
wq/wk/wv: the same initial values, the same function and gradients, HF export/import bit-equal, and
checkpoints of either layout resume in the other. (Tensor parallel parity: tests/test_parallel_mp.py's
ATTENTION_OPTIONS; sharded initialisation: tests/test_sharded_init.py.)"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from lmforge.config import ModelConfig, load_config
from lmforge.model.layers import fuse_qkv, qkv_layout, split_qkv
from lmforge.model.transformer import build_model
from tests.test_parallel_dp import corpus  # noqa: F401  (module-scoped prepared corpus fixture)

# GQA (3 query heads per kv head), q/k/v biases and QK-norm: every part the fused layout touches
# (the separate layout, set explicitly: model.fused_qkv is on by default)
CFG = ModelConfig(vocab_size=96, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, max_seq_len=32, qkv_bias=True,
                  qk_norm=True, tie_embeddings=False, fused_qkv=False)
FUSED = replace(CFG, fused_qkv=True)
PARTS = ("wq", "wk", "wv")


def as_fused(cfg: ModelConfig, state: dict) -> dict:
    """A separate-layout state dict in the fused layout (LoRA adapters as they are)."""
    out = {k: v for k, v in state.items() if "lora" in k or not any(f"attn.{w}." in k for w in PARTS)}
    for k in state:
        if "attn.wq." in k and "lora" not in k:
            out[k.replace("attn.wq.", "attn.wqkv.")] = fuse_qkv(cfg, *(state[k.replace("attn.wq.", f"attn.{w}.")]
                                                                      for w in PARTS))
    return out


def randomised(model):
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def test_layout_groups_each_kv_heads_queries_then_its_key_and_value():
    part, row = qkv_layout(CFG)
    hd = CFG.head_dim
    per_group = (3 + 2) * hd
    assert len(part) == 2 * per_group
    # group 1: query heads 3, 4, 5, then kv head 1's key, then its value
    g1 = slice(per_group, 2 * per_group)
    assert part[g1].tolist() == [0] * 3 * hd + [1] * hd + [2] * hd
    assert row[g1].tolist() == list(range(3 * hd, 6 * hd)) + list(range(hd, 2 * hd)) * 2
    q, k, v = torch.randn(6 * hd, 4), torch.randn(2 * hd, 4), torch.randn(2 * hd, 4)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(CFG, fuse_qkv(CFG, q, k, v)), (q, k, v)))


def test_fused_model_starts_as_the_separate_one_and_computes_the_same_loss_and_gradients():
    """Same seed: the fused weight is the separate weights' rows (init by their names and rows); after
    randomising both alike, the logits are equal and so are the loss and every gradient."""
    sep, fused = build_model(CFG, seed=3), build_model(FUSED, seed=3)
    want = as_fused(CFG, sep.state_dict())
    got = fused.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)
    fused.load_state_dict(as_fused(CFG, randomised(sep).state_dict()))
    tokens = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (sep, fused):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    grads = {n: p.grad for n, p in sep.named_parameters()}
    fused_grads = as_fused(CFG, grads)
    for n, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, fused_grads[n], rtol=1e-5, atol=1e-7)
    norm = lambda gs: torch.linalg.vector_norm(torch.stack([g.norm() for g in gs]))  # noqa: E731
    torch.testing.assert_close(norm([p.grad for p in fused.parameters()]), norm(list(grads.values())), rtol=1e-6,
                               atol=0)


def test_any_rows_of_the_fused_initialisation_are_those_of_the_whole():
    """What a tensor-parallel rank draws (its kv groups' rows, or any rows) equals the same rows of a
    single process's fused weight."""
    from lmforge.model.init import init_source

    with torch.device("meta"):
        model = build_model.__globals__["Transformer"](FUSED)
    layer = model.blocks["0"].attn.wqkv
    source = init_source(FUSED, seed=11)
    shape = tuple(layer.weight.shape)
    whole = source("blocks.0.attn.wqkv.weight", layer, "blocks.0.attn.wqkv", "weight", shape, (None, None),
                   torch.float32)
    for rows in (torch.arange(shape[0] // 2, shape[0]), torch.tensor([0, 9, 17, 40, shape[0] - 1])):
        part = source("blocks.0.attn.wqkv.weight", layer, "blocks.0.attn.wqkv", "weight", shape,
                      (rows, torch.arange(3, 20)), torch.float32)
        assert torch.equal(part, whole[rows][:, 3:20])


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2"])
def test_hf_export_and_import_of_a_fused_model_are_bit_equal_to_the_separate_ones(family, tmp_path):
    """export_hf of a fused model writes exactly the separate model's q_proj/k_proj/v_proj (GPT-2: c_attn)
    tensors; reading that folder into a fused model (fine-tuning's init_from path) gives back the fused
    weights bit for bit."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from lmforge.interop.hf import export_hf
    from lmforge.train.finetune import load_pretrained

    kw = {"qwen2": dict(qk_norm=False), "qwen3": dict(qkv_bias=False),
          "gpt2": dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True, qkv_bias=None,
                       qk_norm=False, n_kv_heads=None)}[family]
    cfg = replace(CFG, **kw)
    sep = randomised(build_model(cfg, seed=0))
    fused = build_model(replace(cfg, fused_qkv=True), seed=1)
    fused.load_state_dict(as_fused(cfg, sep.state_dict()))
    export_hf(sep, tmp_path / "sep")
    export_hf(fused, tmp_path / "fused")
    want, got = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("sep", "fused"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    back = build_model(replace(cfg, fused_qkv=True), seed=2)
    load_pretrained(back, tmp_path / "sep")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in fused.state_dict().items())


SMALL = {
    "model.vocab_size": 320, "model.dim": 48, "model.n_layers": 2, "model.n_heads": 6, "model.n_kv_heads": 2,
    "model.qkv_bias": True, "model.max_seq_len": 64, "data.seq_len": 32, "data.tokenizer_vocab_size": 320,
    "train.global_batch_size": 8, "train.micro_batch_size": 4, "train.steps": 8, "train.eval_every": 0,
    "train.eval_sequences": 8, "train.log_every": 1, "train.sample_tokens": 0, "train.precision": "fp32",
    "train.tensorboard": False, "train.plot": False, "train.progress": "none", "schedule.warmup_steps": 2,
    "optim.lr": 3e-3, "checkpoint.every_steps": 4, "checkpoint.async_save": False,
}


LORA = {"finetune.lora_rank": 4, "finetune.lora_targets": "wq,wv,wo", "finetune.merge_lora": False}


def test_muon_orthogonalises_q_k_v_of_the_fused_weight_apart_bit_equal_to_the_separate_layout():
    """Muon on the fused wqkv (its own Muon group, with qkv_heads) takes the steps it takes on the separate
    wq, wk, wv: each orthogonalised and scaled on its own. Given the same gradients, three steps leave
    the weights bit-equal to the separate model's (fused). Orthogonalising the fused matrix as one
    (the group without qkv_heads) gives other weights."""
    from lmforge.optim.muon import build

    cfg = load_config("tiny", {"optim.name": "muon", "optim.muon_lr": 0.05}).optim
    sep = randomised(build_model(CFG, seed=3))
    fused, whole = build_model(FUSED, seed=4), build_model(FUSED, seed=4)
    for m in (fused, whole):
        m.load_state_dict(as_fused(CFG, sep.state_dict()))
    opts = [build(m, cfg, {}) for m in (sep, fused, whole)]
    qkv = [g for g in opts[1].param_groups if g["qkv_heads"] is not None]
    assert len(qkv) == 1 and qkv[0]["qkv_heads"] == (3, CFG.head_dim) and qkv[0]["group"] == "muon"
    assert all(n.endswith("attn.wqkv.weight") for n in qkv[0]["param_names"]) and len(qkv[0]["param_names"]) == 2
    for g in opts[2].param_groups:
        g["qkv_heads"] = None  # (as before: the fused matrix orthogonalised as one)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in sep.named_parameters()}
        for model, opt in zip((sep, fused, whole), opts, strict=True):
            given = grads if model is sep else as_fused(CFG, grads)
            for n, p in model.named_parameters():
                p.grad = given[n].clone()
            opt.step()
    want, got, other = as_fused(CFG, sep.state_dict()), fused.state_dict(), whole.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert not torch.equal(other["blocks.0.attn.wqkv.weight"], want["blocks.0.attn.wqkv.weight"])


@pytest.mark.parametrize("lora,optim", [(False, "adamw"), (True, "adamw"), (False, "muon")],
                         ids=["full", "lora-wq-wv", "muon"])
@pytest.mark.parametrize("saved_fused", [False, True], ids=["old-separate-checkpoint", "fused-checkpoint"])
def test_a_checkpoint_of_either_layout_resumes_in_the_other(small_data, tmp_path, saved_fused, lora, optim):
    """A run saved with one q/k/v layout (False: the separate wq/wk/wv keys every checkpoint before
    model.fused_qkv has) resumes at step 4 with the other: weights and AdamW moments are converted on
    load, and steps 5-8 give the straight run's losses and gradient norms, and its final weights.
    With LoRA on some of q/k/v (wq, wv) the adapters and their moments carry over under the other
    layout's names (attn.wq.lora_a <-> attn.wqkv.lora.wq.lora_a). With Muon the momentum buffers
    convert, the fused layout's q/k/v group keeps its qkv_heads whatever the checkpoint's groups,
    and q, k and v are orthogonalised apart in either layout (else the runs would part)."""
    from lmforge.train.trainer import Trainer
    from tests.test_parallel_dp import assert_runs_match

    def run(out, fused: bool, **extra):
        trainer = Trainer(load_config("tiny", {**SMALL, "model.fused_qkv": fused, "optim.name": optim,
                                               **(LORA if lora else {}), **extra}),
                          out_dir=out, data=small_data)
        trainer.fit()
        return trainer

    straight = run(tmp_path / "straight", saved_fused)
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step_00000004", out / "checkpoints" / "step_00000004")
    resumed = run(out, not saved_fused)
    assert resumed.resumed_from.name == "step_00000004"
    assert_runs_match(out, tmp_path / "straight", "resumed in the other q/k/v layout", steps=list(range(5, 9)))
    cfg = straight.model.cfg
    want, got = (as_separate_adapters(m.state_dict()) for m in (straight.model, resumed.model))
    if not saved_fused:
        want = as_fused(cfg, want)
    else:
        got = as_fused(cfg, got)
    assert got.keys() == want.keys() and any("lora" in k for k in got) == lora
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


def as_separate_adapters(state: dict) -> dict:
    """A fused model's state dict with its q/k/v part adapters (attn.wqkv.lora.<part>.lora_a) under the
    separate layout's names (attn.<part>.lora_a); other names as they are."""
    return {k.replace("attn.wqkv.lora.", "attn."): v for k, v in state.items()}


def trained_pair(targets: str, steps: int = 4, rank: int = 4, alpha: float = 8.0):
    """A separate-layout model and the fused one with the same weights (converted with fuse_qkv) and the
    same LoRA targets (adapters drawn with the same seed), both trained `steps` AdamW steps on the same
    batch in fp32; returns them and each step's (loss, gradient norm) per model."""
    from lmforge.model.lora import apply_lora

    sep = randomised(build_model(CFG, seed=3))
    fused = build_model(FUSED, seed=4)
    fused.load_state_dict(as_fused(CFG, sep.state_dict()))
    for model in (sep, fused):
        apply_lora(model, targets, rank=rank, alpha=alpha, seed=7)
    tokens = torch.randint(0, CFG.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    history: dict = {"sep": [], "fused": []}
    for key, model in (("sep", sep), ("fused", fused)):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(steps):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e9)
            opt.step()
            history[key].append((loss.item(), norm.item()))
    return sep, fused, history


# AdamW's step is m / sqrt(v): an element whose gradient is near zero moves by up to lr (1e-2 here)
# whatever its size, so the rounding of the fused matmul against the separate ones (a few ulps of
# the gradient) can move a trained adapter element by far more than its own rounding. Measured:
# 1.07e-5 at one element of 192 after 4 steps ("wq,wv", AVX512-BF16 Xeon, 2026-11-26; 0 elsewhere
# before); the losses and gradient norms above stay within 1e-6 / 1e-5 relative on every CPU.
ADAPTER_ATOL = 5e-5


@pytest.mark.parametrize("targets", ["wq,wv", "wq,wk,wv,wo", "attn.wk,up"])
def test_lora_on_some_or_all_of_q_k_v_of_the_fused_layer_trains_as_the_separate_layout(targets):
    """LoRA targets naming some of q/k/v (the common wq,wv) or all of them on the fused wqkv: one
    adapter per named part, the separate projection's (same shapes, same initial values, same names
    under attn.wqkv.lora), so the trainable parameter count, every step's loss and gradient norm
    (fp32, 4 AdamW steps), the trained adapters and the merged weights are those of the separate
    layout with the same targets."""
    from lmforge.model.lora import FusedQKVLoRA, lora_parameters, merge_lora, merged_state_dict

    with torch.no_grad():  # (the adapters start alike: A by the separate names, B = 0)
        sep, fused, _ = trained_pair(targets, steps=0)
        assert as_separate_adapters(lora_parameters(fused)).keys() == lora_parameters(sep).keys()
        assert all(torch.equal(p, lora_parameters(sep)[k]) for k, p in as_separate_adapters(lora_parameters(fused)).items())
    sep, fused, history = trained_pair(targets)
    assert isinstance(fused.blocks["0"].attn.wqkv, FusedQKVLoRA)
    count = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (sep, fused)]
    assert count[0] == count[1] > 0
    for (loss, norm), (want_loss, want_norm) in zip(history["fused"], history["sep"], strict=True):
        assert abs(loss - want_loss) <= 1e-6 * want_loss and abs(norm - want_norm) <= 1e-5 * want_norm, history
    assert history["sep"][-1][0] < history["sep"][0][0]  # (the adapters did train)
    want = lora_parameters(sep)
    for k, p in as_separate_adapters(lora_parameters(fused)).items():
        torch.testing.assert_close(p, want[k], rtol=1e-5, atol=ADAPTER_ATOL)
    with torch.no_grad():
        from_tensors = merged_state_dict(fused.state_dict(), rank=4, alpha=8, cfg=FUSED)  # (as a saved file)
        merge_lora(sep)
        merge_lora(fused)
        got, want = fused.state_dict(), as_fused(CFG, sep.state_dict())
    assert got.keys() == want.keys() == from_tensors.keys()
    for k in got:
        assert torch.equal(from_tensors[k], got[k]), k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=ADAPTER_ATOL)


def test_lora_on_the_fused_layer_keeps_dropout_the_whole_layer_target_and_names_conflicts():
    """Adapter dropout applies on the fused layer (train mode differs, eval mode is exact); 'wqkv' still
    puts one adapter over all its rows; naming both 'wqkv' and a part of it is a ValueError; the
    model starts as the base model either way."""
    from lmforge.model.lora import LoRALinear, apply_lora

    tokens = torch.randint(0, FUSED.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model = build_model(FUSED, seed=0)
    before = model(tokens).detach()
    assert apply_lora(model, "wq,wv,wo", rank=4, alpha=8, dropout=0.5, seed=0) == [
        f"blocks.{i}.attn.{n}" for i in range(2) for n in ("wqkv", "wo")]
    assert torch.equal(model(tokens), before)  # B = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1)
    model.eval()
    evaluated = model(tokens)
    model.train()
    torch.manual_seed(0)
    trained = model(tokens)
    assert not torch.allclose(trained, evaluated) and not torch.allclose(evaluated, before)
    trained.sum().backward()
    assert model.blocks["0"].attn.wqkv.lora["wv"].lora_b.grad.abs().sum() > 0
    assert model.blocks["0"].attn.wqkv.weight.grad is None  # (frozen)
    whole = build_model(FUSED, seed=0)
    assert apply_lora(whole, "attn.wqkv", rank=4, seed=0) == ["blocks.0.attn.wqkv", "blocks.1.attn.wqkv"]
    assert isinstance(whole.blocks["0"].attn.wqkv, LoRALinear)
    with pytest.raises(ValueError, match="both one adapter on all of blocks.0.attn.wqkv.*wq"):
        apply_lora(build_model(FUSED, seed=0), "wqkv,wq")


def test_fused_part_adapters_materialise_with_the_separate_adapters_values():
    """On the meta device (how training builds a model) the part adapters get the initial values the
    separate projections' adapters get: the same seed gives the same A."""
    from lmforge.model.init import init_source
    from lmforge.model.lora import apply_lora
    from lmforge.model.transformer import Transformer

    with torch.device("meta"):
        sep, fused = Transformer(CFG), Transformer(FUSED)
    for model in (sep, fused):
        apply_lora(model, "wk,wv", rank=4, seed=0)
    fused_a = dict(fused.named_modules())["blocks.1.attn.wqkv.lora.wv"]
    sep_a = dict(sep.named_modules())["blocks.1.attn.wv"]
    got = init_source(FUSED, 5)("blocks.1.attn.wqkv.lora.wv.lora_a", fused_a, "blocks.1.attn.wqkv.lora.wv", "lora_a",
                                (4, CFG.dim), (None, None), torch.float32)
    want = init_source(CFG, 5)("blocks.1.attn.wv.lora_a", sep_a, "blocks.1.attn.wv", "lora_a", (4, CFG.dim),
                               (None, None), torch.float32)
    assert torch.equal(got, want) and got.abs().max() > 0


def test_the_planner_counts_the_fused_weight_as_the_model_holds_it():
    from lmforge.model.transformer import Transformer, count_params
    from lmforge.plan.memory import param_specs

    with torch.device("meta"):
        model = Transformer(FUSED)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [(s.name, s.shape)
                                                                          for s in param_specs(FUSED)]
    assert count_params(FUSED) == count_params(CFG)


# the overrides of this file's two parity tests' runs: the TP/SP/CP test's (`TP_SHARED`) and the LoRA test's
# (`LORA_SHARED`), trained in one launch per process count (`parity_runs`, tests/train_runs_driver.py)
TP_SHARED = {"model.n_layers": 2, "model.n_kv_heads": 2, "model.qkv_bias": "true", "model.qk_norm": "true",
             "checkpoint.every_steps": 5, "checkpoint.async_save": "false"}  # (+ test_parallel_mp's FAMILY_STEPS)
LORA_SHARED = {"model.n_layers": 2, "model.n_kv_heads": 2, "finetune.lora_rank": 4,
               "finetune.lora_targets": "wq,wv,wo,up", "train.steps": 6, "schedule.warmup_steps": 2, "train.log_every": 1}
TP2 = {"parallel.tp": 2}
SP = {"parallel.sequence_parallel": "true"}


@pytest.fixture(scope="module")
def parity_runs(corpus, tmp_path_factory):  # noqa: F811
    """ROOT/tp/<run> and ROOT/lora/<run>: one process (separate and fused layouts), then 2 ranks (the
    fused layout under TP=2, TP=2 + SP, CP=2, and TP=2 resuming the separate run's step-5 checkpoint;
    LoRA under TP=2 + SP), then 4 (FSDP2 x TP resuming it): three launches for both tests."""
    from tests.test_parallel_dp import train_runs
    from tests.test_parallel_mp import FAMILY_STEPS

    shared = {**TP_SHARED, **FAMILY_STEPS}
    root = tmp_path_factory.mktemp("fused-parity")
    tp, lora = root / "tp", root / "lora"
    old = str(tp / "separate" / "checkpoints" / "step_00000005")
    fused = {"model.fused_qkv": "true"}
    launches = [
        (1, {tp / "separate": {**shared, "model.fused_qkv": "false"}, tp / "fused": {**shared, **fused},
             lora / "separate": {**LORA_SHARED, "model.fused_qkv": "false"}, lora / "fused": {**LORA_SHARED, **fused}}),
        (2, {tp / "tp2": {**shared, **fused, **TP2}, tp / "tp2-sp": {**shared, **fused, **TP2, **SP},
             tp / "tp2-resumed": {**shared, **fused, **TP2, "checkpoint.resume": old},
             # (context parallel: the fused projection of a sequence shard)
             tp / "cp2": {**shared, **fused, "parallel.cp": 2},
             lora / "fused-tp2-sp": {**LORA_SHARED, **fused, **TP2, **SP}}),
        # FSDP2 x TP (2 x 2): the converted tensors placed on 2-D shards (FSDP2 shards TP's shards)
        (4, {tp / "fsdp2xtp2-resumed": {**shared, **fused, "parallel.dp_shard": 2, **TP2, "checkpoint.resume": old}})]
    for nproc, runs in launches:
        proc = train_runs(corpus, runs, nproc=nproc, timeout=120 + 60 * len(runs))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.mark.slow
def test_fused_qkv_under_tensor_and_sequence_parallel_matches_the_separate_layout_in_one_process(parity_runs):
    """TP=2, TP=2 + SP and CP=2 with the fused wqkv (GQA with 2 kv heads: one group per rank; q/k/v biases;
    QK-norm) against one process with the separate wq/wk/wv: the same per-step losses and gradient
    norms (tests/test_parallel_mp.py's tolerance), so the plain column split gives each rank exactly
    its heads' q, k and v rows."""
    from tests.test_parallel_dp import assert_runs_match
    from tests.test_parallel_mp import TOL

    ref = parity_runs / "tp" / "separate"
    assert_runs_match(parity_runs / "tp" / "fused", ref, "fused vs separate, one process", tol=TOL)
    # and the separate layout's step-5 checkpoint resumed by the TP=2 fused run (each rank's shard of the
    # weights and AdamW moments converted on load) and by FSDP2 x TP
    for name in ("tp2", "tp2-sp", "tp2-resumed", "cp2", "fsdp2xtp2-resumed"):
        steps = list(range(6, 11)) if name.endswith("-resumed") else None
        assert_runs_match(parity_runs / "tp" / name, ref, f"fused qkv, {name} vs separate in one process", steps=steps,
                          tol=TOL)


def test_generation_with_the_kv_cache_is_the_separate_models():
    """Greedy decoding with the KV cache (k and v are strided views of the fused output) gives the
    separate model's tokens, and the same as decoding without the cache."""
    from lmforge.eval.generate import generate_tokens

    sep = randomised(build_model(CFG, seed=0))
    fused = build_model(FUSED, seed=1)
    fused.load_state_dict(as_fused(CFG, sep.state_dict()))
    prompt = [5, 17, 3, 40]
    want = list(generate_tokens(sep, prompt, 12, temperature=0))
    assert list(generate_tokens(fused, prompt, 12, temperature=0)) == want
    assert list(generate_tokens(fused, prompt, 12, temperature=0, use_cache=False)) == want


def test_a_weights_file_of_either_layout_loads_into_the_other(tmp_path):
    """load_weights (load_run: generate, eval, export of a finished run) reads a model.safetensors
    with separate wq/wk/wv into a fused model and the reverse, bit for bit."""
    from lmforge.ckpt.export import load_weights, save_weights

    sep = randomised(build_model(CFG, seed=0))
    fused = build_model(FUSED, seed=1)
    fused.load_state_dict(as_fused(CFG, sep.state_dict()))
    save_weights(sep, tmp_path / "sep.safetensors")
    save_weights(fused, tmp_path / "fused.safetensors")
    into_fused, into_sep = build_model(FUSED, seed=2), build_model(CFG, seed=2)
    load_weights(into_fused, tmp_path / "sep.safetensors")
    load_weights(into_sep, tmp_path / "fused.safetensors")
    for got, want in ((into_fused, fused), (into_sep, sep)):
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())


def test_mixtral_conversion_maps_the_fused_weight_bit_equal():
    """lmforge.interop.hf_moe's state-dict mapping: a fused MoE model gives Mixtral exactly the separate
    model's q_proj/k_proj/v_proj, and Mixtral's weights come back fused."""
    from lmforge.config.sections import MoEConfig
    from lmforge.interop.hf_moe import from_mixtral_state_dict, to_mixtral_state_dict

    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64,
                      tie_embeddings=False, moe=MoEConfig(num_experts=4, top_k=2), fused_qkv=False)
    sep = randomised(build_model(cfg, seed=3))
    fused_cfg = replace(cfg, fused_qkv=True)
    fused_state = as_fused(cfg, sep.state_dict())
    want = to_mixtral_state_dict(cfg, sep.state_dict())
    got = to_mixtral_state_dict(fused_cfg, fused_state)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    back = from_mixtral_state_dict(fused_cfg, want)
    assert all(torch.equal(back[k], fused_state[k]) for k in back) and "blocks.0.attn.wqkv.weight" in back


@pytest.mark.slow
def test_lora_on_some_of_q_k_v_of_the_fused_layer_under_tensor_and_sequence_parallel(parity_runs):
    """LoRA wq,wv (+ wo, up) through `lmforge train`: the fused model in one process and under TP=2 + SP
    (each part adapter's B split by rows: the rank's kv groups) against the separate layout in one
    process: the same per-step losses and gradient norms, and the same merged weights saved."""
    from safetensors.torch import load_file

    from tests.test_parallel_dp import assert_runs_match
    from tests.test_parallel_mp import TOL

    ref, fused, tp = (parity_runs / "lora" / name for name in ("separate", "fused", "fused-tp2-sp"))
    for out in (fused, tp):
        assert_runs_match(out, ref, f"LoRA wq,wv: {out.name} vs separate in one process", tol=TOL)
    want = load_file(str(ref / "model.safetensors"))
    cfg = load_config(ref / "config.toml").model
    want = as_fused(cfg, want)
    for out in (fused, tp):
        have = load_file(str(out / "model.safetensors"))
        assert want.keys() == have.keys() and not any("lora" in k for k in have)  # merged on save
        for key in want:
            torch.testing.assert_close(have[key], want[key], rtol=0, atol=1e-5)


@pytest.mark.parametrize("extra", [{}, {"qk_norm": True}, {"pos_emb": "learned", "n_kv_heads": None}],
                         ids=["rope", "rope-qk-norm", "no-rope"])
def test_the_fused_layout_saves_the_activation_bytes_of_the_separate_one(extra):
    """What autograd keeps for backward (unique storages, weights excluded) is the same in both layouts:
    with RoPE, v is copied out of the fused output so that the v attention saves does not keep the
    whole q/k/v output alive; with QK-norm the q norm runs on q's view (it saves its input), not on a
    reshaped copy of it (GQA)."""
    from lmforge.parallel.activation_ckpt import saved_activation_bytes

    tokens = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    saved = []
    over = {"qk_norm": False, **extra}
    for cfg in (replace(CFG, **over), replace(CFG, fused_qkv=True, **over)):
        model = build_model(cfg, seed=0)
        saved.append(saved_activation_bytes(lambda m=model: m(tokens).sum(), exclude=list(model.parameters())))
    assert saved[1] == saved[0], saved
