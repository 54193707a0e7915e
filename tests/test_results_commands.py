"""Every reproduce command printed in benchmarks/RESULTS.md selects something that exists.

A test selection (`python -m pytest ...`) runs in collect-only mode and must collect at least one
test; a script (`python benchmarks/NAME.py ...`) must be a committed file whose own parser accepts
the printed arguments (they run with `--help` appended: argparse checks each option and choice
it reads before it reaches `--help`, then prints the help and exits 0, running nothing).
`RESULTS.md` printed `-k "parity or 3d"`, which selected no test of tests/test_parallel_mp.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def results_commands() -> list[str]:
    """Each `python -m pytest ...` and `python benchmarks/...` command of RESULTS.md, once: inline code
    (which may wrap over lines) and indented command lines (with their `\\` continuations)."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    found = [" ".join(m.split()) for m in re.findall(r"`(python [^`]*)`", text)]
    found += [" ".join(m.replace("\\\n", " ").split())
              for m in re.findall(r"^ {4,}(python (?:[^\n]*\\\n)*[^\n]*)$", text, flags=re.M)]
    keep = [c for c in found if c.startswith(("python -m pytest ", "python benchmarks/"))]
    return list(dict.fromkeys(keep))


def test_results_md_prints_reproduce_commands():
    commands = results_commands()
    assert sum(c.startswith("python -m pytest") for c in commands) >= 3, commands
    assert sum("parity_layouts.py" in c for c in commands) >= 10, commands  # the rows that said "by hand"
    assert "by hand" not in (ROOT / "benchmarks" / "RESULTS.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("command", results_commands())
def test_each_reproduce_command_selects_a_test_or_a_script(command):
    argv = shlex.split(command.replace("[", "").replace("]", ""))  # ([--flag N]: an optional argument)
    argv[0] = sys.executable
    if argv[1:3] == ["-m", "pytest"]:
        proc = subprocess.run([*argv, "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        # one line per test (`-q`), or per file with its count (`-q -q`, as `-q` in the command adds)
        per_file = {f: int(n) for f, n in re.findall(r"^(\S+\.py): (\d+)$", proc.stdout, flags=re.M)}
        for line in proc.stdout.splitlines():
            if "::" in line:
                per_file[line.split("::")[0]] = per_file.get(line.split("::")[0], 0) + 1
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        for name in [a for a in argv if a.endswith(".py")]:  # every file named selects a test of its own
            assert per_file.get(name, 0) > 0, (command, name, proc.stdout[-2000:])
    else:
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]} is not a committed script"
        proc = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (command, proc.stdout[-2000:], proc.stderr[-2000:])
