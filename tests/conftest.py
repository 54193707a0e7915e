"""Shared fixtures: a small on-disk corpus prepared once per session (no network)."""

from __future__ import annotations

import json
import os
import random
import warnings
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


@pytest.fixture(scope="session")
def prepared_corpus(tmp_path_factory) -> Path:
    """`make_corpus`'s documents through a real `lmforge prepare` (tests/test_parallel_dp.py's `prepare`,
    whose `corpus` fixture hands it on). Session-scoped here, not in that module: a session fixture
    imported into other modules would be set up once per module."""
    from tests.test_parallel_dp import prepare

    root = tmp_path_factory.mktemp("dp")
    make_corpus(root / "raw")
    return prepare(root)


@pytest.fixture(scope="session")
def prepared_docs_corpus(tmp_path_factory) -> Path:
    """300 short documents (tests/test_parallel_dp.py's `docs_corpus`), prepared once per session."""
    from tests.test_parallel_dp import prepare

    root = tmp_path_factory.mktemp("docs")
    make_corpus(root / "raw", n_docs=300, words_per_doc=60, min_words=3)
    return prepare(root)


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny tensors run far faster on one thread on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# CI runs the suite on two pytest-xdist workers, one file per work unit in collection order (`--dist
# loadfile --no-loadscope-reorder` in pyproject.toml): starting the files that take minutes first keeps
# one worker from being left with them at the end. The order comes from tests/durations.json, each
# file's measured seconds (setup, call and teardown of its tests summed); files it does not name run
# after the ones it does, in collection order. Refresh it from a full run:
#     python -m pytest -q -n 2 --durations-file tests/durations.json     (or LMFORGE_DURATIONS_FILE=...)
# which merges the files that ran into it (a partial run updates only its own files).
DURATIONS = Path(__file__).with_name("durations.json")
DURATIONS_ENV = "LMFORGE_DURATIONS_FILE"


def pytest_addoption(parser):
    parser.addoption("--durations-file", default=os.environ.get(DURATIONS_ENV) or None, metavar="PATH",
                     help="write each test file's measured seconds (merged into PATH's, JSON) at the end of the "
                          f"run, for ordering the files longest first (tests/durations.json; also ${DURATIONS_ENV})")


def read_durations(path: Path) -> dict[str, float]:
    """{file name: seconds} from `path`; a missing or malformed file gives {} and a warning (the order
    is then collection order: slower, never wrong)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"a JSON object of file name -> seconds, not {type(data).__name__}")
        return {str(k): float(v) for k, v in data.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError) as e:
        warnings.warn(f"{path}: unreadable test durations ({e}); the files run in collection order. Rewrite it "
                      f"with `--durations-file {path}` on a full run.", pytest.PytestWarning, stacklevel=1)
        return {}


def order_by_durations(items: list, seconds: dict[str, float]) -> None:
    """Sort `items` (anything with .path) in place: the files `seconds` names, longest first, then the
    others. The sort is stable: a file's own order, and the unknown files' collection order, are kept."""
    items.sort(key=lambda item: (0, -seconds[item.path.name]) if item.path.name in seconds else (1, 0.0))


def pytest_collection_modifyitems(config, items):
    order_by_durations(items, read_durations(DURATIONS))


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # under xdist the controller receives every worker's reports, so it alone sums all files
    name = report.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    _measured[name] = _measured.get(name, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--durations-file")
    if not path or hasattr(session.config, "workerinput") or not _measured:
        return
    path = Path(path)
    merged = {**read_durations(path), **{k: round(v, 1) for k, v in _measured.items()}}
    path.write_text(json.dumps(dict(sorted(merged.items(), key=lambda kv: (-kv[1], kv[0]))), indent=1) + "\n",
                    encoding="utf-8")
