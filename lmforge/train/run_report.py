"""What a run says about itself: the header it logs at start (model, data and the corpus' unigram
entropy, batch, MFU peak, the values it resolved, the checkpoint it resumes), and at the end its
summary.json (TrainResult + throughput, health, hardware, checkpoints) and plots; a complete run
found again reports its summary and trains nothing."""

from __future__ import annotations

import json
import logging
import math
import platform
from dataclasses import dataclass, field

import torch

from lmforge.data.prepare import mixture_entropy, mixture_weights, recorded_unigram_entropy, unigram_counts
from lmforge.eval.generate import generate_text
from lmforge.folders import FAILED_RECORD, REPORT, SAMPLE, SUMMARY, atomic_write
from lmforge.model.transformer import count_params
from lmforge.train.components import stage_plan_lines
from lmforge.train.metrics import memory_gb
from lmforge.train.profiler import format_flops
from lmforge.train.progress import is_rank0

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


@dataclass
class RunFacts:
    """What the run knows of its model and hardware once set up: the parameter count, the training
    FLOPs per token and their rule, the MFU peak (rank 0's), the values it resolved at start
    (lmforge.train.auto.Choice), and the corpus' unigram entropy (once the header counted it)."""

    n_params: int
    flops_per_token: float
    flops_rule: str
    peak: object
    resolved: list = field(default_factory=list)
    entropy: float = math.nan


def corpus_entropy(data, train_shards, dist) -> float:
    """The training corpus' unigram entropy (lmforge.data.prepare.unigram_entropy): the value
    `lmforge prepare` recorded (no data read), else, for a folder prepared before it did, counted
    once over the ranks: each counts 1/world of every source, the counts are summed on the host
    group. No rank reads the corpus while the others wait (ARCHITECTURE.md, "Collectives")."""
    recorded = recorded_unigram_entropy(train_shards)
    if recorded is not None:
        return recorded
    log.info("data: %s records no unigram entropy (prepared by an older lmforge): counting its %s tokens, "
             "1/%d on each rank; re-run `lmforge prepare` to record it", data.train_dir,
             f"{len(train_shards):,}", dist.world_size)
    counts = torch.from_numpy(unigram_counts(train_shards, dist.rank, dist.world_size))
    if dist.distributed:
        torch.distributed.all_reduce(counts, group=dist.host_group)
    return mixture_entropy(counts.numpy(), mixture_weights(train_shards))


def log_header(trainer) -> None:
    """The run's header (every rank: the entropy may be counted collectively), and the corpus' unigram
    entropy into `trainer.facts` (nan for fine-tuning: it is the baseline of pre-training only)."""
    cfg, t, facts = trainer.cfg, trainer.cfg.train, trainer.facts
    counts = count_params(cfg.model)
    ft = cfg.finetune
    entropy = math.nan if ft.data else trainer.corpus_entropy()
    log.info("model: %s parameters (%s non-embedding), %.1f MFLOPs/token (%s)",
             f"{facts.n_params:,}", f"{counts['non_embedding']:,}", facts.flops_per_token / 1e6, facts.flops_rule)
    loaders = trainer.loaders
    if ft.data:  # supervised fine-tuning: say what is trained and validated on, not the corpus
        val = (f"{loaders.val_instruct.num_rows} rows of {ft.val_data}" if ft.val_data else
               f"{loaders.val_instruct.num_rows} rows held out of it (finetune.val_fraction {ft.val_fraction})"
               if loaders.val_instruct is not None else f"data.corpus's validation split")
        log.info("data: supervised fine-tuning on %s: %d rows of <= %d tokens, loss on responses only; "
                 "validation on %s", ft.data, trainer.loader.num_rows, cfg.data.seq_len, val)
    else:
        log.info("data: %s train tokens, %s val tokens, vocab %d; unigram entropy %.3f nats (a model that "
                 "learned nothing but token frequencies)", f"{len(loaders.train_shards):,}",
                 f"{len(loaders.val_shards):,}", trainer.data.tokenizer.vocab_size, entropy)
        lines, warnings = stage_plan_lines(cfg, loaders.train_shards)  # (mixture stages: tokens per source, epochs)
        for line in lines:
            log.info("%s", line)
        for line in warnings:
            log.warning("%s", line)
    if not cfg.parallel.async_sgd:  # (the parameter server's updates are one micro-batch each: it says so)
        log.info("batch: %d sequences x %d tokens = %s tokens/step (micro-batch %d x %d accumulation); %s, "
                 "device %s, %d threads", t.global_batch_size, cfg.data.seq_len, f"{cfg.tokens_per_step:,}",
                 t.micro_batch_size, cfg.grad_accum_steps, trainer.precision.name, trainer.device,
                 torch.get_num_threads())
    log.info("mfu: %.1f MFLOPs/token (%s) against %s per device (%s)", facts.flops_per_token / 1e6,
             facts.flops_rule, format_flops(facts.peak.flops), facts.peak.source)
    for choice in facts.resolved:
        if choice.key != "config" and choice.given != choice.value:
            log.info("resolved: %s", choice.line())
    if trainer.resumed_from is not None:
        done = " (the run is already complete: use --checkpoint.resume none or another --train.out_dir " \
               "to start over)" if trainer.state.step >= t.steps else ""
        log.info("resuming at step %d of %d from %s%s", trainer.state.step, t.steps, trainer.resumed_from, done)
    facts.entropy = entropy


