"""The training loop, readable top to bottom.

    Trainer(cfg).fit()
      setup:   seed + device -> data (corpus, tokenizer, shards) -> model (meta -> device -> init)
               -> activation checkpointing / compile -> optimizer + LR schedule -> precision
      loop:    for each step: fetch the micro-batches -> train_step (forward/backward per
               micro-batch, loss normalised by the step's token count) -> unscale -> clip ->
               optimizer step -> schedule step; log every `log_every`, validate every `eval_every`
      finish:  final validation + perplexity, sample text, weights (safetensors) + metrics on disk

Parallel layouts, checkpoint/resume and the spike guard plug into the marked places.
"""

from __future__ import annotations

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

from lmforge.config import Config, to_toml
from lmforge.data.loader import PackedLoader
from lmforge.data.prepare import PreparedData, prepare_default, unigram_entropy
from lmforge.data.shards import TokenShards
from lmforge.eval.generate import generate_text
from lmforge.eval.perplexity import evaluate_loss
from lmforge.model.transformer import Transformer, build_model, count_params, flops_per_token
from lmforge.optim.optimizers import build_optimizer
from lmforge.optim.schedules import build_scheduler
from lmforge.train.activation_ckpt import apply_activation_checkpointing
from lmforge.train.metrics import MetricsWriter, format_duration
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
        raise ValueError(
            f"data.corpus = {cfg.data.corpus!r}: only the embedded 'default' corpus is wired into "
            f"`lmforge train` so far; run `lmforge prepare` for your own corpus.")
    return prepare_default(cache_dir(cfg), tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab_size,
                           val_fraction=cfg.data.val_fraction)


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
        self.device = resolve_device(t.device)
        seed_everything(t.seed)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.toml").write_text(to_toml(cfg))

        # data
        self.data = self._data or prepare_data(cfg)
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.data.tokenizer.vocab_size} tokens but model.vocab_size = "
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least that (a multiple of 64 is fastest).")
        shutil.copyfile(self.data.tokenizer_path, self.out_dir / "tokenizer.json")
        self.train_shards = TokenShards(self.data.train_dir)
        self.val_shards = TokenShards(self.data.val_dir)
        # Parallel layouts set rank/world_size here (data-parallel rank, dp degree).
        self.loader = PackedLoader(self.train_shards, cfg.data.seq_len, t.micro_batch_size, seed=t.seed)

        # model: built on the meta device, materialised and initialised on the target device
        self.model: Transformer = build_model(cfg.model, self.device, seed=t.seed)
        self.n_params = self.model.num_params()
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        apply_activation_checkpointing(self.model.blocks, t.activation_checkpoint, t.ac_every)
        if t.compile:
            for block in self.model.blocks.values():
                block.compile()

        # optimizer, schedule, precision
        o, s = cfg.optim, cfg.schedule
        self.optimizer = build_optimizer(
            self.model, o.name, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps,
            momentum=o.momentum, nesterov=o.nesterov, decay_embeddings=o.decay_embeddings)
        self.scheduler = build_scheduler(
            self.optimizer, schedule=s.name, peak_lr=o.lr, warmup_steps=s.warmup_steps, total_steps=t.steps,
            min_lr_ratio=s.min_lr_ratio, decay_fraction=s.decay_fraction)
        precision, reason = resolve_precision(t.precision, self.device)
        log.info("precision: %s (%s)", precision, reason)
        self.precision = make_precision(precision, self.device)
        self.step = 0
        self.tokens_seen = 0
        self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl")

    # ------------------------------------------------------------------------------------------
    # one optimizer step
    # ------------------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step: forward/backward over the micro-batches, then the update.

        Returns (mean loss, grad norm) as tensors: reading them forces a host sync, so callers
        do it only when they log.
        """
        loss = self.forward_backward(micro_batches)
        grad_norm = self.optimizer_update()
        return loss, grad_norm

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns the step's mean token loss.

        Each micro-batch's loss is its summed token NLL divided by the number of target tokens
        in the *whole step*, so the accumulated gradient is exactly that of one big batch (also
        when -100 targets make micro-batches unequal).
        """
        n_tokens = sum((y != -100).sum() for _, y in micro_batches).clamp(min=1)
        loss_sum = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            with self.precision.autocast():
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                                   reduction="sum") / n_tokens
            self.precision.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        return loss_sum

    def optimizer_update(self) -> torch.Tensor:
        """Unscale (fp16) -> clip the global grad norm -> step -> zero grads -> advance the LR."""
        opt, scaler = self.optimizer, self.precision.scaler
        scaler.unscale_(opt)  # true gradients before clipping (a no-op unless fp16)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=True)
        scaler.step(opt)  # skips the update if fp16 gradients overflowed
        scaler.update()
        opt.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(self.cfg.grad_accum_steps):
            x, y = self.loader.next_batch()
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    def evaluate(self) -> dict[str, float]:
        batches = self.val_loader_batches()
        return evaluate_loss(self.model, batches, self.precision.autocast, self.device)

    def val_loader_batches(self):
        loader = PackedLoader(self.val_shards, self.cfg.data.seq_len, self.cfg.train.micro_batch_size, seed=0)
        return loader.iter_eval_batches(self.cfg.train.eval_batches)

    # ------------------------------------------------------------------------------------------
    # the run
    # ------------------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        self.setup()
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

        initial = self.evaluate()
        log.info("step 0: val loss %.4f, perplexity %.1f", initial["loss"], initial["perplexity"])
        history: list[dict] = []
        pending: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []
        start_time = time.perf_counter()
        window_start, window_tokens = start_time, 0
        last_loss = float("nan")

        while self.step < t.steps:
            batches = self.next_micro_batches()
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm = self.train_step(batches)
            self.step += 1
            self.tokens_seen += cfg.tokens_per_step
            window_tokens += cfg.tokens_per_step
            pending.append((self.step, loss, grad_norm, lr))

            if self.step % t.log_every == 0 or self.step == t.steps:
                now = time.perf_counter()
                tok_s = window_tokens / max(now - window_start, 1e-9)
                window_start, window_tokens = now, 0
                for step, l, g, step_lr in pending:  # one host sync per log line, not per step
                    rec = {"step": step, "loss": float(l), "grad_norm": float(g), "lr": step_lr,
                           "tokens": step * cfg.tokens_per_step, "tokens_per_s": tok_s}
                    history.append(rec)
                    self.metrics.write(rec)
                pending.clear()
                last_loss = history[-1]["loss"]
                if not math.isfinite(last_loss):
                    raise FloatingPointError(
                        f"loss became {last_loss} at step {self.step}; lower optim.lr or use precision = 'bf16'.")
                eta = (t.steps - self.step) * (now - start_time) / self.step
                log.info("step %d/%d | loss %.4f | lr %.2e | grad norm %.2f | %s tok/s | eta %s", self.step, t.steps,
                         last_loss, lr, history[-1]["grad_norm"], f"{tok_s:,.0f}", format_duration(eta))

            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                val = self.evaluate()
                self.metrics.write({"step": self.step, "val_loss": val["loss"], "val_perplexity": val["perplexity"]})
                log.info("step %d: val loss %.4f, perplexity %.1f", self.step, val["loss"], val["perplexity"])

        elapsed = time.perf_counter() - start_time
        final = self.evaluate()
        self.metrics.write({"step": self.step, "val_loss": final["loss"], "val_perplexity": final["perplexity"]})
        log.info("final: val loss %.4f (started at %.4f; unigram entropy %.3f), perplexity %.1f, %s tokens in %s",
                 final["loss"], initial["loss"], entropy, final["perplexity"], f"{self.tokens_seen:,}",
                 format_duration(elapsed))

        sample = ""
        if t.sample_tokens:
            sample = generate_text(self.model, self.data.tokenizer, t.sample_prompt, t.sample_tokens,
                                   temperature=0.8, top_k=50, seed=t.seed)
            (self.out_dir / "sample.txt").write_text(t.sample_prompt + sample + "\n")
        if cfg.checkpoint.save_final:
            from lmforge.ckpt.export import save_weights

            save_weights(self.model, self.out_dir / "model.safetensors")

        result = TrainResult(
            steps=self.step, tokens=self.tokens_seen, train_loss=last_loss, val_loss=final["loss"],
            val_perplexity=final["perplexity"], initial_val_loss=initial["loss"], unigram_entropy=entropy,
            sample=sample, out_dir=str(self.out_dir), seconds=elapsed,
            tokens_per_second=self.tokens_seen / max(elapsed, 1e-9), history=history)
        summary = {k: v for k, v in result.__dict__.items() if k != "history"}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.metrics.close()
        return result
