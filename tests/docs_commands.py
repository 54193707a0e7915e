"""Running the docs' bash blocks (a helper module, not a test file): what tests/test_readme_commands.py,
tests/test_docs_commands_parallel.py and tests/test_docs_commands_eval.py share.

The pages are split over those three files so that the two pytest-xdist workers (`--dist loadfile`: one
file per work unit) can share them; each file runs its pages in tests/docs_pages.py's order, one test per
page, in one scratch folder per file (`Scratch`), so a page still finds what an earlier page of its file
made. A page that uses what another file's page makes (the README's `runs/tiny`) gets it from `seed_tiny`,
which runs that README line as written. Every page of the docs with commands run here belongs to exactly
one file (FILES; test_readme_commands.py checks it).

Left out: README.md's first three blocks (the newcomer's install + train and install + test commands,
and the fast tier: the suite itself; `.ci/run` and tests/test_e2e.py run those), the data page
docs/data.md and the README's "Your own data" lines (tests/test_data_prepare_readme.py runs them, on a
generated corpus), and lines marked `(not run by tests: ...)` with their continuation lines. Training
runs briefly: `LMFORGE_TRAIN_ARGS` (appended to every `lmforge train`, sweep trials included) makes each
five tiny steps (`BRIEF_STEPS`) on the default corpus.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from tests.docs_pages import ROOT, bash_blocks, pages, read
from tests.qwen_standin import make_qwen_standin, write_my_text
from tests import warm_start

SKIP = "(not run by tests"
# README.md's first blocks, the suite itself or its install: install + train, install + test, the fast tier
NEWCOMER = 3
RUN_ELSEWHERE = {("README.md", "Your own data"), ("docs/data.md", None)}  # tests/test_data_prepare_readme.py
# No micro-batch size: each layout adapts the preset's to the brief global batch, as a user's run does
# (one micro-batch per rank, so few gloo collectives per step).
# Five steps: a line's layout, loop, logging (one progress line), checkpoint, export and sample all run
# by then (ten took twice the training for no path more: about a quarter of the docs tests' time).
BRIEF_STEPS = 5
MERGE_EVERY = 2  # the merge section's runs checkpoint every 2 steps: 2, 4 and the final 5
BRIEF = (f"--train.steps {BRIEF_STEPS} --train.global_batch_size 12 --data.seq_len 32 "
         "--train.eval_sequences 4 --train.eval_every 0 --train.sample_tokens 4 --train.log_every 5 "
         "--train.plot false --train.tensorboard false --train.progress lines --train.threads 1 "
         "--checkpoint.every_minutes 0 --schedule.warmup_steps 2")
# the test file that runs each page's commands (the pages of a file share one scratch folder, in page order)
# docs/checkpoints.md runs with the README: its first training line is the README's, which it then finds
# complete, as a user who read both would (in a folder of its own it would train that run again).
FILES = {
    "test_readme_commands.py": ("README.md", "docs/training.md", "docs/planning.md", "docs/checkpoints.md"),
    "test_docs_commands_parallel.py": ("docs/parallel.md",),
    "test_docs_commands_eval.py": ("docs/evaluation.md", "docs/operations.md"),
}
FIRST = "README.md: Train, sample, evaluate"  # its first line trains runs/tiny, which later pages use


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


def page_blocks(page: str) -> list[tuple[str, str]]:
    """readme_blocks() of one page, in order."""
    return [(h, s) for h, s in readme_blocks() if h.startswith(f"{page}: ")]


def training_lines(script: str) -> list[str]:
    """The argument string after `lmforge train` of each training line of a block script."""
    return [line.split("lmforge train", 1)[1].split("#")[0].strip() for line in script.splitlines()
            if "lmforge train" in line and not line.lstrip().startswith("#")]


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
    # docs/operations.md's `lmforge sweep --spec sweep.toml` ("the same in a TOML file"): the page's --grid
    # sweep, which that line then finds in runs/sweep-tiny, done, and resumes (no trial trains twice)
    (cwd / "sweep.toml").write_text('parallel = 2\n[base]\n"train.steps" = 200\n[grid]\n'
                                    '"optim.lr" = [1e-3, 3e-3]\n"schedule.warmup_steps" = [10, 20]\n')
    shutil.copytree(ROOT / "benchmarks" / "scaling", cwd / "benchmarks" / "scaling")  # the scaling-law section's runs


class Scratch:
    """One scratch folder in which blocks run in order, and the runs their training lines made."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        fixtures(cwd)
        self.trained: dict[str, Path] = {}  # the argument string of each training line run so far -> its run folder
        env = {**os.environ, "LMFORGE_TRAIN_ARGS": BRIEF, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        # `lmforge`, `torchrun` and torchrun's workers start as forks of one process that imported torch
        # and lmforge once (tests/warm_start.py: about half of each brief command's CPU time otherwise)
        self.env = warm_start.shared().env(env)

    def run(self, heading: str, script: str) -> None:
        """Run one block as a `bash -e` script; it must pass, and each training line train (or continue) its run."""
        cwd, env = self.cwd, self.env
        if "lmforge import --hf path/to/llama" in script and not (cwd / "path/to/llama").exists():
            # a transformers folder to import (several sections import it)
            made = subprocess.run(["lmforge", "export", "--run", "runs/tiny", "--out", "path/to/llama"], cwd=cwd,
                                  env=env, capture_output=True, text=True)
            assert made.returncode == 0, made.stdout + made.stderr
        if "lmforge import --hf path/to/qwen2.5" in script:  # the walk-through's stand-in and text
            make_qwen_standin(cwd / "path/to/qwen2.5")
            write_my_text(cwd)
        t0 = time.time()
        if "lmforge merge" in script:  # (the brief run's 5 steps: checkpoints at 2, 4, 5 and an EMA from step 2)
            env = {**env, "LMFORGE_TRAIN_ARGS": BRIEF + f" --checkpoint.every_steps {MERGE_EVERY} --train.ema_start_step 2"}
        steps = BRIEF_STEPS
        if sync := re.search(r"--fault_tolerance\.diloco_sync_every (\d+)", script):
            steps = int(sync.group(1))  # (a DiLoCo run ends on a sync: one sync's steps)
            env = {**env, "LMFORGE_TRAIN_ARGS": BRIEF + f" --train.steps {steps}"}
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=900)
        print(f"{time.time() - t0:6.1f} s  {heading}")
        assert proc.returncode == 0, f"docs section {heading!r}:\n{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        check_training_lines(cwd, script, proc.stdout, self.trained, steps)

    def run_page(self, page: str) -> None:
        """Every block of `page`, in order; each of its training lines trained a run of its own (or, the
        same line again, continued it)."""
        blocks = page_blocks(page)
        assert blocks, page
        for heading, script in blocks:
            self.run(heading, script)
        lines = {args for _, script in blocks for args in training_lines(script) if not args.startswith("--run ")}
        assert lines <= set(self.trained), (page, lines - set(self.trained))


