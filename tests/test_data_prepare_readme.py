"""The data-preparation commands of the docs run as written (on a generated corpus in raw/): the data
page docs/data.md, and the README's "Your own data" lines, which are among the page's.

Lines marked "(not run by tests" (Slurm, S3) are left out; everything else in the page's bash
blocks runs verbatim, in order, in one shell; `lmforge train` briefly (LMFORGE_TRAIN_ARGS, as in
tests/test_readme_commands.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_pages import ROOT, bash_blocks
from tests.test_readme_commands import BRIEF


def section_commands() -> str:
    blocks = [body for _, body in bash_blocks("docs/data.md")]
    assert len(blocks) >= 2
    lines = [ln for b in blocks for ln in b.splitlines() if "(not run by tests" not in ln]
    tour = [ln for heading, body in bash_blocks("README.md") if heading == "Your own data" for ln in body.splitlines()]
    assert tour, "README.md has no 'Your own data' block"
    for line in tour:  # the README's lines run here, verbatim, as the data page shows them
        assert line in lines, f"README.md's 'Your own data' line is not among docs/data.md's: {line!r}"
    return "\n".join(lines) + "\n"


def raw_web_and_books(root: Path, web_docs: int = 300, web_words: int = 60, books: int = 3, book_words: int = 2000,
                      vocab: int = 800) -> None:
    """README's layout: root/raw/web/2024/part0.jsonl ({"text"} rows) and root/raw/books/b<k>.txt."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(vocab)]
    (root / "raw" / "web" / "2024").mkdir(parents=True)
    (root / "raw" / "books").mkdir()
    with open(root / "raw" / "web" / "2024" / "part0.jsonl", "w") as f:
        for _ in range(web_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(web_words))}) + "\n")
    for k in range(books):
        (root / "raw" / "books" / f"b{k}.txt").write_text(" ".join(rng.choice(words) for _ in range(book_words)))


@pytest.mark.slow
def test_readme_prepare_commands_run(tmp_path):
    script = section_commands()
    for must in ("lmforge prepare --config prep.toml  ", "torchrun --nproc-per-node 2",
                 "--stage scan --rank 0 --world 2", "--status", "--workers 2"):
        assert must in script
    raw_web_and_books(tmp_path)
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{bindir}:{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "LMFORGE_TRAIN_ARGS": BRIEF}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads((tmp_path / "data" / "mycorpus" / "prepare.json").read_text())
    assert rec["clean"]["kept"] == 303 and set(rec["splits"]["train"]) == {"web", "books"}  # (named from their paths)
    assert "up to date" in r.stderr and "finished and up to date" in r.stdout
    # the stages example: document masking on best-fit rows, validated on each source beside the mix
    staged = [json.loads(line) for line in (tmp_path / "runs" / "staged" / "metrics.jsonl").read_text().splitlines()]
    # (the three books hold no held-out document at val_fraction 0.01: the web alone is validated on its own)
    assert all("val_loss/web" in rec for rec in staged if "val_loss" in rec)
    out = r.stdout + r.stderr
    assert "attention: within each document" in out and "data: epochs per source over the run" in out
