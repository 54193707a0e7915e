"""Every reproduce command printed in benchmarks/RESULTS.md selects something that exists.

A test selection (`python -m pytest ...`) runs in collect-only mode and must collect at least one
test; a script (`python benchmarks/NAME.py ...`) must be a committed file whose own parser accepts
the printed arguments (they run with `--help` appended: argparse checks each option and choice
it reads before it reaches `--help`, then prints the help and exits 0, running nothing).
`RESULTS.md` printed `-k "parity or 3d"`, which selected no test of tests/test_parallel_mp.py.

The commands run in one Python process, one after another (COLLECT: `pytest.main` with each selection's
own arguments, as `python -m pytest` runs them; each script as `python SCRIPT ARGS --help` runs it, by
runpy): torch and the test modules are imported once instead of once per command, which was most of this
file's time. A script that does not pass there runs again in a process of its own, which decides.
"""

from __future__ import annotations

import json
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


def command_argv(command: str) -> list[str]:
    argv = shlex.split(command.replace("[", "").replace("]", ""))  # ([--flag N]: an optional argument)
    argv[0] = sys.executable
    return argv


# Runs each command in turn, its output captured apart: a test selection as `pytest.main(ARGS
# --collect-only -q -p no:cacheprovider)`, a script as `python SCRIPT ARGS --help` (runpy, its folder first
# on sys.path); argv[1]: the JSON list of argument lists (after `python`), argv[2]: where to write
# {arguments as JSON: [exit status, output]}.
COLLECT = """
import contextlib, io, json, runpy, sys, traceback
import pytest
commands, dest = json.loads(sys.argv[1]), sys.argv[2]  # (each script gets its own sys.argv)
done = {}
for args in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            if args[:2] == ["-m", "pytest"]:
                status = pytest.main([*args[2:], "--collect-only", "-q", "-p", "no:cacheprovider"])
            else:
                sys.argv, path = [*args, "--help"], list(sys.path)
                sys.path.insert(0, __import__("os").path.dirname(args[0]))
                try:
                    runpy.run_path(args[0], run_name="__main__")
                    status = 0
                finally:
                    sys.path[:] = path
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
    done[json.dumps(args)] = [int(status), out.getvalue()]
with open(dest, "w") as fh:
    json.dump(done, fh)
"""


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """{arguments after `python`, as JSON: (exit status, output)} of every command of RESULTS.md, run in
    one process (COLLECT)."""
    commands = [command_argv(c)[1:] for c in results_commands()]
    dest = tmp_path_factory.mktemp("collect") / "collected.json"
    proc = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(commands), str(dest)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and dest.is_file(), (proc.stdout[-2000:], proc.stderr[-2000:])
    return {k: (v[0], v[1]) for k, v in json.loads(dest.read_text()).items()}


@pytest.mark.slow
@pytest.mark.parametrize("command", results_commands())
def test_each_reproduce_command_selects_a_test_or_a_script(command, collected):
    argv = command_argv(command)
    status, stdout = collected[json.dumps(argv[1:])]
    if argv[1:3] == ["-m", "pytest"]:
        # one line per test (`-q`), or per file with its count (`-q -q`, as `-q` in the command adds)
        per_file = {f: int(n) for f, n in re.findall(r"^(\S+\.py): (\d+)$", stdout, flags=re.M)}
        for line in stdout.splitlines():
            if "::" in line:
                per_file[line.split("::")[0]] = per_file.get(line.split("::")[0], 0) + 1
        assert status == 0, (command, stdout[-2000:])
        for name in [a for a in argv if a.endswith(".py")]:  # every file named selects a test of its own
            assert per_file.get(name, 0) > 0, (command, name, stdout[-2000:])
    else:
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]} is not a committed script"
        if status == 0 and "usage:" in stdout:
            return
        # (not passed beside the others: what its own process says decides, as before)
        proc = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (command, proc.stdout[-2000:], proc.stderr[-2000:])
