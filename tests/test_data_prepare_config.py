"""PrepareConfig TOML loading/validation and the `lmforge prepare` entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.cli.prepare import prepare_main
from lmforge.data.prepare_config import (PrepareConfig, SourceConfig, describe_prepare_config,
                                         load_prepare_config, prepare_config_from_dict)


def _toml(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "prep.toml"
    p.write_text(body)
    return p


def test_load_resolves_paths_and_defaults(tmp_path):
    p = _toml(tmp_path, """
[prepare]
output_dir = "out"
vocab_size = 512
val_fraction = 0.05
lowercase = true
near_dedup_threshold = 0.7

[[prepare.sources]]
name = "web"
path = "raw/*.jsonl"
text_field = "content"
weight = 7  # an integer where a float is expected is fine

[[prepare.sources]]
path = "/abs/books"
""")
    cfg = load_prepare_config(p)
    assert isinstance(cfg, PrepareConfig) and cfg.lowercase and cfg.vocab_size == 512
    assert cfg.output_dir == str(tmp_path / "out")
    assert cfg.sources[0] == SourceConfig(path=str(tmp_path / "raw/*.jsonl"), name="web",
                                          text_field="content", weight=7.0)
    assert cfg.sources[1].name == "books" and cfg.sources[1].path == "/abs/books"  # (named from its path)
    assert cfg.special_tokens == ["<|endoftext|>", "<|pad|>"]
    docs = {k: d for k, _, d in describe_prepare_config()}
    assert all(docs.values()) and "prepare.sources[].text_field" in docs


@pytest.mark.parametrize("body,match", [
    ("[prepare]\nvocab_sise = 3\n[[prepare.sources]]\npath='x'", "unknown config key 'prepare.vocab_sise'; did you mean 'prepare.vocab_size'"),
    ("[prepare]\nvocab_size = '3'\n[[prepare.sources]]\npath='x'", "prepare.vocab_size = '3' must be an integer"),
    ("[prepare]\nlowercase = 1\n[[prepare.sources]]\npath='x'", "prepare.lowercase = 1 must be true or false"),
    ("[prepare]\non_bad_utf8 = 'ignore'\n[[prepare.sources]]\npath='x'", "prepare.on_bad_utf8 = 'ignore' is not one of"),
    ("[prepare]\n[[prepare.sources]]\npath='x'\nfield='t'", r"unknown config key 'prepare.sources\[0\].field'"),
    ("[prepare]\n[[prepare.sources]]\nname='a'", r"prepare.sources\[0\].path: required key"),
    ("[prepare]\n[[prepare.sources]]\npath='x'\nweight=0", r"prepare.sources\[0\].weight = 0.0 must be > 0"),
    ("[prepare]\n[[prepare.sources]]\npath='x'\nformat='csv'", r"prepare.sources\[0\].format = 'csv'"),
    ("[prepare]\nval_fraction = 1.0\n[[prepare.sources]]\npath='x'", "prepare.val_fraction = 1.0"),
    ("[prepare]\nvocab_size = 100\n[[prepare.sources]]\npath='x'", "prepare.vocab_size = 100 must be at least 258"),
    ("[prepare]\n", "at least one"),
    ("[other]\n", "no \\[prepare\\] table"),
    ("[prepare\n", "invalid TOML"),
    ("[prepare]\n[[prepare.sources]]\npath='x'\nname='a b'", "name = 'a b'"),
    ("[prepare]\n[[prepare.sources]]\npath='x'\nname='a'\n[[prepare.sources]]\npath='y'\nname='a'",
     "used twice"),
])
def test_bad_configs_name_the_key(tmp_path, body, match):
    with pytest.raises(ValueError, match=match):
        load_prepare_config(_toml(tmp_path, body))


def test_from_dict_without_base_dir_keeps_paths():
    cfg = prepare_config_from_dict({"sources": [{"path": "rel/x.txt"}]})
    assert cfg.sources[0].path == "rel/x.txt" and cfg.output_dir == "data/prepared"


def test_cli_runs_prints_summary_and_reports_errors(tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "a.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document number {i} " * 3}) + "\n")
        f.write(json.dumps({"text": "document number 0 " * 3}) + "\n")  # duplicate
    cfg = _toml(tmp_path, """