def report_finished(trainer) -> TrainResult:
    """The run in the folder is complete: report its summary, change nothing."""
    cfg, out = trainer.cfg, trainer.out_dir
    summary = trainer.rank0_decides(json.loads((out / SUMMARY).read_text()) if is_rank0() else None)
    command = cfg.command or "lmforge train ..."
    log.info("nothing trained: %s holds this run, already complete (%d of %d steps, validation loss %.4f). "
             "Train it further: %s --train.out_dir %s --train.steps %d; start it over: %s --checkpoint.resume none",
             out, trainer.state.step, cfg.train.steps, summary.get("val_loss", math.nan), command,
             out, 2 * cfg.train.steps, command)
    fields = {f for f in TrainResult.__dataclass_fields__ if f != "history"}
    return TrainResult(**{k: v for k, v in summary.items() if k in fields})


def operability_summary(trainer, history: list[dict]) -> dict:
    """Extra `summary.json` keys: throughput/MFU, time shares, health counts, hardware, checkpoints."""
    facts, steplog, ckpt = trainer.facts, trainer.steplog, trainer.ckpt
    last = history[-len(history) // 2:] or [{}]  # second half: past warm-up / compilation
    mean = lambda key: sum(r.get(key, 0.0) for r in last) / len(last)  # noqa: E731
    hw = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
          "device": str(trainer.device), "device_name": facts.peak.device_name, "threads": torch.get_num_threads(),
          "world_size": trainer.cfg.parallel.world_size}
    return {"mfu": mean("window_mfu"), "peak_flops": facts.peak.flops, "peak_source": facts.peak.source,
            "flops_per_token": facts.flops_per_token, "n_params": facts.n_params, "layout": trainer.layout.name,
            "data_share": mean("window_data_share"), "checkpoint_s": steplog.timers.total.get("checkpoint", 0.0),
            "peak_mem_gb": memory_gb(trainer.device), "loss_spikes": steplog.health.n_spikes,
            "grad_norm_warnings": steplog.health.n_growth, "hardware": hw,
            "skipped_updates": trainer.guard.n_skipped if trainer.guard is not None else 0,
            "rollbacks": trainer.state.rollbacks,
            "checkpoints": {"saves": ckpt.saves, "failures": ckpt.failures,
                            "blocking_s": ckpt.blocking_s, "last": ckpt.last_save,
                            "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None}}


def write_sample(trainer) -> str:
    """train.sample_tokens of text from train.sample_prompt, into SAMPLE (rank 0). Every rank runs it
    (sharded forwards are collective); the same seed gives the same text."""
    t = trainer.cfg.train
    if not t.sample_tokens:
        return ""
    sample = generate_text(trainer.layout.inference_model(), trainer.data.tokenizer, t.sample_prompt,
                           t.sample_tokens, temperature=0.8, top_k=50, seed=t.seed)
    if is_rank0():
        atomic_write(trainer.out_dir / SAMPLE, t.sample_prompt + sample + "\n")
    return sample


def write_summary(trainer, result: TrainResult, extra: dict) -> None:
    """summary.json: `result`, the operability keys, then `extra` (the EMA's and the tasks' scores,
    validation per source, a loop's own keys); rank 0 writes it and a failed attempt's record goes
    (the run is made good); then the plots."""
    out = trainer.out_dir
    summary = {k: v for k, v in result.__dict__.items() if k != "history"}
    summary.update(operability_summary(trainer, result.history))
    summary.update(extra)
    if is_rank0():
        atomic_write(out / SUMMARY, json.dumps(summary, indent=2) + "\n")
        (out / FAILED_RECORD).unlink(missing_ok=True)
    trainer.metrics.close()
    if trainer.cfg.train.plot and is_rank0():
        try:
            from lmforge.report.plots import plot_runs

            plot_runs([out], out / REPORT)
        except ImportError:
            log.info("plots skipped: `pip install matplotlib` to get %s/*.png", out / REPORT)
