"""Tokenizer wrapper, byte-level BPE training, GPT-2 vocabulary."""

from __future__ import annotations

import pytest

from lmforge.data.tokenizer import (Tokenizer, load_gpt2_tokenizer, load_tokenizer,
                                    train_bpe)

UNICODE = "Grüße, 世界! naïve café — 🤖🚀\r\n\ttabs   and  spaces\u00a0nbsp\n\x00ctrl Ωμέγα"


def _corpus() -> list[str]:
    syll = ["thou", "art", "king", "queen", "sword", "crown", "night", "day", "love", "ble",
            "ing", "ter", "ous", "mor", "pha", "gli", "ven", "dra"]
    words = [a + b for a in syll for b in syll[::3]]  # 108 distinct words
    return [" ".join(words[(i * 31 + j * 17) % len(words)] for j in range(300)) + "\n"
            for i in range(40)]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe(_corpus(), vocab_size=300)


def test_train_bpe_learns_merges_and_specials(bpe):
    assert bpe.vocab_size == 300
    assert bpe.eos_id == bpe.backend.token_to_id("<|endoftext|>")
    assert bpe.bos_id is None and bpe.pad_id is None
    # Merges compress the training text; unseen text still encodes byte by byte.
    doc = _corpus()[0]
    assert len(bpe.encode(doc)) < len(doc.encode()) / 2
    assert len(bpe.encode("zq")) == 2


def test_bpe_round_trips_any_unicode(bpe):
    ids = bpe.encode(UNICODE)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == UNICODE
    assert bpe.encode_batch([UNICODE, "thou art"]) == [ids, bpe.encode("thou art")]


def test_literal_special_token_in_text_is_not_eos(bpe):
    ids = bpe.encode("a<|endoftext|>b")
    assert bpe.eos_id not in ids
    assert bpe.decode(ids) == "a<|endoftext|>b"
    assert bpe.decode(ids + [bpe.eos_id]).endswith("<|endoftext|>")


def test_bpe_training_is_deterministic_and_save_load_keeps_hash(bpe, tmp_path):
    again = train_bpe(_corpus(), vocab_size=300)
    assert again.sha256 == bpe.sha256
    other = train_bpe(_corpus(), vocab_size=290)
    assert other.sha256 != bpe.sha256
    path = tmp_path / "tok" / "tokenizer.json"
    bpe.save(path)
    loaded = load_tokenizer(str(path))
    assert loaded.sha256 == bpe.sha256 and loaded.eos_id == bpe.eos_id
    assert loaded.encode(UNICODE) == bpe.encode(UNICODE)


def test_train_bpe_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(["abc"], vocab_size=100)


def test_gpt2_vocabulary():
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eos_id == 50256
    assert tok.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"
    assert tok.decode(tok.encode(UNICODE)) == UNICODE
    assert load_gpt2_tokenizer().sha256 == tok.sha256


def test_missing_tokenizer_file_is_named(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ValueError, match=str(missing)):
        load_tokenizer(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(bad)
