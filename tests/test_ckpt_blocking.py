"""Checkpoint "blocking" time counts everything the training loop waits for: building the state
dicts (a state's `state_dict()` may gather, copy or convert), not only the staging copy."""

from __future__ import annotations

import time

import pytest
import torch

from lmforge.ckpt.checkpointer import save_states
from lmforge.ckpt.manager import CheckpointManager

SLEEP_S = 0.3


class SlowState:
    """A Stateful whose state_dict takes SLEEP_S seconds to build."""

    def __init__(self) -> None:
        self.w = torch.arange(8, dtype=torch.float32)

    def state_dict(self) -> dict:
        time.sleep(SLEEP_S)
        return {"w": self.w}

    def load_state_dict(self, state: dict) -> None:
        self.w.copy_(state["w"])


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_building_the_state_dict_counts_as_blocking(tmp_path, async_save):
    events: list[dict] = []
    manager = CheckpointManager(tmp_path / "ckpt", async_save=async_save, validate=False, on_event=events.append)
    t0 = time.perf_counter()
    save_states(manager, 1, {"slow": SlowState()}, {})
    returned_after = time.perf_counter() - t0
    blocking = manager.blocking_s  # (before close(), whose wait for the write counts too)
    manager.close()
    assert manager.saves == 1, events
    # the loop waited SLEEP_S for the state dict: it is in the save's blocking time and in the run's
    # total (which also holds the write itself when saving synchronously)
    assert SLEEP_S <= manager.last_save["blocking_s"] <= blocking <= returned_after
    assert [e["blocking_s"] for e in events if e.get("event") == "checkpoint"] == [manager.last_save["blocking_s"]]
