"""train.precision = "bf16-pure" (lmforge.train.precision): every parameter cast to bf16 once per
step, the forward without autocast, so activations and the residual stream are bf16; fp32 master
weights whose fp32 gradients accumulate the micro-batches' bf16 gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmforge.config import load_config
from lmforge.model.lora import apply_lora
from lmforge.model.transformer import build_model
from lmforge.parallel.activation_ckpt import apply_activation_checkpointing
from lmforge.train.precision import make_precision
from tests.test_parallel_dp import corpus  # noqa: F401  (module-scoped corpus fixture)

CPU = torch.device("cpu")
SMALL = {"model.vocab_size": 320, "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
         "data.seq_len": 32, "data.tokenizer_vocab_size": 320}
GPT2_STYLE = {"model.pos_emb": "learned", "model.norm": "layernorm", "model.activation": "gelu", "model.bias": True}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def batches(vocab: int, n: int = 2) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().logsumexp(-1).mean()


def pure_step(model: nn.Module, xs: list[torch.Tensor]) -> list[float]:
    """One bf16-pure step over the micro-batches `xs` (as a layout runs it)."""
    p = make_precision("bf16-pure", CPU)
    losses = []
    with p.step(model), p.training_forward():
        assert not torch.is_autocast_enabled("cpu")
        for x in xs:
            loss = loss_of(model(x))
            loss.backward()
            losses.append(loss.item())
    return losses


def small_model(style: dict, lora: bool = False) -> nn.Module:
    model = build_model(load_config("tiny", {**SMALL, **style}).model, "cpu", seed=0)
    if lora:
        apply_lora(model, "wq,wv,fc,proj" if style else "wq,wv,gate,up,down", rank=4, alpha=8, seed=0)
        for p in model.parameters():  # (B starts at 0: move the adapters so every gradient path counts)
            if p.requires_grad:
                p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
    return model


@pytest.mark.parametrize("style", [{}, GPT2_STYLE], ids=["llama", "gpt2"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_parameter_computes_in_bf16_and_the_masters_stay_fp32(style, lora):
    """Inside the step every floating parameter but the embeddings' is a bf16 copy (norms, biases,
    the tied head, LoRA adapters and their frozen base weights), every module's output is bf16 (the
    residual stream: each block's output), the embedding reads its fp32 rows and returns bf16. The
    numbers equal a forward through the same bf16 values given explicitly
    (`torch.func.functional_call`), bit for bit, loss and fp32 gradients; afterwards the modules
    hold their fp32 `nn.Parameter`s again."""
    model = small_model(style, lora)
    ref = copy.deepcopy(model)
    outputs: dict[str, torch.dtype] = {}
    hooks = [m.register_forward_hook(lambda m, a, out, name=name: outputs.__setitem__(name, out.dtype))
             for name, m in model.named_modules() if name and not isinstance(m, (nn.ModuleDict, nn.Dropout))]
    got = pure_step(model, batches(320))
    for h in hooks:
        h.remove()
    assert outputs and all(dtype == torch.bfloat16 for name, dtype in outputs.items() if "emb" not in name), outputs
    assert {outputs[n] for n in outputs if "emb" in n} == {torch.float32}  # (observed before the step's cast)

    def explicit(x: torch.Tensor) -> torch.Tensor:
        """The forward through bf16 casts of every parameter but the embeddings' (the tied head's
        entry: its own cast of the shared weight), with bf16 embedding outputs."""
        values = {n: p if n.split(".")[0] in ("tok_emb", "pos_emb") else p.to(torch.bfloat16)
                  for n, p in ref.named_parameters(remove_duplicate=False)}
        hooks = [m.register_forward_hook(lambda m, a, out: out.to(torch.bfloat16))
                 for m in ref.modules() if isinstance(m, nn.Embedding)]
        try:
            return torch.func.functional_call(ref, values, (x,), tie_weights=False)
        finally:
            for h in hooks:
                h.remove()

    want = []
    for x in batches(320):
        loss = loss_of(explicit(x))
        loss.backward()
        want.append(loss.item())
    assert got == want
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    g_got, g_want = grads(model), grads(ref)
    assert g_got.keys() == g_want.keys() and g_got
    for name in g_got:
        assert g_got[name].dtype == torch.float32 and torch.equal(g_got[name], g_want[name]), name


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_activation_checkpoint_recompute_reads_the_steps_copies(ac):
    """Recomputed blocks run on the same bf16 copies as the forward: the same loss and gradients as
    without activation checkpointing, bit for bit."""
    model = small_model({})
    ref = copy.deepcopy(model)
    apply_activation_checkpointing(model.blocks, ac)
    assert pure_step(model, batches(320)) == pure_step(ref, batches(320))
    strip = lambda n: n.replace("_checkpoint_wrapped_module.", "")  # noqa: E731
    g, g_ref = {strip(n): t for n, t in grads(model).items()}, grads(ref)
    assert g.keys() == g_ref.keys() and all(torch.equal(g[n], g_ref[n]) for n in g)


def test_micro_batch_gradients_accumulate_in_fp32():
    """Each micro-batch's bf16 gradient is added to the fp32 `.grad` in fp32 (Megatron's main
    gradients): the step's gradient of two micro-batches equals the two one-micro-batch steps'
    gradients added in fp32, bit for bit, and differs from adding them in bf16."""
    model = small_model({})
    xs = batches(320)
    parts = []
    for x in xs:
        model.zero_grad(set_to_none=True)
        pure_step(model, [x])
        parts.append(grads(model))
    model.zero_grad(set_to_none=True)
    pure_step(model, xs)
    both = grads(model)
    assert all(torch.equal(both[n], parts[0][n] + parts[1][n]) for n in both)
    in_bf16 = {n: (parts[0][n].bfloat16() + parts[1][n].bfloat16()).float() for n in both}
    assert any(not torch.equal(both[n], in_bf16[n]) for n in both)


def test_embedding_gradients_accumulate_in_fp32():
    """A token seen many times in a batch: the embedding reads its fp32 master row, so its
    gradient adds every occurrence in fp32 (the CPU's bf16 embedding backward would add them in
    bf16, several % off here)."""
    emb = nn.Embedding(8, 16)
    x = torch.zeros(1, 4096, dtype=torch.long)  # token 0, 4096 times
    g = torch.randn(1, 4096, 16, generator=torch.Generator().manual_seed(0)) * 1e-2
    with make_precision("bf16-pure", CPU).step(emb):
        out = emb(x)
        assert out.dtype == torch.bfloat16
        out.backward(g.bfloat16())
    want = g.bfloat16().float().sum(1)[0]
    torch.testing.assert_close(emb.weight.grad[0], want, rtol=1e-5, atol=1e-6)
    bf16_emb = emb.weight.detach().bfloat16().requires_grad_()
    nn.functional.embedding(x, bf16_emb).backward(g.bfloat16())
    assert (bf16_emb.grad[0].float() - want).abs().max() > 100 * (emb.weight.grad[0] - want).abs().max()


def test_evaluation_outside_a_step_runs_under_autocast_over_the_fp32_masters():
    p = make_precision("bf16-pure", CPU)
    assert p.pure and p.dtype == torch.bfloat16 and not p.scaler.is_enabled()
    with p.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for name in ("bf16", "fp16"):
        with make_precision(name, CPU).training_forward():
            assert torch.is_autocast_enabled("cpu")


def test_final_weights_and_the_export_are_written_in_the_dtype_asked_for(small_data, tmp_path):
    """checkpoint.weights_dtype = bf16: model.safetensors holds the fp32 masters each rounded once to
    bf16 (the checkpoint keeps fp32), loads into an fp32 model for eval / generate, and `lmforge
    export` writes it as a bf16 transformers folder (config.json's dtype says so); `--dtype fp32`
    (`export_hf(dtype=...)`) converts back."""
    from safetensors.torch import load_file

    from lmforge.ckpt.export import load_run
    from lmforge.cli.interop import export_main
    from lmforge.train.trainer import Trainer

    cfg = load_config("tiny", {**SMALL, "train.global_batch_size": 4, "train.micro_batch_size": 4, "train.steps": 2,
                               "train.eval_every": 0, "train.eval_sequences": 4, "train.sample_tokens": 0,
                               "train.precision": "bf16-pure", "train.plot": False, "train.tensorboard": False,
                               "checkpoint.async_save": False, "checkpoint.weights_dtype": "bf16"})
    run = tmp_path / "run"
    trainer = Trainer(cfg, out_dir=run, data=small_data)
    trainer.fit()
    saved = load_file(str(run / "model.safetensors"))
    masters = dict(trainer.model.named_parameters())
    assert saved.keys() == masters.keys() - {"lm_head.weight"}  # (tied: stored once)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, masters[name].detach().bfloat16()), name
    _, model = load_run(run)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.tok_emb.weight, saved["tok_emb.weight"].float())

    pytest.importorskip("transformers")
    import json

    assert export_main(["--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in hf.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert export_main(["--run", str(run), "--out", str(tmp_path / "hf32"), "--dtype", "fp32"]) == 0
    hf32 = load_file(str(tmp_path / "hf32" / "model.safetensors"))
    assert {t.dtype for t in hf32.values()} == {torch.float32}
    assert all(torch.equal(hf32[k], hf[k].float()) for k in hf)
    assert json.loads((tmp_path / "hf32" / "config.json").read_text())["dtype"] == "float32"


RESUME = {**SMALL, "train.global_batch_size": 8, "train.micro_batch_size": 4, "train.steps": 8, "train.eval_every": 0,
          "train.eval_sequences": 8, "train.log_every": 1, "train.sample_tokens": 0, "train.precision": "bf16-pure",
          "train.tensorboard": False, "train.plot": False, "train.progress": "none", "schedule.warmup_steps": 2,
          "optim.lr": 3e-3, "checkpoint.every_steps": 4, "checkpoint.async_save": False}
# bf16 autocast resumed from a bf16-pure checkpoint, steps 5-8, against bf16-pure's own: the relative
# loss difference measured 4.2e-4 at most (the two modes round differently from the first resumed
# step on); the bound leaves 10x
ACROSS_MODES_TOL = 5e-3


def test_resume_is_bitwise_in_bf16_pure_and_continues_in_autocast(small_data, tmp_path):
    """A bf16-pure run stopped after its step-4 checkpoint and resumed in bf16-pure ends with the
    straight run's weights, bit for bit; resumed in bf16 autocast instead (the checkpoint holds the
    fp32 masters, as autocast's does) it continues with the straight run's losses within
    ACROSS_MODES_TOL."""
    import json
    import shutil

    from lmforge.train.trainer import Trainer

    def run(out, **extra):
        trainer = Trainer(load_config("tiny", {**RESUME, **extra}), out_dir=out, data=small_data)
        trainer.fit()
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return trainer, {r["step"]: r["loss"] for r in recs if "loss" in r}

    straight, want = run(tmp_path / "straight")
    for name, precision in (("same", "bf16-pure"), ("autocast", "bf16")):
        out = tmp_path / name
        shutil.copytree(tmp_path / "straight" / "checkpoints" / "step_00000004", out / "checkpoints" / "step_00000004")
        resumed, got = run(out, **{"train.precision": precision})
        assert resumed.resumed_from.name == "step_00000004" and sorted(got) == [5, 6, 7, 8]
        assert resumed.precision.name == precision
        if precision == "bf16-pure":
            state, ref = resumed.model.state_dict(), straight.model.state_dict()
            assert state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)
            assert got == {s: want[s] for s in got}
        else:
            worst = max(abs(got[s] - want[s]) / want[s] for s in got)
            print(f"\nbf16 autocast resumed from bf16-pure: max relative loss difference {worst:.1e}")
            assert 0 < worst < ACROSS_MODES_TOL, (got, want)


NUMERICS = {**SMALL, "train.global_batch_size": 8, "train.micro_batch_size": 4, "train.steps": 60,
            "train.eval_every": 0, "train.eval_sequences": 32, "train.log_every": 1, "train.sample_tokens": 0,
            "train.tensorboard": False, "train.plot": False, "train.progress": "none", "schedule.warmup_steps": 6,
            "optim.lr": 3e-3, "checkpoint.save_final": False, "checkpoint.every_minutes": 0}
# The test's own runs (CPU, torch 2.13), 10-step average loss, max relative difference over 60 steps:
# bf16-pure vs bf16 autocast of the same seed 8.9e-4, autocast seed 1337 vs seed 7 7.4e-2; final
# validation loss 1.4346 vs 1.4343. The bound leaves 11x over the measured difference (300 steps:
# benchmarks/bf16_pure_numerics.py, benchmarks/RESULTS.md, 2.7e-3 / 3.2e-3 on the 20-step average).
PURE_VS_AUTOCAST_TOL = 1e-2


def moving_average(losses: dict[int, float], window: int = 10) -> dict[int, float]:
    steps = sorted(losses)
    return {s: sum(losses[t] for t in steps[i - window + 1:i + 1]) / window
            for i, s in enumerate(steps) if i >= window - 1}


@pytest.mark.slow
def test_bf16_pure_trains_like_autocast_within_the_seed_to_seed_spread(small_data, tmp_path):
    """60 steps of a small Llama-style model: bf16-pure's loss curve (10-step moving average) stays
    closer to bf16 autocast's of the same seed than two autocast runs of different seeds stay to
    each other (the issue's tolerance, measured by the test itself) and within PURE_VS_AUTOCAST_TOL,
    and its final validation loss is within 1% of autocast's. The 300-step measurement on the tiny
    preset and a GPT-2-style model is benchmarks/bf16_pure_numerics.py (benchmarks/RESULTS.md)."""
    import json

    from lmforge.train.trainer import Trainer

    def run(name, **extra):
        out = tmp_path / name
        Trainer(load_config("tiny", {**NUMERICS, **extra}), out_dir=out, data=small_data).fit()
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses = {r["step"]: r["loss"] for r in recs if "loss" in r}
        assert sorted(losses) == list(range(1, 61))
        return moving_average(losses), recs[-1]["val_loss"]

    (auto_a, val_a), (auto_b, _) = run("a", **{"train.precision": "bf16"}), \
        run("b", **{"train.precision": "bf16", "train.seed": 7})
    pure, val_pure = run("pure", **{"train.precision": "bf16-pure"})
    spread = max(abs(auto_b[s] - auto_a[s]) / auto_a[s] for s in auto_a)
    apart = max(abs(pure[s] - auto_a[s]) / auto_a[s] for s in auto_a)
    print(f"\n10-step average loss, max relative difference: autocast seed vs seed {spread:.2e}, "
          f"bf16-pure vs autocast {apart:.2e}; final val loss {val_pure:.4f} vs {val_a:.4f}")
    assert 0 < apart < min(spread, PURE_VS_AUTOCAST_TOL), (apart, spread)
    assert abs(val_pure - val_a) / val_a < 0.01, (val_pure, val_a)


# ---- every layout in bf16-pure against one process in bf16-pure --------------------------------------


# one process vs each layout, bf16-pure, 8 steps; the layouts' own overrides are those of their fp32
# parity tests (tests/test_parallel_*.py), on the model those use (4 layers, untied: pipeline stages)
def layouts() -> dict[str, dict]:
    from tests.test_parallel_cp import LAYOUTS as CP
    from tests.test_parallel_dp import LAYOUTS as DP
    from tests.test_parallel_ep import LAYOUTS as EP
    from tests.test_parallel_mp import LAYOUTS as MP_LAYOUTS

    return {"ddp": DP["ddp"], "fsdp2": DP["zero3"], "tp2-sp": MP_LAYOUTS["tp2-sp"][1],
            "pp2-1f1b": MP_LAYOUTS["pp2-1f1b"][1], "cp2": {"parallel.cp": 2}, "ep2": EP["ep2"][1]}


# Measured (8 steps, AdamW, CPU, torch 2.13), max relative difference against one process, loss / grad
# norm: DDP 2.3e-4 / 7.1e-3, FSDP2 8.2e-4 / 1.5e-2, TP + SP 1.6e-3 / 2.9e-2, PP 3e-5 / 6.9e-4, CP
# 9.9e-4 / 1.9e-2, EP 3e-4 / 1.5e-2, all at step 5's gradient-norm spike, small before it (<= 2e-4 /
# 8e-4 at step 1). One process against itself with another micro-batch size (4 or 8 instead of 2:
# only the accumulation's grouping changes) already differs by 4e-4 / 6.7e-3: bf16 rounds every
# reordered sum differently, and AdamW and the spike amplify it; TP, CP and FSDP2 split more sums.
# The bound is about twice the largest layout's (fp32 runs of the same layouts stay below 1e-5).
PURE_TOL = {"losses": 4e-3, "grad_norms": 6e-2}


@pytest.mark.slow
def test_every_layout_in_bf16_pure_matches_one_process(corpus, tmp_path):  # noqa: F811
    """DDP, FSDP2, TP + SP, PP (1F1B), CP and EP, each in bf16-pure, against one process in bf16-pure:
    per-step loss and gradient norm within PURE_TOL (bf16 rounds differently where a layout splits a
    matmul or a reduction; measured: see PURE_TOL). One launch for the six 2-process runs (every
    layout's own overrides from its fp32 parity test)."""
    from tests.test_parallel_dp import assert_runs_match, train_runs
    from tests.test_parallel_ep import MOE
    from tests.test_parallel_mp import MP

    shared = {**MP, "train.precision": "bf16-pure", "train.steps": 8, "train.log_every": 1, "train.sample_tokens": 0,
              "schedule.warmup_steps": 2}
    moe = {k: v for k, v in MOE.items() if k.startswith("model.")}
    ref, runs = tmp_path / "single", tmp_path / "layouts"
    proc = train_runs(corpus, {ref / "dense": {}, ref / "moe": moe}, **shared)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    mine = {runs / name: {**(moe if name == "ep2" else {}), **extra} for name, extra in layouts().items()}
    proc = train_runs(corpus, mine, nproc=2, timeout=600, **shared)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for out in mine:
        want = ref / ("moe" if out.name == "ep2" else "dense")
        assert_runs_match(out, want, f"bf16-pure {out.name} vs one process", tol=PURE_TOL)


def test_float8_linears_keep_their_own_cast():
    """torchao's Float8Linear casts its fp32 weight to fp8 itself (with its scales): bf16-pure copies
    every other parameter but leaves its weight and bias fp32 (torchao is optional: a stand-in class
    of that name)."""
    from lmforge.train.precision import copied_parameters

    class Float8Linear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Float8Linear(4, 4), nn.LayerNorm(4))
    copied = {(id(m), name) for m, name, _ in copied_parameters([model], every=True)}
    assert copied == {(id(model[0]), "weight"), (id(model[0]), "bias"), (id(model[2]), "weight"), (id(model[2]), "bias")}
    with make_precision("bf16-pure", CPU).step(model):
        assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16


def test_every_optimizer_steps_the_fp32_masters_with_clipping_and_the_guard(small_data, tmp_path):
    """Every optimizer of the registry in bf16-pure, gradient clipping active (optim.grad_clip below the
    gradient norm) and the spike guard on: the parameters stay fp32 `nn.Parameter`s and move, no
    optimizer state is 16-bit (the states are kept as in autocast: fp32, 8-bit Adam's quantised
    blocks), the reported gradient norm is finite and the guard accepts the steps; no GradScaler."""
    from lmforge.spec.optimizers import OPTIMIZER_NAMES
    from lmforge.train.trainer import Trainer
    from tests.test_optim_train import LRS

    assert set(OPTIMIZER_NAMES) <= set(LRS)
    for name in OPTIMIZER_NAMES:
        cfg = load_config("tiny", {**SMALL, "train.global_batch_size": 4, "train.micro_batch_size": 2,
                                   "train.precision": "bf16-pure", "train.eval_every": 0, "train.sample_tokens": 0,
                                   "optim.name": name, "optim.lr": LRS[name], "optim.grad_clip": 0.05,
                                   "guard.enabled": True})
        trainer = Trainer(cfg, out_dir=tmp_path / name, data=small_data)
        trainer.setup()
        assert not trainer.precision.scaler.is_enabled()
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        for _ in range(2):
            _, norm = trainer.train_step(trainer.next_micro_batches())
            assert torch.isfinite(norm) and norm > 0.05, (name, norm)
        params = dict(trainer.model.named_parameters())
        assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in params.values()), name
        assert any(not torch.equal(params[n], before[n]) for n in before), name
        states = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        assert (states or name == "sgd") and not any(t.dtype in (torch.bfloat16, torch.float16) for t in states), name
        assert trainer.guard is not None and trainer.guard.n_skipped == 0, name
