"""What a user sees when something is wrong: one line that names the file or key and the fix, exit
status 2, no traceback, nothing created (issue 18, sections 3 and 4). Plus the help and docs texts
that point to the config overrides."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.model.transformer import build_model
from tests.tiny_lm import MODEL, tiny_tokenizer, write_run

ROOT = Path(__file__).resolve().parents[1]


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


# ---- a config error under torchrun ----------------------------------------------------------------

def test_a_config_error_under_torchrun_is_printed_once(tmp_path):
    """Each rank printed the error, inside torchrun's summary of every rank's failure. Now local
    rank 0 prints it once; the summary lists that rank alone, and torchrun still fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "lmforge", "train", "--model.n_layerz", "6"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    line = "config error: unknown config key 'model.n_layerz'; did you mean 'model.n_layers'?"
    assert output.count(line) == 1, output
    assert proc.stderr.count("exitcode  :") == 1, proc.stderr  # one failed rank in torchrun's summary, not 2
    assert "local_rank: 1" not in proc.stderr and "SIGTERM" not in proc.stderr
    assert len(proc.stderr.splitlines()) < 40, proc.stderr  # was 45 lines for 2 ranks, ~8 more per rank
    assert seconds < 60
    assert not list(tmp_path.iterdir())  # nothing written


# ---- help and docs ------------------------------------------------------------------------------------

def test_train_help_names_the_overrides_and_the_docs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--section.key value   set any config key, e.g. --optim.lr 3e-4" in out
    assert "lmforge config --docs               every key with its default and meaning" in out


