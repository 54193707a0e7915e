"""What started this process, from torchrun's environment (no torch import: the command line checks
a config against its launch before the heavy imports)."""

from __future__ import annotations

import os


LAUNCHER_ENV = "LMFORGE_LAUNCHER"  # set by `lmforge launch` for its workers


def launcher_command(processes: int) -> str:
    """The command line that starts `processes` workers, as this run was launched."""
    if os.environ.get(LAUNCHER_ENV) == "lmforge launch":
        return f"lmforge launch --nproc-per-node {processes} train ..."
    return f"torchrun --nproc-per-node {processes} -m lmforge train ..."


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_description(world_size: int) -> str:
    """Who started this process and how many: the process-count error's words."""
    if world_size > 1 or launched_by_torchrun():
        return f"torchrun started {world_size} process{'es' if world_size > 1 else ''}"
    return "this is a single process (not launched by torchrun)"


def current_launch() -> tuple[int, str]:
    """(processes started, who started them) for `load_config(..., launch=...)`."""
    world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
    return world, launch_description(world)
