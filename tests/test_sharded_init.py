"""Sharded initialisation: every rank materialises only its own part of the model, and the parts are
one process's model, bit for bit (random initialisation and pre-trained weights alike).

Real torchrun jobs of tests/sharded_init_driver.py on CPU/gloo, several layouts per launch: for each,
rank 0 compares the weights it receives tensor by tensor with `build_model` (or `load_pretrained`
into it, with LoRA adapters) in one process, and each rank checks that it holds only its share of
the parameters. The transformers folders are made by transformers itself (random weights, random
norm weights and biases), so slicing them (GPT-2's fused, transposed c_attn under FSDP2 x TP:
FSDP2 shards TP's shards, a strided placement) is checked against an independent writer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_parallel_dp import corpus, launcher  # noqa: F401  (module-scoped corpus fixture)

DRIVER = str(Path(__file__).with_name("sharded_init_driver.py"))
SMALL = {"model.vocab_size": 320, "model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.max_seq_len": 64,
         "data.seq_len": 32, "data.tokenizer_vocab_size": 320, "train.global_batch_size": 8,
         "train.micro_batch_size": 2, "train.precision": "fp32", "train.threads": 1, "train.seed": 7}
UNTIED = {"model.tie_embeddings": False}
GPT2 = {"model.pos_emb": "learned", "model.norm": "layernorm", "model.activation": "gelu", "model.bias": True}
LORA = {"finetune.lora_rank": 4, "finetune.lora_targets": "wq,wv,down"}
# Qwen3-style (issue 37): QK-norm weights (replicated under TP), a sliding window (no weights)
FAMILY = {"model.n_kv_heads": 2, "model.qk_norm": True, "model.sliding_window": 8}


def hf_folder(tmp: Path, overrides: dict) -> Path:
    """A transformers folder with random weights (norm weights and biases too) of the model that
    `overrides` describe on the tiny preset, written by transformers."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from lmforge.config import load_config
    from lmforge.interop.hf import hf_config

    cfg = load_config("tiny", {**SMALL, **overrides}).model
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(hf_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(str(tmp))
    return tmp


def run(corpus: Path, nproc: int, cases: dict) -> str:  # noqa: F811
    cases = {name: {**SMALL, **c} for name, c in cases.items()}
    proc = subprocess.run(launcher(nproc, torchrun=True) + [DRIVER, str(corpus), json.dumps(cases)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    for name in cases:
        assert f"{name}: ok" in proc.stdout, (name, proc.stdout)
    return proc.stdout


@pytest.mark.slow
def test_two_rank_layouts_materialise_one_processs_weights(corpus, tmp_path):  # noqa: F811
    llama = hf_folder(tmp_path / "llama", {**UNTIED, "model.n_kv_heads": 2})
    run(corpus, 2, {
        "fsdp2": {"parallel.dp_shard": 2},
        "zero1": {"parallel.dp_shard": 2, "parallel.zero_stage": 1},
        "ddp2": {"parallel.dp_replicate": 2},
        "tp2-sp-tied": {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "pp2-interleaved": {**UNTIED, "parallel.pp": 2, "parallel.pp_schedule": "interleaved",
                            "parallel.pp_virtual_stages": 2},
        "pp2-tied": {"parallel.pp": 2},  # (the last stage's copy of the embedding: the same values)
        "fsdp2-hf-lora": {**UNTIED, "model.n_kv_heads": 2, "parallel.dp_shard": 2,
                          "finetune.init_from": str(llama), **LORA},
        "tp2-sp-qkv-bias-qk-norm": {**FAMILY, "model.qkv_bias": True, "parallel.tp": 2,
                                    "parallel.sequence_parallel": True},
        # fused q/k/v (one attn.wqkv): each rank draws its kv groups' rows by the separate names
        "tp2-sp-fused-qkv": {**FAMILY, "model.qkv_bias": True, "model.fused_qkv": True, "parallel.tp": 2,
                             "parallel.sequence_parallel": True},
        "tp2-fused-qkv-hf-lora": {**UNTIED, "model.n_kv_heads": 2, "model.fused_qkv": True, "parallel.tp": 2,
                                  "finetune.init_from": str(llama), "finetune.lora_rank": 4,
                                  "finetune.lora_targets": "wq,wk,wv,down"},
    })


@pytest.mark.slow
def test_four_rank_layouts_materialise_one_processs_weights(corpus, tmp_path):  # noqa: F811
    gpt2 = hf_folder(tmp_path / "gpt2", GPT2)
    qwen3 = hf_folder(tmp_path / "qwen3", {**UNTIED, **FAMILY})
    run(corpus, 4, {
        "fsdp2xtp2-qwen3-hf": {**UNTIED, **FAMILY, "parallel.dp_shard": 2, "parallel.tp": 2,
                               "finetune.init_from": str(qwen3)},
        "fsdp2xtp2": {"parallel.dp_shard": 2, "parallel.tp": 2, "parallel.sequence_parallel": True},
        "hsdp2x2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2},
        "tp2xpp2": {**UNTIED, "parallel.tp": 2, "parallel.pp": 2},
        "fsdp2xtp2-gpt2-hf": {**GPT2, "parallel.dp_shard": 2, "parallel.tp": 2, "finetune.init_from": str(gpt2)},
        # learned positions under SP: the position weight a replicated DTensor, FSDP2-sharded over dp
        "fsdp2xtp2-sp-gpt2-hf": {**GPT2, "parallel.dp_shard": 2, "parallel.tp": 2, "parallel.sequence_parallel": True,
                                 "finetune.init_from": str(gpt2)},
    })


def test_a_part_of_a_parameter_is_the_same_numbers_as_the_whole():
    """The initialisation of any rows and columns of a parameter equals those of the whole one: the
    property every layout relies on (in one process, no launch)."""
    from lmforge.model.init import InitRule, block_rows, init_values

    rule, shape = InitRule("normal", 0.02), (3 * block_rows((5, 700)) + 7, 700)
    whole = init_values(rule, "blocks.0.mlp.up.weight", shape, (None, None), seed=1)
    rows, cols = torch.tensor([0, 5, shape[0] // 2, shape[0] - 1]), torch.arange(3, 700, 7)
    part = init_values(rule, "blocks.0.mlp.up.weight", shape, (rows, cols), seed=1)
    assert torch.equal(part, whole[rows][:, cols])
    assert not torch.equal(whole, init_values(rule, "blocks.0.mlp.up.weight", shape, (None, None), seed=2))
    assert not torch.equal(whole, init_values(rule, "blocks.1.mlp.up.weight", shape, (None, None), seed=1))
    assert abs(float(whole.std()) - 0.02) < 1e-3
