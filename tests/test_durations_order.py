"""The suite's file order from tests/durations.json (tests/conftest.py): longest first, unknown files
after in collection order, and a missing or malformed file never stops the suite."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import DURATIONS, order_by_durations, read_durations


def test_known_files_run_longest_first_and_unknown_ones_after_in_collection_order():
    items = [SimpleNamespace(path=Path(f"tests/{name}"), test=i) for i, name in
             enumerate(["a.py", "b.py", "a.py", "c.py", "d.py", "e.py"])]
    order_by_durations(items, {"d.py": 5.0, "b.py": 40.0, "gone.py": 99.0})
    assert [(i.path.name, i.test) for i in items] == [("b.py", 1), ("d.py", 4), ("a.py", 0), ("a.py", 2),
                                                      ("c.py", 3), ("e.py", 5)]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"a.py": "long"}', '{"a.py": null}'])
def test_a_malformed_durations_file_warns_and_orders_nothing(tmp_path, text):
    path = tmp_path / "durations.json"
    path.write_text(text)
    with pytest.warns(pytest.PytestWarning, match="unreadable test durations"):
        assert read_durations(path) == {}
    assert read_durations(tmp_path / "missing.json") == {}  # (no file: collection order, silently)


def test_the_committed_durations_file_reads():
    seconds = read_durations(DURATIONS)
    assert seconds and all(v >= 0 for v in seconds.values())
    assert json.loads(DURATIONS.read_text()) == seconds
