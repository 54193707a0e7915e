"""Reading small jsonl record files (instruction data, evaluation sets) with errors that name
the file, the line and the fix."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_records(path: str | Path, required: Sequence[str | tuple[str, ...]]) -> list[dict[str, Any]]:
    """The JSON objects of a jsonl file, one a line (blank lines skipped).

    ``required``: keys every record must have; a tuple lists alternative spellings (the first
    present one is also stored under the first name, so callers read one name). A bad line raises
    ValueError naming ``path:line`` and what is wrong.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: file not found.")
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg}); each line must be one JSON object.") from exc
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}.")
            for key in required:
                names = (key,) if isinstance(key, str) else key
                found = next((n for n in names if n in rec), None)
                if found is None:
                    raise ValueError(f"{path}:{lineno}: missing key {' or '.join(map(repr, names))} "
                                     f"(keys present: {sorted(rec)}).")
                rec[names[0]] = rec[found]
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records (the file is empty).")
    return records