def _docs(capsys, argv: list[str]) -> tuple[str, dict[str, str]]:
    assert main(["config", "--docs", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    values = {}
    for line in lines[1:]:
        key, value = line.split()[:2]
        values[key] = value.rstrip("*")
    return lines[0], values


def test_config_docs_honour_config_and_say_whose_values_they_show(capsys):
    """`config --docs --config gpt2-124m` ignored --config, and the column showed values that are
    neither tiny's nor gpt2's (the dataclass defaults) without saying so."""
    header, builtin = _docs(capsys, [])
    assert header.startswith("# value column: the built-in defaults, what a config file without `inherit` gets")
    assert "not the tiny preset" in header and "model.dim" in header and "model.n_layers" not in header
    assert builtin["model.dim"] == "256" and builtin["train.steps"] == "600"

    header, gpt2 = _docs(capsys, ["--config", "gpt2-124m"])
    assert header.startswith("# value column: the resolved config of 'gpt2-124m'; * = differs from the built-in")
    assert (gpt2["model.dim"], gpt2["model.n_layers"], gpt2["model.pos_emb"]) == ("768", "12", "'learned'")
    assert gpt2.keys() == builtin.keys()

    header, tiny = _docs(capsys, ["--config", "tiny", "--optim.lr", "0.01"])
    assert header.startswith("# value column: the resolved config of 'tiny' with the given overrides")
    assert (tiny["model.dim"], tiny["optim.lr"]) == ("192", "0.01")


# ---- errors that name what was typed, before any heavy work (issue 35) ---------------------------------

# Each error below must come before torch is imported: data preparation, the precision probe and
# model loading all need torch, so a run in which `torch` never entered sys.modules did none of them.
# That is the structural form of "within 2 s" (no timed unit test: a loaded CI machine would make a
# wall-clock bound flaky); a fresh `python -c "import torch"` alone takes 1-3 s.
CHECK = """
import sys
from lmforge.cli import main
rc = main(sys.argv[1:])
print("TORCH_IMPORTED" if "torch" in sys.modules else "NO_TORCH", rc)
"""


def error_before_torch(cwd: Path, argv: list[str]) -> str:
    """Run `lmforge <argv>` in a fresh interpreter: exit status 2, one line on stderr (returned), no
    traceback, and torch never imported."""
    proc = subprocess.run([sys.executable, "-c", CHECK, *argv], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.strip().splitlines()[-1] == "NO_TORCH 2", (proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_train_errors_name_the_typed_key_or_path_before_any_work(run_dir, tmp_path):
    err = error_before_torch(tmp_path, ["train", "--train.steps", "-5"])
    assert err == "config error: train.steps = -5 must be >= 1.", err  # was about schedule.warmup_steps = -1
    readme = ROOT / "README.md"
    err = error_before_torch(tmp_path, ["train", "--train.out_dir", str(readme)])
    assert err == f"config error: train.out_dir = '{readme}' is a file; give a folder path.", err
    err = error_before_torch(tmp_path, ["train", "--train.out_dir", f"{readme}/run"])
    assert err.startswith(f"config error: train.out_dir = '{readme}/run' would go inside '{readme}', which is a file")
    if Path("/proc/self").is_dir():  # a folder nothing can be created in (even by root)
        err = error_before_torch(tmp_path, ["train", "--train.out_dir", "/proc/lmforge-run"])
        assert err.startswith("config error: train.out_dir = '/proc/lmforge-run' is not writable"), err
    assert not list(tmp_path.iterdir())  # nothing written


def test_other_commands_name_the_typed_path_or_value_before_any_work(run_dir, tmp_path):
    for argv in (["generate", "--run", "nowhere"], ["eval", "--run", "nowhere"],
                 ["export", "--run", "nowhere", "--out", "hf"]):
        err = error_before_torch(tmp_path, argv)
        assert err.startswith("error: run folder 'nowhere' does not exist"), (argv, err)
    err = error_before_torch(tmp_path, ["eval", "--run", str(run_dir), "--bleu", "pairs.jsonl"])
    assert err == "error: --bleu 'pairs.jsonl' does not exist.", err
    for spec, count in (("-3xH100", "-3"), ("2.5xH100", "2.5"), ("-2x8xH100", "-2")):
        err = error_before_torch(tmp_path, ["plan", "--model", "gpt2-124m", "--gpus", spec])
        assert err.startswith(f"lmforge plan: error: --gpus '{spec}': '{count}' is not a count"), err
    assert not list(tmp_path.iterdir())


# ---- one name for a run folder; --version -------------------------------------------------------------

def test_run_is_the_run_folder_option_everywhere_and_version_prints(run_dir, tmp_path, capsys):
    from lmforge import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"lmforge {__version__}"
    for command in ("generate", "eval", "export", "report"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--run RUN_DIR" in capsys.readouterr().out, command
    pytest.importorskip("matplotlib")
    assert main(["report", "--run", str(tmp_path / "none")]) == 2  # --run, and the old positional form
    assert main(["report", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.count("no run folder") == 2


# ---- every numeric option is checked while parsing (issue 61, item 1) ----------------------------------

def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every sub-command's parser, sub-sub-commands (`scale sweep`) included, by name."""
    import argparse as ap

    from lmforge.cli import DELEGATED, build_parser
    from lmforge.cli import compare, eval as eval_cli, interop, merge, plan, prepare, report, scale, sweep

    own = {"compare": compare.build_parser, "prepare": prepare.build_parser, "plan": plan.build_parser, "eval": eval_cli.build_parser,
           "merge": merge.build_parser, "report": report.build_parser, "scale": scale.build_parser,
           "sweep": sweep.build_parser, "export": lambda: interop.build_parser(**interop.EXPORT),
           "import": lambda: interop.build_parser(**interop.IMPORT)}
    assert set(own) == set(DELEGATED), "a new sub-command: add its parser here"
    todo = [(name, build()) for name, build in own.items()]
    [subs] = [a for a in build_parser()._actions if isinstance(a, ap._SubParsersAction)]
    todo += [(name, p) for name, p in subs.choices.items() if name not in DELEGATED]
    found = {}
    while todo:
        name, parser = todo.pop()
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, ap._SubParsersAction):
                todo += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
    return found


def numeric_options() -> list[tuple[str, str, object]]:
    """(command, option, action) for every option that takes a number: a numeric type or default."""
    import argparse as ap

    from lmforge.cli.options import ListOf, Number

    rows = []
    for command, parser in sorted(command_parsers().items()):
        for action in parser._actions:
            if isinstance(action, (ap._HelpAction, ap._VersionAction, ap._SubParsersAction)) or action.nargs == 0:
                continue
            numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            if action.type in (int, float) or numeric_default or isinstance(action.type, (Number, ListOf)):
                rows.append((command, action.option_strings[0] if action.option_strings else action.dest, action))
    return rows


@pytest.mark.parametrize("command,option,action", numeric_options(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_numeric_option_refuses_a_value_out_of_range_in_one_line(command, option, action):
    from lmforge.cli.options import ListOf, Number, OptionError

    assert isinstance(action.type, (Number, ListOf)), \
        f"lmforge {command} {option}: a numeric option needs a checked type= (lmforge/cli/options.py)"
    parser = command_parsers()[command]
    for bad in (action.type.outside(), "abc"):
        with pytest.raises(OptionError) as exc:
            parser.parse_known_args([f"{option}={bad}"])
        message = str(exc.value)
        assert message.startswith(f"{option} {bad} must be ") and "\n" not in message, message


def test_numeric_options_are_found():
    """The sweep above covers the commands the issue names (a broken collector would pass vacuously)."""
    commands = {command.split()[0] for command, _, _ in numeric_options()}
    assert {"generate", "eval", "merge", "plan", "scale", "sweep", "prepare"} <= commands, commands
    assert len(numeric_options()) >= 35


def test_generate_refuses_a_negative_max_tokens_before_loading(tmp_path):
    err = error_before_torch(tmp_path, ["generate", "--run", "runs/tiny", "--max-tokens", "-5"])
    assert err == "error: --max-tokens -5 must be an integer >= 1", err


# ---- a stage naming an unknown source fails with the config (issue 61, item 5) -------------------------

def test_a_stage_naming_an_unknown_source_fails_before_anything_loads(tmp_path):
    """Only the prepared folder's manifest exists (no shards, no tokenizer): the check reads nothing
    else, in a process that never imports torch. Was: the error came ~18 s in, once the data opened."""
    (tmp_path / "corpus" / "train").mkdir(parents=True)
    (tmp_path / "corpus" / "train" / "mixture.json").write_text(
        '{"sources": [{"name": "web", "dir": "web", "weight": 0.7}, {"name": "books", "dir": "books", "weight": 0.3}]}')
    stages = '[{start_step = 0, weights = {web = 1.0}}, {start_step = 8, weights = {bookz = 1.0}, name = "anneal"}]'
    err = error_before_torch(tmp_path, ["train", "--data.corpus", "corpus", "--data.stages", stages])
    assert err == ("config error: data.stages[1] ('anneal').weights names unknown sources ['bookz']; the prepared "
                   "mixture's sources: ['web', 'books']."), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # no run folder


def test_log_lines_follow_stdout_after_an_in_process_main_restores_it(capsys):
    """`main()` run in-process with stdout captured, then stdout restored: a later log line (an async
    checkpoint's, from its thread) goes to the stdout of that moment, never to the closed capture."""
    import io
    import logging
    import sys

    from lmforge.cli import _setup_logging

    saved = sys.stdout
    first = io.StringIO()
    sys.stdout = first
    try:
        _setup_logging()
    finally:
        sys.stdout = saved
    first.close()  # what a finished capture does
    later = io.StringIO()
    sys.stdout = later
    try:
        logging.getLogger("lmforge.ckpt").info("checkpoint: step 1")
    finally:
        sys.stdout = saved
    assert later.getvalue() == "checkpoint: step 1\n"
    assert "Logging error" not in capsys.readouterr().err
