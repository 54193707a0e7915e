"""A background thread that draws a loader's next batches ahead of the training step.

    loader = Prefetcher(PackedLoader(...), depth=4, pin_memory=device.type == "cuda")
    x, y = loader.next_batch()          # the same batches, in the same order, as the wrapped loader
    loader.state_dict()                 # the state after the last batch *consumed*, never one prefetched
    loader.load_state_dict(sd)          # stops the thread, restores the loader, restarts on the next draw
    loader.close()                      # stops and joins the thread (the trainer: at the end of fit)

The thread runs the wrapped loader's ``next_batch`` (the numpy gather and the shard reads), pins
the batch's tensors when ``pin_memory`` (CUDA: so that ``.to(device, non_blocking=True)`` is a true
asynchronous copy; on CPU pinning buys nothing and is skipped) and queues it with the loader's
``state_dict()`` taken right after that batch. ``depth`` batches at most wait in the queue. Work is
per batch, not per optimizer step, so a batch-size ramp-up (more micro-batches per step) needs
nothing special: the consumer simply takes more of them.

Determinism: only the thread touches the wrapped loader while it runs, and the loader is a pure
function of its state (seeded permutations, no global RNG), so the stream is the one the loader
gives on its own. Resume: a checkpoint saves the state queued with the last consumed batch, so a
resumed run draws exactly the batch that followed it; batches prefetched beyond it are dropped
when the state is loaded (resume, rollback). ``wait_s`` accumulates the time ``next_batch`` was
blocked on the queue: the data-wait the trainer logs as ``data_s``.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from typing import Any

import torch

_POLL_S = 0.1  # how often a blocked put/get checks that the other side is still there


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _work(loader: Any, pin_memory: bool, q: queue.Queue, stop: threading.Event) -> None:
    """The thread: draw, pin, queue with the state after the batch; a failure is queued and ends it."""
    while not stop.is_set():
        try:
            x, y = loader.next_batch()
            if pin_memory:
                x, y = x.pin_memory(), y.pin_memory()
            item: Any = (x, y, copy.deepcopy(loader.state_dict()))
        except BaseException as e:  # handed to the consumer, raised there
            item = _Failure(e)
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return


class Prefetcher:
    """``depth`` batches of ``loader`` drawn ahead on a daemon thread (see the module docstring)."""

    def __init__(self, loader: Any, depth: int, pin_memory: bool = False) -> None:
        assert depth >= 1, depth
        self.loader = loader
        self.depth = int(depth)
        self.pin_memory = bool(pin_memory)
        self.wait_s = 0.0
        self._consumed_state = copy.deepcopy(loader.state_dict())
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    # anything else (num_rows, seq_len, iter_eval_batches, ...) is the wrapped loader's
    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # (not yet set: during unpickling / early __init__ failure)
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        # (the thread holds the loader, not this object: an abandoned Prefetcher is collected and
        # its __del__ stops the thread)
        self._thread = threading.Thread(target=_work, args=(self.loader, self.pin_memory, self._queue, self._stop),
                                        name="lmforge-prefetch", daemon=True)
        self._thread.start()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The wrapped loader's next batch (pinned when ``pin_memory``)."""
        if not self.running and (self._queue is None or self._queue.empty()):
            self._start()
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self.running and self._queue.empty():
                    raise RuntimeError("the data prefetch thread ended without a batch") from None
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        x, y, self._consumed_state = item
        return x, y

    def close(self) -> None:
        """Stop the thread and drop what it prefetched; the wrapped loader is left at an arbitrary
        prefetched position, so the consumed state is put back (a later draw restarts the thread)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._thread = self._stop = self._queue = None
        self.loader.load_state_dict(copy.deepcopy(self._consumed_state))

    def __del__(self) -> None:
        stop = self.__dict__.get("_stop")
        if stop is not None:
            stop.set()

    def state_dict(self) -> dict:
        """The wrapped loader's state after the last batch consumed (not the prefetched ones)."""
        return copy.deepcopy(self._consumed_state)

    def load_state_dict(self, sd: dict) -> None:
        """Drop the prefetched batches and restore the wrapped loader; the thread restarts at the
        next draw."""
        self.close()
        self.loader.load_state_dict(sd)
        self._consumed_state = copy.deepcopy(self.loader.state_dict())
