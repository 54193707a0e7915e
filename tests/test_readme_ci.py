"""README.md opens with the two newcomer commands and the fast tier, and .ci/run runs the second one
verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands(n: int = 2) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)[:n]


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


def test_the_fast_tier_follows_the_test_command():
    """Right under the test command, the fast tier: the same pytest command, the tests marked `slow`
    left out."""
    _, test, fast = readme_commands(3)
    text = (ROOT / "README.md").read_text()
    suite = test.split("&&")[-1].strip()
    assert suite == "python -m pytest -q -n 2", suite
    assert fast.strip() == f'{suite} -m "not slow"', fast
    between = text[text.index(test) + len(test):text.index("```bash\n" + fast)]
    assert "```bash" not in between and len(between.splitlines()) <= 5, between  # nothing else in between


def test_what_is_here_names_every_package_folder():
    """The map of the code (docs/code.md, "What is here") has a row for every folder of lmforge/ and for
    its top-level modules, so a newcomer finds every part from it."""
    text = (ROOT / "docs" / "code.md").read_text()
    assert text.startswith("# What is here")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    where = " ".join(line.split("|")[2] for line in rows)
    package = ROOT / "lmforge"
    parts = [f"lmforge/{p.name}/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    parts += [f"lmforge/{p.name}" for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    missing = [p for p in sorted(parts) if f"`{p}" not in where]
    assert not missing, f"docs/code.md 'What is here' lacks rows for {missing}"
