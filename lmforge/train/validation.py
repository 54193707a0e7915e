"""Validation during training: which held-out sequences are scored, how, and what is recorded.

    validation = Validation(cfg, val_shards, val_instruct, documents)
    val = validation.evaluate(layout.inference_model(), precision.autocast, device, loss_chunk)
    metrics.write({"step": step, **validation.record(val)})     # val_loss, val_perplexity, val_loss/<source>

The mix: the first train.eval_sequences validation windows (data.seq_len tokens, consecutive,
unshuffled: the same tokens whatever the micro-batch size, the layout and data.packing), run
micro_batch_size at a time, or the held-out instruction rows of supervised fine-tuning.

Per source: a prepared mixture of several sources (`lmforge prepare`) records where each source's
held-out documents lie in the validation shards (their manifest's meta.sources); each source is then
scored on its own first train.eval_sequences windows (fewer where it holds fewer) at every
validation, recorded as `val_loss/<source>` beside the mix's `val_loss` (metrics.jsonl, TensorBoard,
the report's val_sources.png: lmforge.report.plots). The mix's loss is then the mean of the sources'
losses weighted by the prepared mixture's weights (the windows above would all come from the first
source: the validation shards hold the sources one after the other); a source with less than one
window of held-out tokens is left out of both (the log says so). A folder prepared before those
ranges were recorded validates the mix only, on its first windows (the run log says so).

The model attends as it trains (data.attention: within documents, or causally across them).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch

from lmforge.config import Config
from lmforge.data.loader import PackedLoader
from lmforge.data.shards import source_slices
from lmforge.eval.perplexity import evaluate_loss
from lmforge.model.documents import DocumentAttention

log = logging.getLogger("lmforge.train")


class Validation:
    """The held-out data of a run and how it is scored (module docstring)."""

    def __init__(self, cfg: Config, val_shards, val_instruct=None, documents: DocumentAttention | None = None,
                 train_shards=None):
        self.cfg = cfg
        self.val_shards, self.val_instruct, self.documents = val_shards, val_instruct, documents
        self.sources = []  # (name, TokenSlice) of each source with enough held-out tokens for a window
        names = list(getattr(train_shards, "names", None) or [])
        self.weights = dict(zip(names, getattr(train_shards, "weights", None) or []))  # the prepared mixture's
        if val_instruct is None and len(names) > 1:
            slices = source_slices(val_shards)
            if not slices:
                log.info("validation: %s records no per-source ranges (prepared by an older lmforge): the mix "
                         "only; re-run `lmforge prepare` into a new folder to validate each source", val_shards.dir)
            for part in slices:
                if len(part) > cfg.data.seq_len:
                    self.sources.append((part.name, part))
                else:
                    log.warning("validation: source %r holds %d held-out tokens, fewer than one %d-token window: "
                                "not validated on its own (raise prepare.val_fraction)", part.name, len(part),
                                cfg.data.seq_len)

    def batches(self, shards=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first train.eval_sequences validation sequences of `shards` (default: all of the validation
        data, or the instruction rows), micro_batch_size at a time."""
        n, b = self.cfg.train.eval_sequences, self.cfg.train.micro_batch_size
        source = self.val_instruct if self.val_instruct is not None and shards is None else PackedLoader(
            shards if shards is not None else self.val_shards, self.cfg.data.seq_len, b, seed=0)
        done = 0
        for x, y in source.iter_eval_batches(-(-n // b)):
            take = min(len(x), n - done)
            yield x[:take], y[:take]
            done += take

    def evaluate(self, model, autocast, device: torch.device, loss_chunk: int = 0) -> dict:
        """{"loss", "perplexity"} of `model` (the layout's inference model) on the mix's validation
        sequences, and {"sources": {name: loss}} on each source's."""
        def score(shards=None) -> dict[str, float]:
            return evaluate_loss(model, self.batches(shards), autocast, device, loss_chunk=loss_chunk,
                                 documents=self.documents)

        if not self.sources:
            return score()
        losses = {name: score(part)["loss"] for name, part in self.sources}
        total = sum(self.weights[name] for name in losses)
        mix = sum(self.weights[name] * loss for name, loss in losses.items()) / total
        return {"loss": mix, "perplexity": math.exp(min(mix, 50.0)), "sources": losses}

    @staticmethod
    def record(val: dict) -> dict[str, float]:
        """The metrics.jsonl keys of one validation."""
        return {"val_loss": val["loss"], "val_perplexity": val["perplexity"],
                **{f"val_loss/{name}": loss for name, loss in val.get("sources", {}).items()}}

    @staticmethod
    def line(step: int, val: dict) -> str:
        """The log line of one validation."""
        per = ", ".join(f"{name} {loss:.4f}" for name, loss in val.get("sources", {}).items())
        return (f"step {step}: val loss {val['loss']:.4f}, perplexity {val['perplexity']:.1f}"
                + (f"; per source: {per}" if per else ""))

