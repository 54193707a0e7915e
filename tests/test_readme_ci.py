"""README.md opens with the two newcomer commands, and .ci/run runs the second one verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)[:2]


def test_readme_starts_with_train_then_test_command():
    train, test = readme_commands()
    text = (ROOT / "README.md").read_text()
    assert text.index(train) < 600, "the train command must open the README"
    assert train.strip().endswith("lmforge train")
    assert "pip install" in train and "pytest" in test


def test_ci_runs_exactly_the_readme_test_command():
    _, test = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test.strip() in ci.splitlines()
