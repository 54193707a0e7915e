"""The training loop, readable top to bottom.

    Trainer(cfg, handlers=[...]).fit()
      setup:   process group + device -> the run folder (held: lmforge.train.run_folder) -> the
               checkpoint to resume (chosen first: it records the run's precision) -> every "auto" of
               the config resolved once, then the config frozen (lmforge.train.auto) -> data (corpus,
               tokenizer, shards, loaders) -> model (meta -> device -> init; pre-trained weights, LoRA,
               FP8) -> parallelize (the layout: pipeline split, TP, activation checkpointing, compile,
               FSDP/DDP) -> optimizer + LR schedule -> guard, EMA -> resume from that checkpoint
      loop:    for each step: the step's micro-batches -> layout.forward_backward (loss normalised by
               the global step's token count) -> unscale -> clip -> guard -> optimizer step ->
               schedule step; log every `log_every`, validate every `eval_every`, checkpoint
      finish:  final validation + perplexity, sample text, final checkpoint, weights (safetensors),
               summary.json, plots

Everything that differs between parallel layouts is behind `self.layout` (lmforge.parallel.layout):
the trainer never asks which one it has. Checkpoints hold `self.states`, a mapping of `Stateful`
objects (lmforge.ckpt.checkpointer). The other concerns join the loop through the events of
lmforge.train.events (their order and contract are written there) as handlers: the rank health
report and hang watchdog (train.rank_health), the profiler (train.profiler.Profiling), the replica
groups of live fault tolerance (train.fault_tolerance, idle unless configured), and what a
caller adds (`Trainer(cfg, handlers=[...])`, `add_handler`, `events.register_handler`). Elsewhere:
the guard and its rollback (train.guard.StepGuard), checkpoints and preemption (train.checkpointing),
step records and log lines (train.step_log), header, summary and plots (train.run_report), final
weights (ckpt.export). Asynchronous SGD is its own loop on top of this class
(train.async_sgd.AsyncSGDTrainer; `trainer_for(cfg)` picks the class).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path

import torch

from lmforge.ckpt.checkpointer import check_compatible, manager_for_run, resolve_resume
from lmforge.ckpt.export import save_final_weights
from lmforge.ckpt.manager import CheckpointFailure, read_meta
from lmforge.ckpt.state import ModelOptimizerState, RNGState
from lmforge.config import Config
from lmforge.config.freeze import freeze
from lmforge.data.prefetch import Prefetcher
from lmforge.folders import EMA_WEIGHTS, FAILED_RECORD, SUMMARY, WEIGHTS, new_run_id, read_run_id, record_failure
from lmforge.model.documents import describe_document_attention
from lmforge.model.transformer import flops_per_token
from lmforge.optim.optimizers import build_optimizer, schedule_lr
from lmforge.optim.schedules import build_scheduler, config_batch_rampup
from lmforge.parallel.layout import Layout
from lmforge.parallel.mesh import destroy_distributed, init_distributed
from lmforge.parallel.parallelize import parallelize
from lmforge.train import auto, run_report
from lmforge.train.checkpointing import Checkpoints
from lmforge.train.components import (build_loaders, build_training_model, document_attention, prepare_data_once,
                                      seed_everything, stage_schedule)
from lmforge.train.ema import WeightEMA
from lmforge.train.eval_tasks import TaskEvaluator
from lmforge.train.events import Handler, Handlers, registered_handlers
from lmforge.train.fault_tolerance import FaultTolerance, data_coordinate
from lmforge.train.fp8 import fp8_handlers
from lmforge.train.guard import StepGuard, can_skip_on_device
from lmforge.train.metrics import format_duration
from lmforge.train.precision import Resolved, make_precision
from lmforge.train.preempt import Preemption
from lmforge.train.profiler import Profiling, device_peak
from lmforge.train.progress import is_rank0
from lmforge.train.rank_health import RankHealth
from lmforge.train.run_folder import RunRecords, check_out_dir, run_folder
from lmforge.train.run_report import RunFacts, TrainResult
from lmforge.train.state import ScalerState, SchedulerPosition, TrainState
from lmforge.train.step_log import StepEvents, StepLog, StepTokens
from lmforge.train.validation import Validation

log = logging.getLogger("lmforge.train")

Batch = tuple[torch.Tensor, torch.Tensor]


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | Path | None = None, data=None,
                 handlers: list[Handler] | None = None):
        # (a copy: the run resolves and freezes its own config; the caller's stays as it was)
        self.cfg = copy.deepcopy(cfg).validate()
        self.out_dir = Path(out_dir) if out_dir else None  # None: from train.out_dir, decided in setup
        self.data = data  # an already prepared dataset (tests, benchmarks), else prepared in setup
        self.handlers = Handlers(self.builtin_handlers() + list(handlers or []) + registered_handlers())
        self.preemption = Preemption()  # SIGTERM / SIGINT / SIGUSR1 -> a checkpoint (handlers: during fit)
        self.run: RunRecords | None = None

    def builtin_handlers(self) -> list[Handler]:
        """The handlers every synchronous run has, first, in order (lmforge.train.events); then its config's."""
        return [RankHealth(), Profiling(), FaultTolerance(), *fp8_handlers(self.cfg)]

    def add_handler(self, handler: Handler) -> None:
        """Join `handler` to this trainer's events (after the others; before `fit`)."""
        self.handlers.add(handler)

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Build everything and resume. Until every check has passed (data, model, layout,
        checkpoint compatibility, S3) nothing is written into the run folder; a run that is already
        complete is left exactly as it is (`self.finished`)."""
        cfg, t = self.cfg, self.cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.dist = init_distributed(cfg)  # validates the layout against the launch first
        self.preemption.attach(self.dist.host_group, self.dist.distributed)
        self.device = self.dist.device
        for note in cfg.adjustments:  # (what load_config fitted to the layout)
            log.info("config: %s", note)
        if self.out_dir is None:  # rank 0 decides which sibling folder; each rank keeps its own expansion
            chosen = run_folder(cfg)
            self.out_dir = chosen.with_name(self.rank0_decides(chosen.name))
        check_out_dir(self.out_dir)
        self.run = RunRecords(self.out_dir, is_rank0(), lambda: self.state.step, node_leader=self.dist.local_rank == 0)
        self.run.hold(self.rank0_decides)
        seed_everything(t.seed)

        # the checkpoint to resume (rank 0's choice), checked against this config before any data work
        # or hardware probing (a refused resume answers at once); before the precision: it records
        # the run's precision (the run's identity keys its S3 backup: the folder's, or a new one)
        run_id = self.rank0_decides((read_run_id(self.out_dir) or new_run_id()) if is_rank0() else None)
        self.checkpointing = Checkpoints(manager_for_run(cfg, self.out_dir, self.dist, self.log_event, run_id=run_id))
        self.resumed_from = resolve_resume(cfg.checkpoint, self.ckpt)
        if self.resumed_from is not None:
            check_compatible(read_meta(self.resumed_from), cfg, self.resumed_from)

        # every "auto" resolved once (rank 0 probes), before the loaders; then nothing changes the config
        precision, resolved = auto.resolve_auto(cfg, self.device, self.resumed_from, self.rank0_decides)
        freeze(cfg)

        # data
        self.data = self.data or prepare_data_once(cfg, self.dist)
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.data.tokenizer.vocab_size} tokens but model.vocab_size = "
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least that (a multiple of 64 is fastest).")
        self.loaders = loaders = build_loaders(cfg, self.data, *data_coordinate(cfg, self.dist))
        documents = document_attention(cfg, self.data.tokenizer.eos_id, loaders.train_shards)  # (data.attention)
        self.validation = Validation(cfg, loaders.val_shards, loaders.val_instruct, documents, loaders.train_shards)
        if cfg.data.prefetch:  # the next micro-batches are drawn (CUDA: pinned) while the step runs
            loaders.train = Prefetcher(loaders.train, cfg.data.prefetch, pin_memory=self.device.type == "cuda")

        # model, parallel layout, optimizer, precision
        model, weight_source = build_training_model(cfg, self.device)  # (on the meta device)
        trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
        rule = "6N + 12*L*d*s" if len(trainable) == len(list(model.parameters())) else \
            "forward + input gradients of all weights, weight gradients of the trainable ones only"
        self.facts = RunFacts(model.num_params(), flops_per_token(cfg.model, cfg.data.seq_len, trainable), rule,
                              None, resolved)
        self.layout = self.build_layout(model, precision.name, weight_source, documents)
        self.optimizer = self.layout.prepare_optimizer(build_optimizer(cfg.optim, self.model))
        # (data.stages: a stage may start the WSD decay)
        self.scheduler = build_scheduler(stage_schedule(cfg), self.optimizer, cfg.optim.lr, t.steps)
        self.precision = make_precision(precision.name, self.device)
        self.rampup = config_batch_rampup(cfg)
        self.steplog = StepLog(cfg, self.device)  # health signals, timers, phases, the log window
        self.facts.peak = self.rank0_decides(device_peak(self.device, self.precision.name) if is_rank0() else None)

        # fault tolerance: training state, spike guard, checkpoints, resume (every rank, same decisions)
        self.state = TrainState()
        self.guard = StepGuard(cfg.guard, self.log_event, self.precision.name == "fp16") if cfg.guard.enabled else None
        if self.guard is not None:
            self.guard.on_device = self.guard_can_skip_on_device()
        self.states = {"train": self.state, "model": ModelOptimizerState(self.model, self.optimizer),
                       "loader": self.loader, "scheduler": SchedulerPosition(self.scheduler),
                       "scaler": ScalerState(self.precision.scaler), "rng": RNGState(self.dist.rank)}
        if self.guard is not None:
            self.states["guard"] = self.guard
        self.ema = WeightEMA.for_run(self.model, t, self.layout.forward_roots())  # (train.ema_decay: lmforge.train.ema)
        if self.ema is not None:
            self.states["ema"] = self.ema
        self.states.update(self.handlers.emit("states", self))  # (the handlers' own parts: lmforge.train.events)
        self.tasks = TaskEvaluator.for_run(cfg, self.data.tokenizer, self.precision.autocast)  # (train.eval_tasks)
        if self.resumed_from is not None:
            self.load_checkpoint(self.resumed_from)
        self.finished = self.rank0_decides(self.resumed_from is not None and self.state.step >= t.steps
                                           and (self.out_dir / SUMMARY).is_file())
        if not self.finished:  # every check passed: the run starts (or continues) in its folder
            self.run.start(cfg, self.ckpt.run_id, self.data.tokenizer_path, auto.choices_text(resolved))
            self.ckpt.prepare()

    def build_layout(self, model, precision: str, weight_source, documents) -> Layout:
        """The parallel layout the loop drives, with this rank's part of the model materialised
        (lmforge.parallel.parallelize)."""
        layout = parallelize(model, self.cfg, self.dist, precision, weight_source)
        layout.documents = documents  # (data.attention = "document": the layouts pass each batch's documents on)
        log.info("%s", describe_document_attention(documents, self.device.type, self.cfg.model.dropout,
                                                   self.cfg.train.micro_batch_size, self.cfg.data.seq_len,
                                                   self.cfg.parallel.cp))
        return layout

    def decide_precision(self) -> Resolved:
        """train.precision resolved on rank 0 for every rank (lmforge.train.auto.decide_precision)."""
        return auto.decide_precision(self.cfg, self.device, self.resumed_from, self.rank0_decides)

    def rank0_decides(self, value):
        """Rank 0's value on every rank (decisions that read rank 0's disk or hardware)."""
        if self.dist.distributed:
            box = [value]
            torch.distributed.broadcast_object_list(box, src=0, group=self.dist.host_group)
            value = box[0]
        return value

    def finish_decides(self, value):
        """Rank 0's value on every rank that runs `finish` (a synchronous run: all of them)."""
        return self.rank0_decides(value)

    def guard_can_skip_on_device(self) -> bool:
        """Whether the guard's verdict may skip a rejected update on the device (lmforge.train.guard.can_skip_on_device)."""
        return can_skip_on_device(self.optimizer, self.precision.scaler, self.cfg.parallel.async_sgd)

    # what the parts hold, by the names callers use
    model = property(lambda self: self.layout.model)
    loader = property(lambda self: self.loaders.train)
    val_instruct = property(lambda self: self.loaders.val_instruct)
    ckpt = property(lambda self: self.checkpointing.manager)
    metrics = property(lambda self: self.run.metrics if self.run is not None else None)
    n_params = property(lambda self: self.facts.n_params)
    flops_per_token = property(lambda self: self.facts.flops_per_token)
    peak = property(lambda self: self.facts.peak)
    _guard_on_device = property(lambda self: self.guard is not None and self.guard.on_device)
    _guard_pending = property(lambda self: self.guard.pending if self.guard is not None else None)

    # ------------------------------------------------------------------------------------------
    # the run
    # ------------------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Set up, train, finish. A signal (lmforge.train.preempt) ends the loop early with a
        checkpoint and raises `Preempted`."""
        error = None
        try:
            self.preemption.install()
            self.setup()
            self.run.lock.running = True  # (another trainer of this process may not take the folder now)
            result = run_report.report_finished(self) if self.finished else self.train()
            self.end_together()
            return result
        except BaseException as e:
            error = e  # (a CheckpointFailure, every rank alike: the rerun says what happened)
            failed = isinstance(e, CheckpointFailure) and is_rank0()
            if failed and not record_failure(self.out_dir, self.state.step, str(e)):
                log.error("could not record the failure in %s", self.out_dir / FAILED_RECORD)
            raise
        finally:
            self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        """Release what `setup()` started, whatever ended the run (`fit` calls it; a caller that drives
        `setup()` and the steps itself calls it when done): the prefetch thread, the checkpoint
        writer (never a save half-written behind an exception), the process groups (a process that
        exits with its gloo/NCCL groups alive can abort in their destructors: "terminate called
        without an active exception"), the handlers (`close`), the lock, the signal handlers."""
        if isinstance(getattr(self, "loader", None), Prefetcher):
            self.loader.close()
        if getattr(self, "checkpointing", None) is not None:
            self.ckpt.close()
        if getattr(self, "dist", None) is not None and self.dist.distributed:
            destroy_distributed()
        try:
            self.handlers.close(self, error)
        finally:
            if self.run is not None:
                self.run.lock.release()
            self.preemption.uninstall()

    def end_together(self) -> None:
        """Every rank waits here for the others before any tears its process groups down. A rank
        that closes its connections while a peer is still finishing its last collective can abort
        that peer on exit (gloo; seen once in CI as a SIGABRT, "terminate called without an active
        exception", on one rank of a 4-rank run that only reported a finished run). Only after a
        clean end: after an error a peer may never arrive."""
        if self.dist.distributed:
            torch.distributed.barrier(group=self.dist.host_group)

    def train(self) -> TrainResult:
        """The synchronous loop: every rank steps together; the handlers hear its events in order."""
        cfg, t, st, steps, events = self.cfg, self.cfg.train, self.state, self.steplog, self.handlers
        run_report.log_header(self)
        steps.start(st)
        events.emit("run_start", self)
        initial = self.validate()
        self.score_tasks()
        steps.start_window(st, self.facts.flops_per_token, self.facts.peak)
        start_step, self.checkpointing.last_save_time = st.step, time.time()

        while st.step < t.steps:
            step = st.step + 1
            steps.step_t0 = time.perf_counter()
            events.emit("step_begin", self, step)
            step_tokens = self.global_batch_now() * cfg.data.seq_len
            steps.step_tokens = StepTokens(step_tokens, step_tokens)  # (a handler may count otherwise: fault tolerance)
            batches = self.next_micro_batches()
            data_s = time.perf_counter() - steps.step_t0
            lr = schedule_lr(self.optimizer)  # (without a μP group's multiplier)
            loss, grad_norm = self.train_step(batches)
            st.step, st.tokens_seen = st.step + 1, st.tokens_seen + steps.step_tokens.trained
            step = st.step  # (a step that healed this process from a live group's state goes on at its step)
            events.emit("update_end", self, step)
            steps.add(step, loss, grad_norm, lr, st.tokens_seen, steps.step_tokens.here, data_s, dict(self.layout.moe_stats))
            due = StepEvents.at(cfg, step)
            if self.guard is not None and due.syncs:
                self.guard.book()
            rollback = self.guard is not None and self.guard.rollback_requested
            if due.log or rollback:
                steps.write(self, lambda: events.emit("log_window", self), step - start_step)
            if rollback:
                with events.paused(self):
                    self.guard.rollback(self)
                continue
            if due.evaluate:
                with steps.timed_eval(), events.paused(self):
                    self.validate()
            if self.tasks is not None and self.tasks.due(step):
                with steps.timed_eval(), events.paused(self):
                    self.score_tasks()
            if (not due.last or not cfg.checkpoint.save_final) and self.checkpointing.due(cfg, self.dist, due):
                st.last_loss = float(loss)
                with events.paused(self):
                    self.save_checkpoint()
            with steps.phases("sync"):
                stop = self.preemption.requested()  # (every rank, every step: one tiny all-reduce)
            events.emit("step_end", self, step)
            if stop:
                self.checkpointing.stop_for_preemption(self)

        steps.close()
        events.emit("run_end", self)
        return self.finish(initial, steps.history, steps.run_seconds(st), start_step)

    # ------------------------------------------------------------------------------------------
    # one optimizer step
    # ------------------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: forward/backward over the micro-batches, then the update. Returns (mean
        loss, grad norm) as tensors: reading them forces a host sync, so the loop does it only when
        it logs. The spike guard decides on the device where the optimizer can skip there (torch's
        fused Adam/AdamW, `StepGuard.verdict_on_device`); otherwise it reads both once per step. The
        phases are timed for the straggler report (lmforge.train.stragglers): `data` is this
        rank's time from the step's start to its compute."""
        clock, steps = self.steplog.phases, self.steplog
        if steps.step_t0 is not None:  # (the loop's step; a driver calling train_step alone has none)
            clock.add("data", time.perf_counter() - steps.step_t0)
            steps.step_t0 = None
        with clock("compute"):
            loss = self.forward_backward(micro_batches)
            self.handlers.emit("backward_end", self, loss)
        with clock("optimizer"):
            return loss, self.update(loss)

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Accumulated gradients of the step's micro-batches; the global step's mean token loss."""
        return self.layout.forward_backward(micro_batches, self.precision)

    def update(self, loss: torch.Tensor) -> torch.Tensor:
        """Unscale (fp16) -> clip the global grad norm -> guard -> step -> zero grads -> advance the LR."""
        opt, scaler, guard, st = self.optimizer, self.precision.scaler, self.guard, self.state
        scaler.unscale_(opt)  # true gradients before clipping (a no-op unless fp16)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = self.layout.clip_grad_norm(clip)
        if guard is not None and guard.on_device:  # no host wait: the optimizer skips on the device's verdict
            opt.found_inf = (~guard.verdict_on_device(loss, grad_norm, st.step + 1, st.batches_drawn - 1)).to(
                torch.float32)
            try:
                scaler.step(opt)
            finally:
                del opt.found_inf
            scaler.update()
        elif guard is not None and not guard.allows(float(loss), float(grad_norm), st.step + 1, st.batches_drawn - 1):
            scaler.update()  # (fp16) still adapt the loss scale to an overflow
        else:
            scaler.step(opt)  # skips the update if fp16 gradients overflowed
            scaler.update()
        self.layout.zero_grad(opt)  # (DDP: in place, into its buckets)
        self.scheduler.step()
        if self.ema is not None:  # (on the device, no host sync)
            self.ema.update(st.step + 1)
        return grad_norm

    def global_batch_now(self) -> int:
        """Global batch (sequences) of the next step: the target, or the ramp-up's current value."""
        if self.rampup is None:
            return self.cfg.train.global_batch_size
        return self.rampup.batch_at(self.state.tokens_seen)

    def next_micro_batches(self) -> list[Batch]:
        """This rank's micro-batches for the next step (more of them as a batch ramp-up grows);
        batches that once rolled the run back are drawn and dropped."""
        while self.state.batches_drawn in self.state.skip_batches:
            self._draw_micro_batches()
            self.log_event({"event": "skipped_batch", "batch": self.state.batches_drawn - 1,
                            "message": f"batch {self.state.batches_drawn - 1} skipped (it caused a rollback)"})
        return self._draw_micro_batches()

    def micro_batches_per_step(self) -> int:
        """How many micro-batches each rank draws for the next step (its share of `global_batch_now`)."""
        return self.global_batch_now() // (self.cfg.train.micro_batch_size * self.cfg.parallel.dp)

    def _draw_micro_batches(self) -> list[Batch]:
        self.state.batches_drawn += 1
        out = []
        for _ in range(self.micro_batches_per_step()):
            x, y = self.loader.next_batch()
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    def save_checkpoint(self) -> None:
        """Checkpoint `self.states` at the current step (every rank; lmforge.train.checkpointing)."""
        self.checkpointing.save(self)

    def load_checkpoint(self, path: Path) -> None:
        """Restore `self.states` from `path` (every rank; the checkpoint may come from any layout)."""
        self.checkpointing.load(self, path)

    # ------------------------------------------------------------------------------------------
    # evaluation, logging
    # ------------------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Validation of the model as it is now (lmforge.train.validation; every rank calls it)."""
        return self.validation.evaluate(self.layout.inference_model(), self.precision.autocast, self.device,
                                        loss_chunk=self.layout.loss_chunk(self.precision))

    def validate(self) -> dict[str, float]:
        """Validation loss and perplexity, recorded in the metrics and shown. The run's first is kept
        (TrainState.initial_val_loss) across resumes."""
        val = self.evaluate()
        ema = self.ema.evaluate(self.evaluate) if self.ema is not None else {}  # (the EMA swapped in: val_loss_ema)
        if math.isnan(self.state.initial_val_loss) and self.state.step == 0:
            self.state.initial_val_loss = val["loss"]
        self.metrics.write({"step": self.state.step, **self.validation.record(val), **ema})
        self.metrics.flush()
        line = self.validation.line(self.state.step, val)
        self.steplog.say(line + (f"; EMA of the weights {ema['val_loss_ema']:.4f}" if ema else ""))
        return val

    def score_tasks(self) -> dict:
        """train.eval_tasks scored on the sharded model (lmforge.train.eval_tasks): metrics and a line each."""
        if self.tasks is None:
            return {}
        return self.tasks.run(self.state.step, self.layout.inference_model(), self.metrics, self.steplog.say)

    def corpus_entropy(self) -> float:
        """The training corpus' unigram entropy (lmforge.train.run_report.corpus_entropy)."""
        return run_report.corpus_entropy(self.data, self.loaders.train_shards, self.dist)

    def log_event(self, event: dict) -> None:
        """An event (skipped update, rollback, checkpoint, ...) into metrics.jsonl and the log."""
        self.run.log_event(event)

    # ------------------------------------------------------------------------------------------
    # end of the run (shared with asynchronous SGD)
    # ------------------------------------------------------------------------------------------

    def finish(self, initial: dict, history: list[dict], elapsed: float, start_step: int,
               checkpoint: bool = True, extra_summary: dict | None = None) -> TrainResult:
        """Final validation, sample text, final checkpoint (unless `checkpoint` is False) and weights,
        summary.json, plots. Every rank of a synchronous run calls it (sharded forwards and the
        weight gathering are collective)."""
        cfg, t, st, out = self.cfg, self.cfg.train, self.state, self.out_dir
        first_val = st.initial_val_loss if math.isfinite(st.initial_val_loss) else initial["loss"]
        final = self.evaluate()
        ema = self.ema.evaluate(self.evaluate) if self.ema is not None else {}
        self.metrics.write({"step": st.step, **self.validation.record(final), **ema})
        entropy = self.facts.entropy
        baseline = "" if math.isnan(entropy) else f"; unigram entropy {entropy:.3f}"
        log.info("final: val loss %.4f (started at %.4f%s), perplexity %.1f, %s tokens in %s", final["loss"],
                 first_val, baseline, final["perplexity"], f"{st.tokens_seen:,}", format_duration(elapsed))
        if ema:
            log.info("final: EMA of the weights (train.ema_decay %g): val loss %.4f", t.ema_decay, ema["val_loss_ema"])
        tasks = self.score_tasks()
        sample = run_report.write_sample(self)  # (every rank: sharded forwards are collective)
        weights_error = None
        if cfg.checkpoint.save_final:
            if checkpoint and (st.step > start_step or self.resumed_from is None):  # (not if resumed at this step)
                self.save_checkpoint()
            with self.steplog.timers("checkpoint"):
                weights_error = save_final_weights(self.layout, cfg, out / WEIGHTS, is_rank0(), self.finish_decides)
                if self.ema is not None and self.ema.started and not weights_error:  # (every rank: a collective)
                    with self.ema.swapped_in():
                        weights_error = save_final_weights(self.layout, cfg, out / EMA_WEIGHTS, is_rank0(),
                                                           self.finish_decides)
        self.checkpointing.close_protected(weights_error, out / WEIGHTS, st.step, self.metrics)  # (every rank alike)
        result = TrainResult(
            steps=st.step, tokens=st.tokens_seen, train_loss=st.last_loss, val_loss=final["loss"],
            val_perplexity=final["perplexity"], initial_val_loss=first_val, unigram_entropy=entropy,
            sample=sample, out_dir=str(out), seconds=elapsed,
            tokens_per_second=st.tokens_seen / max(elapsed, 1e-9), history=history)
        per_source = {"val_loss_per_source": final["sources"]} if final.get("sources") else {}  # (a mixture)
        run_report.write_summary(self, result, {**per_source, **ema, **({"eval_tasks": tasks} if tasks else {}),
                                                **(extra_summary or {})})
        return result

