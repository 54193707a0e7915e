"""A transformers-made stand-in for a Qwen2.5 checkpoint, made offline in a second: a small random
`Qwen2ForCausalLM` (biases on q/k/v, tied embeddings, RoPE theta 1e6) saved with `save_pretrained`,
and a real byte-level BPE `tokenizer.json` trained with the `tokenizers` library on a text and
wrapped for transformers (`PreTrainedTokenizerFast`) with Qwen's special tokens. Shared by the
walk-through test and tests/test_readme_commands.py (a helper module, not a test file)."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("The river runs past the mill and the miller counts the sacks of grain. "
        "In spring the water rises; in autumn the wheel turns slowly. ") * 30
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen2.5's (EOS / chat markers)
TOKENIZER_VOCAB = 300  # bytes + merges + SPECIAL
MODEL_VOCAB = 384  # padded beyond the tokenizer, as Qwen2.5 pads 151,665 tokens to 151,936 rows
# BOS / EOS the folder's tokenizer_config.json names; neither is one of the names lmforge would guess
# (lmforge.data.tokenizer's candidates), so keeping their ids shows the import read them
BOS, EOS = "<|im_start|>", "<|im_end|>"
MY_TEXT_TOML = '''[prepare]
output_dir = "data/my_text"
tokenizer = "path/to/qwen2.5"    # the model's own tokenizer.json (a Hugging Face folder)
val_fraction = 0.1
val_split = "tail"    # the last 10% of every text is held out

[[prepare.sources]]
path = "my_text/*.txt"
'''


def make_qwen_standin(out: str | Path) -> Path:
    """Write the stand-in transformers folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, ...) to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=EOS, pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rope_theta=1e6,
                      tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random biases and norm weights, so a mapping mistake shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return out


def write_my_text(cwd: Path) -> None:
    """The user's own text (my_text/*.txt) and its prepare config (my_text.toml), as docs/evaluation.md shows."""
    (cwd / "my_text").mkdir(parents=True, exist_ok=True)
    for i in range(4):
        (cwd / "my_text" / f"part{i}.txt").write_text(
            f"Chapter {i}. The miller's daughter walked to the river every morning.\n\n" + TEXT[:1500] + "\n")
    (cwd / "my_text.toml").write_text(MY_TEXT_TOML)