[prepare]
output_dir = "out"
vocab_size = 300
val_fraction = 0.1
shard_tokens = 1000
parallelism = "threads"
[[prepare.sources]]
path = "raw"
""")
    assert prepare_main(["--config", str(cfg), "-q"]) == 0
    out = capsys.readouterr().out
    assert "documents read              201" in out and "removed: duplicates       1" in out
    assert "train/raw" in out and "MB/s" in out
    rec = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert rec["clean"]["kept"] == 200
    assert prepare_main(["--config", str(cfg), "-q"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert prepare_main(["--config", str(cfg), "--out", str(tmp_path / "o2"), "-q"]) == 0
    assert (tmp_path / "o2" / "prepare.json").is_file()
    capsys.readouterr()
    assert prepare_main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml not found" in capsys.readouterr().err
    bad = _toml(tmp_path, "[prepare]\n[[prepare.sources]]\npath = 'nowhere/*.txt'\n")
    assert prepare_main(["--config", str(bad)]) == 2
    assert "no input files match" in capsys.readouterr().err
    assert prepare_main(["--keys"]) == 0 and "prepare.on_bad_utf8" in capsys.readouterr().out


# ---- sources named from their paths (issue 61 item 4) ------------------------------------------------

@pytest.mark.parametrize("paths,names", [
    (["raw/web/**/*.jsonl", "raw/books/*.txt"], ["web", "books"]),
    (["data/shakespeare.txt", "s3://bucket/books.txt.gz", "/abs/my corpus/"], ["shakespeare", "books", "my-corpus"]),
    (["raw/a/*.jsonl", "raw/a/*.txt"], ["a-0", "a-1"]),  # the same folder twice: each with its index
    (["*.txt"], ["source0"]),  # nothing to name it by
])
def test_a_source_without_a_name_is_named_from_its_path(paths, names):
    cfg = PrepareConfig(sources=[SourceConfig(path=p) for p in paths]).validate()
    assert [s.name for s in cfg.sources] == names


def test_a_typed_name_wins_over_a_derived_one():
    cfg = PrepareConfig(sources=[SourceConfig(path="raw/books/*.txt"),
                                 SourceConfig(path="raw/more/*.txt", name="books")]).validate()
    assert [s.name for s in cfg.sources] == ["books-0", "books"]


def test_derived_names_flow_to_the_manifest_a_stage_and_the_val_loss_keys(tmp_path):
    import contextlib

    import torch

    from lmforge.config import load_config
    from lmforge.data.loader import open_tokens
    from lmforge.data.mixture import configured_stages, mixture_entries
    from lmforge.data.pipeline import run_prepare
    from lmforge.data.prepare import load_prepared
    from lmforge.model.transformer import build_model
    from lmforge.train.validation import Validation
    from tests.test_data_prepare_readme import raw_web_and_books

    raw_web_and_books(tmp_path, web_docs=120, web_words=30, books=12, book_words=300, vocab=60)
    prep = PrepareConfig(sources=[SourceConfig(path=str(tmp_path / "raw/web/**/*.jsonl"), weight=0.7),
                                  SourceConfig(path=str(tmp_path / "raw/books/*.txt"), weight=0.3)],
                         output_dir=str(tmp_path / "out"), vocab_size=300, val_fraction=0.3, shard_tokens=2000,
                         parallelism="threads").validate()
    run_prepare(prep)
    data = load_prepared(tmp_path / "out")
    assert [name for name, _, _ in mixture_entries(data.train_dir)] == ["web", "books"]
    train = open_tokens(data.train_dir)
    cfg = load_config("tiny", {"data.seq_len": 16, "model.vocab_size": 300, "data.tokenizer_vocab_size": 300,
                               "train.eval_sequences": 2,
                               "data.stages": [{"start_step": 0, "weights": {"books": 1.0}, "name": "anneal"}]})
    [stage] = configured_stages(cfg.data.stages, train.names, train.weights, [0])
    assert stage.weights == (0.0, 1.0) and stage.record["weights"] == {"books": 1.0}
    validation = Validation(cfg, open_tokens(data.val_dir), train_shards=train)
    assert [name for name, _ in validation.sources] == ["web", "books"]
    val = validation.evaluate(build_model(cfg.model, seed=0), contextlib.nullcontext, torch.device("cpu"))
    assert {"val_loss/web", "val_loss/books"} <= Validation.record(val).keys()


def test_an_old_mixture_manifest_without_names_still_loads(tmp_path):
    """A mixture.json whose sources carry no names reads as source0, source1, ... (prepare's old names)."""
    from lmforge.data.mixture import mixture_entries

    (tmp_path / "mixture.json").write_text(json.dumps({"sources": [{"dir": "source0", "weight": 0.7},
                                                                   {"dir": "source1", "weight": 0.3}]}))
    assert mixture_entries(tmp_path) == [("source0", "source0", 0.7), ("source1", "source1", 0.3)]
