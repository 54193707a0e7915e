"""What a user sees when something is wrong: one line that names the file or key and the fix, exit
status 2, no traceback, nothing created (issue 18, section 3)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.model.transformer import build_model
from tests.tiny_lm import MODEL, tiny_tokenizer, write_run

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run folder (config.toml, model.safetensors, tokenizer.json) of an untrained model."""
    return write_run(tmp_path_factory.mktemp("run") / "tiny", build_model(ModelConfig(**MODEL), seed=0),
                     tiny_tokenizer())


def one_line_error(capsys, argv: list[str]) -> str:
    """Run `lmforge <argv>`; it must exit 2 with exactly one line on stderr, which is returned."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


# ---- lmforge export without transformers --------------------------------------------------------

def test_export_without_transformers_says_how_to_install_and_creates_nothing(run_dir, tmp_path, monkeypatch,
                                                                            capsys):
    """Was a ModuleNotFoundError traceback, after an empty --out folder had been created."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    out = tmp_path / "hf" / "tiny"
    err = one_line_error(capsys, ["export", "--run", str(run_dir), "--out", str(out)])
    assert err.startswith("error: lmforge export needs the transformers package, which is not installed")
    assert err.endswith('install it with: pip install "lmforge[eval]"')
    assert not (tmp_path / "hf").exists()  # nothing created, not even the parent folder


# ---- a truncated model.safetensors -----------------------------------------------------------------

@pytest.mark.parametrize("keep", ["half", "header"])
def test_truncated_weights_name_the_file_and_the_fix(run_dir, tmp_path, capsys, keep):
    """Was a 19-line traceback ending in `SafetensorError: ... incomplete metadata`, without the path.
    generate, eval, export and fine-tuning's init_from all read weights through load_weights."""
    import shutil

    from lmforge.ckpt.export import load_weights

    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    weights = run / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if keep == "half" else data[:6])
    reason = "incomplete metadata, file not fully covered" if keep == "half" else "header too small"
    expected = (f"{weights} ({weights.stat().st_size:,} bytes) is not a complete safetensors file ({reason}): it "
                f"was truncated (an interrupted copy or download, a full disk) or is corrupt. Fix: copy or write it "
                f"again from its source.")
    assert one_line_error(capsys, ["generate", "--ckpt", str(run), "--max-tokens", "2"]) == f"error: {expected}"
    assert one_line_error(capsys, ["eval", "--ckpt", str(run), "--samples", "0"]) == f"error: {expected}"
    if keep == "half":
        pytest.importorskip("transformers")
        assert one_line_error(capsys, ["export", "--run", str(run), "--out", str(tmp_path / "hf")]) == \
            f"error: {expected}"
        assert not (tmp_path / "hf").exists()
        with pytest.raises(ValueError) as exc:  # what finetune.init_from calls for a run or a .safetensors
            load_weights(build_model(ModelConfig(**MODEL), seed=0), weights)
        assert str(exc.value) == expected


# ---- a wrong --ckpt / --run path ---------------------------------------------------------------------

def test_a_wrong_run_path_says_what_the_path_is(run_dir, tmp_path, capsys):
    """Every wrong path used to say "config.toml is missing", even one that does not exist."""
    root = run_dir.parent
    err = one_line_error(capsys, ["generate", "--ckpt", str(root / "tiyn")])
    assert err == (f"error: run folder '{root / 'tiyn'}' does not exist (did you mean '{run_dir}'?); give the "
                   f"folder `lmforge train` wrote (its train.out_dir, e.g. runs/tiny).")
    err = one_line_error(capsys, ["eval", "--ckpt", str(tmp_path / "nowhere" / "tiny")])
    assert f"run folder '{tmp_path / 'nowhere' / 'tiny'}' does not exist (nor does '{tmp_path / 'nowhere'}')" in err

    weights = run_dir / "model.safetensors"
    err = one_line_error(capsys, ["generate", "--ckpt", str(weights)])
    assert err == f"error: '{weights}' is a file, not a run folder; give its folder '{run_dir}'."

    hf = tmp_path / "llama"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    expected = (f"error: '{hf}' is a transformers model folder (config.json), not an lmforge run folder; turn it "
                f"into one with `lmforge import --hf {hf} --out RUN_DIR`, then use RUN_DIR.")
    assert one_line_error(capsys, ["generate", "--ckpt", str(hf)]) == expected
    assert one_line_error(capsys, ["eval", "--run", str(hf)]) == expected
    pytest.importorskip("transformers")
    assert one_line_error(capsys, ["export", "--run", str(hf), "--out", str(tmp_path / "out")]) == expected

    sweep = tmp_path / "sweep"  # a folder of runs (a sweep): name them
    for name in ("t000-aa", "t001-bb"):
        (sweep / name).mkdir(parents=True)
        (sweep / name / "config.toml").write_text("")
    err = one_line_error(capsys, ["generate", "--ckpt", str(sweep)])
    assert err == (f"error: '{sweep}' is not an lmforge run folder: it has no config.toml; it holds run folders "
                   f"(t000-aa, t001-bb): give one of them, e.g. '{sweep / 't000-aa'}'.")
    err = one_line_error(capsys, ["generate", "--ckpt", str(sweep / "t000-aa")])
    assert err.startswith(f"error: '{sweep / 't000-aa'}' has no model.safetensors: training writes it when the "
                          f"run finishes")


def test_generate_without_a_tokenizer_says_so(run_dir, tmp_path, capsys):
    import shutil

    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    (run / "tokenizer.json").unlink()
    err = one_line_error(capsys, ["generate", "--ckpt", str(run)])
    assert err.startswith(f"error: '{run / 'tokenizer.json'}' is missing: generate needs the run's tokenizer")
