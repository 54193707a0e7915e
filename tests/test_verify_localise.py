"""`lmforge plan --verify` in 16 bits and where a failing layout leaves one process (lmforge/verify/):
the toy trains in the layout's precision, its rounding can be perturbed (the band's reruns), and a
failing parity check is localised: the first module whose output norm (forward order) or parameter
gradient norm (backward order) leaves the band at the first failing step, of the full tensors (shards
gathered, ranks merged).

Three layouts broken on purpose, through the test-only faults of lmforge/verify/faults.py (the
LMFORGE_VERIFY_FAULT environment variable, read by the verify rank driver in multi-process runs only):

  tp-row-bias-twice       TP, bf16: the row-parallel projections add their bias again after the all-reduce.
                          At step 1 the biases are 0, so every output agrees; the bias gradient is doubled,
                          and the first module in backward order with a row-parallel bias is named:
                          blocks.1.mlp.down (the last block's MLP down-projection).
  pp-stage-grad-unscaled  PP, fp32: the first stage's gradients SKIPPED_SCALE (4) times too large: its
                          last module in backward order, blocks.0.mlp.down, at 4x (relative difference 3).
  cp-chunks-swapped       CP, fp32: each rank's two chunks of a sequence swapped in the input: the norms
                          of per-token modules do not see the order; the first that does is the first
                          attention's output, blocks.0.attn.wo (and, the loss being off, every gradient:
                          the head's first in backward order).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmforge.config import load_config
from lmforge.plan.layout import Layout
from lmforge.verify import faults
from lmforge.verify.perturb import rounding_perturbed
from lmforge.verify.probe import Probe, merge_ranks
from lmforge.verify.toy import toy_run
from tests import warm_start


@pytest.fixture(autouse=True)
def warm(monkeypatch):
    """The certificate's runs start warm (tests/warm_start.py: PYTHON_EXEC, which lmforge.verify.certify honours)."""
    return warm_start.warm_exec(monkeypatch)


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure", "fp16", "fp32"])
def test_the_toy_trains_in_the_layout_precision(precision):
    toy = toy_run(load_config("tiny"), Layout.parse(f"dp=2,zero=3,precision={precision}"))
    assert toy.config.train.precision == toy.reference.train.precision == precision


def test_the_perturbed_rounding_moves_outputs_by_about_one_16_bit_ulp():
    """A bf16 output by about one ulp (eps relative at most, + its rounding); an fp32 output (a norm's,
    an embedding's under autocast) by up to bf16's eps, as rounding it to bf16 would; a module without
    weights of its own is left alone; fp32 runs have no band and are refused."""
    torch.manual_seed(0)
    lin, norm, act = nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()
    x = torch.randn(8, 64)
    eps = torch.finfo(torch.bfloat16).eps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, plain_norm = lin(x), norm(x)
        with rounding_perturbed(1, "bf16"):
            moved, moved_norm, same = lin(x), norm(x), act(x)
    assert moved.dtype == torch.bfloat16 and not torch.equal(moved, plain)
    assert ((moved.float() - plain.float()).abs() / plain.float().abs().clamp_min(1e-6)).max() <= 2 * eps
    assert moved_norm.dtype == torch.float32 and not torch.equal(moved_norm, plain_norm)
    assert ((moved_norm - plain_norm).abs() / plain_norm.abs().clamp_min(1e-6)).max() <= eps * (1 + 1e-6)
    assert torch.equal(same, act(x))
    with pytest.raises(ValueError, match="'fp32' has no 16-bit rounding"):
        with rounding_perturbed(1, "fp32"):
            pass


