"""lmforge.folders: file names, folder kinds, atomic writes, the shard manifest."""

from __future__ import annotations

import os
import stat

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


def test_manifest_totals_and_max_id():
    shards = [folders.shard_record(0, b"\x01\x00\x07\x00", 2, 7), folders.shard_record(1, b"\x03\x00", 1, 3)]
    m = folders.build_manifest("uint16", 10, 2, shards, {"documents": 1})
    assert m["total_tokens"] == 3 and m["max_id"] == 7 and m["shards"][1]["file"] == "shard_00001.bin"
    assert m["format"] == folders.SHARD_FORMAT and m["version"] == folders.SHARD_FORMAT_VERSION
