"""The (N, D, L) of finished runs: N from the run's own config.toml (non-embedding parameters), D the
tokens it trained (summary.json), L its final validation loss (summary.json)."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.config import load_config
from lmforge.folders import CONFIG, SUMMARY
from lmforge.model.accounting import count_params


def run_folders(paths: list[str]) -> list[Path]:
    """Each path's finished runs: the path itself when it is a run folder with summary.json, else the
    runs one level below it (a sweep folder's trials). ValueError for a path with none."""
    out: list[Path] = []
    for text in paths:
        path = Path(text)
        if (path / SUMMARY).is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(p.parent for p in path.glob(f"*/{SUMMARY}"))
        else:
            raise ValueError(f"{text!r} is not a folder; give run folders (with {SUMMARY}) or sweep folders")
        if not found:
            raise ValueError(f"{text!r} holds no finished run (no {SUMMARY} in it or in its sub-folders)")
        out += [p for p in found if p not in out]
    return out


def run_point(run: Path) -> dict:
    """{"run", "n_params", "tokens", "loss", "flops", ...} of a finished run: its N, D, L, 6ND, and what
    decides the loss's units (vocabulary, sequence length, corpus)."""
    summary = json.loads((run / SUMMARY).read_text())
    loss = summary.get("val_loss")
    if not isinstance(loss, (int, float)) or not loss > 0:
        raise ValueError(f"{str(run)!r}: summary.json has no final validation loss (val_loss = {loss!r}); train "
                         f"with validation (data with a val split) or leave the run out")
    cfg = load_config(str(run / CONFIG), validate=False)
    n = count_params(cfg.model)["non_embedding"]
    tokens = int(summary["tokens"])
    return {"run": str(run), "n_params": n, "tokens": tokens, "loss": float(loss), "flops": 6.0 * n * tokens,
            "dim": cfg.model.dim, "n_layers": cfg.model.n_layers, "preset": cfg.preset,
            "vocab_size": cfg.model.vocab_size, "seq_len": cfg.data.seq_len, "corpus": str(cfg.data.corpus)}


def collect(paths: list[str]) -> list[dict]:
    return [run_point(run) for run in run_folders(paths)]
