"""The parameter server's messages: flat parameters down to workers, flat gradients up to the
server, over torch.distributed point-to-point calls. It moves tensors and nothing else; the
asynchronous SGD loop that uses it is `lmforge.train.async_sgd`.

Rank 0 is the server, ranks 1..N-1 the workers. Messages, in order on each (server, worker) pair:

    server -> worker   int64 [version, stop]; then, unless stop, the flat fp32 parameters
                       (stop: 0 go on, 1 the run is done, 2 the run was preempted)
    worker -> server   float64 [version, mean token loss, target tokens, preempt]; then the flat fp32
                       gradient (preempt 1: this worker got a signal, lmforge.train.preempt)

They are host tensors on `DistInfo.host_group`, an explicit gloo group (also on GPU runs, where
the default group is NCCL), and every receive names its source: NCCL has no receive-from-any-source
and ignores tags, and this code relies on neither. The server learns which worker pushed first
from one listener thread per worker, each receiving only from its worker and only while that
worker has parameters to work on, into one queue: arrival order. (Polling posted `irecv`s does not
work: gloo's receive work never reports completion before `wait()`.) The per-pair order above is
all that tells a header from a gradient.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

STOP_DONE, STOP_PREEMPTED = 1, 2  # the stop field of the server's header


def flat_params(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in params])


def load_flat_params(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    i = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float().cpu()
                      for p in params])


def set_flat_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    i = 0
    for p in params:
        p.grad = flat[i:i + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype).clone()
        i += p.numel()


@dataclass
class Push:
    worker: int
    version: int
    loss: float
    tokens: float
    grad: torch.Tensor
    preempt: bool = False  # the worker got a preemption signal


class ServerLink:
    """The server's end: send parameters to a worker, receive the next push from whichever worker."""

    def __init__(self, numel: int, workers: list[int], group):
        self.numel, self.group = numel, group
        self._arrivals: queue.Queue = queue.Queue()
        self._turns = {w: threading.Semaphore(0) for w in workers}  # released once per parameter send
        self._stopped: set[int] = set()
        self.in_flight = 0  # workers holding parameters whose gradient has not been received
        self._threads = [threading.Thread(target=self._listen, args=(w,), name=f"lmforge-ps-{w}", daemon=True)
                         for w in workers]
        for t in self._threads:
            t.start()

    def send(self, worker: int, version: int, params: torch.Tensor | None, preempted: bool = False) -> None:
        """Parameters at `version` to `worker`, or (params None) tell it to stop (`preempted`: the run
        stops for a signal)."""
        stop = 0 if params is not None else STOP_PREEMPTED if preempted else STOP_DONE
        dist.send(torch.tensor([version, stop], dtype=torch.int64), dst=worker, group=self.group)
        if params is None:
            self._stopped.add(worker)
        else:
            dist.send(params, dst=worker, group=self.group)
            self.in_flight += 1
        self._turns[worker].release()

    def receive(self) -> Push:
        """The next push of any worker that holds parameters (arrival order)."""
        assert self.in_flight, "no worker has a gradient in flight"
        push = self._arrivals.get()
        if isinstance(push, BaseException):
            raise push
        self.in_flight -= 1
        return push

    def _listen(self, worker: int) -> None:
        try:
            while True:
                self._turns[worker].acquire()
                if worker in self._stopped:
                    return
                header = torch.zeros(4, dtype=torch.float64)
                dist.recv(header, src=worker, group=self.group)
                grad = torch.empty(self.numel, dtype=torch.float32)
                dist.recv(grad, src=worker, group=self.group)
                self._arrivals.put(Push(worker, int(header[0]), float(header[1]), float(header[2]), grad,
                                        bool(header[3])))
        except BaseException as e:  # noqa: BLE001 - handed to the server's loop, which raises it
            self._arrivals.put(e)

    def close(self) -> None:
        for t in self._threads:
            t.join()


class WorkerLink:
    """A worker's end: pull parameters (or the stop message), push a gradient."""

    def __init__(self, numel: int, group, server: int = 0):
        self.group, self.server = group, server
        self._header = torch.zeros(2, dtype=torch.int64)
        self._params = torch.empty(numel, dtype=torch.float32)
        self.preempted = False  # the server's stop message said the run was preempted

    def pull(self) -> tuple[int, torch.Tensor] | None:
        """(version, flat parameters), or None when the server says stop."""
        dist.recv(self._header, src=self.server, group=self.group)
        if int(self._header[1]):
            self.preempted = int(self._header[1]) == STOP_PREEMPTED
            return None
        dist.recv(self._params, src=self.server, group=self.group)
        return int(self._header[0]), self._params

    def push(self, version: int, loss: float, tokens: float, grad: torch.Tensor, preempt: bool = False) -> None:
        dist.send(torch.tensor([version, loss, tokens, float(preempt)], dtype=torch.float64), dst=self.server,
                  group=self.group)
        dist.send(grad, dst=self.server, group=self.group)
