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
    assert cfg.sources[1].name == "source1" and cfg.sources[1].path == "/abs/books"
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
    assert "train/source0" in out and "MB/s" in out
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
