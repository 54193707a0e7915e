"""The training loop: accumulation, precision, activation checkpointing, and that it learns."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import load_config
from lmforge.model.transformer import build_model
from lmforge.parallel.activation_ckpt import saved_activation_bytes
from lmforge.train.trainer import Trainer

SMALL = {
    "model.vocab_size": 320, "model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.max_seq_len": 64,
    "data.seq_len": 32, "data.tokenizer_vocab_size": 320,
    "train.global_batch_size": 8, "train.micro_batch_size": 8, "train.steps": 30, "train.eval_every": 0,
    "train.eval_sequences": 32, "train.log_every": 5, "train.sample_tokens": 8, "train.precision": "fp32",
    "schedule.warmup_steps": 3, "optim.lr": 3e-3,
}


def make_trainer(small_data, tmp_path, **overrides) -> Trainer:
    cfg = load_config("tiny", {**SMALL, **overrides})
    trainer = Trainer(cfg, out_dir=tmp_path / "run", data=small_data)
    trainer.setup()
    return trainer


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_equals_one_large_batch(small_data, tmp_path):
    """k micro-batches of b == one batch of k*b. fp32; tolerance 1e-5 relative (summation order only)."""
    big = make_trainer(small_data, tmp_path, **{"train.micro_batch_size": 8})
    acc = make_trainer(small_data, tmp_path, **{"train.micro_batch_size": 2})
    assert acc.cfg.grad_accum_steps == 4
    x, y = big.loader.next_batch()
    y[0, :20] = -100  # unequal numbers of target tokens per micro-batch: normalisation must still match
    loss_big = big.forward_backward([(x, y)])
    loss_acc = acc.forward_backward([(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)])
    assert torch.allclose(loss_big, loss_acc, rtol=1e-6)
    g_big, g_acc = grads(big.model), grads(acc.model)
    assert g_big.keys() == g_acc.keys()
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-pure"])
def test_mixed_precision_paths_train(small_data, tmp_path, precision):
    trainer = make_trainer(small_data, tmp_path, **{"train.precision": precision})
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    assert trainer.precision.scaler.is_enabled() == (precision == "fp16")
    losses = []
    for _ in range(25):
        loss, grad_norm = trainer.train_step(trainer.next_micro_batches())
        assert torch.isfinite(grad_norm)
        losses.append(float(loss))
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


@pytest.mark.parametrize("lora, ac", [(False, "none"), (False, "full"), (True, "selective")])
def test_the_steps_16_bit_copies_give_autocasts_numbers_bit_for_bit(lora, ac):
    """Precision.step holds one 16-bit copy of each weight for the step (lmforge.train.precision),
    the cast autocast's cache made before: the same losses and fp32 gradients, bit for bit (2
    micro-batches; the tied head, LoRA adapters and frozen base weights, activation checkpointing)."""
    import copy

    from lmforge.model.lora import apply_lora
    from lmforge.parallel.activation_ckpt import apply_activation_checkpointing
    from lmforge.train.precision import make_precision

    cfg = load_config("tiny", SMALL).model
    model = build_model(cfg, "cpu", seed=0)
    if lora:
        apply_lora(model, "wq,wv,gate,up,down", rank=4, alpha=8, seed=0)
        for p in model.parameters():  # (B starts at 0: move the adapters so every gradient path counts)
            if p.requires_grad:
                p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
    apply_activation_checkpointing(model.blocks, ac)
    ref = copy.deepcopy(model)
    batches = [torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def step(m, bf16_step, autocast) -> list[float]:
        losses = []
        with bf16_step:
            for x in batches:
                with autocast():
                    loss = m(x).float().logsumexp(-1).mean()
                loss.backward()
                losses.append(loss.item())
        return losses

    bf16 = make_precision("bf16", torch.device("cpu"))
    got = step(model, bf16.step(model), bf16.autocast)
    # the old mechanism: autocast's weight-cast cache, kept alive for the step by an outer context
    want = step(ref, torch.autocast("cpu", enabled=False), lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert got == want
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    g_got, g_want = grads(model), grads(ref)
    assert g_got.keys() == g_want.keys() and g_got
    for name in g_got:
        assert g_got[name].dtype == torch.float32 and torch.equal(g_got[name], g_want[name]), name


def test_fp16_gradients_are_unscaled_before_clipping(small_data, tmp_path):
    """The clipped norm must be the true gradient norm, not one inflated by the loss scale (2**16)."""
    ref = make_trainer(small_data, tmp_path, **{"train.precision": "fp32"})
    half = make_trainer(small_data, tmp_path, **{"train.precision": "fp16"})
    batch = ref.next_micro_batches()
    ref.forward_backward(batch)
    half.forward_backward(batch)
    half.precision.scaler.unscale_(half.optimizer)
    norm = lambda m: torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None]))
    assert half.precision.scaler.get_scale() > 1000
    assert torch.allclose(norm(half.model), norm(ref.model), rtol=0.05)


@pytest.mark.parametrize("mode", ["full", "every_k", "selective"])
def test_activation_checkpointing_same_gradients_less_memory(small_data, tmp_path, mode):
    base = make_trainer(small_data, tmp_path, **{"train.activation_checkpoint": "none"})
    ckpt = make_trainer(small_data, tmp_path, **{"train.activation_checkpoint": mode, "train.ac_every": 2})
    batch = base.next_micro_batches()
    base.forward_backward(batch)
    ckpt.forward_backward(batch)
    g0, g1 = grads(base.model), grads(ckpt.model)
    strip = lambda n: n.replace("_checkpoint_wrapped_module.", "")
    g1 = {strip(n): g for n, g in g1.items()}
    assert g0.keys() == g1.keys()
    for name in g0:  # recomputation is the same math in fp32: tolerance only for op-order noise
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)

    x, _ = batch[0]
    saved_none = saved_activation_bytes(lambda: base.model(x).sum(), exclude=list(base.model.parameters()))
    saved_ckpt = saved_activation_bytes(lambda: ckpt.model(x).sum(), exclude=list(ckpt.model.parameters()))
    assert saved_ckpt < 0.8 * saved_none, (saved_ckpt, saved_none)


def test_checkpoint_modes_order_by_memory(small_data, tmp_path):
    sizes = {}
    for mode in ("none", "selective", "every_k", "full"):
        t = make_trainer(small_data, tmp_path, **{"train.activation_checkpoint": mode, "train.ac_every": 2})
        x, _ = t.next_micro_batches()[0]
        sizes[mode] = saved_activation_bytes(lambda: t.model(x).sum(), exclude=list(t.model.parameters()))
    assert sizes["full"] < sizes["every_k"] < sizes["none"]
    assert sizes["selective"] < sizes["none"]


def test_short_run_learns_and_writes_outputs(small_data, tmp_path):
    cfg = load_config("tiny", {**SMALL, "train.steps": 60, "train.eval_every": 30, "train.precision": "bf16"})
    trainer = Trainer(cfg, out_dir=tmp_path / "run", data=small_data)
    result = trainer.fit()
    assert result.val_loss < result.initial_val_loss - 1.5
    assert result.val_loss < result.unigram_entropy  # learned more than token frequencies
    out = tmp_path / "run"
    for name in ("config.toml", "metrics.jsonl", "model.safetensors", "tokenizer.json", "summary.json", "sample.txt"):
        assert (out / name).is_file(), name
    steps = [r["step"] for r in result.history]
    assert steps == list(range(1, 61))  # one metrics record per step

    # the saved run reloads and reproduces the trained model's logits: the weights written at the end
    # are the fp32 master weights, so the reloaded model equals the in-memory one bit for bit
    from lmforge.ckpt.export import load_run

    _, model = load_run(out)
    trained = trainer.model.eval()
    x = torch.randint(0, 320, (1, 16))
    with torch.no_grad():
        want, got = trained(x), model(x)
        assert not torch.equal(want, build_model(cfg.model, seed=cfg.train.seed)(x))  # (training moved it)
    assert torch.equal(got, want), (got - want).abs().max()


def test_lr_follows_the_schedule(small_data, tmp_path):
    from lmforge.optim.schedules import lr_at

    trainer = make_trainer(small_data, tmp_path, **{"schedule.name": "wsd", "train.steps": 20})
    seen = []
    for _ in range(20):
        seen.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.train_step(trainer.next_micro_batches())
    expected = [lr_at(s, schedule="wsd", peak_lr=3e-3, warmup_steps=3, total_steps=20, min_lr_ratio=0.1,
                      decay_fraction=0.2) for s in range(20)]
    assert seen == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lion", "muon"])
def test_optimizers_plug_into_the_trainer(small_data, tmp_path, name):
    lr = {"sgd": 0.3, "lion": 3e-4}.get(name, 3e-3)
    trainer = make_trainer(small_data, tmp_path, **{"optim.name": name, "optim.lr": lr})
    first = float(trainer.train_step(trainer.next_micro_batches())[0])
    for _ in range(15):
        loss, _ = trainer.train_step(trainer.next_micro_batches())
    assert float(loss) < first, (name, first, float(loss))


@pytest.mark.slow
def test_compiled_blocks_match_eager(small_data, tmp_path):
    """train.compile = true (torch.compile per block, inductor C++ backend on CPU): same loss and
    gradients as eager within fp32 reassociation noise (rtol 1e-4)."""
    eager = make_trainer(small_data, tmp_path, **{"model.n_layers": 2})
    compiled = make_trainer(small_data, tmp_path, **{"model.n_layers": 2, "train.compile": True})
    batch = eager.next_micro_batches()
    l_eager, l_comp = eager.forward_backward(batch), compiled.forward_backward(batch)
    torch.testing.assert_close(l_comp, l_eager, rtol=1e-4, atol=1e-5)
    g0 = grads(eager.model)
    g1 = {n.replace("_orig_mod.", ""): g for n, g in grads(compiled.model).items()}
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow
def test_compiled_whole_model_matches_eager(small_data, tmp_path, monkeypatch):
    """train.compile = model (lmforge.parallel.layout.Layout.compile_model): the whole training forward
    with its loss inside (here the chunked loss) as one fullgraph, in bf16-pure over 2 micro-batches
    per step: the same losses and gradient norms as eager within bf16 rounding (the compiled kernels
    fuse and round differently: measured 1.5e-5 relative for the loss and 0.9% of the largest
    gradient element), and one graph for every micro-batch and step (the step's new bf16 copies do
    not recompile it)."""
    from torch._dynamo.utils import counters

    import lmforge.model.loss as loss_module

    def probe(device):  # the chunked loss's own decision, untraceable as on a CUDA GPU (its Triton probe:
        torch._dynamo.graph_break()  # torch 2.11's dynamo refuses importlib's find_spec; gpt2-bf16-pure-model
        return False  # failed so on the H100, 2026-11-27): inside the whole-model graph it must not be taken

    monkeypatch.setattr(loss_module, "use_compiled_chunk", probe)
    setting = {"model.n_layers": 2, "train.precision": "bf16-pure", "train.micro_batch_size": 4, "train.loss_chunk": 64}
    eager = make_trainer(small_data, tmp_path / "eager", **setting)
    compiled = make_trainer(small_data, tmp_path / "compiled", **setting, **{"train.compile": "model"})
    assert compiled.layout.compiled_nll is not None and eager.layout.compiled_nll is None
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        batch = eager.next_micro_batches()
        compiled.next_micro_batches()
        (l_eager, n_eager), (l_comp, n_comp) = eager.train_step(batch), compiled.train_step(batch)
        torch.testing.assert_close(l_comp, l_eager, rtol=1e-3, atol=0)
        torch.testing.assert_close(n_comp, n_eager, rtol=2e-2, atol=0)
    assert counters["stats"]["unique_graphs"] - graphs == 1


@pytest.mark.parametrize("marker", ["prepare.json", "manifest.json", "config.json"])
def test_out_dir_that_is_a_data_or_transformers_folder_is_refused_untouched(small_data, tmp_path, marker):
    """A run writes config.toml, tokenizer.json and model.safetensors into train.out_dir; pointed at a
    prepared dataset, a shard folder or a transformers folder it would clobber their files."""
    from lmforge.config import ConfigError

    folder = tmp_path / "not-a-run"
    folder.mkdir()
    (folder / marker).write_text("{}")
    (folder / "tokenizer.json").write_text("keep me")
    trainer = Trainer(load_config("tiny", SMALL), out_dir=folder, data=small_data)
    with pytest.raises(ConfigError, match=f"train.out_dir = .*not-a-run.*{marker}"):
        trainer.fit()
    assert sorted(p.name for p in folder.iterdir()) == sorted([marker, "tokenizer.json"])
    assert (folder / "tokenizer.json").read_text() == "keep me"


def test_validation_loss_does_not_depend_on_the_micro_batch(small_data, tmp_path):
    """train.eval_sequences scores the same sequences whatever train.micro_batch_size is (it scored
    eval_batches x micro batch sequences: the same model gave 6.7296 and 6.7783)."""
    a = make_trainer(small_data, tmp_path / "a", **{"train.micro_batch_size": 8})
    b = make_trainer(small_data, tmp_path / "b", **{"train.micro_batch_size": 2})
    la, lb = a.evaluate(), b.evaluate()
    assert la["tokens"] == lb["tokens"] == 32 * 32  # 32 sequences x 32 targets
    assert abs(la["loss"] - lb["loss"]) < 1e-6 * la["loss"]  # fp32 kernels differ by batch shape: ~5e-9 seen


@pytest.mark.parametrize("flags, slow", [({"avx2"}, True), ({"avx2", "avx512_bf16"}, False)])
def test_an_emulated_bf16_is_kept_but_flagged(monkeypatch, flags, slow):
    """train.precision = bf16 on a CPU without bf16 units runs ~90x slower: say so (a warning)."""
    from lmforge.train import precision as precision_module

    monkeypatch.setattr(precision_module, "cpu_flags", lambda: flags)
    got = precision_module.resolve_precision("bf16", torch.device("cpu"))
    assert got.name == "bf16" and got.slow is slow
    assert ("emulates bf16" in got.reason and "100x slower" in got.reason) if slow else got.reason == "as configured"


def test_saved_weights_get_the_users_umask(tmp_path):
    """model.safetensors was written with mode 0600; it follows the umask like every other file."""
    import os
    import stat

    from lmforge.ckpt.export import save_weights

    old = os.umask(0o022)
    try:
        save_weights(torch.nn.Linear(2, 2), tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o644


def test_token_ids_beyond_the_vocabulary_stop_the_run_at_start_up(small_data, tmp_path):
    """Corrupt shard bytes of the right size used to open silently (an id of 60000 with a vocabulary
    of 320) and fail later in the embedding; the manifest's largest id is checked at start-up."""
    import json
    import shutil

    from lmforge.data.prepare import PreparedData

    root = tmp_path / "copy"
    shutil.copytree(small_data.train_dir.parent, root)
    train = root / small_data.train_dir.name
    manifest = json.loads((train / "manifest.json").read_text())
    shard = train / manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[0:2] = (60000).to_bytes(2, "little")  # same size, one id out of range
    shard.write_bytes(bytes(data))
    manifest["shards"][0].pop("max_id", None)  # an old manifest: the id is found in the data
    manifest.pop("max_id", None)
    (train / "manifest.json").write_text(json.dumps(manifest))
    bad = PreparedData(**{**small_data.__dict__, "train_dir": train, "val_dir": root / small_data.val_dir.name})
    with pytest.raises(ValueError, match="train shards hold token id 60000 but model.vocab_size = 320"):
        make_trainer(bad, tmp_path)
    with pytest.raises(ValueError, match="sha256"):  # data.verify_checksums re-hashes the shards
        make_trainer(bad, tmp_path, **{"data.verify_checksums": True})
