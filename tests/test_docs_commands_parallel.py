"""The commands of docs/parallel.md run as written (tests/docs_commands.py: how;
tests/test_readme_commands.py runs the other pages'): a file of its own, so that the other pytest-xdist
worker can run it while the README's run."""

from __future__ import annotations

from tests.docs_commands import page_tests

scratch, test_every_docs_command_runs = page_tests(__file__)
