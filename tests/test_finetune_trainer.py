"""Fine-tuning through `Trainer` once the `[finetune]` config section is wired in (skipped until
then): LoRA and full supervised fine-tuning from a pre-trained run lower the held-out response
loss, and the saved weights are a plain model in which LoRA changed only the adapted layers."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import Config, load_config
from tests.test_finetune import PAIRS
from tests.tiny_lm import MODEL, TEXT, train_tiny, write_run

pytestmark = pytest.mark.skipif(not hasattr(Config(), "finetune"),
                                reason="the [finetune] config section is not wired into Config/Trainer yet")


def sft_setup(tmp_path, rows: list[dict]):
    """A pre-trained tiny run, its prepared text, an instruction file of `rows`, and the overrides of a
    fine-tuning run from it: (pre-trained model, data, instruction file, overrides)."""
    from lmforge.data.prepare import prepare_texts

    tok, model = train_tiny()
    run = write_run(tmp_path / "pre", model, tok)
    (tmp_path / "t.txt").write_text(TEXT)
    data = prepare_texts([tmp_path / "t.txt"], tmp_path / "cache", tokenizer=str(run / "tokenizer.json"),
                         vocab_size=300, val_fraction=0.2)
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = {f"model.{k}": v for k, v in MODEL.items()}
    overrides.update({
        "data.seq_len": 32, "data.tokenizer": str(run / "tokenizer.json"), "train.global_batch_size": 4,
        "train.micro_batch_size": 4, "train.eval_every": 0, "train.sample_tokens": 0, "train.tensorboard": False,
        "train.plot": False, "train.device": "cpu", "train.precision": "fp32", "train.progress": "none",
        "finetune.init_from": str(run), "finetune.data": str(sft)})
    return model, data, sft, overrides


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_finetune_through_the_trainer(tmp_path, lora_rank):
    from lmforge.ckpt.export import load_run
    from lmforge.train.trainer import Trainer

    model, data, sft, overrides = sft_setup(tmp_path, [{"prompt": p, "response": r} for p, r in PAIRS * 4])
    overrides.update({"train.steps": 30, "optim.lr": 3e-3, "schedule.warmup_steps": 2, "finetune.val_data": str(sft),
                      "finetune.lora_rank": lora_rank})
    result = Trainer(load_config("tiny", overrides), out_dir=tmp_path / "ft", data=data).fit()
    assert result.val_loss < 0.7 * result.initial_val_loss
    from lmforge.model.layers import qkv_state

    _, tuned = load_run(tmp_path / "ft")
    # (the pre-trained run has the separate q/k/v layout, the fine-tuned one the default fused attn.wqkv:
    # compared in the former's)
    base, new = model.state_dict(), qkv_state(model.cfg, tuned.state_dict())
    assert set(new) == set(base)  # merged: no lora_* tensors left
    changed = [k for k in base if not k.startswith("rope_") and not torch.equal(base[k], new[k])]
    if lora_rank:
        assert changed and all(k.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight")) for k in changed)
    else:
        assert len(changed) > 8


def test_sft_holds_out_a_split_of_its_data_and_says_what_it_trains_on(tmp_path, caplog):
    """With finetune.val_data empty, finetune.val_fraction of the instruction rows are held out for
    validation (never trained on) instead of validating on the pre-training corpus; the log names
    the instruction data, not the corpus."""
    import logging

    from lmforge.train.trainer import Trainer

    _, data, sft, overrides = sft_setup(tmp_path, [{"prompt": f"{p} {i}", "response": r}
                                                   for i in range(5) for p, r in PAIRS])
    overrides.update({"train.steps": 2, "schedule.warmup_steps": 1, "finetune.val_fraction": 0.2})
    trainer = Trainer(load_config("tiny", overrides), out_dir=tmp_path / "ft", data=data)
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        trainer.fit()
    train_rows = {tuple(r.tolist()) for r in trainer.loader.rows.tokens}
    val_rows = {tuple(r.tolist()) for r in trainer.val_instruct.rows.tokens}
    total = 5 * len(PAIRS)
    assert len(trainer.val_instruct.rows.tokens) == round(0.2 * total)
    assert len(trainer.loader.rows.tokens) == total - round(0.2 * total) and not train_rows & val_rows
    text = caplog.text
    assert f"supervised fine-tuning on {sft}" in text and "held out of it (finetune.val_fraction 0.2)" in text
    assert "unigram entropy" not in text
