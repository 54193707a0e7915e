"""The training loop, readable top to bottom.

    Trainer(cfg).fit()
      setup:   process group + device -> data (corpus, tokenizer, shards, loaders) -> the checkpoint
               to resume (chosen first: it records the run's precision) -> model (meta -> device ->
               init; pre-trained weights, LoRA, FP8) -> precision (rank 0 decides) -> parallelize
               (the layout: pipeline split, TP, activation checkpointing, compile, FSDP/DDP) ->
               optimizer + LR schedule -> metrics, guard -> resume from that checkpoint
      loop:    for each step: the step's micro-batches -> layout.forward_backward (loss normalised by
               the global step's token count) -> unscale -> clip -> guard -> optimizer step ->
               schedule step; log every `log_every`, validate every `eval_every`, checkpoint
      finish:  final validation + perplexity, sample text, final checkpoint, weights (safetensors),
               summary.json, plots

Everything that differs between parallel layouts is behind `self.layout` (lmforge.parallel.layout):
the trainer never asks which one it has. Checkpoints hold `self.states`, a mapping of `Stateful`
objects (lmforge.ckpt.checkpointer). Asynchronous SGD is its own loop on top of this class
(lmforge.train.async_sgd.AsyncSGDTrainer; `trainer_for(cfg)` picks the class).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.ckpt.checkpointer import check_compatible, load_states, manager_for_run, resolve_resume, save_states
from lmforge.ckpt.export import save_streaming
from lmforge.ckpt.manager import CheckpointFailure, read_meta
from lmforge.ckpt.state import ModelOptimizerState, RNGState
from lmforge.config import Config, to_toml
from lmforge.config.rules import check_resolved_precision
from lmforge.data.prefetch import Prefetcher
from lmforge.data.prepare import mixture_entropy, mixture_weights, recorded_unigram_entropy, unigram_counts
from lmforge.eval.generate import generate_text
from lmforge.folders import (CONFIG, EMA_WEIGHTS, FAILED_RECORD, METRICS, PROFILE, REPORT, SAMPLE, SUMMARY, TOKENIZER,
                             WEIGHTS, atomic_path, atomic_write, new_run_id, read_failure, read_run_id, record_failure,
                             write_run_record)
from lmforge.model.documents import describe_document_attention
from lmforge.model.transformer import count_params, flops_per_token
from lmforge.optim.optimizers import build_optimizer, schedule_lr
from lmforge.optim.schedules import build_scheduler, config_batch_rampup
from lmforge.parallel.layout import Layout
from lmforge.parallel.mesh import destroy_distributed, folder_is_shared, init_distributed
from lmforge.parallel.parallelize import parallelize
from lmforge.train.components import (build_loaders, build_training_model, cache_dir,
                                      document_attention, prepare_data, seed_everything, stage_plan_lines,
                                      stage_schedule)
from lmforge.train.ema import WeightEMA
from lmforge.train.eval_tasks import TaskEvaluator
from lmforge.train.guard import SpikeGuard
from lmforge.train.metrics import HealthMonitor, MetricsWriter, ThroughputWindow, Timers, format_duration, make_sinks, \
    memory_gb
from lmforge.train.micro_batch import decide_micro_batch
from lmforge.train.precision import Resolved, make_precision, resolve_precision
from lmforge.train.run_folder import RunFolderInUse, RunLock, check_out_dir, config_differences, run_folder
from lmforge.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from lmforge.train.profiler import StepProfiler, device_peak, format_flops
from lmforge.train.progress import Progress, is_rank0
from lmforge.train.state import ScalerState, SchedulerPosition, TrainState
from lmforge.train.stragglers import PhaseClock, StragglerMonitor
from lmforge.train.validation import Validation
from lmforge.train.watchdog import HangWatchdog

log = logging.getLogger("lmforge.train")

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class StepEvents:
    """What the loop does after step `step` by count (computed once per step, read by the loop and
    by the guard): a log line, an evaluation, a checkpoint by step count, the last step. At each of
    them the loop syncs with the device anyway."""

    log: bool
    evaluate: bool
    checkpoint_by_count: bool
    last: bool

    @classmethod
    def at(cls, cfg: Config, step: int) -> "StepEvents":
        t, c = cfg.train, cfg.checkpoint
        return cls(log=step % t.log_every == 0 or step >= t.steps,
                   evaluate=bool(t.eval_every and step % t.eval_every == 0 and step < t.steps),
                   checkpoint_by_count=bool(c.every_steps and step % c.every_steps == 0),
                   last=step >= t.steps)

    @property
    def syncs(self) -> bool:
        """The loop reads device values at this step anyway: the guard books its verdict here, so
        events, rollbacks and the saved guard state are those of the host check at the same step."""
        return self.log or self.evaluate or self.checkpoint_by_count or self.last


@dataclass
class TrainResult:
    """What a finished run reports (also written to `summary.json` in the run folder)."""

    steps: int
    tokens: int
    train_loss: float
    val_loss: float
    val_perplexity: float
    initial_val_loss: float
    unigram_entropy: float
    sample: str
    out_dir: str
    seconds: float
    tokens_per_second: float
    history: list[dict] = field(default_factory=list, repr=False)


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | Path | None = None, data=None):
        self.cfg = cfg.validate()
        self.out_dir = Path(out_dir) if out_dir else None  # None: from train.out_dir, decided in setup
        self._data = data  # an already prepared dataset (tests, benchmarks), else prepared in setup
        self.metrics = None  # opened once the run really starts (events before that wait in _early)
        self._early: list[dict] = []
        self.preemption = Preemption()  # SIGTERM / SIGINT / SIGUSR1 -> a checkpoint (handlers: during fit)
        self._saved_step = -1  # the step of the last checkpoint this run saved

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
        self.hold_run_folder()
        seed_everything(t.seed)

        # the checkpoint to resume (rank 0's choice), checked against this config before any data work
        # or hardware probing (a refused resume answers at once); before the precision: it records
        # the run's precision
        # (the run's identity keys its S3 backup: the folder's, or a new one, recorded with the folder)
        self.run_id = self.rank0_decides((read_run_id(self.out_dir) or new_run_id()) if is_rank0() else None)
        self.ckpt = manager_for_run(cfg, self.out_dir, self.dist, self.log_event, run_id=self.run_id)
        self.run_id = self.ckpt.run_id  # (another run's, adopted: checkpoint.s3_adopt)
        self.resumed_from = resolve_resume(cfg.checkpoint, self.ckpt)
        if self.resumed_from is not None:
            check_compatible(read_meta(self.resumed_from), cfg, self.resumed_from)

        # the precision, then the micro-batch it fits (train.micro_batch_size = "auto"), before the loaders
        precision = self.decide_precision()
        self.resolve_micro_batch(precision.name)

        # data
        self.data = self._data or self.prepare_data()
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.data.tokenizer.vocab_size} tokens but model.vocab_size = "
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least that (a multiple of 64 is fastest).")
        loaders = build_loaders(cfg, self.data, self.dist.dp_rank, self.dist.dp_size)
        self.train_shards, self.val_shards = loaders.train_shards, loaders.val_shards
        self.loader, self.val_instruct = loaders.train, loaders.val_instruct
        self.documents = document_attention(cfg, self.data.tokenizer.eos_id, self.train_shards)  # (data.attention)
        self.validation = Validation(cfg, self.val_shards, self.val_instruct, self.documents, self.train_shards)
        if cfg.data.prefetch:  # the next micro-batches are drawn (CUDA: pinned) while the step runs
            self.loader = Prefetcher(self.loader, cfg.data.prefetch, pin_memory=self.device.type == "cuda")

        # model, parallel layout, optimizer, precision
        model, self.weight_source = build_training_model(cfg, self.device)  # (on the meta device)
        self.n_params = model.num_params()
        trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len, trainable)
        self.flops_rule = "6N + 12*L*d*s" if len(trainable) == len(list(model.parameters())) else \
            "forward + input gradients of all weights, weight gradients of the trainable ones only"
        self.layout = self.build_layout(model, precision.name)
        self.model = self.layout.model
        self.optimizer = self.layout.prepare_optimizer(build_optimizer(cfg.optim, self.model))
        # (data.stages: a stage may start the WSD decay)
        self.scheduler = build_scheduler(stage_schedule(cfg), self.optimizer, cfg.optim.lr, t.steps)
        self.precision = make_precision(precision.name, self.device)
        self.rampup = config_batch_rampup(cfg)

        # operability: health signals, timers, profiler, the MFU peak (metrics open with the run folder)
        self.health = HealthMonitor(t.spike_threshold, t.health_window, t.grad_growth_factor)
        self.timers = Timers()  # `with self.timers("checkpoint"):` around blocking saves -> ckpt_s
        self.phase_clock = PhaseClock(self.device)  # each step's phases (lmforge.train.stragglers)
        self._step_t0: float | None = None
        self.profiler = StepProfiler(t.profile_steps, self.out_dir / PROFILE, self.device)
        self.peak = self.rank0_decides(device_peak(self.device, self.precision.name) if is_rank0() else None)

        # fault tolerance: training state, spike guard, checkpoints, resume (every rank, same decisions)
        self.state = TrainState()
        g = cfg.guard
        self.guard = SpikeGuard(g.sigma, g.window, g.min_history, g.rollback_after) if g.enabled else None
        self._skipped_batches: list[int] = []  # batch indices of the current run of skipped steps
        self._rollback_requested = False
        self._guard_on_device = self.guard is not None and self.guard_can_skip_on_device()
        self._guard_pending: tuple | None = None  # the last step's (values on the host, step, batch, event)
        self.states = {"train": self.state, "model": ModelOptimizerState(self.model, self.optimizer),
                       "loader": self.loader, "scheduler": SchedulerPosition(self.scheduler),
                       "scaler": ScalerState(self.precision.scaler), "rng": RNGState(self.dist.rank)}
        if self.guard is not None:
            self.states["guard"] = self.guard
        self.ema = WeightEMA.for_run(self.model, t, self.layout.forward_roots())  # (train.ema_decay: lmforge.train.ema)
        if self.ema is not None:
            self.states["ema"] = self.ema
        self.tasks = TaskEvaluator.for_run(cfg, self.data.tokenizer, self.precision.autocast)  # (train.eval_tasks)
        if self.resumed_from is not None:
            self.load_checkpoint(self.resumed_from)
        self.finished = self.rank0_decides(self.resumed_from is not None and self.state.step >= t.steps
                                           and (self.out_dir / SUMMARY).is_file())
        if not self.finished:
            self.start_run_folder()

    def start_run_folder(self) -> None:
        """Every check passed and the run starts (or continues): write its config and tokenizer, open
        the metrics (JSONL + TensorBoard/W&B, rank 0) and the checkpoint folder."""
        cfg, t = self.cfg, self.cfg.train
        rank0 = is_rank0()
        if rank0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.out_dir / CONFIG, to_toml(cfg))
            if read_run_id(self.out_dir) != self.run_id:
                write_run_record(self.out_dir, self.run_id)
            with atomic_path(self.out_dir / TOKENIZER) as tmp:
                shutil.copyfile(self.data.tokenizer_path, tmp)
        self.metrics = MetricsWriter(self.out_dir / METRICS, make_sinks(
            self.out_dir, t.tensorboard and rank0, t.wandb and rank0, cfg.to_dict(), self.out_dir.name), enabled=rank0)
        for event in self._early:
            self.log_event(event)
        self._early.clear()
        failed = read_failure(self.out_dir) if rank0 else None
        if failed:  # (the record goes once the run completes)
            self.log_event({"event": "previous_attempt_failed", **failed, "message": (
                f"the previous attempt in {self.out_dir} stopped at step {failed.get('step')} ({failed.get('time')}) "
                f"without protecting its work: {failed.get('error')}")})
        self.ckpt.prepare()

    def hold_run_folder(self) -> None:
        """Rank 0 takes the run folder's lock for the run's life (lmforge.train.run_folder.RunLock): a
        second trainer on the folder stops here, every rank with the same one-line error."""
        self.run_lock = RunLock(self.out_dir)
        refused = None
        if is_rank0():
            try:
                self.run_lock.acquire()
            except RunFolderInUse as e:
                refused = str(e)
        refused = self.rank0_decides(refused)
        if refused:
            raise RunFolderInUse(refused)

    def finish_decides(self, value):
        """Rank 0's value on every rank that runs `finish` (a synchronous run: all of them)."""
        return self.rank0_decides(value)

    def rank0_decides(self, value):
        """Rank 0's value on every rank (decisions that read rank 0's disk)."""
        if self.dist.distributed:
            box = [value]
            torch.distributed.broadcast_object_list(box, src=0, group=self.dist.host_group)
            value = box[0]
        return value

    def decide_precision(self) -> Resolved:
        """train.precision resolved once, on rank 0, for every rank (lmforge.train.precision): from the
        hardware, or under `auto` kept from the checkpoint being resumed; then checked against the layout."""
        resolved = None
        if is_rank0():
            saved = read_meta(self.resumed_from).get("precision") if self.resumed_from is not None else None
            resolved = resolve_precision(self.cfg.train.precision, self.device, saved)
        resolved = self.rank0_decides(resolved)
        check_resolved_precision(self.cfg, resolved.name, resolved.reason)
        log.log(logging.WARNING if (resolved.slow or resolved.changed) and is_rank0() else logging.INFO,
                "precision: %s (%s)",
                resolved.name, resolved.reason)
        return resolved

    def resolve_micro_batch(self, precision: str) -> None:
        """train.micro_batch_size = "auto" resolved once, by rank 0 for every rank, from the memory free on
        its device (lmforge.train.micro_batch: the planner's rule, lmforge.plan.micro_batch); logged."""
        t = self.cfg.train
        if t.micro_batch_size != "auto":
            return
        choice = self.rank0_decides(decide_micro_batch(self.cfg, precision, self.device) if is_rank0() else None)
        t.micro_batch_size = choice.size
        self.cfg.validate()
        log.log(logging.INFO if choice.budget_bytes is None or choice.planned_bytes <= choice.budget_bytes
                else logging.WARNING, "train.micro_batch_size: %s", choice.reason)

    def build_layout(self, model, precision: str) -> Layout:
        """The parallel layout the loop drives, with this rank's part of the model materialised
        (lmforge.parallel.parallelize)."""
        layout = parallelize(model, self.cfg, self.dist, precision, self.weight_source)
        layout.documents = self.documents  # (data.attention = "document": the layouts pass each batch's documents on)
        log.info("%s", describe_document_attention(self.documents, self.device.type, self.cfg.model.dropout,
                                                   self.cfg.train.micro_batch_size, self.cfg.data.seq_len,
                                                   self.cfg.parallel.cp))
        return layout

    def prepare_data(self):
        """The dataset, prepared (or read from its cache) by one rank first, then read by the others:
        rank 0 when every rank sees the same cache folder, else each node's local rank 0 (node-local
        disks: every node prepares its own copy)."""
        if not self.dist.distributed:
            return prepare_data(self.cfg)
        shared = self.cfg.data.corpus != "default" or folder_is_shared(cache_dir(self.cfg), self.dist)
        first = self.dist.rank == 0 if shared else self.dist.local_rank == 0
        if not shared and self.dist.rank == 0:
            log.info("data: the cache %s is not shared by all ranks: each node prepares its own copy", cache_dir(self.cfg))
        if not first:
            torch.distributed.barrier(group=self.dist.host_group)
        data = prepare_data(self.cfg)
        if first:
            torch.distributed.barrier(group=self.dist.host_group)
        return data

    # ------------------------------------------------------------------------------------------
    # the run
    # ------------------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Set up, train, finish. A signal (lmforge.train.preempt) ends the loop early with a
        checkpoint and raises `Preempted`."""
        try:
            self.preemption.install()
            self.setup()
            self.run_lock.running = True  # (another trainer of this process may not take the folder now)
            result = self.report_finished() if self.finished else self.train()
            self.end_together()
            return result
        except CheckpointFailure as e:  # (every rank alike) the rerun says what happened
            if is_rank0() and not record_failure(self.out_dir, self.state.step, str(e)):
                log.error("could not record the failure in %s", self.out_dir / FAILED_RECORD)
            raise
        except RuntimeError as e:  # a collective that timed out: every thread's stack, as for a hang
            if "timed out" in str(e).lower() and getattr(self, "watchdog", None) is not None:
                self.watchdog.dump(f"a collective timed out (parallel.timeout_s = {self.cfg.parallel.timeout_s:g}): {e}")
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Release what `setup()` started, whatever ended the run (`fit` calls it; a caller that drives
        `setup()` and the steps itself calls it when done): the prefetch thread, the checkpoint
        writer (never a save half-written behind an exception), the process groups (a process that
        exits with its gloo/NCCL groups alive can abort in their destructors: "terminate called
        without an active exception"), the signal handlers."""
        if isinstance(getattr(self, "loader", None), Prefetcher):
            self.loader.close()
        if getattr(self, "ckpt", None) is not None:
            self.ckpt.close()
        if getattr(self, "dist", None) is not None and self.dist.distributed:
            destroy_distributed()
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        if getattr(self, "run_lock", None) is not None:
            self.run_lock.release()
        self.preemption.uninstall()

    def end_together(self) -> None:
        """Every rank waits here for the others before any tears its process groups down. A rank
        that closes its connections while a peer is still finishing its last collective can abort
        that peer on exit (gloo; seen once in CI as a SIGABRT, "terminate called without an active
        exception", on one rank of a 4-rank run that only reported a finished run). Only after a
        clean end: after an error a peer may never arrive."""
        if self.dist.distributed:
            torch.distributed.barrier(group=self.dist.host_group)

    def report_finished(self) -> TrainResult:
        """The run in the folder is complete: report its summary, change nothing."""
        summary = self.rank0_decides(json.loads((self.out_dir / SUMMARY).read_text()) if is_rank0() else None)
        command = self.cfg.command or "lmforge train ..."
        log.info("nothing trained: %s holds this run, already complete (%d of %d steps, validation loss %.4f). "
                 "Train it further: %s --train.out_dir %s --train.steps %d; start it over: %s --checkpoint.resume none",
                 self.out_dir, self.state.step, self.cfg.train.steps, summary.get("val_loss", math.nan), command,
                 self.out_dir, 2 * self.cfg.train.steps, command)
        fields = {f for f in TrainResult.__dataclass_fields__ if f != "history"}
        return TrainResult(**{k: v for k, v in summary.items() if k in fields})

    def train(self) -> TrainResult:
        """The synchronous loop: every rank steps together."""
        cfg, t, st = self.cfg, self.cfg.train, self.state
        self.log_run_header()
        progress = Progress(t.steps, t.progress, initial=st.step)
        initial = self.validate(progress)
        self.score_tasks(progress)
        history: list[dict] = []
        pending: list[tuple] = []  # steps since the last log line: read (host sync) only when logging
        window = ThroughputWindow(self.flops_per_token, self.peak, cfg.parallel.world_size, self.device,
                                  self.timers)
        self.start_clock(window.start)
        start_step, last_save_time = st.step, time.time()
        self.start_rank_health()

        while st.step < t.steps:
            self.watchdog.step_begin(st.step + 1)
            self._step_t0 = time.perf_counter()
            self.profiler.step_begin(st.step + 1)
            step_tokens = self.global_batch_now() * cfg.data.seq_len
            batches = self.next_micro_batches()
            data_s = time.perf_counter() - self._step_t0
            lr = schedule_lr(self.optimizer)  # (without a μP group's multiplier)
            loss, grad_norm = self.train_step(batches)
            st.step += 1
            st.tokens_seen += step_tokens
            self.profiler.step_end(st.step)
            window.add_step(step_tokens, data_s)
            pending.append((st.step, loss, grad_norm, lr, st.tokens_seen, data_s, dict(self.layout.moe_stats)))
            due = StepEvents.at(cfg, st.step)
            if self._guard_pending is not None and due.syncs:
                self.book_guard()

            if due.log or self._rollback_requested:
                if self.device.type == "cuda":  # the log line's one sync, before timing the window
                    torch.cuda.synchronize(self.device)
                self.log_window(pending, {**window.take(), **self.rank_comparison()}, history, progress)
                eta = (t.steps - st.step) * (time.perf_counter() - window.start) / max(st.step - start_step, 1)
                progress.update(st.step, history[-1], eta)
            if self._rollback_requested:
                with self.watchdog.paused():
                    self.rollback()
                continue
            if due.evaluate:
                eval_t0 = time.perf_counter()
                with self.watchdog.paused():
                    self.validate(progress)
                window.add_eval(time.perf_counter() - eval_t0)
            if self.tasks is not None and self.tasks.due(st.step):
                eval_t0 = time.perf_counter()
                with self.watchdog.paused():
                    self.score_tasks(progress)
                window.add_eval(time.perf_counter() - eval_t0)
            if (not due.last or not cfg.checkpoint.save_final) and self.checkpoint_due(last_save_time, due):
                st.last_loss = float(loss)
                with self.watchdog.paused():
                    self.save_checkpoint()
                last_save_time = time.time()
            with self.phase_clock("sync"):
                stop = self.preemption.requested()  # (every rank, every step: one tiny all-reduce)
            self.watchdog.step_end()
            if stop:
                self.stop_for_preemption(pending, window, history, progress)

        progress.close()
        self.profiler.close()
        return self.finish(initial, history, self.run_seconds(), start_step)

    # ------------------------------------------------------------------------------------------
    # one optimizer step
    # ------------------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: forward/backward over the micro-batches, then the update. Returns (mean
        loss, grad norm) as tensors: reading them forces a host sync, so the loop does it only when
        it logs. The spike guard decides on the device where the optimizer can skip there (torch's
        fused Adam/AdamW, `guard_verdict_on_device`); otherwise it reads both once per step. The
        phases are timed for the straggler report (lmforge.train.stragglers): `data` is this
        rank's time from the step's start to its compute."""
        clock = self.phase_clock
        if self._step_t0 is not None:  # (the loop's step; a driver calling train_step alone has none)
            clock.add("data", time.perf_counter() - self._step_t0)
            self._step_t0 = None
        with clock("compute"):
            loss = self.forward_backward(micro_batches)
        with clock("optimizer"):
            return loss, self.update(loss)

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Accumulated gradients of the step's micro-batches; the global step's mean token loss."""
        return self.layout.forward_backward(micro_batches, self.precision)

    def update(self, loss: torch.Tensor) -> torch.Tensor:
        """Unscale (fp16) -> clip the global grad norm -> guard -> step -> zero grads -> advance the LR."""
        opt, scaler = self.optimizer, self.precision.scaler
        scaler.unscale_(opt)  # true gradients before clipping (a no-op unless fp16)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = self.layout.clip_grad_norm(clip)
        if self._guard_on_device and self.guard is not None:  # no host wait: the optimizer skips on the device's verdict
            opt.found_inf = (~self.guard_verdict_on_device(loss, grad_norm)).to(torch.float32)
            try:
                scaler.step(opt)
            finally:
                del opt.found_inf
            scaler.update()
        elif self.guard is not None and not self.guard_allows(float(loss), float(grad_norm)):
            scaler.update()  # (fp16) still adapt the loss scale to an overflow
        else:
            scaler.step(opt)  # skips the update if fp16 gradients overflowed
            scaler.update()
        self.layout.zero_grad(opt)  # (DDP: in place, into its buckets)
        self.scheduler.step()
        if self.ema is not None:  # (on the device, no host sync)
            self.ema.update(self.state.step + 1)
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

    def _draw_micro_batches(self) -> list[Batch]:
        t = self.cfg.train
        self.state.batches_drawn += 1
        out = []
        for _ in range(self.global_batch_now() // (t.micro_batch_size * self.cfg.parallel.dp)):
            x, y = self.loader.next_batch()
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    # ------------------------------------------------------------------------------------------
    # fault tolerance: guard, rollback, checkpoints
    # ------------------------------------------------------------------------------------------

    def guard_can_skip_on_device(self) -> bool:
        """Can a rejected update be skipped on the device, so that the guard never makes the host wait
        inside a step? Yes for torch's fused Adam / AdamW (their kernels honour `found_inf`: a skipped
        step changes neither the weights nor any state, the step count included) unless fp16's
        GradScaler already drives `found_inf`. Every other optimizer (foreach kernels, ZeRO-1, the
        lmforge optimizers, fp16) keeps the host verdict: one host wait per step, after the backward;
        so does asynchronous SGD's server, which reads every update's values anyway."""
        opt = self.optimizer
        return not self.cfg.parallel.async_sgd and (type(opt) in (torch.optim.Adam, torch.optim.AdamW) and bool(opt.defaults.get("fused"))
                and getattr(opt, "_step_supports_amp_scaling", False) and not self.precision.scaler.is_enabled())

    def guard_verdict_on_device(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """This step's guard verdict as a device boolean (True: apply the update), with no host wait.

        The host books the previous step first (`book_guard`: its values were copied to pinned memory
        a step ago, so that wait is normally over), which makes the guard's accepted history what the
        host check would see; then "finite, and <= the history's limits" (`SpikeGuard.limits`,
        compared in float64 like `SpikeGuard.check`) is computed on the device. So every verdict is the
        host check's, booked (events) one step late. The host waits for this step's values only where
        the loop syncs anyway (`StepEvents.syncs`), before a checkpoint, and while a bad step would
        ask for a rollback (`guard.rollback_after - 1` skipped steps in a row already; with
        rollback_after = 1: every step), so that a rollback happens at the step the host check
        asks for it."""
        self.book_guard()
        lim_loss, lim_norm = self.guard.limits()
        if hasattr(grad_norm, "full_tensor"):  # (a DTensor norm: the global value, on every rank)
            grad_norm = grad_norm.full_tensor()
        values = torch.stack([loss.detach().to(torch.float64).reshape(()),
                              grad_norm.detach().to(loss.device, torch.float64).reshape(())])
        ok = torch.isfinite(values).all() & (values[0] <= lim_loss) & (values[1] <= lim_norm)
        event = None
        if values.device.type == "cuda":
            host = torch.empty(2, dtype=torch.float64, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            values = host
        self._guard_pending = (values, self.state.step + 1, self.state.batches_drawn - 1, event)
        g = self.guard
        if g.rollback_after > 0 and g.consecutive + 1 >= g.rollback_after:
            self.book_guard()  # (a bad step now rolls back: known in this step, as the host check knows it)
        return ok

    def book_guard(self) -> None:
        """Book the verdict of the last step judged on the device (`guard_verdict_on_device`)."""
        if self._guard_pending is None:
            return
        values, step, batch, event = self._guard_pending
        self._guard_pending = None
        if event is not None:
            event.synchronize()
        loss, grad_norm = values.tolist()
        self.guard_allows(loss, grad_norm, step, batch)

    def guard_allows(self, loss: float, grad_norm: float, step: int | None = None, batch: int | None = None) -> bool:
        """The spike guard's verdict on step `step` (default: this step), which drew batch `batch` (same
        on every rank: global loss and norm)."""
        if self.precision.name == "fp16" and math.isfinite(loss) and not math.isfinite(grad_norm):
            return True  # an fp16 overflow: the GradScaler skips the step and lowers its scale
        verdict = self.guard.check(loss, grad_norm)
        if not verdict.skip:
            self._skipped_batches.clear()
            return True
        batch = self.state.batches_drawn - 1 if batch is None else batch
        step = self.state.step + 1 if step is None else step
        self._skipped_batches.append(batch)
        self.log_event({"step": step, "event": "skipped_update", "loss": loss, "grad_norm": grad_norm,
                        "batch": batch, "message": f"step {step}: update skipped ({verdict.reason})"})
        self._rollback_requested = verdict.rollback
        return False

    def rollback(self) -> None:
        """Repeated bad steps: reload the last checkpoint and never train on the offending batches."""
        bad = list(self._skipped_batches)
        self.state.skip_batches.update(bad)
        self._skipped_batches.clear()
        self._rollback_requested = False
        self.guard.consecutive = 0
        self.ckpt.wait()
        path = self.ckpt.latest_valid()
        if path is None:
            self.log_event({"event": "rollback_impossible", "batches": bad,
                            "message": f"{len(bad)} consecutive skipped steps but no checkpoint to roll back to; "
                                       f"going on (set checkpoint.every_steps to enable rollbacks)"})
            return
        self.state.rollbacks += 1
        if self.state.rollbacks > self.cfg.guard.max_rollbacks:
            raise FloatingPointError(
                f"training rolled back {self.state.rollbacks - 1} times and still produces bad steps (last batches "
                f"{bad}); lower optim.lr, raise optim.warmup, or use precision = 'bf16'.")
        skipped = self.guard.n_skipped
        self.load_checkpoint(path)  # (TrainState keeps the larger rollback count and the union of skips)
        self.guard.n_skipped = skipped
        self.log_event({"event": "rollback", "to_step": self.state.step, "path": str(path), "skip_batches": bad,
                        "message": f"rolled back to {path.name} (step {self.state.step}); batches {bad} will be "
                                   f"skipped"})

    def checkpoint_due(self, last_save_time: float, due: StepEvents) -> bool:
        """Periodic checkpoint now? By step count, or by rank 0's clock, read at log steps and
        broadcast over the host (gloo) group, where a CPU tensor is legal on every backend."""
        c = self.cfg.checkpoint
        if due.checkpoint_by_count:
            return True
        if c.every_minutes > 0 and due.log:  # (at log steps: no extra sync)
            due = torch.tensor([1 if time.time() - last_save_time >= 60 * c.every_minutes else 0])
            if self.dist.distributed:
                torch.distributed.broadcast(due, src=0, group=self.dist.host_group)
            return bool(due.item())
        return False

    def start_rank_health(self) -> None:
        """The straggler report's phase clock and cross-rank comparison (every rank: the comparison's
        host names are gathered here), and the hang watchdog's thread (lmforge.train.watchdog)."""
        t = self.cfg.train
        self.stragglers = StragglerMonitor(t.straggler_ratio, t.straggler_windows, self.dist.host_group,
                                           self.dist.distributed)
        self.watchdog = HangWatchdog(self.out_dir, self.dist.rank, t.hang_factor, t.hang_min_s, t.hang_action,
                                     on_hang=self.log_event).start()

    def rank_comparison(self) -> dict:
        """This log window's slowest and fastest rank (a collective on the host group: every rank
        logs at the same steps); a rank slow for long enough is named as a `straggler` event."""
        fields, events = self.stragglers.window(self.phase_clock.take())
        for event in events:
            self.log_event(event)
        return fields

    def start_clock(self, t0: float) -> None:
        """This leg's training starts at `t0` (time.perf_counter), after the legs the state has counted."""
        self._clock = (self.state.seconds, t0)

    def run_seconds(self) -> float:
        """Training seconds of the whole run so far: the legs before this one (up to the checkpoint it
        resumed) and this one's since its first step."""
        before, t0 = getattr(self, "_clock", (self.state.seconds, time.perf_counter()))
        return before + time.perf_counter() - t0

    def save_checkpoint(self) -> None:
        """Checkpoint `self.states` at the current step (every rank calls this)."""
        self.book_guard()  # (the guard state saved is the one after this step's verdict)
        self.state.seconds = self.run_seconds()
        meta = {"loss": self.state.last_loss, "tokens_seen": self.state.tokens_seen, "config": self.cfg.to_dict(),
                "layout": self.layout.name, "optimizer": self.cfg.optim.name, "precision": self.precision.name}
        with self.timers("checkpoint"):
            save_states(self.ckpt, self.state.step, self.states, meta)
        self._saved_step = self.state.step

    def stop_for_preemption(self, pending: list[tuple], window: ThroughputWindow, history: list[dict],
                            progress: Progress) -> None:
        """A signal came (lmforge.train.preempt): log the steps not logged yet, checkpoint this step
        synchronously on every rank (unless the loop just did), log a `preempted` event, leave
        together and raise `Preempted` (the command line exits with its code)."""
        st, t = self.state, self.cfg.train
        if pending:
            self.log_window(pending, window.take(), history, progress)
        progress.close()
        self.profiler.close()
        if self._saved_step != st.step:
            self.save_checkpoint()
        self.ckpt.wait()  # written, validated and rotated before we report it
        saved = self.ckpt.last_save.get("step") == st.step
        where = self.ckpt.last_save.get("path") if saved else None
        name = self.preemption.signal_name
        message = (f"preempted ({name}) at step {st.step} of {t.steps}: " + (
            f"checkpoint saved in {where}; run the same command again to resume" if saved or not is_rank0() else
            "the checkpoint of this step failed (see above); a rerun resumes from the last good one")
            + f" (exit code {PREEMPTED_EXIT_CODE})")
        self.log_event({"event": "preempted", "signal": name, "checkpoint": where, "message": message})
        self.metrics.close()
        self.ckpt.close()
        self.end_together()
        raise Preempted(message, st.step, name, where)

    def load_checkpoint(self, path: Path) -> None:
        """Restore `self.states` from `path` (every rank; the checkpoint may come from any layout)."""
        self._guard_pending = None  # (a verdict not booked yet belongs to a step this load undoes)
        meta = read_meta(path)
        check_compatible(meta, self.cfg, path)
        changed = config_differences(meta.get("config", {}), self.cfg.to_dict())
        if changed and is_rank0():
            log.warning("resuming %s with changed settings: %s", path,
                        "; ".join(f"{k} {old!r} -> {new!r}" for k, old, new in changed))
        try:
            load_states(self.ckpt, path, self.states, self.cfg.model)
        except ValueError as e:
            raise ValueError(f"checkpoint {path}: {e}") from e
        if not self.states["rng"].restored:
            log.warning("checkpoint: %s has no RNG state for rank %d (saved by %s ranks); this rank keeps its seed",
                        path, self.dist.rank, meta.get("world_size"))
        log.info("resumed from %s: step %d, %s tokens seen (saved by %s rank(s) as %s)", path, self.state.step,
                 f"{self.state.tokens_seen:,}", meta.get("world_size"), meta.get("layout"))

    # ------------------------------------------------------------------------------------------
    # evaluation, logging
    # ------------------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Validation of the model as it is now (lmforge.train.validation; every rank calls it)."""
        return self.validation.evaluate(self.layout.inference_model(), self.precision.autocast, self.device,
                                        loss_chunk=self.layout.loss_chunk(self.precision))

    def validate(self, progress: Progress | None = None) -> dict[str, float]:
        """Validation loss and perplexity, recorded in the metrics and shown. The run's first is kept
        (TrainState.initial_val_loss) across resumes."""
        val = self.evaluate()
        ema = self.ema.evaluate(self.evaluate) if self.ema is not None else {}  # (the EMA swapped in: val_loss_ema)
        if math.isnan(self.state.initial_val_loss) and self.state.step == 0:
            self.state.initial_val_loss = val["loss"]
        self.metrics.write({"step": self.state.step, **self.validation.record(val), **ema})
        self.metrics.flush()
        line = self.validation.line(self.state.step, val)
        line += f"; EMA of the weights {ema['val_loss_ema']:.4f}" if ema else ""
        progress.write(line) if progress is not None else log.info("%s", line)
        return val

    def score_tasks(self, progress: Progress | None = None) -> dict:
        """train.eval_tasks scored on the sharded model (lmforge.train.eval_tasks): metrics and a line each."""
        if self.tasks is None:
            return {}
        say = progress.write if progress is not None else log.info
        return self.tasks.run(self.state.step, self.layout.inference_model(), self.metrics, say)

    def corpus_entropy(self) -> float:
        """The training corpus' unigram entropy (lmforge.data.prepare.unigram_entropy): the value
        `lmforge prepare` recorded (no data read), else, for a folder prepared before it did, counted
        once over the ranks: each counts 1/world of every source, the counts are summed on the host
        group. No rank reads the corpus while the others wait (ARCHITECTURE.md, "Collectives")."""
        recorded = recorded_unigram_entropy(self.train_shards)
        if recorded is not None:
            return recorded
        log.info("data: %s records no unigram entropy (prepared by an older lmforge): counting its %s tokens, "
                 "1/%d on each rank; re-run `lmforge prepare` to record it", self.data.train_dir,
                 f"{len(self.train_shards):,}", self.dist.world_size)
        counts = torch.from_numpy(unigram_counts(self.train_shards, self.dist.rank, self.dist.world_size))
        if self.dist.distributed:
            torch.distributed.all_reduce(counts, group=self.dist.host_group)
        return mixture_entropy(counts.numpy(), mixture_weights(self.train_shards))

    def log_run_header(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        counts = count_params(cfg.model)
        ft = cfg.finetune  # (the corpus' unigram entropy is the baseline of pre-training only)
        self.entropy = math.nan if ft.data else self.corpus_entropy()
        rule = self.flops_rule
        log.info("model: %s parameters (%s non-embedding), %.1f MFLOPs/token (%s)",
                 f"{self.n_params:,}", f"{counts['non_embedding']:,}", self.flops_per_token / 1e6, rule)
        if ft.data:  # supervised fine-tuning: say what is trained and validated on, not the corpus
            val = (f"{self.val_instruct.num_rows} rows of {ft.val_data}" if ft.val_data else
                   f"{self.val_instruct.num_rows} rows held out of it (finetune.val_fraction {ft.val_fraction})"
                   if self.val_instruct is not None else f"data.corpus's validation split")
            log.info("data: supervised fine-tuning on %s: %d rows of <= %d tokens, loss on responses only; "
                     "validation on %s", ft.data, self.loader.num_rows, cfg.data.seq_len, val)
        else:
            log.info("data: %s train tokens, %s val tokens, vocab %d; unigram entropy %.3f nats (a model that "
                     "learned nothing but token frequencies)", f"{len(self.train_shards):,}",
                     f"{len(self.val_shards):,}", self.data.tokenizer.vocab_size, self.entropy)
            lines, warnings = stage_plan_lines(cfg, self.train_shards)  # (mixture stages: tokens per source, epochs)
            for line in lines:
                log.info("%s", line)
            for line in warnings:
                log.warning("%s", line)
        if not cfg.parallel.async_sgd:  # (the parameter server's updates are one micro-batch each: it says so)
            log.info("batch: %d sequences x %d tokens = %s tokens/step (micro-batch %d x %d accumulation); %s, "
                     "device %s, %d threads", t.global_batch_size, cfg.data.seq_len, f"{cfg.tokens_per_step:,}",
                     t.micro_batch_size, cfg.grad_accum_steps, self.precision.name, self.device,
                     torch.get_num_threads())
        log.info("mfu: %.1f MFLOPs/token (%s) against %s per device (%s)", self.flops_per_token / 1e6, rule,
                 format_flops(self.peak.flops), self.peak.source)
        if self.resumed_from is not None:
            done = " (the run is already complete: use --checkpoint.resume none or another --train.out_dir " \
                   "to start over)" if self.state.step >= t.steps else ""
            log.info("resuming at step %d of %d from %s%s", self.state.step, t.steps, self.resumed_from, done)

    def log_window(self, pending: list[tuple], stats: dict, history: list[dict], progress: Progress) -> None:
        """Metrics records of the steps since the last log line (one host sync for all of them)."""
        for step, loss, grad_norm, lr, tokens, data_s, moe in pending:
            rec = {"step": step, "loss": float(loss), "grad_norm": float(grad_norm), "lr": lr, "tokens": tokens,
                   **stats, "data_s": data_s, **self.layout.moe_metrics(moe)}
            history.append(rec)
            self.metrics.write(rec)
            for event in self.health.update(step, rec["loss"], rec["grad_norm"]):
                self.metrics.write(event)
                progress.write(f"warning: {event['message']}", logging.WARNING)
        pending.clear()
        self.metrics.flush()
        self.state.last_loss = history[-1]["loss"]
        if not math.isfinite(self.state.last_loss) and self.guard is None:
            progress.close()
            raise FloatingPointError(f"loss became {self.state.last_loss} at step {self.state.step}; lower optim.lr, "
                                     f"use precision = 'bf16', or enable the guard (guard.enabled).")

    def log_event(self, event: dict) -> None:
        """An event (skipped update, rollback, checkpoint, ...) into metrics.jsonl and the log."""
        if not is_rank0():
            return
        if self.metrics is None:  # (the run folder is not open yet)
            self._early.append(event)
            return
        self.metrics.write({"step": self.state.step, **event})
        self.metrics.flush()
        if event.get("event") not in ("checkpoint", "backup", "checkpoint_failed"):  # (those log their own line)
            log.warning("%s", event.get("message", event.get("event")))

    # ------------------------------------------------------------------------------------------
    # end of the run (shared with asynchronous SGD)
    # ------------------------------------------------------------------------------------------

    def finish(self, initial: dict, history: list[dict], elapsed: float, start_step: int,
               checkpoint: bool = True, extra_summary: dict | None = None) -> TrainResult:
        """Final validation, sample text, final checkpoint (unless `checkpoint` is False) and weights,
        summary.json, plots. Every rank of a synchronous run calls it (sharded forwards and the
        weight gathering are collective)."""
        cfg, t, st = self.cfg, self.cfg.train, self.state
        first_val = st.initial_val_loss if math.isfinite(st.initial_val_loss) else initial["loss"]
        final = self.evaluate()
        ema = self.ema.evaluate(self.evaluate) if self.ema is not None else {}
        self.metrics.write({"step": st.step, **self.validation.record(final), **ema})
        baseline = "" if math.isnan(self.entropy) else f"; unigram entropy {self.entropy:.3f}"
        log.info("final: val loss %.4f (started at %.4f%s), perplexity %.1f, %s tokens in %s", final["loss"],
                 first_val, baseline, final["perplexity"], f"{st.tokens_seen:,}", format_duration(elapsed))
        if ema:
            log.info("final: EMA of the weights (train.ema_decay %g): val loss %.4f", t.ema_decay, ema["val_loss_ema"])
        tasks = self.score_tasks()
        sample = ""
        if t.sample_tokens:  # every rank runs it (sharded forwards are collective); same seed -> same text
            sample = generate_text(self.layout.inference_model(), self.data.tokenizer, t.sample_prompt,
                                   t.sample_tokens, temperature=0.8, top_k=50, seed=t.seed)
            if is_rank0():
                atomic_write(self.out_dir / SAMPLE, t.sample_prompt + sample + "\n")
        weights_error = None
        if cfg.checkpoint.save_final:
            if checkpoint and (st.step > start_step or self.resumed_from is None):  # (not if resumed at this step)
                self.save_checkpoint()
            with self.timers("checkpoint"):
                weights_error = self.save_final_weights(self.out_dir / WEIGHTS)
                if self.ema is not None and self.ema.started and not weights_error:  # (every rank: a collective)
                    with self.ema.swapped_in():
                        weights_error = self.save_final_weights(self.out_dir / EMA_WEIGHTS)
        self.ckpt.close()  # the last save is written, validated and backed up before we report
        if self.ckpt.consecutive_failures or weights_error:  # (every rank alike) no summary: a rerun resumes
            what = [f"the last checkpoint failed ({self.ckpt.last_error})"] if self.ckpt.consecutive_failures else []
            what += [f"the final weights {self.out_dir / WEIGHTS} could not be written ({weights_error})"] \
                if weights_error else []
            self.metrics.close()
            raise CheckpointFailure(f"training reached step {st.step}, but {' and '.join(what)}. Fix that and run the "
                                    f"same command again: it resumes from the newest valid checkpoint.")

        result = TrainResult(
            steps=st.step, tokens=st.tokens_seen, train_loss=st.last_loss, val_loss=final["loss"],
            val_perplexity=final["perplexity"], initial_val_loss=first_val, unigram_entropy=self.entropy,
            sample=sample, out_dir=str(self.out_dir), seconds=elapsed,
            tokens_per_second=st.tokens_seen / max(elapsed, 1e-9), history=history)
        summary = {k: v for k, v in result.__dict__.items() if k != "history"}
        summary.update(self.operability_summary(history))
        if final.get("sources"):  # (validation per source of a prepared mixture)
            summary["val_loss_per_source"] = final["sources"]
        summary.update({**ema, **({"eval_tasks": tasks} if tasks else {})})
        summary.update(extra_summary or {})
        if is_rank0():
            atomic_write(self.out_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
            (self.out_dir / FAILED_RECORD).unlink(missing_ok=True)  # (a failed attempt, now made good)
        self.metrics.close()
        if t.plot and is_rank0():
            try:
                from lmforge.report.plots import plot_runs

                plot_runs([self.out_dir], self.out_dir / REPORT)
            except ImportError:
                log.info("plots skipped: `pip install matplotlib` to get %s/*.png", self.out_dir / REPORT)
        return result

    def save_final_weights(self, path: Path) -> str | None:
        """safetensors weights, streamed by rank 0 one tensor at a time as the layout gathers them (LoRA
        adapters folded in unless finetune.merge_lora = false; a tied head stored once, as the
        embedding). A collective: every rank calls this. Returns why the file could not be written
        (a full disk: the bytes free and needed), on every rank, or None; rank 0 then still drains the
        layout's gathers so that no rank is left in a collective."""
        from lmforge.ckpt.export import WEIGHT_DTYPES, written_dtype
        from lmforge.ckpt.manager import describe_write_error, free_bytes
        from lmforge.model.lora import is_adapter, merge_adapters

        ft = self.cfg.finetune
        merge = bool(ft.lora_rank and ft.merge_lora)
        target = WEIGHT_DTYPES[self.cfg.checkpoint.weights_dtype]  # (checkpoint.weights_dtype)
        specs = [(name, written_dtype(dtype, target), shape) for name, dtype, shape in self.layout.weight_specs()
                 if not (merge and is_adapter(name))]
        rank0 = is_rank0()
        adapters: dict[str, torch.Tensor] = {}
        needed = sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in specs)
        free = free_bytes(path.parent) if rank0 else None
        error: BaseException | None = None
        stack = contextlib.ExitStack()
        write = None
        if rank0:
            try:
                write = stack.enter_context(save_streaming(path, specs))
            except OSError as e:
                error = e
        for name, tensor in self.layout.full_weights():
            if write is None or error is not None:
                continue
            if merge and is_adapter(name):
                adapters[name] = tensor
                continue
            if merge:  # (its adapters came first: weight_specs' order)
                tensor = merge_adapters(name, tensor, adapters, ft.lora_rank, ft.lora_alpha, self.cfg.model)
            try:
                write(name, tensor.to(written_dtype(tensor.dtype, target)))
            except OSError as e:
                error = e
        try:
            if error is not None:  # (the writer removes its temp file; `path` stays as it was)
                stack.__exit__(type(error), error, error.__traceback__)
            else:
                stack.close()  # fsync, check, rename
        except OSError as e:
            error = error or e
        why = describe_write_error(error, path.parent, needed, free) if error is not None else None
        return self.finish_decides(why)

    def operability_summary(self, history: list[dict]) -> dict:
        """Extra `summary.json` keys: throughput/MFU, time shares, health counts, hardware."""
        import platform

        last = history[-len(history) // 2:] or [{}]  # second half: past warm-up / compilation
        mean = lambda key: sum(r.get(key, 0.0) for r in last) / len(last)  # noqa: E731
        hw = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
              "device": str(self.device), "device_name": self.peak.device_name, "threads": torch.get_num_threads(),
              "world_size": self.cfg.parallel.world_size}
        return {"mfu": mean("window_mfu"), "peak_flops": self.peak.flops, "peak_source": self.peak.source,
                "flops_per_token": self.flops_per_token, "n_params": self.n_params, "layout": self.layout.name,
                "data_share": mean("window_data_share"), "checkpoint_s": self.timers.total.get("checkpoint", 0.0),
                "peak_mem_gb": memory_gb(self.device), "loss_spikes": self.health.n_spikes,
                "grad_norm_warnings": self.health.n_growth, "hardware": hw,
                "skipped_updates": self.guard.n_skipped if self.guard is not None else 0,
                "rollbacks": self.state.rollbacks,
                "checkpoints": {"saves": self.ckpt.saves, "failures": self.ckpt.failures,
                                "blocking_s": self.ckpt.blocking_s, "last": self.ckpt.last_save,
                                "resumed_from": str(self.resumed_from) if self.resumed_from else None}}
