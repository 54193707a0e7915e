"""The commands of docs/evaluation.md and docs/operations.md run as written (tests/docs_commands.py: how;
tests/test_readme_commands.py runs the other pages'): a file of its own, so that the other pytest-xdist
worker can run it while the README's run. Their `runs/tiny` is the README's first line's, run here."""

from __future__ import annotations

from tests.docs_commands import page_tests, seed_tiny

scratch, test_every_docs_command_runs = page_tests(__file__, seed=seed_tiny)
