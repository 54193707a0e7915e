"""The unigram entropy (the validation baseline a run reports) is computed once, when the shards are
written (issue 31 part 5): `lmforge prepare` and the default-corpus preparation record each shard
folder's token counts and their entropy; training reads them instead of the corpus, and counts
only for a folder prepared before they were recorded, each rank a 1/world share."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import lmforge.data.prepare as prepare_mod
from lmforge.config import load_config
from lmforge.data.loader import TokenMixture, open_tokens
from lmforge.data.pipeline import run_prepare
from lmforge.data.prepare import (load_prepared, mixture_entropy, recorded_unigram_entropy, unigram_counts,
                                  unigram_entropy)
from lmforge.data.prepare_config import PrepareConfig, SourceConfig
from lmforge.data.shards import TokenShards, count_entropy, write_token_shards
from lmforge.folders import MANIFEST, UNIGRAM_COUNTS
from tests.conftest import make_corpus

OTHER_WORDS = "a b c d e f g h i j k l m n o p".split()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Two sources with different token distributions and sizes, weighted 0.2 / 0.8 (the pooled
    counts would weigh them ~0.7 / 0.3 by size)."""
    root = tmp_path_factory.mktemp("unigram")
    make_corpus(root / "big", n_docs=12, words_per_doc=600, seed=1)
    small = root / "small"
    small.mkdir()
    rng = np.random.default_rng(0)
    for d in range(6):
        (small / f"d{d}.txt").write_text(" ".join(rng.choice(OTHER_WORDS, 400)) + "\n")
    cfg = PrepareConfig(sources=[SourceConfig(path=str(root / "big"), name="big", weight=0.2),
                                 SourceConfig(path=str(small), name="small", weight=0.8)],
                        output_dir=str(root / "out"), vocab_size=300, val_fraction=0.1, shard_tokens=500,
                        chunk_bytes=4000, parallelism="threads").validate()
    run_prepare(cfg)
    return root / "out"


def _counted(shards: TokenShards) -> np.ndarray:
    return np.bincount(shards.read(0, len(shards)), minlength=shards.vocab_size)


def test_prepare_records_every_folders_token_counts_and_entropy(prepared):
    mixture = open_tokens(prepared / "train")
    assert isinstance(mixture, TokenMixture) and len(mixture.shards) == 2
    record = json.loads((prepared / "prepare.json").read_text())
    for name, src in zip(mixture.names, mixture.shards):
        assert src.manifest["unigram"]["file"] == UNIGRAM_COUNTS and len(src.manifest["shards"]) > 1
        assert np.array_equal(src.recorded_counts(), _counted(src))  # summed over several assemble tasks
        assert src.recorded_entropy == pytest.approx(count_entropy(_counted(src)), rel=1e-12)
        assert record["splits"]["train"][name]["unigram_entropy"] == src.recorded_entropy
    val = TokenShards(prepared / "val")
    assert np.array_equal(val.recorded_counts(), _counted(val))


def test_a_mixtures_entropy_is_that_of_its_weighted_sources(prepared):
    """p = sum_s w_s c_s / n_s: the distribution the loader samples (source s supplies w_s of the
    sequences), not the pooled counts (which weigh the sources by their sizes)."""
    mixture = open_tokens(prepared / "train")
    counted = np.stack([_counted(s) for s in mixture.shards])
    p = sum(w * c / c.sum() for w, c in zip(mixture.weights, counted))
    want = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    assert recorded_unigram_entropy(mixture) == pytest.approx(want, rel=1e-12)
    assert mixture_entropy(unigram_counts(mixture), mixture.weights) == pytest.approx(want, rel=1e-12)
    pooled = count_entropy(counted.sum(axis=0))
    assert abs(pooled - want) > 0.05, (pooled, want)  # the weighting matters for these two sources
    # the counting shares add up to the whole (how ranks count a folder prepared before the record)
    assert np.array_equal(sum(unigram_counts(mixture, r, 3) for r in range(3)), counted)


def test_write_token_shards_records_the_counts(tmp_path):
    """The default-corpus preparation (prepare_texts) writes its shards through write_token_shards."""
    parts = [np.array([1, 2, 2, 3]), np.array([3, 3, 3]), np.array([0])]
    manifest = write_token_shards(parts, tmp_path / "s", shard_tokens=3, vocab_size=5, meta={})
    shards = TokenShards(tmp_path / "s")
    assert shards.recorded_counts().tolist() == [1, 1, 2, 4, 0]
    assert manifest["unigram"]["entropy"] == shards.recorded_entropy == pytest.approx(
        count_entropy(np.array([1, 1, 2, 4])))
    (tmp_path / "s" / UNIGRAM_COUNTS).write_bytes(np.zeros(5, "<i8").tobytes())
    with pytest.raises(ValueError, match="corrupted"):
        TokenShards(tmp_path / "s").recorded_counts()


def _trainer(prepared: Path, tmp_path: Path):
    from lmforge.train.trainer import Trainer

    cfg = load_config("tiny", {
        "data.corpus": str(prepared), "model.vocab_size": 320, "data.tokenizer_vocab_size": 300, "model.dim": 32,
        "model.n_layers": 1, "model.n_heads": 2, "data.seq_len": 16, "train.global_batch_size": 4,
        "train.micro_batch_size": 4, "train.steps": 2, "train.eval_every": 0, "train.eval_sequences": 4,
        "train.sample_tokens": 0, "train.precision": "fp32", "train.plot": False, "train.tensorboard": False,
        "checkpoint.save_final": False, "schedule.warmup_steps": 1})
    return Trainer(cfg, out_dir=tmp_path / "run", data=load_prepared(prepared))


def test_training_reads_the_recorded_entropy_without_reading_the_shards(prepared, tmp_path, monkeypatch):
    want = recorded_unigram_entropy(open_tokens(prepared / "train"))

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was read for its unigram entropy")

    monkeypatch.setattr(prepare_mod, "unigram_counts", refuse)
    monkeypatch.setattr("lmforge.train.run_report.unigram_counts", refuse)
    monkeypatch.setattr(TokenShards, "iter_chunks", refuse)
    result = _trainer(prepared, tmp_path).fit()
    assert result.unigram_entropy == want
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["unigram_entropy"] == want


def test_a_folder_prepared_before_the_record_is_counted_once_with_a_log_line(prepared, tmp_path, monkeypatch, caplog):
    old = tmp_path / "old"
    shutil.copytree(prepared, old)
    for manifest in old.glob(f"**/{MANIFEST}"):  # as an older lmforge wrote them
        m = json.loads(manifest.read_text())
        del m["unigram"]
        manifest.write_text(json.dumps(m))
        (manifest.parent / UNIGRAM_COUNTS).unlink()
    assert recorded_unigram_entropy(open_tokens(old / "train")) is None
    calls = []
    real = prepare_mod.unigram_counts
    monkeypatch.setattr("lmforge.train.run_report.unigram_counts", lambda *a: calls.append(a[1:]) or real(*a))
    trainer = _trainer(old, tmp_path)
    trainer.setup()
    with caplog.at_level(logging.INFO, logger="lmforge.train"):
        entropy = trainer.corpus_entropy()
    assert calls == [(0, 1)]  # one process: the whole corpus, once
    assert entropy == pytest.approx(recorded_unigram_entropy(open_tokens(prepared / "train")), rel=1e-12)
    assert entropy == pytest.approx(unigram_entropy(open_tokens(old / "train")), rel=1e-12)
    assert "records no unigram entropy" in caplog.text and "re-run `lmforge prepare`" in caplog.text
