"""Shared fixtures: a small on-disk corpus prepared once per session (no network)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

# CI runs the suite on two pytest-xdist workers on two cores. There, every process a test starts
# (`lmforge train`, torchrun, the GPU suite's smoke run) gets one thread unless the test says
# otherwise: torch's default of one thread per core would oversubscribe the core the other worker
# is using, and a busy-waiting second thread makes both workers several times slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

WORDS = ("the king and queen walked to the castle where a knight told a story of the sea and the "
         "storm while the people of the town sang songs about love honour and war").split()


def make_corpus(root: Path, n_docs: int = 12, words_per_doc: int = 1500, seed: int = 0,
                min_words: int | None = None) -> list[Path]:
    """Pseudo-English documents from a small vocabulary with local structure (learnable fast); with
    `min_words`, each document's length is drawn between min_words and words_per_doc words."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for d in range(n_docs):
        sentences = []
        words = words_per_doc if min_words is None else rng.randint(min_words, words_per_doc)
        for _ in range(max(words // 10, 1)):
            start = rng.randrange(len(WORDS) - 10)
            sentences.append(" ".join(WORDS[start:start + rng.randint(5, 10)]).capitalize() + ".")
        path = root / f"doc{d:02d}.txt"
        path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
        files.append(path)
    return files


def make_tasks(path: Path, n_items: int = 12, seed: int = 0) -> Path:
    """A multiple-choice task file (lmforge.eval.tasks' format) in `make_corpus`'s words: a few words of
    context and 3 continuations of unequal length, the first the true one."""
    import json

    rng = random.Random(seed)
    lines = []
    for _ in range(n_items):
        start = rng.randrange(len(WORDS) - 12)
        choices = [" " + " ".join(WORDS[start + 5:start + 8])] + [" " + " ".join(rng.sample(WORDS, k)) for k in (2, 4)]
        lines.append(json.dumps({"context": " ".join(WORDS[start:start + 5]).capitalize(), "choices": choices,
                                 "label": 0}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    from lmforge.data.prepare import prepare_texts

    root = tmp_path_factory.mktemp("corpus")
    files = make_corpus(root / "text")
    return prepare_texts(files, root / "cache", tokenizer="bpe", vocab_size=320, val_fraction=0.1)


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors run far faster on one thread on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The longest test files, longest first. CI runs the suite on two pytest-xdist workers, one file per
# work unit in collection order (`--dist loadfile --no-loadscope-reorder` in pyproject.toml): starting
# the files that take minutes first keeps one worker from being left with them at the end.
LONGEST_FIRST = ("test_readme_commands.py", "test_parallel_mp.py", "test_ckpt_fault.py", "test_parallel_ep.py",
                 "test_parallel_dp.py", "test_optim_train.py", "test_e2e.py", "test_preempt.py", "test_gpu_suite.py",
                 "test_parallel_optim.py", "test_parallel_cp.py")  # (2026-11-27's fresh-clone run's file totals)


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
