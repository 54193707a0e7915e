"""Walk-through: continue pre-training a Qwen2.5-style model on your own text, as docs/evaluation.md shows it.

A transformers-made stand-in (tests/qwen_standin.py: a random `Qwen2ForCausalLM` saved with
`save_pretrained`, and a real byte-level BPE tokenizer.json trained with `tokenizers` and wrapped for
transformers) goes through the real command line, offline: `lmforge import`, `lmforge prepare` with
the model's own tokenizer, `lmforge train --finetune.init_from` for 20 steps, `lmforge export`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests import warm_start
from tests.qwen_standin import BOS, EOS, MODEL_VOCAB, MY_TEXT_TOML, TOKENIZER_VOCAB, make_qwen_standin, write_my_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--train.steps", "20", "--train.global_batch_size", "8", "--train.micro_batch_size", "4",
         "--data.seq_len", "32", "--train.eval_every", "10", "--train.eval_sequences", "4", "--train.log_every", "1",
         "--train.sample_tokens", "4", "--train.plot", "false", "--train.tensorboard", "false",
         "--train.progress", "lines", "--train.threads", "1", "--train.precision", "fp32",
         "--schedule.warmup_steps", "2", "--checkpoint.every_minutes", "0"]


def lmforge(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*warm_start.shared().interpreter(), "-m", "lmforge", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"lmforge {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_continue_pretraining_a_qwen25_style_model_on_your_own_text(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmforge.ckpt.export import load_run
    from lmforge.data.prepare import load_prepared
    from lmforge.data.tokenizer import Tokenizer

    hf_dir = make_qwen_standin(tmp_path / "path" / "to" / "qwen2.5")
    hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    write_my_text(tmp_path)
    assert MY_TEXT_TOML in (ROOT / "docs" / "evaluation.md").read_text()  # the prepare config the docs show

    # 1. import: the model, its tokenizer.json and its own BOS/EOS ids
    lmforge(tmp_path, "import", "--hf", "path/to/qwen2.5", "--out", "runs/qwen-base")
    base = tmp_path / "runs" / "qwen-base"
    cfg, model = load_run(base)
    cfg = cfg.model
    assert (cfg.qkv_bias, cfg.bias, cfg.tie_embeddings, cfg.vocab_size) == (True, False, True, MODEL_VOCAB)
    tok = Tokenizer.load(base / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)
    assert (hf_tok.convert_ids_to_tokens(tok.bos_id), hf_tok.convert_ids_to_tokens(tok.eos_id)) == (BOS, EOS)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = torch.tensor([hf_tok("The miller counts the sacks.")["input_ids"]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-5

    # 2. prepare the user's text with the model's tokenizer: the same ids transformers gives
    lmforge(tmp_path, "prepare", "--config", "my_text.toml")
    prepared = load_prepared(tmp_path / "data" / "my_text")
    text = "In spring the water rises."
    assert prepared.tokenizer.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert prepared.tokenizer.vocab_size == TOKENIZER_VOCAB < MODEL_VOCAB  # the model keeps its padded rows

    # 3. continue pre-training from the imported weights for 20 steps
    # (no --config: the run that finetune.init_from names gives the model)
    proc = lmforge(tmp_path, "train", "--finetune.init_from", "runs/qwen-base",
                   "--data.corpus", "data/my_text", "--optim.lr", "1e-3", "--train.out_dir", "runs/qwen-cpt", *TRAIN)
    run = tmp_path / "runs" / "qwen-cpt"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in recs if "loss" in r and "step" in r) == list(range(1, 21)), proc.stdout[-2000:]
    trained_cfg, trained = load_run(run)
    assert trained_cfg.model == cfg
    # training started from the imported weights: 20 AdamW steps of lr 1e-3 move a weight by at most
    # ~0.02, while the imported norm weights (random, 1 +- 0.1) are far from a fresh init's ones
    norms = [name for name, _ in model.named_parameters() if "norm" in name]
    imported, after = model.state_dict(), trained.state_dict()
    assert max((imported[n] - 1).abs().max().item() for n in norms) > 0.15
    assert max((after[n] - imported[n]).abs().max().item() for n in norms) < 0.05
    assert not torch.equal(after["tok_emb.weight"], imported["tok_emb.weight"])

    # 4. export: a Qwen2ForCausalLM folder transformers loads, the same function as the run
    lmforge(tmp_path, "export", "--run", "runs/qwen-cpt", "--out", "hf/qwen-cpt")
    out = tmp_path / "hf" / "qwen-cpt"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (trained(ids) - back(ids).logits).abs().max().item() < 1e-5
    assert AutoTokenizer.from_pretrained(str(out))(text, add_special_tokens=False)["input_ids"] == \
        prepared.tokenizer.encode(text)

