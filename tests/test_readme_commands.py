"""Every command of README.md and of the pages in docs/ runs as written, so the docs cannot drift from
the code.

The bash blocks run in order (README.md, then the pages in tests/docs_pages.py's order), each as one
`bash -e` script, in one scratch folder that holds the files the docs name (`my_run.toml`, `book.txt`,
`pairs.jsonl`, ...). Left out: README.md's first three blocks (the newcomer's install + train and
install + test commands, and the fast tier: the suite itself; `.ci/run` and tests/test_e2e.py run
those), the data page docs/data.md and the README's "Your own data" lines (tests/test_data_prepare_readme.py
runs them, on a generated corpus), and lines marked `(not run by tests: ...)` with their continuation
lines. Training runs briefly: `LMFORGE_TRAIN_ARGS` (appended to every `lmforge train`, sweep trials
included) makes each ten tiny steps on the default corpus.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from tests.docs_pages import ROOT, bash_blocks, pages, read
from tests.qwen_standin import make_qwen_standin, write_my_text

SKIP = "(not run by tests"
# README.md's first blocks, the suite itself or its install: install + train, install + test, the fast tier
NEWCOMER = 3
RUN_ELSEWHERE = {("README.md", "Your own data"), ("docs/data.md", None)}  # tests/test_data_prepare_readme.py
# No micro-batch size: each layout adapts the preset's to the brief global batch, as a user's run does
# (one micro-batch per rank, so few gloo collectives per step).
BRIEF = ("--train.steps 10 --train.global_batch_size 12 --data.seq_len 32 "
         "--train.eval_sequences 4 --train.eval_every 0 --train.sample_tokens 4 --train.log_every 5 "
         "--train.plot false --train.tensorboard false --train.progress lines --train.threads 1 "
         "--checkpoint.every_minutes 0 --schedule.warmup_steps 2")


def readme_blocks() -> list[tuple[str, str]]:
    """("page: heading", script) of every bash block of the docs, in order, but the newcomer's blocks
    and those run elsewhere, with the marked lines (and the lines continuing them) removed."""
    blocks = []
    for page in pages():
        found = bash_blocks(page)
        if page == "README.md":
            first = [body.strip() for _, body in found[:NEWCOMER]]
            assert first[0].endswith("lmforge train") and first[1].endswith("python -m pytest -q -n 2") \
                and first[2] == 'python -m pytest -q -n 2 -m "not slow"', first  # nothing else is skipped
            found = found[NEWCOMER:]
        for heading, body in found:
            if (page, heading) in RUN_ELSEWHERE or (page, None) in RUN_ELSEWHERE:
                continue
            commands = re.sub(r"\\\n\s*", "", body).splitlines()  # one line per command
            kept = [c for c in commands if SKIP not in c]
            blocks.append((f"{page}: {heading}", "\n".join(kept)))
    return blocks


def docs_text() -> str:
    return "\n".join(read(page) for page in pages())


def fixtures(cwd: Path) -> None:
    """The files the docs' commands name: the TOML files their blocks write themselves (`cat > F <<'TOML'`),
    as written there, and the others."""
    written = re.findall(r"cat > (\S+) <<'TOML'\n(.*?)\nTOML\n", docs_text(), flags=re.S)
    assert len({name for name, _ in written}) == len(written), written  # one text per file name
    for name, body in written:
        (cwd / name).write_text(body + "\n")
    (cwd / "my_run.toml").write_text('inherit = "tiny"\n[optim]\nlr = 3e-3\n')
    (cwd / "book.txt").write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 20)
    (cwd / "pairs.jsonl").write_text("".join(json.dumps({"prompt": p, "reference": r}) + "\n" for p, r in [
        ("ROMEO:", "But soft, what light"), ("JULIET:", "O Romeo, Romeo")]))
    for name in ("hellaswag.jsonl", "piqa.jsonl"):
        (cwd / name).write_text("".join(json.dumps({"context": c, "choices": ch, "label": 0}) + "\n" for c, ch in [
            ("The king", [" spoke to the people.", " zzz qqq."]), ("The queen", [" walked home.", " xq zz."])]))
    (cwd / "sft.jsonl").write_text("".join(json.dumps({"prompt": f"Q{i}: who speaks?", "response": " ROMEO."}) + "\n"
                                           for i in range(40)))
    (cwd / "sweep.toml").write_text('[grid]\n"optim.lr" = [1e-3, 3e-3]\n')
    shutil.copytree(ROOT / "benchmarks" / "scaling", cwd / "benchmarks" / "scaling")  # the scaling-law section's runs


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    blocks = readme_blocks()
    headings = [h for h, _ in blocks]
    for must in ("README.md: Train, sample, evaluate", "docs/planning.md: Planning a run",
                 "docs/parallel.md: Scale out: DDP, ZeRO, FSDP2, HSDP", "docs/checkpoints.md: Never lose a run",
                 "docs/evaluation.md: Evaluate, fine-tune, and interoperate with Hugging Face",
                 "docs/operations.md: Reports and sweeps"):
        assert must in headings, headings
    fixtures(tmp_path)
    trained: dict[str, Path] = {}  # the argument string of each training line run so far -> its run folder
    env = {**os.environ, "LMFORGE_TRAIN_ARGS": BRIEF, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for heading, script in blocks:
        if "lmforge import --hf path/to/llama" in script and not (tmp_path / "path/to/llama").exists():
            # a transformers folder to import (several sections import it)
            made = subprocess.run(["lmforge", "export", "--run", "runs/tiny", "--out", "path/to/llama"], cwd=tmp_path,
                                  env=env, capture_output=True, text=True)
            assert made.returncode == 0, made.stdout + made.stderr
        if "lmforge import --hf path/to/qwen2.5" in script:  # the walk-through's stand-in and text
            make_qwen_standin(tmp_path / "path/to/qwen2.5")
            write_my_text(tmp_path)
        t0 = time.time()
        block_env = env
        if "lmforge merge" in script:  # (the brief run's 10 steps: checkpoints at 3, 6, 9, 10 and an EMA from step 2)
            block_env = {**env, "LMFORGE_TRAIN_ARGS": BRIEF + " --checkpoint.every_steps 3 --train.ema_start_step 2"}
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=block_env, capture_output=True,
                              text=True, timeout=900)
        print(f"{time.time() - t0:6.1f} s  {heading}")
        assert proc.returncode == 0, f"docs section {heading!r}:\n{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        check_training_lines(tmp_path, script, proc.stdout, trained)
    # what the commands made: the runs, the export, the report, the sweeps
    assert (tmp_path / "runs" / "tiny" / "model.safetensors").is_file()
    assert (tmp_path / "hf" / "tiny" / "config.json").is_file()
    assert json.loads((tmp_path / "hf" / "tiny-bf16" / "config.json").read_text())["dtype"] == "bfloat16"  # --dtype
    assert (tmp_path / "runs" / "imported" / "config.toml").is_file()
    assert (tmp_path / "hf" / "qwen-cpt" / "model.safetensors").is_file()  # the walk-through's export
    assert (tmp_path / "runs" / "tiny" / "report" / "index.html").is_file()
    assert json.loads((tmp_path / "runs" / "wsd-merged" / "merge.json").read_text())["merged"][0]["step"] == 6
    assert (tmp_path / "hf" / "wsd-ema" / "config.json").is_file()  # the EMA, exported
    assert "Downstream tasks" in (tmp_path / "runs" / "wsd" / "report" / "index.html").read_text()
    assert json.loads((tmp_path / "runs" / "tiny" / "summary.json").read_text())["steps"] == 10
    assert len(set(trained.values())) >= 20, trained  # every layout line trained a run of its own
    for folder in re.findall(r"`(runs/sweep-[^`/]+)`", docs_text()):  # the sweep folders the docs name
        if "<" not in folder:
            assert (tmp_path / folder / "results.json").is_file(), (folder, sorted(os.listdir(tmp_path / "runs")))


def check_training_lines(cwd: Path, script: str, stdout: str, trained: dict[str, Path]) -> None:
    """Each `lmforge train` line of a block trained a run of its own: the N-th `run folder:` line of the
    block's output is the N-th training line's; that folder is new (no earlier line's), its config
    has the layout the line asks for, and its summary the steps taken. A line identical to an
    earlier one continues that line's folder (here: finds it complete and says so)."""
    from lmforge.config import parse_cli_overrides

    lines = [line.split("lmforge train", 1)[1].split("#")[0].strip() for line in script.splitlines()
             if "lmforge train" in line and not line.lstrip().startswith("#")]
    segments = re.split(r"^run folder: (.+)$", stdout, flags=re.M)  # output, folder, output, folder, ...
    folders, outputs = segments[1::2], segments[0::2]
    assert len(folders) == len(lines), (lines, stdout[-3000:])
    for args, folder, output in zip(lines, folders, outputs):
        folder = Path(folder)
        if args.startswith("--run "):  # an earlier line's run, continued by its folder (here: found complete)
            assert folder == Path(args.split()[1]) and folder in trained.values() and "nothing trained:" in output, \
                (args, folder, output[-2000:])
            continue
        if args in trained:
            assert folder == trained[args] and "nothing trained:" in output, (args, folder, output[-2000:])
            continue
        assert "nothing trained" not in output and folder not in trained.values(), (args, folder, output[-2000:])
        trained[args] = folder
        argv = args.split()
        if "--config" in argv:
            del argv[argv.index("--config"):argv.index("--config") + 2]
        with open(cwd / folder / "config.toml", "rb") as fh:
            saved = tomllib.load(fh)
        for key, value in parse_cli_overrides(argv).items():
            if key.startswith("parallel."):
                assert saved["parallel"][key.split(".", 1)[1]] == value, (args, key, saved["parallel"])
        assert json.loads((cwd / folder / "summary.json").read_text())["steps"] == 10, (args, folder)


def readme_train_lines() -> list[tuple[int, str]]:
    """(processes, argument string after `lmforge train`) of every training command in the bash blocks
    of README.md and docs/, marked lines and the blocks run elsewhere included (they must be valid
    configs too, even where tests cannot launch them)."""
    found = []
    for _, body in (block for page in pages() for block in bash_blocks(page)):
        for line in re.sub(r"\\\n\s*", "", body).splitlines():
            line = line.split("#")[0]
            if "lmforge train" not in line:
                continue
            nodes = re.search(r"--nnodes (\d+)", line)
            procs = re.search(r"--nproc-per-node (\d+)", line)
            world = (int(nodes.group(1)) if nodes else 1) * (int(procs.group(1)) if procs else 1)
            found.append((world, line.split("lmforge train", 1)[1].strip()))
    return found


def test_every_readme_train_line_is_a_valid_config_as_written(tmp_path, monkeypatch):
    """The end-to-end docs test shortens training with LMFORGE_TRAIN_ARGS; this one loads every
    training command's config exactly as printed (no overrides) and checks that its layout fills
    the launch, so no line of the docs depends on the shortening to be valid."""
    from lmforge.config import load_config, parse_cli_overrides, to_toml
    from lmforge.folders import CONFIG

    lines = readme_train_lines()
    assert len(lines) >= 20, lines
    assert any("async_sgd" in args for _, args in lines)
    fixtures(tmp_path)
    (tmp_path / "runs" / "base").mkdir(parents=True)  # the fine-tuning example starts from a run's config
    (tmp_path / "runs" / "base" / CONFIG).write_text(to_toml(load_config("tiny")))
    (tmp_path / "runs" / "qwen-base").mkdir(parents=True)  # ... and so does the Qwen2.5 walk-through
    (tmp_path / "runs" / "qwen-base" / CONFIG).write_text(to_toml(load_config("tiny")))
    monkeypatch.chdir(tmp_path)
    for world, args in lines:
        argv = args.split()
        preset = "tiny"
        if "--run" in argv:  # (that run's own config.toml: test_every_readme_command_runs continues it)
            del argv[argv.index("--run"):argv.index("--run") + 2]
        if "--config" in argv:
            i = argv.index("--config")
            preset = argv[i + 1]
            del argv[i:i + 2]
        # as `lmforge train` loads it under its launch (dp_shard inferred for EP, the process count checked)
        cfg = load_config(preset, parse_cli_overrides(argv), launch=(world, f"{world} processes started"))
        assert cfg.parallel.world_size == world, (args, cfg.parallel.world_size, world)
