"""prepare_texts / prepare_default on a tiny on-disk corpus (no network)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from lmforge.data import prepare as prep
from lmforge.data.shards import TokenShards, write_token_shards
from lmforge.data.tokenizer import Tokenizer


def _write_corpus(root: Path, n_docs: int = 4) -> list[Path]:
    files = []
    for d in range(n_docs):
        lines = [f"Document {d}, line {i}: the {'quick' if i % 2 else 'slow'} fox "
                 f"number {d * 1000 + i} jumps — ünïcode ✓" for i in range(60)]
        f = root / f"doc{d}.txt"
        f.write_text("\r\n".join(lines) + "\r\n\r\n\r\n\r\n\r\n", encoding="utf-8")
        files.append(f)
    return files


def _split_at_eos(tokens: np.ndarray, eos: int) -> list[list[int]]:
    parts, cur = [], []
    for t in tokens.tolist():
        if t == eos:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    assert cur == [], "stream must end with EOS"
    return parts


def test_split_is_disjoint_complete_and_deterministic(tmp_path):
    files = _write_corpus(tmp_path)
    out = prep.prepare_texts(files, tmp_path / "cache", "bpe", 320, 0.1, shard_tokens=500)
    tok = out.tokenizer
    assert tok.vocab_size == 320
    assert Tokenizer.load(out.tokenizer_path).sha256 == tok.sha256
    train, val = TokenShards(out.train_dir), TokenShards(out.val_dir)
    assert train.manifest["meta"]["tokenizer_sha256"] == tok.sha256
    assert train.manifest["meta"]["documents"] == 4 and len(train.manifest["shards"]) > 1
    heads = _split_at_eos(train.read(0, len(train)), tok.eos_id)
    tails = _split_at_eos(val.read(0, len(val)), tok.eos_id)
    docs = [tok.encode(d) for d in prep.read_text_files(files)]
    assert len(heads) == len(tails) == len(docs) == 4
    for doc, head, tail in zip(docs, heads, tails):
        assert head + tail == doc  # every token in exactly one split, in order
        assert len(tail) == round(0.1 * len(doc)) > 0
    train_text = tok.decode(train.read(0, len(train)))
    for tail in tails:  # held-out text does not appear in train
        assert tok.decode(tail[len(tail) // 4:]) not in train_text
    assert "\r" not in train_text and "\n\n\n\n" not in train_text  # cleaned


def test_second_call_is_cached_and_does_not_retokenize(tmp_path, monkeypatch):
    files = _write_corpus(tmp_path)
    first = prep.prepare_texts(files, tmp_path / "cache", "bpe", 300, 0.2)
    mtime = (first.train_dir / "shard_00000.bin").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("re-tokenized a cached dataset")

    monkeypatch.setattr(prep, "train_bpe", boom)
    monkeypatch.setattr(Tokenizer, "encode_batch", boom)
    second = prep.prepare_texts(files, tmp_path / "cache", "bpe", 300, 0.2)
    assert second.train_dir == first.train_dir and second.val_dir == first.val_dir
    assert second.tokenizer.sha256 == first.tokenizer.sha256
    assert (second.train_dir / "shard_00000.bin").stat().st_mtime_ns == mtime
    # Any change of an input of the key builds (tries to build) a new dataset.
    for args in [("bpe", 300, 0.3), ("bpe", 310, 0.2)]:
        with pytest.raises(AssertionError, match="re-tokenized"):
            prep.prepare_texts(files, tmp_path / "cache", *args)
    files[0].write_text("changed content\n")
    with pytest.raises(AssertionError, match="re-tokenized"):
        prep.prepare_texts(files, tmp_path / "cache", "bpe", 300, 0.2)


def test_interrupted_prepare_leaves_no_dataset(tmp_path, monkeypatch):
    files = _write_corpus(tmp_path, 2)
    real = prep.write_token_shards

    def crash_on_val(arrays, out_dir, *a, **k):
        if Path(out_dir).name == "val":
            raise KeyboardInterrupt
        return real(arrays, out_dir, *a, **k)

    monkeypatch.setattr(prep, "write_token_shards", crash_on_val)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare_texts(files, tmp_path / "cache", "bpe", 300, 0.1)
    assert list((tmp_path / "cache" / "datasets").iterdir()) == []
    monkeypatch.setattr(prep, "write_token_shards", real)
    out = prep.prepare_texts(files, tmp_path / "cache", "bpe", 300, 0.1)
    assert len(TokenShards(out.val_dir)) > 0


def test_gpt2_tokenizer_and_tokenizer_file(tmp_path):
    files = _write_corpus(tmp_path, 2)
    g = prep.prepare_texts(files, tmp_path / "cache", "gpt2", 4096, 0.1)
    assert g.tokenizer.vocab_size == 50257
    m = TokenShards(g.train_dir).manifest
    assert m["vocab_size"] == 50257 and m["dtype"] == "uint16"
    # A tokenizer.json path works too and is keyed by its content.
    f = prep.prepare_texts(files, tmp_path / "cache", str(g.tokenizer_path), 1, 0.1)
    assert f.train_dir != g.train_dir
    np.testing.assert_array_equal(TokenShards(f.train_dir).read(0, 50),
                                  TokenShards(g.train_dir).read(0, 50))


def test_prepare_default_uses_fetched_corpus(tmp_path, monkeypatch):
    files = _write_corpus(tmp_path, 2)
    seen = []
    monkeypatch.setattr(prep, "fetch_default_corpus", lambda c: seen.append(c) or files)
    out = prep.prepare_default(tmp_path / "cache", "bpe", 300, 0.1)
    assert seen == [tmp_path / "cache"]
    assert out.train_dir.parent.parent == tmp_path / "cache" / "datasets"


def test_bad_inputs_name_the_problem(tmp_path):
    files = _write_corpus(tmp_path, 1)
    missing = tmp_path / "missing" / "tokenizer.json"
    with pytest.raises(ValueError, match=str(missing)):
        prep.prepare_texts(files, tmp_path / "c", str(missing), 300, 0.1)
    for frac in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match=f"val_fraction={frac}"):
            prep.prepare_texts(files, tmp_path / "c", "bpe", 300, frac)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"abc\xe9def")
    with pytest.raises(ValueError, match="latin1.txt: invalid UTF-8 at byte offset 3"):
        prep.prepare_texts([bad], tmp_path / "c", "bpe", 300, 0.1)
    with pytest.raises(ValueError, match="nothere.txt not found"):
        prep.prepare_texts([tmp_path / "nothere.txt"], tmp_path / "c", "bpe", 300, 0.1)


@pytest.mark.parametrize("tokens,expected", [
    ([0, 0, 1, 1], math.log(2)),
    ([0, 1, 2, 3] * 5, math.log(4)),
    ([7] * 10, 0.0),
    ([0, 0, 0, 1], -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))),
])
def test_unigram_entropy(tmp_path, tokens, expected):
    write_token_shards([np.array(tokens)], tmp_path / "s", 3, 10, {})
    assert prep.unigram_entropy(TokenShards(tmp_path / "s")) == pytest.approx(expected)


def test_concurrent_prepare_keeps_the_winners_dataset(tmp_path, monkeypatch):
    """Two ranks preparing at once: the loser discards its copy, the winner's stays intact."""
    files = _write_corpus(tmp_path, 2)
    real_build = prep._build
    winner = {}

    def build_after_other_rank_finished(*a, **k):
        monkeypatch.setattr(prep, "_build", real_build)
        winner["data"] = prep.prepare_texts(files, tmp_path / "cache", "bpe", 300, 0.1)
        winner["mtime"] = (winner["data"].train_dir / "manifest.json").stat().st_mtime_ns
        return real_build(*a, **k)

    monkeypatch.setattr(prep, "_build", build_after_other_rank_finished)
    loser = prep.prepare_texts(files, tmp_path / "cache", "bpe", 300, 0.1)
    assert loser.train_dir == winner["data"].train_dir
    assert (loser.train_dir / "manifest.json").stat().st_mtime_ns == winner["mtime"]
    assert [p.name for p in (tmp_path / "cache" / "datasets").iterdir()] == [
        loser.train_dir.parent.name]
