"""The planner's cost of the document mask (data.attention = "document": lmforge.plan.documents),
against what the kernels hold: SDPA's saved tensors (saved-tensor hooks) and the CP ranks' masks, and
the plan's memory and time with and without the mask; `lmforge plan` reads the corpus' documents and
prints the stage plan."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import load_config
from lmforge.model.documents import dense_document_mask, document_ids
from lmforge.plan.documents import (attention_work_factor, document_bias_bytes_per_layer, document_mask_bytes,
                                    mask_pairs)
from lmforge.plan.hardware import get_device
from lmforge.plan.layout import Layout
from lmforge.plan.memory import estimate_memory
from lmforge.plan.op_time import op_times

EOS = 0


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def doc_tokens(b: int, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1, 50, (b, t), generator=gen)
    x[torch.rand(b, t, generator=gen) < 0.05] = EOS
    return x


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_sdpa_saves_the_planned_copy_of_the_mask(precision, dtype):
    """What SDPA saves for backward under the boolean document mask, beyond causal attention, is the
    plan's per-layer bytes (its additive copy of the mask in the attention dtype)."""
    B, H, T, D = 2, 4, 192, 16
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
    ids = document_ids(doc_tokens(B, T), EOS)
    mask = dense_document_mask(ids, ids, 0)
    extra = saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) - \
        saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    layout = Layout(micro_batch=B, precision=precision, documents="sdpa")
    assert extra == document_bias_bytes_per_layer(layout, T) > 0
    assert document_mask_bytes(layout, T) == mask.numel() + 4 * ids.numel()  # the bool mask and the int32 ids


@pytest.mark.parametrize("cp", [2, 4])
def test_each_cp_rank_holds_the_planned_mask_pairs(cp):
    from lmforge.parallel.context_parallel import SequenceSharding

    B, T = 2, 64
    ids = document_ids(doc_tokens(B, T), EOS)
    for rank in range(cp):
        masks = SequenceSharding(None, rank, cp, torch.device("cpu")).document_masks(ids, 0, 0.0)
        assert sum(m.numel() for m in masks) == B * mask_pairs(Layout(cp=cp), T), (cp, rank)


def test_the_plan_counts_the_mask_in_memory_and_time():
    cfg = load_config("gpt2-124m").model
    seq = 1024
    h100 = get_device("H100-SXM")

    def plan(**kw):
        layout = Layout(micro_batch=4, grad_accum=2, **kw)
        return estimate_memory(cfg, layout, "adamw", seq), op_times(cfg, layout, seq, h100)

    (causal, t_causal), (sdpa, t_sdpa), (flex, t_flex) = plan(), plan(documents="sdpa"), plan(documents="flex")
    lay = Layout(micro_batch=4, documents="sdpa")
    per_layer, mask = document_bias_bytes_per_layer(lay, seq), document_mask_bytes(lay, seq)
    assert sdpa.activations - causal.activations == pytest.approx(cfg.n_layers * per_layer + mask)
    assert 0 < flex.activations - causal.activations < mask / 100  # the block mask and the ids
    # full recompute keeps no layer's copy, only the mask every block reads
    (causal_ac, _), (sdpa_ac, _) = plan(ac="full"), plan(ac="full", documents="sdpa")
    assert sdpa_ac.activations - causal_ac.activations == pytest.approx(mask)
    attention = {name: t.by_kind()["attention"] for name, t in (("causal", t_causal), ("sdpa", t_sdpa),
                                                                ("flex", t_flex))}
    assert attention["sdpa"] == pytest.approx(2 * attention["causal"]) and attention["flex"] == attention["causal"]
    assert t_sdpa.by_kind()["elementwise"] > t_causal.by_kind()["elementwise"]
    # FlexAttention skips the blocks outside documents of 100 tokens: (100 + 128) / 1024 of the work
    _, t_short = plan(documents="flex", doc_tokens=100)
    assert t_short.by_kind()["attention"] == pytest.approx(attention["causal"] * 228 / 1024)
    assert attention_work_factor(Layout(documents="flex", doc_tokens=4000), seq) == 1.0


def test_lmforge_plan_reads_the_corpus_documents_and_prints_the_stage_plan(tmp_path, capsys):
    from lmforge.data.shards import write_token_shards
    from lmforge.cli.plan import plan_main

    train = tmp_path / "corpus" / "train"
    for name, n_docs, length in (("a", 300, 20), ("b", 100, 80)):
        docs = [torch.cat((torch.ones(length - 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))).numpy()
                for _ in range(n_docs)]
        write_token_shards(docs, train / name, 1000, 1 << 16, {"eos_id": EOS, "documents": n_docs})
    (train / "mixture.json").write_text(json.dumps({"sources": [{"name": "a", "dir": "a", "weight": 0.5},
                                                                {"name": "b", "dir": "b", "weight": 0.5}]}))
    args = ["--model", "tiny", "--gpus", "1xH100", "--set", f"data.corpus={tmp_path / 'corpus'}",
            "--set", "data.attention=document", "--set", "train.steps=100",
            "--set", 'data.stages=[{start_step = 60, weights = {b = 1.0}, name = "anneal"}]']
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    # half the tokens from 20-token documents, half from 80-token ones: 1 / (0.5 / 20 + 0.5 / 80) = 32
    assert "documents=flex,doc_tokens=32" in out
    assert "data: anneal, steps 60-99: 163,840 tokens: b 163,840 (100%)" in out, out
    assert "warning:" in out and "'b' is repeated" in out  # 8,000 tokens of b, drawn ~50 times
