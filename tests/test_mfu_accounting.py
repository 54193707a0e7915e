"""FLOPs per token count what autograd computes (frozen weights skip their weight gradient), and
the MFU a run reports is exactly tokens/s x flops_per_token / (peak x world size)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config import load_config
from lmforge.model.accounting import flops_per_token, training_flops
from lmforge.model.lora import apply_lora
from lmforge.model.loss import token_nll_sum
from lmforge.model.transformer import build_model
from lmforge.train.trainer import Trainer

SMALL = {"model.dim": 64, "model.n_heads": 4, "model.n_layers": 2, "model.vocab_size": 320,
         "data.tokenizer_vocab_size": 320, "data.seq_len": 32, "model.max_seq_len": 64}
GPT2ISH = {"model.activation": "gelu", "model.norm": "layernorm", "model.bias": True, "model.pos_emb": "learned",
           "model.tie_embeddings": False}

# Gemma 3's and OLMo 2 / 3's blocks (model.norm_placement, qk_norm_scope, ...): windows of 8 of the 32 tokens
GEMMA3ISH = {"model.norm_placement": "sandwich", "model.embed_scale": True, "model.activation": "geglu",
             "model.qk_norm": True, "model.n_kv_heads": 2, "model.attn_scale_dim": 12, "model.sliding_window": 8,
             "model.layer_types": ["sliding_attention", "full_attention"], "model.rope_local_theta": 100.0}
OLMOISH = {"model.norm_placement": "post", "model.qk_norm": True, "model.qk_norm_scope": "projection",
           "model.n_kv_heads": 2, "model.sliding_window": 8, "model.layer_types": ["sliding_attention", "full_attention"]}


def trainable(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("over, lora", [
    ({}, ""),                                          # pre-training: 6N
    ({}, "wq,wk,wv,wo"),                               # LoRA on attention (the default targets)
    ({"model.n_kv_heads": 2, "model.tie_embeddings": False}, "wk,wv"),
    ({}, "gate,up,down"),                              # first block's attention entirely frozen
    (GPT2ISH, "fc,proj,lm_head"),                      # biases, LayerNorm, a LoRA head
    ({"model.fused_qkv": True, "model.n_kv_heads": 2, "model.qkv_bias": True}, ""),  # one wqkv matmul
    ({"model.fused_qkv": True, "model.n_kv_heads": 2}, "wq,wk,wv,wo"),               # an adapter per part
    ({"model.fused_qkv": True, "model.n_kv_heads": 2}, "wq,wv"),                     # on some of the parts
    (GEMMA3ISH, ""),                                   # four norms a block, GeGLU, local / global windows
    (OLMOISH, "gate,up,down"),                         # output norms only, QK-norm over the projections
], ids=["full", "lora-attn", "lora-gqa-kv", "lora-mlp", "lora-gelu-head", "fused-qkv", "lora-fused-qkv",
        "lora-fused-q-v", "gemma3", "lora-olmo"])
def test_matmul_flops_equal_what_torch_counts(over, lora):
    """torch's FlopCounterMode counts every mm/addmm of one forward + backward; the accounting's
    matmul part must equal it exactly (attention runs in SDPA, which the counter does not see on
    CPU; its 12*L*d*s term is the PaLM convention)."""
    cfg = load_config("tiny", {**SMALL, **over})
    model = build_model(cfg.model, seed=0)
    if lora:
        apply_lora(model, lora, rank=4, alpha=8.0)
    batch, seq = 2, cfg.data.seq_len
    x, y = torch.randint(0, 320, (batch, seq)), torch.randint(0, 320, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        token_nll_sum(model(x), y).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(counts) <= {"aten.mm", "aten.addmm"}, counts  # (no bmm: attention is SDPA)
    measured = (counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)) / (batch * seq)
    got = training_flops(cfg.model, seq, trainable(model))
    assert got["matmul"] == measured
    assert flops_per_token(cfg.model, seq, trainable(model)) == got["total"]
    if not lora:  # every weight trains: exactly the PaLM 6N + 12*L*d*s
        assert got["total"] == flops_per_token(cfg.model, seq)
    else:  # frozen weights skip their weight gradients: well below 6N
        assert got["total"] < 0.8 * flops_per_token(cfg.model, seq)


def test_lora_run_reports_the_flops_it_computes_and_mfu_is_the_identity(small_data, tmp_path, caplog):
    over = {**SMALL, "finetune.lora_rank": 4, "train.steps": 4, "train.log_every": 2, "train.eval_every": 0,
            "train.eval_sequences": 8, "train.sample_tokens": 0, "train.global_batch_size": 4,
            "train.micro_batch_size": 4, "train.precision": "fp32", "train.tensorboard": False, "train.plot": False,
            "train.progress": "none", "schedule.warmup_steps": 1, "checkpoint.save_final": False}
    trainer = Trainer(load_config("tiny", over), out_dir=tmp_path / "run", data=small_data)
    with caplog.at_level("INFO", logger="lmforge.train"):
        trainer.fit()
    header = [r.getMessage() for r in caplog.records if "MFLOPs/token" in r.getMessage()]
    assert len(header) == 2 and all("weight gradients of the trainable ones only" in h and "6N" not in h
                                    for h in header), header  # the log names the rule it counted by
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cfg = trainer.cfg
    want = training_flops(cfg.model, cfg.data.seq_len, trainable(trainer.model))["total"]
    assert summary["flops_per_token"] == want < 0.8 * flops_per_token(cfg.model, cfg.data.seq_len)
    peak, world = summary["peak_flops"], summary["hardware"]["world_size"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "window_mfu" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:  # exactly, as logged (JSON floats round-trip)
        assert r["window_mfu"] == r["window_tokens_per_s"] * summary["flops_per_token"] / (peak * world), r
    half = records[-len(records) // 2:]
    assert summary["mfu"] == sum(r["window_mfu"] for r in half) / len(half)
