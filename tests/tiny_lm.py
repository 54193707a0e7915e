"""A tiny language model trained in a few seconds on a repetitive text, and its run folder:
shared by the evaluation, interop and fine-tuning tests (a helper module, not a test file)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.config import Config, DataConfig, ModelConfig, to_toml

TEXT = "the cat sat on the mat. the dog ran to the park. a bird sang in the tree. " * 40
MODEL = dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=128)


def tiny_tokenizer():
    from lmforge.data.tokenizer import train_bpe

    return train_bpe([TEXT], vocab_size=300)


@functools.lru_cache(maxsize=2)
def train_tiny(steps: int = 150, seed: int = 0):
    """(tokenizer, model trained on TEXT); the loss ends far below the uniform ln(320). Cached:
    trained once per test process (callers must not modify the model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped fixtures run before conftest's single-thread fixture
    try:
        return _train(steps, seed)
    finally:
        torch.set_num_threads(threads)


def _train(steps: int, seed: int):
    from lmforge.model.transformer import build_model

    tok = tiny_tokenizer()
    ids = torch.tensor(tok.encode(TEXT))
    # (the separate q/k/v layout, as before model.fused_qkv was the default: 150 steps at lr 1e-2 amplify
    # the fused matmul's different rounding into another trained model, and the tests that read this
    # one were written against it; runs built from MODEL get the fused default and load it converted)
    model = build_model(ModelConfig(**MODEL, fused_qkv=False), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 33, (8,), generator=gen)
        rows = torch.stack([ids[s:s + 33] for s in starts.tolist()])
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return tok, model


def write_run(run_dir: Path, model, tokenizer) -> Path:
    """An lmforge run folder (config.toml, model.safetensors, tokenizer.json) for `model`."""
    from lmforge.ckpt.export import save_weights

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(run_dir / "tokenizer.json")
    cfg = Config(preset="test", model=model.cfg,
                 data=DataConfig(tokenizer=str(run_dir / "tokenizer.json"), seq_len=model.cfg.max_seq_len))
    cfg.train.sample_prompt = "the cat"
    (run_dir / "config.toml").write_text(to_toml(cfg.validate()))
    save_weights(model, run_dir / "model.safetensors")
    return run_dir
