"""Asynchronous SGD through a parameter server: its own loop over the Trainer's parts.

    torchrun --nproc-per-node 3 -m lmforge train --parallel.dp_replicate 3 --parallel.async_sgd true

Rank 0 is the server: it holds the parameters, the optimizer and the LR schedule. Ranks 1..N-1
are workers; worker w reads data shard w-1 of N-1 (the loader's rank/world size). The loop:

    worker: pull (version v, parameters) -> gradient of one micro-batch (train.micro_batch_size
            sequences, mean token loss) -> push (v, loss, token count, gradient) -> pull again ...
    server: take the next push from whichever worker sent it -> staleness s = version now - v.
            If s <= parallel.max_staleness: clip + guard + optimizer step + LR step (the Trainer's
            `update`), version += 1; else the gradient is DROPPED (not applied). Either way the
            worker then gets the current parameters, so its next gradient is fresh.

``train.steps`` counts applied server updates. The staleness of every received gradient (mean /
max, applied and dropped) and the dropped count go to metrics.jsonl (one record per applied
update, with its staleness and worker) and to summary.json. The end of the run (validation,
sample, weights, summary) is the Trainer's `finish`, run by the server on its own model; no
periodic or final checkpoint is written (the server's state is not checkpointed yet: the config
refuses checkpoint.every_steps). Messages: lmforge.parallel.param_server.

Preemption (lmforge.train.preempt): a signal to the server, or to a worker (which says so with its
next push), stops the run after the update in progress: the server stops every worker, logs a
`preempted` event and every rank exits with PREEMPTED_EXIT_CODE. There is no checkpoint to resume
(see above): a rerun starts over.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from lmforge.model.loss import count_targets
from lmforge.model.materialise import materialise
from lmforge.optim.optimizers import schedule_lr
from lmforge.parallel.layout import Layout
from lmforge.parallel.param_server import (ServerLink, WorkerLink, flat_grads, flat_params, load_flat_params,
                                           set_flat_grads)
from lmforge.train.preempt import PREEMPTED_EXIT_CODE, Preempted
from lmforge.train.progress import Progress
from lmforge.train import run_report
from lmforge.train.trainer import Trainer, TrainResult

log = logging.getLogger("lmforge.train")


class AsyncSGDTrainer(Trainer):
    def build_layout(self, model, precision: str, weight_source, documents) -> Layout:
        """Every rank holds the whole model: the server steps it, a worker computes gradients on its
        pulled copy; the one-process layout, with no collective in the step."""
        materialise(model, self.device, weight_source)
        return Layout(model, self.cfg, self.dist, precision)

    def end_together(self) -> None:
        """No closing barrier: a worker is done when the server stops it, while the server goes on
        to its final evaluation, sample and checkpoint, which may outlast parallel.timeout_s. The
        stop message is the last one either side sends."""

    def finish_decides(self, value):
        """Only the server (rank 0) runs `finish`: its value as it is."""
        return value

    def train(self) -> TrainResult:
        if self.dist.rank != 0:
            preempted = self.work()
            self.metrics.close()
            self.ckpt.close()
            if preempted:
                raise Preempted("preempted", self.state.step, self.preemption.signal_name, None)
            nan = math.nan
            return TrainResult(steps=self.state.step, tokens=0, train_loss=nan, val_loss=nan, val_perplexity=nan,
                               initial_val_loss=nan, unigram_entropy=nan, sample="", out_dir=str(self.out_dir),
                               seconds=0.0, tokens_per_second=0.0)
        run_report.log_header(self)
        log.info("async SGD: parameter server (rank 0) + %d workers, %d updates of %d sequences each, "
                 "max staleness %d (staler gradients are dropped)", self.dist.world_size - 1, self.cfg.train.steps,
                 self.cfg.train.micro_batch_size, self.cfg.parallel.max_staleness)
        initial = self.validate()
        start = time.perf_counter()
        history, stats = self.serve()
        if stats["preempted"]:
            self.stop_for_preemption_async()
        elapsed = time.perf_counter() - start
        return self.finish(initial, history, elapsed, start_step=0, checkpoint=False,
                           extra_summary={"async_sgd": stats, **self.async_operability(elapsed, stats)})

    def async_operability(self, elapsed: float, stats: dict) -> dict:
        """summary.json's layout and MFU of this loop (the synchronous loop's come from its windows):
        the model FLOPs of every gradient the workers computed (dropped stale ones included: they
        were computed) over the whole job's GPUs (the server's too) x their peak x the time."""
        flops = self.state.tokens_seen * self.flops_per_token
        peak = self.peak.flops * self.dist.world_size * max(elapsed, 1e-9)
        return {"layout": f"async-sgd (parameter server + {stats['workers']} workers)",
                "mfu": flops / peak if self.peak.flops else 0.0}

    def serve(self) -> tuple[list[dict], dict]:
        """The server's loop; returns the per-update records and the staleness statistics."""
        cfg, st = self.cfg, self.state
        params = list(self.model.parameters())  # unique (a tied embedding once), the same order on all ranks
        workers = list(range(1, self.dist.world_size))
        link = ServerLink(sum(p.numel() for p in params), workers, self.dist.host_group)
        version, dropped, staleness, history = 0, 0, [], []
        progress = Progress(cfg.train.steps, cfg.train.progress)
        for w in workers:
            link.send(w, version, flat_params(params))
        preempted = False
        while st.step < cfg.train.steps and not preempted:
            push = link.receive()
            stale = version - push.version
            staleness.append(stale)
            st.tokens_seen += cfg.train.micro_batch_size * cfg.data.seq_len
            if stale > cfg.parallel.max_staleness:
                dropped += 1
                self.metrics.write({"event": "stale_gradient_dropped", "step": st.step, "worker": push.worker,
                                    "staleness": stale, "max_staleness": cfg.parallel.max_staleness})
            else:
                set_flat_grads(params, push.grad)
                lr = schedule_lr(self.optimizer)
                grad_norm = self.update(torch.tensor(push.loss))
                version += 1
                st.step += 1
                st.last_loss = push.loss
                rec = {"step": st.step, "loss": push.loss, "grad_norm": float(grad_norm), "lr": lr,
                       "tokens": st.tokens_seen, "staleness": stale, "worker": push.worker, "dropped": dropped}
                history.append(rec)
                self.metrics.write(rec)
                if st.step % cfg.train.log_every == 0 or st.step == cfg.train.steps:
                    progress.write(f"update {st.step}: loss {push.loss:.4f} (worker {push.worker}, staleness "
                                   f"{stale}; mean {sum(staleness) / len(staleness):.2f}, max {max(staleness)}, "
                                   f"dropped {dropped})")
            preempted = push.preempt or self.preemption.signum is not None
            go_on = st.step < cfg.train.steps and not preempted
            link.send(push.worker, version, flat_params(params) if go_on else None, preempted)
        while link.in_flight:  # every other worker has one gradient in flight: take it (not applied), stop it
            link.send(link.receive().worker, version, None, preempted)
        link.close()
        progress.close()
        stats = {"staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
                 "dropped": dropped, "received": len(staleness), "max_staleness": cfg.parallel.max_staleness,
                 "workers": len(workers), "preempted": preempted}
        self.metrics.write({"step": st.step, **stats})
        log.info("async SGD done: staleness mean %.2f, max %d; %d of %d gradients dropped", stats["staleness_mean"],
                 stats["staleness_max"], dropped, len(staleness))
        return history, stats

    def stop_for_preemption_async(self) -> None:
        """The server, after a signal stopped the run (its own or a worker's): log it, raise Preempted."""
        st = self.state
        message = (f"preempted ({self.preemption.signal_name}) at update {st.step} of {self.cfg.train.steps}: "
                   f"asynchronous SGD keeps no checkpoint, a rerun starts over (exit code {PREEMPTED_EXIT_CODE})")
        self.log_event({"event": "preempted", "signal": self.preemption.signal_name, "checkpoint": None,
                        "message": message})
        self.metrics.close()
        raise Preempted(message, st.step, self.preemption.signal_name, None)

    def work(self) -> bool:
        """A worker's loop: pull -> gradient of one micro-batch -> push, until the server says stop.
        Returns whether the run was preempted."""
        params = list(self.model.parameters())
        link = WorkerLink(sum(p.numel() for p in params), self.dist.host_group)
        while (pulled := link.pull()) is not None:
            version, flat = pulled
            load_flat_params(params, flat)
            x, y = self.loader.next_batch()
            batch = [(x.to(self.device), y.to(self.device))]
            loss = self.layout.forward_backward(batch, self.precision)  # (one process's layout: no collective)
            link.push(version, float(loss), float(count_targets(y)), flat_grads(params),
                      preempt=self.preemption.signum is not None)
            self.model.zero_grad(set_to_none=True)
        return link.preempted


