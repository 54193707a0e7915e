"""lmforge.folders: file names, folder kinds, atomic writes, the shard manifest."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from lmforge import folders


def test_folder_kind_by_marker(tmp_path):
    assert folders.folder_kind(tmp_path) is None
    for kind, (marker, _) in folders.KINDS.items():
        d = tmp_path / kind
        d.mkdir()
        (d / marker).write_text("{}")
        assert folders.folder_kind(d) == kind


def test_check_target_refuses_another_kind_and_existing_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / folders.PREPARE_RECORD).write_text("{}")
    with pytest.raises(ValueError, match=r"train.out_dir = .*data.* is a prepared dataset .*prepare.json.*Choose another"):
        folders.check_target(data, "run", folders.RUN_FILES, "train.out_dir")
    run = tmp_path / "run"
    run.mkdir()
    (run / folders.CONFIG).write_text("")
    folders.check_target(run, "run", folders.RUN_FILES, "--out")  # same kind, overwrite allowed
    with pytest.raises(ValueError, match="already holds config.toml; .*--force"):
        folders.check_target(run, "run", folders.RUN_FILES, "--out", overwrite=False)


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "f.json"
    folders.atomic_write_json(path, {"a": 1})
    with pytest.raises(RuntimeError):
        with folders.atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == '{\n "a": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no temp file left behind


def test_atomic_write_gives_umask_permissions_and_temp_names_are_recognised(tmp_path):
    old = os.umask(0o022)
    try:
        folders.atomic_write(tmp_path / "w.bin", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "w.bin").stat().st_mode) == 0o644
    tmp = folders.temp_name(tmp_path / "meta.json")
    assert folders.is_temp_name(tmp.name)
    assert not folders.is_temp_name(".metadata") and not folders.is_temp_name("meta.json")


def test_atomic_dir_publishes_a_whole_folder_or_nothing(tmp_path):
    final = tmp_path / "ds"
    with pytest.raises(RuntimeError):
        with folders.atomic_dir(final) as tmp:
            assert tmp.parent == tmp_path and not final.exists()
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []  # no final folder, no temp folder
    old = os.umask(0o022)
    try:
        with folders.atomic_dir(final) as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "a.bin").write_bytes(b"a")
    finally:
        os.umask(old)
    assert (final / "sub" / "a.bin").read_bytes() == b"a" and [p.name for p in tmp_path.iterdir()] == ["ds"]
    assert stat.S_IMODE(final.stat().st_mode) == 0o755  # not mkdtemp's 0700
    with pytest.raises(OSError):  # without is_complete an existing (non-empty) folder is not replaced
        with folders.atomic_dir(final) as tmp:
            (tmp / "b.bin").write_bytes(b"b")
    assert [p.name for p in final.rglob("*")] == ["sub", "a.bin"] and [p.name for p in tmp_path.iterdir()] == ["ds"]


def test_atomic_dir_keeps_a_complete_folder_and_replaces_a_broken_one(tmp_path):
    final = tmp_path / "ds"
    final.mkdir()
    (final / "partial").write_text("")

    def complete(d: Path) -> bool:
        return (d / "done").is_file()

    with folders.atomic_dir(final, is_complete=complete) as tmp:  # broken: replaced
        (tmp / "done").write_text("first")
    assert sorted(p.name for p in final.iterdir()) == ["done"]
    with folders.atomic_dir(final, is_complete=complete) as tmp:  # complete (another writer won): kept
        (tmp / "done").write_text("second")
    assert (final / "done").read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["ds"]


# ---- file names are spelled only in lmforge/folders.py ----------------------------------------

PACKAGE = Path(folders.__file__).parent
# Every upper-case string constant of folders.py: the file and folder names (and the shard format tag).
NAMES = {value for name, value in vars(folders).items() if name.isupper() and isinstance(value, str)}
# (module, literal) -> why the literal there is not a file name
ALLOWED = {
    ("lmforge/cli/__init__.py", folders.REPORT): "the `lmforge report` subcommand's name",
    ("lmforge/train/run_report.py", folders.CHECKPOINTS): "a key of summary.json (checkpoint statistics), not a path",
}


def file_name_literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of every string constant in `source` that is exactly one of folders.py's names,
    except docstrings and other bare string statements (prose, not values). An f-string's literal
    pieces are checked too: a piece equal to a name is the name written out (a name inside a longer
    piece, as in messages, is prose and passes)."""
    tree = ast.parse(source)
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
                  and id(node) not in prose)


def test_file_name_literals_finds_names_used_as_values_only():
    source = ('"""Writes config.toml."""\n'
              'def f(d):\n'
              '    """Reads tokenizer.json."""\n'
              '    print(f"{d} has no tokenizer.json")\n'
              '    return d / "config.toml", d / "config.toml.bak", f"{d}" "metrics.jsonl"\n')
    assert file_name_literals(source) == [(5, "config.toml"), (5, "metrics.jsonl")]
    assert file_name_literals('x = f"tb"\n') == [(1, "tb")]


def test_file_names_are_spelled_only_in_folders_py():
    """Every module names run-folder, dataset and shard-folder files by folders.py's constants."""
    root = PACKAGE.parent
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if path == Path(folders.__file__):
            continue
        found += [f"{module}:{line}: {value!r} (use folders.{_constant(value)})"
                  for line, value in file_name_literals(path.read_text()) if (module, value) not in ALLOWED]
    assert not found, "file names written out instead of lmforge.folders constants:\n" + "\n".join(found)


def _constant(value: str) -> str:
    return next(name for name, v in vars(folders).items() if name.isupper() and v == value)


def test_manifest_totals_and_max_id():
    shards = [folders.shard_record(0, b"\x01\x00\x07\x00", 2, 7), folders.shard_record(1, b"\x03\x00", 1, 3)]
    m = folders.build_manifest("uint16", 10, 2, shards, {"documents": 1})
    assert m["total_tokens"] == 3 and m["max_id"] == 7 and m["shards"][1]["file"] == "shard_00001.bin"
    assert m["format"] == folders.SHARD_FORMAT and m["version"] == folders.SHARD_FORMAT_VERSION
