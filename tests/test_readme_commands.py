"""Every command of README.md and of the pages in docs/ runs as written, so the docs cannot drift from
the code: this file runs README.md's, docs/training.md's, docs/planning.md's and docs/checkpoints.md's,
one test per page; tests/test_docs_commands_parallel.py and tests/test_docs_commands_eval.py run the
other pages' (split so that the two pytest-xdist workers share them). tests/docs_commands.py says how, and what is left out.
"""

from __future__ import annotations

import re

from tests.docs_commands import BRIEF, FILES, fixtures, page_tests, readme_blocks, training_lines
from tests.docs_pages import bash_blocks, pages

__all__ = ["BRIEF"]  # tests/test_data_prepare_readme.py's brief training, the same as here


def test_every_docs_page_with_commands_runs_in_one_file():
    """Each page whose blocks run here belongs to exactly one docs-command file, the sections that must
    run are there, and together they train at least 20 runs of their own (one per distinct line of a file)."""
    blocks = readme_blocks()
    headings = [h for h, _ in blocks]
    for must in ("README.md: Train, sample, evaluate", "docs/planning.md: Planning a run",
                 "docs/parallel.md: Scale out: DDP, ZeRO, FSDP2, HSDP", "docs/checkpoints.md: Never lose a run",
                 "docs/evaluation.md: Evaluate, fine-tune, and interoperate with Hugging Face",
                 "docs/operations.md: Reports and sweeps"):
        assert must in headings, headings
    listed = [page for file_pages in FILES.values() for page in file_pages]
    assert len(listed) == len(set(listed)), FILES
    with_blocks = {h.split(": ", 1)[0] for h in headings}
    assert with_blocks == set(listed), (sorted(with_blocks), FILES)
    order = [p for p in pages() if p in with_blocks]
    for file_pages in FILES.values():  # each file keeps the pages' order
        assert list(file_pages) == [p for p in order if p in file_pages], file_pages
    runs = 0
    for file_pages in FILES.values():
        lines = {args for h, script in blocks if h.split(": ", 1)[0] in file_pages
                 for args in training_lines(script) if not args.startswith("--run ")}
        runs += len(lines)
    assert runs >= 20, runs  # every layout line trains a run of its own


scratch, test_every_readme_command_runs = page_tests(__file__)


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
