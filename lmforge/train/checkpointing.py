"""The trainer's checkpoints: when one is due, saving and loading `Trainer.states` (every rank; the
checkpoint may come from any layout: lmforge.ckpt.checkpointer), and the checkpoint a preemption
asks for before the run leaves (lmforge.train.preempt)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from lmforge.ckpt.checkpointer import check_compatible, load_states, save_states
from lmforge.ckpt.manager import CheckpointFailure, read_meta
from lmforge.train.preempt import PREEMPTED_EXIT_CODE, Preempted
from lmforge.train.progress import is_rank0
from lmforge.train.run_folder import config_differences

log = logging.getLogger("lmforge.train")


class Checkpoints:
    """The run's checkpoint manager (`manager`, lmforge.ckpt.manager) and the loop's record of it:
    the step this run saved last and when."""

    def __init__(self, manager):
        self.manager = manager
        self.saved_step = -1  # the step of the last checkpoint this run saved
        self.last_save_time = time.time()

    def due(self, cfg, dist, due) -> bool:
        """A periodic checkpoint now (`due`: the step's StepEvents)? By step count, or by rank 0's
        clock, read at log steps and broadcast over the host (gloo) group, where a CPU tensor is
        legal on every backend."""
        c = cfg.checkpoint
        if due.checkpoint_by_count:
            return True
        if c.every_minutes > 0 and due.log:  # (at log steps: no extra sync)
            flag = torch.tensor([1 if time.time() - self.last_save_time >= 60 * c.every_minutes else 0])
            if dist.distributed:
                torch.distributed.broadcast(flag, src=0, group=dist.host_group)
            return bool(flag.item())
        return False

    def save(self, trainer) -> None:
        """Checkpoint the trainer's `states` at the current step (every rank calls this)."""
        st = trainer.state
        if trainer.guard is not None:
            trainer.guard.book()  # (the guard state saved is the one after this step's verdict)
        st.seconds = trainer.steplog.run_seconds(st)
        meta = {"loss": st.last_loss, "tokens_seen": st.tokens_seen, "config": trainer.cfg.to_dict(),
                "layout": trainer.layout.name, "optimizer": trainer.cfg.optim.name,
                "precision": trainer.precision.name}
        with trainer.steplog.timers("checkpoint"):
            save_states(self.manager, st.step, trainer.states, meta)
        self.saved_step = st.step
        self.last_save_time = time.time()

    def load(self, trainer, path: Path) -> None:
        """Restore the trainer's `states` from `path` (every rank)."""
        if trainer.guard is not None:
            trainer.guard.pending = None  # (a verdict not booked yet belongs to a step this load undoes)
        cfg, st = trainer.cfg, trainer.state
        meta = read_meta(path)
        check_compatible(meta, cfg, path)
        changed = config_differences(meta.get("config", {}), cfg.to_dict())
        if changed and is_rank0():
            log.warning("resuming %s with changed settings: %s", path,
                        "; ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changed))
        try:
            load_states(self.manager, path, trainer.states, cfg.model)
        except ValueError as e:
            raise ValueError(f"checkpoint {path}: {e}") from e
        if not trainer.states["rng"].restored:
            log.warning("checkpoint: %s has no RNG state for rank %d (saved by %s ranks); this rank keeps its seed",
                        path, trainer.dist.rank, meta.get("world_size"))
        log.info("resumed from %s: step %d, %s tokens seen (saved by %s rank(s) as %s)", path, st.step,
                 f"{st.tokens_seen:,}", meta.get("world_size"), meta.get("layout"))

    def stop_for_preemption(self, trainer) -> None:
        """A signal came (lmforge.train.preempt): log the steps not logged yet, checkpoint this step
        synchronously on every rank (unless the loop just did), log a `preempted` event, leave
        together and raise `Preempted` (the command line exits with its code)."""
        st, t, steplog, manager = trainer.state, trainer.cfg.train, trainer.steplog, self.manager
        if steplog.pending:
            steplog.flush(trainer, steplog.window.take())
        steplog.close()
        trainer.handlers.emit("run_end", trainer)
        if self.saved_step != st.step:
            self.save(trainer)
        manager.wait()  # written, validated and rotated before we report it
        saved = manager.last_save.get("step") == st.step
        where = manager.last_save.get("path") if saved else None
        name = trainer.preemption.signal_name
        message = (f"preempted ({name}) at step {st.step} of {t.steps}: " + (
            f"checkpoint saved in {where}; run the same command again to resume" if saved or not is_rank0() else
            "the checkpoint of this step failed (see above); a rerun resumes from the last good one")
            + f" (exit code {PREEMPTED_EXIT_CODE})")
        trainer.log_event({"event": "preempted", "signal": name, "checkpoint": where, "message": message})
        trainer.metrics.close()
        manager.close()
        trainer.end_together()
        raise Preempted(message, st.step, name, where)

    def close_protected(self, weights_error: str | None, weights: Path, step: int, metrics) -> None:
        """The end of a run: the last save written, validated and backed up before the run reports;
        if it failed, or the final weights could not be written (`weights_error`), no summary:
        CheckpointFailure (every rank alike), and a rerun resumes."""
        manager = self.manager
        manager.close()
        if manager.consecutive_failures or weights_error:
            what = [f"the last checkpoint failed ({manager.last_error})"] if manager.consecutive_failures else []
            what += [f"the final weights {weights} could not be written ({weights_error})"] if weights_error else []
            metrics.close()
            raise CheckpointFailure(f"training reached step {step}, but {' and '.join(what)}. Fix that and run the "
                                    f"same command again: it resumes from the newest valid checkpoint.")
