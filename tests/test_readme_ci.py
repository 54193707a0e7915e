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


def test_what_is_here_names_every_package_folder():
    """The README's map of the code ("What is here") has a row for every folder of lmforge/ and for
    its top-level modules, so a newcomer finds every part from it."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## What is here"):text.index("\n## ", text.index("## What is here") + 1)]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    where = " ".join(line.split("|")[2] for line in rows)
    package = ROOT / "lmforge"
    parts = [f"lmforge/{p.name}/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    parts += [f"lmforge/{p.name}" for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    missing = [p for p in sorted(parts) if f"`{p}" not in where]
    assert not missing, f"README 'What is here' lacks rows for {missing}"
