"""The training loop's events, and the handlers that join the loop through them.

A concern that is not the step itself (the hang watchdog, the straggler report, the profiler, a
benchmark's measurement, a test's planted fault) is a `Handler`: it overrides the events it needs
and the `Trainer` calls them. Nothing extends the trainer by replacing its methods.

    Trainer(cfg, handlers=[MyHandler()])        # this trainer
    trainer.add_handler(MyHandler())            # before fit()
    register_handler(MyHandler)                 # every Trainer built afterwards in this process
                                                # (a factory: each trainer gets its own handler)

The events, in the order the synchronous loop (lmforge.train.trainer.Trainer.train) calls them:

    states(trainer) -> dict          in setup, before a checkpoint is restored: more parts of the
                                     run's checkpoint (name: a Stateful), saved and restored with it
    run_start(trainer)               setup done, the run folder open; before the first validation
    per step:
      step_begin(trainer, step)      before the step's micro-batches are drawn (`step`: 1-based, the
                                     step about to run); time spent here counts as the step's data phase
      backward_end(trainer, loss)    the step's gradients accumulated, before unscale / clip / update
      update_end(trainer, step)      the optimizer stepped and the step is counted (`state.step == step`)
      log_window(trainer) -> dict    at a log line, before the window's records are written: fields to
                                     add to each of them
      paused(trainer)                a context manager around blocking work that is not a step:
                                     validation, in-loop tasks, checkpoints, a rollback
      step_end(trainer, step)        the step's validation, checkpoint and preemption check are done
    run_end(trainer)                 the loop is over (also before a preemption's checkpoint);
                                     before the final validation, weights and summary
    close(trainer, error)            whatever ended the run (`error`: the exception, or None), once,
                                     the last handler first (as a stack unwinds)

The contract. Every rank builds the same handlers in the same order and calls every event on
every rank, in that order: built-in handlers first (`Trainer.builtin_handlers`), then the ones
passed to the Trainer, then the registered ones. A handler may run a collective inside an event
(the straggler report gathers every rank's phase times at `log_window`), so it must do so on every
rank, and must not skip an event on some ranks only. `close` is the exception: it runs on the
error path too, where a peer may never arrive, so it must not run a collective. The asynchronous
SGD loop (lmforge.train.async_sgd) calls only `close`: its ranks never step together, so no event
of the synchronous loop would reach every rank at the same point.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

EVENTS = ("states", "run_start", "step_begin", "backward_end", "update_end", "log_window", "paused", "step_end", "run_end",
          "close")


class Handler:
    """A participant in the loop's events (see the module's docstring for their order and contract).
    Every event does nothing here: override the ones you need."""

    def states(self, trainer) -> dict[str, Any]:
        return {}

    def run_start(self, trainer) -> None:
        pass

    def step_begin(self, trainer, step: int) -> None:
        pass

    def backward_end(self, trainer, loss) -> None:
        pass

    def update_end(self, trainer, step: int) -> None:
        pass

    def log_window(self, trainer) -> dict[str, Any]:
        return {}

    @contextlib.contextmanager
    def paused(self, trainer) -> Iterator[None]:
        yield

    def step_end(self, trainer, step: int) -> None:
        pass

    def run_end(self, trainer) -> None:
        pass

    def close(self, trainer, error: BaseException | None) -> None:
        pass


_REGISTERED: list[Callable[[], Handler]] = []


def register_handler(factory: Callable[[], Handler]) -> None:
    """Every Trainer built after this call in this process gets `factory()` as its last handlers
    (a driver script that runs the `lmforge train` command line, a `sitecustomize` that plants a
    fault in every process of a launch)."""
    _REGISTERED.append(factory)


def registered_handlers() -> list[Handler]:
    return [factory() for factory in _REGISTERED]


class Handlers:
    """The trainer's handlers, called in their fixed order (see the module's docstring)."""

    def __init__(self, handlers: list[Handler]):
        self.handlers = list(handlers)

    def add(self, handler: Handler) -> None:
        self.handlers.append(handler)

    def emit(self, event: str, trainer, *args) -> dict[str, Any]:
        """Call `event` on every handler in order; the dicts they return, merged (`log_window`)."""
        out: dict[str, Any] = {}
        for handler in self.handlers:
            got = getattr(handler, event)(trainer, *args)
            if got:
                out.update(got)
        return out

    @contextlib.contextmanager
    def paused(self, trainer) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for handler in self.handlers:
                stack.enter_context(handler.paused(trainer))
            yield

    def close(self, trainer, error: BaseException | None) -> None:
        """`close` on every handler, the last first (as they started); each one even if another raised."""
        errors = []
        for handler in reversed(self.handlers):
            try:
                handler.close(trainer, error)
            except Exception as e:  # noqa: BLE001 (the others still close; the first error is raised)
                errors.append(e)
        if errors:
            raise errors[0]