def test_ranks_merge_shards_add_and_replicas_count_once():
    """dp / cp ranks hold other data (add); TP ranks add when their outputs are shards (unequal), count once
    when replicated (equal) or gathered whole (a DTensor output)."""
    def rank(r, dp, tp, forward, whole=()):
        return {"coords": {"rank": r, "dp": dp, "cp": 0, "tp": tp, "pp": 0}, "forward": forward, "whole": list(whole)}
    ranks = [rank(0, 0, 0, {"col": 1.0, "row": 4.0, "d": 2.0}, ["d"]), rank(1, 0, 1, {"col": 3.0, "row": 4.0, "d": 2.0}),
             rank(2, 1, 0, {"col": 2.0, "row": 5.0, "d": 1.0}, ["d"]), rank(3, 1, 1, {"col": 2.5, "row": 5.0, "d": 1.0})]
    norms = merge_ranks(ranks)
    assert norms["col"] == pytest.approx(math.sqrt(1 + 3 + 2 + 2.5))
    assert norms["row"] == pytest.approx(math.sqrt(4 + 5)) and norms["d"] == pytest.approx(math.sqrt(3))


def test_the_probe_records_forward_order_and_gradients_at_its_step():
    from lmforge.model.transformer import Transformer

    cfg = load_config("tiny", {"model.dim": 32, "model.n_layers": 1, "model.n_heads": 2, "model.vocab_size": 320,
                                 "data.tokenizer_vocab_size": 320})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 320, (2, 8))
    with Probe(step=2) as probe:
        for step in (1, 2, 3):
            model(tokens).float().pow(2).mean().backward()
            if step == 2:
                want = {n: m.weight.grad.norm().item() for n, m in model.named_modules() if n == "blocks.0.mlp.down"}
            opt.step()
            opt.zero_grad()
    assert probe.order[0] == "tok_emb" and probe.order.index("blocks.0.attn.wqkv") < probe.order.index("blocks.0.attn.wo")
    assert math.sqrt(probe.gradient["blocks.0.mlp.down"]) == pytest.approx(want["blocks.0.mlp.down"], rel=1e-6)
    assert probe.done == 3


def test_an_unknown_fault_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="LMFORGE_VERIFY_FAULT='nope' is not one of tp-row-bias-twice"):
        with faults.installed("nope"):
            pass


BROKEN = {  # fault: (plan arguments, the module named (forward, gradient): None = every module within the band)
    "tp-row-bias-twice": ("--gpus 2xH100 --layout dp=1,tp=2 --precision bf16 --set model.bias=true",
                          (None, "blocks.1.mlp.down")),
    "pp-stage-grad-unscaled": ("--gpus 2xH100 --layout dp=1,pp=2 --precision fp32 --set model.tie_embeddings=false",
                               (None, "blocks.0.mlp.down")),
    # (its outputs differ from the first attention on, so does the loss: every gradient, the head's first)
    "cp-chunks-swapped": ("--gpus 2xH100 --layout dp=1,cp=2 --precision fp32", ("blocks.0.attn.wo", "lm_head")),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(BROKEN))
def test_a_broken_layout_is_named_at_its_module(fault, monkeypatch, capsys):
    from lmforge.cli.plan import plan_main

    args, (forward, gradient) = BROKEN[fault]
    monkeypatch.setenv(faults.FAULT_ENV, fault)
    code = plan_main(["--model", "tiny", *args.split(), "--verify"])
    out = capsys.readouterr().out
    out = out[out.index("verify:"):]
    print(out)
    assert code == 1 and "FAIL  parity" in out, out
    localised = out[out.index("  localised at step"):]
    lines = localised.splitlines()
    for kind, name in (("forward output", forward), ("gradient", gradient)):
        line = next(line for line in lines if kind in line)
        if name is None:
            assert f"every module's {kind} norm within the band" in line, localised
        else:
            assert line.strip().startswith(f"first {kind} outside the band") and f": {name}: norm " in line, localised
    if fault == "pp-stage-grad-unscaled":
        assert "relative difference 3.00e+00" in localised  # 4x: the scale the stage skipped
    if fault == "tp-row-bias-twice":
        assert "band (bf16, measured)" in out