def seed_tiny(scratch: Scratch) -> None:
    """runs/tiny, as the README's first training line (`lmforge train`, as written) makes it, for the pages
    that use it in a file without the README."""
    heading, script = page_blocks("README.md")[0]
    assert heading == FIRST, heading
    line = script.splitlines()[0]
    assert training_lines(line) == [""], line  # the bare `lmforge train`: the tiny preset into runs/tiny
    scratch.run(f"{FIRST} (its first line)", line)
    assert (scratch.cwd / "runs" / "tiny" / "model.safetensors").is_file()


def check_training_lines(cwd: Path, script: str, stdout: str, trained: dict[str, Path],
                         steps: int = BRIEF_STEPS) -> None:
    """Each `lmforge train` line of a block trained a run of its own: the N-th `run folder:` line of the
    block's output is the N-th training line's; that folder is new (no earlier line's), its config
    has the layout the line asks for, and its summary the steps taken. A line identical to an
    earlier one continues that line's folder (here: finds it complete and says so)."""
    from lmforge.config import parse_cli_overrides

    lines = training_lines(script)
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
        assert json.loads((cwd / folder / "summary.json").read_text())["steps"] == steps, (args, folder)


def check_made(page: str, cwd: Path) -> None:
    """What a page's commands made: the runs, the exports, the reports, the sweeps."""
    if page == "README.md":
        assert (cwd / "runs" / "tiny" / "model.safetensors").is_file()
        assert (cwd / "hf" / "tiny" / "config.json").is_file()
        assert json.loads((cwd / "runs" / "tiny" / "summary.json").read_text())["steps"] == BRIEF_STEPS
    elif page == "docs/training.md":
        assert json.loads((cwd / "hf" / "tiny-bf16" / "config.json").read_text())["dtype"] == "bfloat16"  # --dtype
    elif page == "docs/evaluation.md":
        assert (cwd / "hf" / "tiny" / "config.json").is_file()
        assert (cwd / "runs" / "imported" / "config.toml").is_file()
        assert (cwd / "hf" / "qwen-cpt" / "model.safetensors").is_file()  # the walk-through's export
        assert json.loads((cwd / "runs" / "wsd-merged" / "merge.json").read_text())["merged"][0]["step"] == MERGE_EVERY  # (--last 3 of 2, 4, 5)
        assert (cwd / "hf" / "wsd-ema" / "config.json").is_file()  # the EMA, exported
        assert "Downstream tasks" in (cwd / "runs" / "wsd" / "report" / "index.html").read_text()
    elif page == "docs/operations.md":
        assert (cwd / "runs" / "tiny" / "report" / "index.html").is_file()
        for folder in re.findall(r"`(runs/sweep-[^`/]+)`", docs_text()):  # the sweep folders the docs name
            if "<" not in folder:
                assert (cwd / folder / "results.json").is_file(), (folder, sorted(os.listdir(cwd / "runs")))


def page_tests(file: str, seed=None):
    """The module-scoped scratch fixture and the one-test-per-page test of a docs-command file (its
    FILES pages, in order, in one folder; `seed(scratch)` first, where given). A test file assigns both:
    `scratch, test_... = page_tests(__file__)`."""
    import pytest

    name = Path(file).name

    @pytest.fixture(scope="module")
    def scratch(tmp_path_factory):
        made = Scratch(tmp_path_factory.mktemp("docs"))
        if seed is not None:
            seed(made)
        return made

    @pytest.mark.slow
    @pytest.mark.parametrize("page", FILES[name])
    def test_every_docs_command_runs(scratch, page):
        scratch.run_page(page)
        check_made(page, scratch.cwd)

    return scratch, test_every_docs_command_runs
