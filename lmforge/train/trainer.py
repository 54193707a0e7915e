"""The training loop, readable top to bottom.

    Trainer(cfg).fit()
      setup:   seed + device -> data (corpus, tokenizer, shards) -> model (meta -> device -> init)
               -> activation checkpointing / compile -> optimizer + LR schedule -> precision
      loop:    for each step: fetch the micro-batches -> train_step (forward/backward per
               micro-batch, loss normalised by the step's token count) -> unscale -> clip ->
               optimizer step -> schedule step; log every `log_every`, validate every `eval_every`
      finish:  final validation + perplexity, sample text, weights (safetensors) + metrics on disk

Checkpoints (lmforge.ckpt): `setup` resumes from the newest valid checkpoint (checkpoint.resume =
"auto"); the loop saves every `checkpoint.every_steps` steps / `every_minutes` minutes in the
background. The spike guard (lmforge.train.guard) sits between clipping and the optimizer step: a
non-finite or k-sigma loss / grad norm skips the update; repeated skips roll back to the last
checkpoint and skip the offending batches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lmforge.ckpt import trainer_io
from lmforge.folders import RUN_FILES, check_target
from lmforge.config import Config, ConfigError, to_toml
from lmforge.data.loader import PackedLoader, open_tokens
from lmforge.data.prepare import PreparedData, load_prepared, prepare_default, unigram_entropy
from lmforge.data.shards import TokenShards
from lmforge.eval.generate import generate_text
from lmforge.eval.perplexity import evaluate_loss
from lmforge.model.transformer import Transformer, build_model, count_params, flops_per_token
from lmforge.optim.optimizers import build_optimizer
from lmforge.optim.schedules import BatchRampup, build_scheduler
from lmforge.parallel.distributed import (DistInfo, all_reduce_sum, all_reduce_sum_group, apply_ddp, apply_fsdp,
                                          clip_grad_norm, clip_grad_norm_model_parallel, destroy_distributed,
                                          init_distributed, layout_kind, wrap_optimizer_zero1)
from lmforge.train.activation_ckpt import apply_activation_checkpointing
from lmforge.train.guard import SpikeGuard
from lmforge.train.metrics import HealthMonitor, MetricsWriter, Timers, format_duration, make_sinks, memory_gb
from lmforge.train.profiler import StepProfiler, device_peak, format_flops
from lmforge.train.progress import Progress, is_rank0
from lmforge.train.precision import make_precision, resolve_precision

log = logging.getLogger("lmforge.train")


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device = {name!r} but no CUDA device is available; use 'cpu' or 'auto'.")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cache_dir(cfg: Config) -> Path:
    return Path(os.environ.get("LMFORGE_CACHE", cfg.data.cache_dir)).expanduser()


def prepare_data(cfg: Config) -> PreparedData:
    """Corpus -> tokenizer -> train/val token shards (cached; instant on the second run)."""
    if cfg.data.corpus != "default":
        path = Path(cfg.data.corpus).expanduser()
        if not (path / "prepare.json").is_file():
            raise ValueError(
                f"data.corpus = {cfg.data.corpus!r} is neither 'default' nor a folder written by "
                f"`lmforge prepare` (no prepare.json there); run `lmforge prepare --config C` first.")
        return load_prepared(path)
    return prepare_default(cache_dir(cfg), tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab_size,
                           val_fraction=cfg.data.val_fraction)


def check_out_dir(out_dir: Path) -> None:
    """Refuse a run folder that is another kind of lmforge/transformers folder: a run writes
    config.toml, tokenizer.json and model.safetensors there, which would clobber its files."""
    try:
        check_target(out_dir, "run", RUN_FILES, "train.out_dir")
    except ValueError as e:
        raise ConfigError(str(e)) from None


class Trainer:
    def __init__(self, cfg: Config, out_dir: str | Path | None = None, data: PreparedData | None = None):
        self.cfg = cfg.validate()
        self.out_dir = Path(out_dir or cfg.train.out_dir.format(preset=cfg.preset))
        self._data = data

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        # parallel layout: process group + mesh under torchrun (validated first), else nothing
        self.dist: DistInfo = init_distributed(cfg)
        self.layout = layout_kind(cfg)
        self.device = self.dist.device if self.dist.distributed else resolve_device(t.device)
        seed_everything(t.seed)
        rank0 = is_rank0()
        check_out_dir(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if rank0:
            (self.out_dir / "config.toml").write_text(to_toml(cfg))

        # data (rank 0 prepares/caches first, the others then read the cache)
        if self.dist.distributed and self._data is None and not rank0:
            torch.distributed.barrier()
        self.data = self._data or prepare_data(cfg)
        if self.dist.distributed and self._data is None and rank0:
            torch.distributed.barrier()
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.data.tokenizer.vocab_size} tokens but model.vocab_size = "
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least that (a multiple of 64 is fastest).")
        if rank0:
            shutil.copyfile(self.data.tokenizer_path, self.out_dir / "tokenizer.json")
        self.train_shards = open_tokens(self.data.train_dir)  # one shard set, or a weighted mixture
        self.val_shards = TokenShards(self.data.val_dir)
        # rank r of W data-parallel ranks takes global samples r, r+W, ... (the 1-rank order, split)
        self.loader = PackedLoader(self.train_shards, cfg.data.seq_len, t.micro_batch_size, seed=t.seed,
                                   rank=self.dist.dp_rank, world_size=self.dist.dp_size,
                                   mask_doc_boundaries=cfg.data.mask_doc_boundaries,
                                   eos_id=self.data.tokenizer.eos_id)
        ft = cfg.finetune
        self.val_instruct = None
        if ft.data:  # supervised fine-tuning: prompt/response rows, loss on the response only
            from lmforge.data.instruct import InstructLoader

            sft = dict(tokenizer=self.data.tokenizer, seq_len=cfg.data.seq_len, batch_size=t.micro_batch_size,
                       rank=self.dist.dp_rank, world_size=self.dist.dp_size, pack=ft.pack)
            self.loader = InstructLoader(ft.data, seed=t.seed, **sft)
            if ft.val_data:
                self.val_instruct = InstructLoader(ft.val_data, seed=0, **sft)

        # model: built on the meta device, materialised and initialised on the target device
        self.model: Transformer = build_model(cfg.model, self.device, seed=t.seed)
        if ft.init_from:  # fine-tuning: pre-trained weights (lmforge run, HF folder or safetensors)
            from lmforge.train.finetune import load_pretrained

            load_pretrained(self.model, ft.init_from)
        if ft.lora_rank:  # before activation checkpointing / compile / DDP / FSDP wrap the blocks
            from lmforge.model.lora import apply_lora

            adapted = apply_lora(self.model, ft.lora_targets, ft.lora_rank, ft.lora_alpha, ft.lora_dropout, seed=t.seed)
            log.info("LoRA: rank %d on %d layers; %s trainable parameters", ft.lora_rank, len(adapted),
                     f"{sum(p.numel() for p in self.model.parameters() if p.requires_grad):,}")
        self.n_params = self.model.num_params()
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        if t.fp8:  # torchao Float8Linear in the blocks (before AC, compile and FSDP)
            from lmforge.train.fp8 import apply_fp8

            log.info("fp8: %d block linears converted to torchao Float8Linear", apply_fp8(self.model, self.device))
        # model parallelism (before activation checkpointing / compile, which rename the modules):
        # pipeline split (this rank keeps its stages' modules), then tensor-parallel sharding
        self.model_parallel = cfg.parallel.tp > 1 or cfg.parallel.pp > 1
        self.pipeline = None
        if self.model_parallel:
            self._apply_model_parallel()
        apply_activation_checkpointing(self.model.blocks, t.activation_checkpoint, t.ac_every)
        if t.compile:
            for block in self.model.blocks.values():
                block.compile()
        precision, reason = resolve_precision(t.precision, self.device)

        # data parallelism: self.model stays the Transformer (FSDP shards it in place);
        # self.train_model is what forward/backward run through (the DDP wrapper for DDP/ZeRO-1)
        self.train_model: torch.nn.Module = self.model
        if cfg.parallel.async_sgd:
            pass  # the parameter server moves parameters and gradients itself (lmforge.parallel.param_server)
        elif cfg.parallel.pp > 1:  # stages wrapped per layout, then the pipeline schedule
            self._build_pipeline(precision)
        elif self.layout in ("ddp", "zero1"):
            self.train_model = apply_ddp(self.model, cfg, self.dist)
        elif self.layout == "fsdp":
            apply_fsdp(self.model, cfg, self.dist, precision)

        # optimizer, schedule, precision
        o, s = cfg.optim, cfg.schedule
        self.optimizer = build_optimizer(
            self.model, o.name, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps,
            momentum=o.momentum, nesterov=o.nesterov, decay_embeddings=o.decay_embeddings,
            fused={"auto": None, "on": True, "off": False}[o.fused],
            **({"muon_lr": o.muon_lr, "muon_momentum": o.muon_momentum} if o.name == "muon" else {}))
        if self.layout == "zero1":
            self.optimizer = wrap_optimizer_zero1(self.optimizer)
        if self.model_parallel:  # foreach kernels need DTensor and plain parameters in separate groups
            from lmforge.parallel.tensor_parallel import split_dtensor_param_groups

            split_dtensor_param_groups(self.optimizer)
        self.scheduler = build_scheduler(
            self.optimizer, schedule=s.name, peak_lr=o.lr, warmup_steps=s.warmup_steps, total_steps=t.steps,
            min_lr_ratio=s.min_lr_ratio, decay_fraction=s.decay_fraction)
        log.info("precision: %s (%s)", precision, reason)
        self.precision = make_precision(precision, self.device)
        self.rampup = None
        if s.batch_rampup_start:
            self.rampup = BatchRampup(s.batch_rampup_start, t.global_batch_size, s.batch_rampup_tokens,
                                      s.batch_rampup_increment or t.micro_batch_size * cfg.parallel.dp,
                                      cfg.data.seq_len)
        self.step = 0
        self.tokens_seen = 0
        # operability: metrics (JSONL + TensorBoard/W&B, rank 0), health signals, timers, profiler
        self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl", make_sinks(
            self.out_dir, t.tensorboard and rank0, t.wandb and rank0, cfg.to_dict(), self.out_dir.name), enabled=rank0)
        self.health = HealthMonitor(t.spike_threshold, t.health_window, t.grad_growth_factor)
        self.timers = Timers()  # `with self.timers("checkpoint"):` around blocking saves -> ckpt_s
        self.profiler = StepProfiler(t.profile_steps, self.out_dir / "profile", self.device)
        self._peak = None

        # fault tolerance: spike guard, checkpoint manager, resume (every rank, same decisions)
        g = cfg.guard
        self.guard = SpikeGuard(g.sigma, g.window, g.min_history, g.rollback_after) if g.enabled else None
        self.batches_drawn = 0          # step-batches taken from the loader (skipped ones included)
        self.skip_batches: set[int] = set()  # batch indices that rolled the run back: never trained on
        self.rollbacks = 0
        self.last_loss = float("nan")
        self._skipped_batches: list[int] = []  # batch indices of the current run of skipped steps
        self._rollback_requested = False
        self.ckpt = trainer_io.make_manager(self)
        self.resumed_from = trainer_io.resolve_resume(self)
        if self.resumed_from is not None:
            trainer_io.load_checkpoint(self, self.resumed_from)

    # ------------------------------------------------------------------------------------------
    # one optimizer step
    # ------------------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: forward/backward over the micro-batches, then the update.

        Returns (mean loss, grad norm) as tensors: reading them forces a host sync, so the loop
        does it only when it logs (the spike guard, when enabled, reads both once per step).
        """
        loss = self.forward_backward(micro_batches)
        grad_norm = self.optimizer_update(loss)
        return loss, grad_norm

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns the step's mean token loss.

        Each micro-batch's loss is its summed token NLL divided by the number of target tokens
        in the *whole step*, so the accumulated gradient is exactly that of one big batch (also
        when -100 targets make micro-batches unequal).

        Data parallel: the token count is all-reduced (SUM) over the dp ranks first, so it is the
        count of the whole *global* step. DDP and FSDP average gradients over the dp ranks, so each
        rank's loss is also multiplied by the dp size: mean_r(dp * nll_r / N) = sum_r(nll_r) / N,
        the one-big-batch gradient, also when ranks hold different numbers of target tokens. The
        returned loss is all-reduced too (the global step's mean token loss, equal on all ranks).
        """
        if self.model_parallel:
            return self.forward_backward_model_parallel(micro_batches)
        n_tokens = sum((y != -100).sum() for _, y in micro_batches)
        dp = self.dist.dp_size if self.dist.distributed else 1
        if dp > 1:
            n_tokens = all_reduce_sum(n_tokens.to(self.device))
        n_tokens = n_tokens.clamp(min=1)
        loss_sum = torch.zeros((), device=self.device)
        ddp = self.train_model is not self.model  # a DDP wrapper: skip the all-reduce until the last micro-batch
        for i, (x, y) in enumerate(micro_batches):
            sync = (not ddp) or i == len(micro_batches) - 1
            with (contextlib.nullcontext() if sync else self.train_model.no_sync()):
                loss = self.token_nll_sum(x, y) / n_tokens
                self.precision.scaler.scale(loss * dp if dp > 1 else loss).backward()
            loss_sum += loss.detach()
        if dp > 1:
            all_reduce_sum(loss_sum)
        return loss_sum

    def token_nll_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Summed token NLL (fp32) of one micro-batch through `train_model`. With train.loss_chunk the
        model computes it fused with the output projection, chunk by chunk (no [B, T, vocab] logits)."""
        chunk = self.cfg.train.loss_chunk
        with self.precision.autocast():
            if chunk:
                return self.train_model(x, targets=y, loss_chunk=chunk)
            logits = self.train_model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")

    def optimizer_update(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """Unscale (fp16) -> clip the global grad norm -> guard -> step -> zero grads -> advance the LR."""
        opt, scaler = self.optimizer, self.precision.scaler
        scaler.unscale_(opt)  # true gradients before clipping (a no-op unless fp16)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        if self.model_parallel:  # TP / FSDP shards and pipeline stages: one norm of the whole model
            grad_norm = clip_grad_norm_model_parallel(list(self.model.parameters()), clip, self.dist)
        elif self.layout == "fsdp":  # DTensor shards: the norm is reduced over all shards
            grad_norm = clip_grad_norm(list(self.model.parameters()), clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=True)
        if self.guard is not None and loss is not None and not self.guard_allows(float(loss), float(grad_norm)):
            scaler.update()  # (fp16) still adapt the loss scale to an overflow
        else:
            scaler.step(opt)  # skips the update if fp16 gradients overflowed
            scaler.update()
        opt.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    def guard_allows(self, loss: float, grad_norm: float) -> bool:
        """The spike guard's verdict on this step (same on every rank: global loss and norm)."""
        if self.precision.name == "fp16" and math.isfinite(loss) and not math.isfinite(grad_norm):
            return True  # an fp16 overflow: the GradScaler skips the step and lowers its scale
        verdict = self.guard.check(loss, grad_norm)
        if not verdict.skip:
            self._skipped_batches.clear()
            return True
        self._skipped_batches.append(self.batches_drawn - 1)
        self.log_event({"step": self.step + 1, "event": "skipped_update", "loss": loss, "grad_norm": grad_norm,
                        "batch": self.batches_drawn - 1,
                        "message": f"step {self.step + 1}: update skipped ({verdict.reason})"})
        self._rollback_requested = verdict.rollback
        return False

    def log_event(self, event: dict) -> None:
        """An event (skipped update, rollback, checkpoint, ...) into metrics.jsonl and the log."""
        if not is_rank0():
            return
        rec = {"step": self.step, **event}
        self.metrics.write(rec)
        self.metrics.flush()
        if event.get("event") not in ("checkpoint", "backup"):  # (those log their own info line)
            log.warning("%s", event.get("message", event.get("event")))

    def rollback(self) -> None:
        """Repeated bad steps: reload the last checkpoint and never train on the offending batches."""
        bad = list(self._skipped_batches)
        self.skip_batches.update(bad)
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
        self.rollbacks += 1
        if self.rollbacks > self.cfg.guard.max_rollbacks:
            raise FloatingPointError(
                f"training rolled back {self.rollbacks - 1} times and still produces bad steps (last batches {bad}); "
                f"lower optim.lr, raise optim.warmup, or use precision = 'bf16'.")
        skipped = self.guard.n_skipped
        trainer_io.load_checkpoint(self, path)  # (keeps the larger rollback count and the union of skips)
        self.guard.n_skipped = skipped
        self.log_event({"event": "rollback", "to_step": self.step, "path": str(path), "skip_batches": bad,
                        "message": f"rolled back to {path.name} (step {self.step}); batches {bad} will be skipped"})

    def checkpoint_due(self, last_save_time: float) -> bool:
        """Periodic checkpoint now? (step count, or rank 0's clock, read at log steps and broadcast)"""
        c = self.cfg.checkpoint
        if c.every_steps and self.step % c.every_steps == 0:
            return True
        if c.every_minutes > 0 and self.step % self.cfg.train.log_every == 0:  # (at log steps: no extra sync)
            due = torch.tensor([1 if time.time() - last_save_time >= 60 * c.every_minutes else 0])
            if self.dist.distributed:
                torch.distributed.broadcast(due, src=0)
            return bool(due.item())
        return False

    # ---- model parallelism (tensor / pipeline), see lmforge/parallel/{tensor_parallel,pipeline}.py ----

    def _apply_model_parallel(self) -> None:
        """Pipeline split (keep this rank's stages), then TP sharding over the "tp" sub-mesh."""
        from lmforge.parallel.pipeline import split_model
        from lmforge.parallel.tensor_parallel import apply_tensor_parallel

        p = self.cfg.parallel
        self._stage_ids = split_model(self.model, self.cfg, self.dist.pp_rank) if p.pp > 1 else None
        if p.tp > 1:
            apply_tensor_parallel(self.model, self.dist.sub_mesh("tp"), p.sequence_parallel)
            log.info("tensor parallel: %d ranks, %s, vocab-parallel embedding + loss_parallel cross-entropy",
                     p.tp, "sequence parallel" if p.sequence_parallel else "no sequence parallelism")

    def _build_pipeline(self, precision: str) -> None:
        """Wrap each stage chunk for data parallelism (FSDP2 on the dp sub-mesh: sharded over dp_shard,
        replicated over dp_replicate) and build the schedule."""
        from lmforge.parallel.pipeline import PipelineRunner

        cfg = self.cfg

        def wrap(chunk):  # dp_replicate only: FSDP2 on the (dp_replicate, dp_shard=1) mesh = pure replication
            if self.layout in ("fsdp", "ddp"):  # (DDP's bucket rebuild breaks under pipeline schedules)
                return apply_fsdp(chunk, cfg, self.dist, precision)
            return chunk

        self.pipeline = PipelineRunner(self.model, self._stage_ids, cfg, self.dist, wrap,
                                       lambda: self.precision.autocast())

    def forward_backward_model_parallel(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """forward_backward for TP and/or PP layouts: same normalisation (summed token NLL / token count
        of the global step, x dp), the count all-reduced over the *data-parallel* group only (TP ranks
        and pipeline stages share a dp coordinate and read the same data)."""
        from lmforge.parallel.tensor_parallel import loss_parallel_context, to_local_value

        n_tokens = sum((y != -100).sum() for _, y in micro_batches).to(self.device)
        dp = self.dist.dp_size
        if dp > 1:
            all_reduce_sum_group(n_tokens, self.dist.dp_group)
        n_tokens = n_tokens.clamp(min=1)
        if self.pipeline is not None:
            return self.pipeline.step(micro_batches, n_tokens, dp)
        loss_sum = torch.zeros((), device=self.device)
        for x, y in micro_batches:  # TP (+ FSDP on dp_shard): FSDP2 reduces gradients in the last backward
            with loss_parallel_context(self.cfg.parallel.tp):
                with self.precision.autocast():
                    logits = self.train_model(x)  # DTensor sharded over the vocabulary
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                                       reduction="sum") / n_tokens
                (loss * dp if dp > 1 else loss).backward()
            loss_sum += to_local_value(loss.detach())
        if dp > 1:
            all_reduce_sum_group(loss_sum, self.dist.dp_group)
        return loss_sum

    def eval_model(self) -> torch.nn.Module:
        """The model evaluation and sampling run on: the training model, or for TP / PP a full
        unsharded copy gathered on every rank (rebuilt when the step changed)."""
        if not self.model_parallel:
            return self.model
        if getattr(self, "_gathered_at", None) != self.step:
            self._gathered = build_model(self.cfg.model, self.device, seed=self.cfg.train.seed)
            state, ft = self.full_state_dict(), self.cfg.finetune
            if ft.lora_rank:  # the same function as the adapted model in eval mode (no dropout)
                from lmforge.model.lora import merged_state_dict

                state = merged_state_dict(state, ft.lora_rank, ft.lora_alpha)
            self._gathered.load_state_dict(state)
            self._gathered.tie_weights()
            self._gathered_at = self.step
        return self._gathered

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights of the whole model on every rank (a collective): DTensor shards (TP,
        FSDP) are all-gathered, pipeline stages exchanged over the pp group."""
        from torch.distributed.tensor import DTensor

        state = {}
        for name, t in self.model.state_dict().items():
            t = t.full_tensor() if isinstance(t, DTensor) else t
            state[name] = t.detach().cpu()
        if self.cfg.parallel.pp > 1:
            parts: list = [None] * self.cfg.parallel.pp
            torch.distributed.all_gather_object(parts, state, group=self.dist.group("pp"))
            state = {k: v for part in parts for k, v in part.items()}
        return state

    def global_batch_now(self) -> int:
        """Global batch (sequences) of the next step: the target, or the ramp-up's current value."""
        if self.rampup is None:
            return self.cfg.train.global_batch_size
        return self.rampup.batch_at(self.tokens_seen)

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for the next step (more of them as a batch ramp-up grows);
        batches that once rolled the run back are drawn and dropped."""
        while self.batches_drawn in self.skip_batches:
            self._draw_micro_batches()
            self.log_event({"event": "skipped_batch", "batch": self.batches_drawn - 1,
                            "message": f"batch {self.batches_drawn - 1} skipped (it caused a rollback)"})
        return self._draw_micro_batches()

    def _draw_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t = self.cfg.train
        self.batches_drawn += 1
        out = []
        for _ in range(self.global_batch_now() // (t.micro_batch_size * self.cfg.parallel.dp)):
            x, y = self.loader.next_batch()
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    def evaluate(self) -> dict[str, float]:
        batches = self.val_loader_batches()
        return evaluate_loss(self.eval_model(), batches, self.precision.autocast, self.device)

    def val_loader_batches(self):
        if self.val_instruct is not None:
            return self.val_instruct.iter_eval_batches(self.cfg.train.eval_batches)
        loader = PackedLoader(self.val_shards, self.cfg.data.seq_len, self.cfg.train.micro_batch_size, seed=0)
        return loader.iter_eval_batches(self.cfg.train.eval_batches)

    # ------------------------------------------------------------------------------------------
    # the run
    # ------------------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        try:
            if self.cfg.parallel.async_sgd:  # asynchronous SGD: its own loop (parameter server + workers)
                from lmforge.parallel.param_server import fit_async

                return fit_async(self)
            return self._fit()
        finally:
            if getattr(self, "ckpt", None) is not None:
                self.ckpt.close()  # never leave a save half-written behind an exception
            if getattr(self, "dist", None) is not None and self.dist.distributed:
                destroy_distributed()

    def _fit(self) -> TrainResult:
        if not is_rank0():
            log.setLevel(logging.WARNING)  # only rank 0 prints progress and info lines
        self.setup()
        if not is_rank0():
            log.setLevel(logging.WARNING)
        cfg, t = self.cfg, self.cfg.train
        counts = count_params(cfg.model)
        entropy = unigram_entropy(self.train_shards)
        log.info("model: %s parameters (%s non-embedding), %.1f MFLOPs/token (6N + 12*L*d*s)",
                 f"{self.n_params:,}", f"{counts['non_embedding']:,}", self.flops_per_token / 1e6)
        log.info("data: %s train tokens, %s val tokens, vocab %d; unigram entropy %.3f nats (a model that "
                 "learned nothing but token frequencies)", f"{len(self.train_shards):,}",
                 f"{len(self.val_shards):,}", self.data.tokenizer.vocab_size, entropy)
        log.info("batch: %d sequences x %d tokens = %s tokens/step (micro-batch %d x %d accumulation); %s, "
                 "device %s, %d threads", t.global_batch_size, cfg.data.seq_len, f"{cfg.tokens_per_step:,}",
                 t.micro_batch_size, cfg.grad_accum_steps, self.precision.name, self.device, torch.get_num_threads())

        peak = self.peak
        log.info("mfu: 6N + 12*L*d*s = %.1f MFLOPs/token against %s per device (%s)",
                 self.flops_per_token / 1e6, format_flops(peak.flops), peak.source)
        if self.resumed_from is not None:
            done = " (the run is already complete: use --checkpoint.resume none or another --train.out_dir " \
                   "to start over)" if self.step >= t.steps else ""
            log.info("resuming at step %d of %d from %s%s", self.step, t.steps, self.resumed_from, done)
        progress = Progress(t.steps, t.progress, initial=self.step)
        initial = self.evaluate()
        self.metrics.write({"step": self.step, "val_loss": initial["loss"], "val_perplexity": initial["perplexity"]})
        progress.write(f"step {self.step}: val loss {initial['loss']:.4f}, perplexity {initial['perplexity']:.1f}")
        history: list[dict] = []
        pending: list[tuple] = []
        start_time = time.perf_counter()
        window_start, window_tokens, window_steps, window_data, window_eval = start_time, 0, 0, 0.0, 0.0
        start_step, last_save_time = self.step, time.time()

        while self.step < t.steps:
            self.profiler.step_begin(self.step + 1)
            step_tokens = self.global_batch_now() * cfg.data.seq_len
            data_t0 = time.perf_counter()
            batches = self.next_micro_batches()
            data_s = time.perf_counter() - data_t0
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm = self.train_step(batches)
            self.step += 1
            self.profiler.step_end(self.step)
            self.tokens_seen += step_tokens
            window_tokens += step_tokens
            window_steps += 1
            window_data += data_s
            pending.append((self.step, loss, grad_norm, lr, self.tokens_seen, data_s))

            if self.step % t.log_every == 0 or self.step == t.steps or self._rollback_requested:
                if self.device.type == "cuda":  # the log line's one sync, before timing the window
                    torch.cuda.synchronize(self.device)
                now = time.perf_counter()
                busy = max(now - window_start - window_eval, 1e-9)  # validation time is not training time
                tok_s = window_tokens / busy
                window_stats = {
                    "tokens_per_s": tok_s,
                    "mfu": tok_s * self.flops_per_token / (peak.flops * cfg.parallel.world_size),
                    "step_time_s": busy / window_steps, "data_share": window_data / busy,
                    "ckpt_s": self.timers.take("checkpoint"), "mem_gb": memory_gb(self.device),
                    "elapsed_s": now - start_time}
                window_start, window_tokens, window_steps, window_data, window_eval = now, 0, 0, 0.0, 0.0
                for step, l, g, step_lr, tokens, d_s in pending:  # one host sync per log line, not per step
                    rec = {"step": step, "loss": float(l), "grad_norm": float(g), "lr": step_lr,
                           "tokens": tokens, **window_stats, "data_s": d_s}
                    history.append(rec)
                    self.metrics.write(rec)
                    for event in self.health.update(step, rec["loss"], rec["grad_norm"]):
                        self.metrics.write(event)
                        progress.write(f"warning: {event['message']}", logging.WARNING)
                pending.clear()
                self.metrics.flush()
                self.last_loss = history[-1]["loss"]
                if not math.isfinite(self.last_loss) and self.guard is None:
                    progress.close()
                    raise FloatingPointError(f"loss became {self.last_loss} at step {self.step}; lower optim.lr, "
                                             f"use precision = 'bf16', or enable the guard (guard.enabled).")
                eta = (t.steps - self.step) * (now - start_time) / max(self.step - start_step, 1)
                progress.update(self.step, history[-1], eta)
            if self._rollback_requested:
                self.rollback()
                continue

            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                eval_t0 = time.perf_counter()
                val = self.evaluate()
                window_eval += time.perf_counter() - eval_t0
                self.metrics.write({"step": self.step, "val_loss": val["loss"], "val_perplexity": val["perplexity"]})
                self.metrics.flush()
                progress.write(f"step {self.step}: val loss {val['loss']:.4f}, perplexity {val['perplexity']:.1f}")

            if (self.step < t.steps or not cfg.checkpoint.save_final) and self.checkpoint_due(last_save_time):
                self.last_loss = float(loss)
                trainer_io.save_checkpoint(self)
                last_save_time = time.time()

        progress.close()
        self.profiler.close()
        elapsed = time.perf_counter() - start_time
        final = self.evaluate()
        self.metrics.write({"step": self.step, "val_loss": final["loss"], "val_perplexity": final["perplexity"]})
        log.info("final: val loss %.4f (started at %.4f; unigram entropy %.3f), perplexity %.1f, %s tokens in %s",
                 final["loss"], initial["loss"], entropy, final["perplexity"], f"{self.tokens_seen:,}",
                 format_duration(elapsed))

        sample = ""
        if t.sample_tokens:  # every rank runs it (FSDP forwards are collective); same seed -> same text
            sample = generate_text(self.eval_model(), self.data.tokenizer, t.sample_prompt, t.sample_tokens,
                                   temperature=0.8, top_k=50, seed=t.seed)
            if is_rank0():
                (self.out_dir / "sample.txt").write_text(t.sample_prompt + sample + "\n")
        if cfg.checkpoint.save_final:
            if self.step > start_step or self.resumed_from is None:  # (not if resumed from this very step)
                trainer_io.save_checkpoint(self)
            with self.timers("checkpoint"):
                self.save_final_weights(self.out_dir / "model.safetensors")
        self.ckpt.close()  # the last save is written, validated and backed up before we report

        result = TrainResult(
            steps=self.step, tokens=self.tokens_seen, train_loss=self.last_loss, val_loss=final["loss"],
            val_perplexity=final["perplexity"], initial_val_loss=initial["loss"], unigram_entropy=entropy,
            sample=sample, out_dir=str(self.out_dir), seconds=elapsed,
            tokens_per_second=self.tokens_seen / max(elapsed, 1e-9), history=history)
        summary = {k: v for k, v in result.__dict__.items() if k != "history"}
        summary.update(self.operability_summary(history))
        if is_rank0():
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.close()
        if t.plot and is_rank0():
            try:
                from lmforge.report.plots import plot_runs

                plot_runs([self.out_dir], self.out_dir / "report")
            except ImportError:
                log.info("plots skipped: `pip install matplotlib` to get %s/report/*.png", self.out_dir)
        return result

    def save_final_weights(self, path: Path) -> None:
        """safetensors weights, written by rank 0 only (LoRA adapters folded in unless
        finetune.merge_lora = false). FSDP / TP / PP: the full state dict is gathered first (a
        collective: every rank calls this)."""
        from lmforge.ckpt.export import save_state

        ft = self.cfg.finetune
        if self.model_parallel:  # TP / PP: gathered on every rank (a collective)
            state = self.full_state_dict()
        elif self.layout != "fsdp":
            state = self.model.state_dict()
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if ft.lora_rank and ft.merge_lora:
            from lmforge.model.lora import merged_state_dict

            state = merged_state_dict(state, ft.lora_rank, ft.lora_alpha)
        if is_rank0():
            if self.cfg.model.tie_embeddings:
                state.pop("lm_head.weight", None)  # tied: stored once, as tok_emb.weight
            save_state(state, path)

    # ------------------------------------------------------------------------------------------
    # operability: MFU peak, summary numbers
    # ------------------------------------------------------------------------------------------

    @property
    def peak(self):
        """MFU denominator (lmforge.train.profiler.Peak): catalogue peak on known GPUs, else measured."""
        if self._peak is None:
            self._peak = device_peak(self.device, self.precision.name)
        return self._peak

    def operability_summary(self, history: list[dict]) -> dict:
        """Extra `summary.json` keys: throughput/MFU, time shares, health counts, hardware."""
        import platform

        last = history[-len(history) // 2:] or [{}]  # second half: past warm-up / compilation
        mean = lambda key: sum(r.get(key, 0.0) for r in last) / len(last)
        hw = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
              "device": str(self.device), "device_name": self.peak.device_name, "threads": torch.get_num_threads(),
              "world_size": self.cfg.parallel.world_size}
        return {"mfu": mean("mfu"), "peak_flops": self.peak.flops, "peak_source": self.peak.source,
                "flops_per_token": self.flops_per_token, "n_params": self.n_params,
                "data_share": mean("data_share"), "checkpoint_s": self.timers.total.get("checkpoint", 0.0),
                "peak_mem_gb": memory_gb(self.device), "loss_spikes": self.health.n_spikes,
                "grad_norm_warnings": self.health.n_growth, "hardware": hw,
                "skipped_updates": self.guard.n_skipped if self.guard is not None else 0, "rollbacks": self.rollbacks,
                "checkpoints": {"saves": self.ckpt.saves, "failures": self.ckpt.failures,
                                "blocking_s": self.ckpt.blocking_s, "last": self.ckpt.last_save,
                                "resumed_from": str(self.resumed_from) if self.resumed_from else None}}
