"""Asynchronous SGD through a parameter server, on torch.distributed point-to-point messages.

    torchrun --nproc-per-node 3 -m lmforge train --parallel.dp_replicate 3 --parallel.async_sgd true

Rank 0 is the server: it holds the parameters, the optimizer and the LR schedule. Ranks 1..N-1
are workers; worker w reads data shard w-1 of N-1 (the loader's rank/world size). The loop:

    worker: pull (version v, parameters) -> gradient of one micro-batch (train.micro_batch_size
            sequences, mean token loss) -> push (v, loss, token count, gradient) -> pull again ...
    server: receive a push from *any* worker (blocking recv, any source) -> staleness s = version
            now - v. If s <= parallel.max_staleness: clip + optimizer step + LR step, version += 1;
            else the gradient is DROPPED (not applied). Either way the worker then gets the current
            parameters (a re-pull), so its next gradient is fresh.

``train.steps`` counts applied server updates. The staleness of every received gradient (mean /
max, applied and dropped) and the dropped count go to metrics.jsonl (one record per applied
update, with its staleness and worker) and to summary.json. Validation, the sample text and the
weights are done by the server on its own (plain, unsharded) model.

Messages (tags keep the two directions apart): server -> worker: int64 header [version, stop]
(tag 1), then the flat fp32 parameters (tag 2); worker -> server: float64 header [rank, version,
loss sum, tokens] (tag 3), then the flat fp32 gradient (tag 4). gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import json
import logging
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

log = logging.getLogger("lmforge.parallel")

TAG_HDR_DOWN, TAG_PARAMS, TAG_HDR_UP, TAG_GRAD = 1, 2, 3, 4


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.parameters())  # unique (a tied embedding once), in a fixed order on all ranks


def _flat_params(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _load_flat(params, flat: torch.Tensor) -> None:
    i = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[i:i + n].view_as(p))
            i += n


class ParameterServer:
    def __init__(self, trainer):
        self.t = trainer
        self.params = _params(trainer.model)
        self.n = sum(p.numel() for p in self.params)
        self.device = trainer.device
        self.version = 0

    def _send_params(self, worker: int, stop: bool) -> None:
        dist.send(torch.tensor([self.version, int(stop)], dtype=torch.int64), dst=worker, tag=TAG_HDR_DOWN)
        if not stop:
            dist.send(_flat_params(self.params).cpu(), dst=worker, tag=TAG_PARAMS)

    def _recv_push(self) -> tuple[int, int, float, float, torch.Tensor]:
        hdr = torch.zeros(4, dtype=torch.float64)
        src = dist.recv(hdr, tag=TAG_HDR_UP)  # any worker
        grad = torch.empty(self.n, dtype=torch.float32)
        dist.recv(grad, src=src, tag=TAG_GRAD)
        return src, int(hdr[1]), float(hdr[2]), float(hdr[3]), grad

    def run(self) -> dict:
        t, cfg = self.t, self.t.cfg
        max_stale = cfg.parallel.max_staleness
        workers = list(range(1, t.dist.world_size))
        for w in workers:
            self._send_params(w, stop=False)
        staleness: list[int] = []
        dropped = 0
        history = []
        tokens = 0
        while t.step < cfg.train.steps:
            src, version, loss_sum, n_tok, grad = self._recv_push()
            stale = self.version - version
            staleness.append(stale)
            tokens += cfg.train.micro_batch_size * cfg.data.seq_len
            if stale > max_stale:
                dropped += 1
                t.metrics.write({"event": "stale_gradient_dropped", "step": t.step, "worker": src,
                                 "staleness": stale, "max_staleness": max_stale})
            else:
                _unflatten_grads(self.params, grad.to(self.device))
                lr = t.optimizer.param_groups[0]["lr"]
                grad_norm = t.optimizer_update()
                self.version += 1
                t.step += 1
                t.tokens_seen = tokens
                rec = {"step": t.step, "loss": loss_sum / max(n_tok, 1.0), "grad_norm": float(grad_norm), "lr": lr,
                       "tokens": tokens, "staleness": stale, "worker": src, "dropped": dropped}
                history.append(rec)
                t.metrics.write(rec)
                if t.step % cfg.train.log_every == 0 or t.step == cfg.train.steps:
                    log.info("update %d: loss %.4f (worker %d, staleness %d; mean %.2f, max %d, dropped %d)",
                             t.step, rec["loss"], src, stale, sum(staleness) / len(staleness), max(staleness),
                             dropped)
            self._send_params(src, stop=t.step >= cfg.train.steps)
        # every other worker has one gradient in flight: take it (not applied) and stop the worker
        for _ in range(len(workers) - 1):
            src, *_ = self._recv_push()
            self._send_params(src, stop=True)
        stats = {"staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
                 "dropped": dropped, "received": len(staleness), "max_staleness": max_stale,
                 "workers": len(workers)}
        t.metrics.write({"step": t.step, **stats})
        return {"history": history, **stats}


def _unflatten_grads(params, flat: torch.Tensor) -> None:
    i = 0
    for p in params:
        n = p.numel()
        p.grad = flat[i:i + n].view_as(p).to(p.dtype).clone()
        i += n


def run_worker(trainer) -> None:
    """Pull -> gradient of one micro-batch -> push, until the server says stop."""
    t = trainer
    params = _params(t.model)
    n = sum(p.numel() for p in params)
    hdr = torch.zeros(2, dtype=torch.int64)
    flat = torch.empty(n, dtype=torch.float32)
    while True:
        dist.recv(hdr, src=0, tag=TAG_HDR_DOWN)
        if int(hdr[1]):
            return
        dist.recv(flat, src=0, tag=TAG_PARAMS)
        _load_flat(params, flat.to(t.device))
        x, y = t.loader.next_batch()
        x, y = x.to(t.device), y.to(t.device)
        n_tok = (y != -100).sum().clamp(min=1)
        with t.precision.autocast():
            logits = t.model(x)
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
        t.model.zero_grad(set_to_none=True)
        (nll / n_tok).backward()
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params])
        dist.send(torch.tensor([t.dist.rank, int(hdr[0]), float(nll.detach()), float(n_tok)], dtype=torch.float64),
                  dst=0, tag=TAG_HDR_UP)
        dist.send(grad.cpu(), dst=0, tag=TAG_GRAD)


def fit_async(trainer):
    """Trainer.fit for parallel.async_sgd = true: set up, serve or work, then (server) evaluate, sample,
    save. Returns a TrainResult on every rank (workers: NaN losses, no sample)."""
    from lmforge.data.prepare import unigram_entropy
    from lmforge.eval.generate import generate_text
    from lmforge.train.trainer import TrainResult

    t = trainer
    t.setup()
    cfg = t.cfg
    server = t.dist.rank == 0
    start = time.perf_counter()
    initial = final = {"loss": math.nan, "perplexity": math.nan}
    sample, stats = "", {"history": []}
    if server:
        initial = t.evaluate()
        t.metrics.write({"step": 0, "val_loss": initial["loss"], "val_perplexity": initial["perplexity"]})
        log.info("async SGD: parameter server (rank 0) + %d workers, %d updates of %d sequences each, "
                 "max staleness %d (staler gradients are dropped)", t.dist.world_size - 1, cfg.train.steps,
                 cfg.train.micro_batch_size, cfg.parallel.max_staleness)
        stats = ParameterServer(t).run()
        final = t.evaluate()
        t.metrics.write({"step": t.step, "val_loss": final["loss"], "val_perplexity": final["perplexity"]})
        log.info("async SGD done: val loss %.4f (from %.4f); staleness mean %.2f, max %d; %d of %d gradients "
                 "dropped", final["loss"], initial["loss"], stats["staleness_mean"], stats["staleness_max"],
                 stats["dropped"], stats["received"])
        if cfg.train.sample_tokens:
            sample = generate_text(t.model, t.data.tokenizer, cfg.train.sample_prompt, cfg.train.sample_tokens,
                                   temperature=0.8, top_k=50, seed=cfg.train.seed)
            (t.out_dir / "sample.txt").write_text(cfg.train.sample_prompt + sample + "\n")
        if cfg.checkpoint.save_final:
            from lmforge.ckpt.export import save_weights

            save_weights(t.model, t.out_dir / "model.safetensors")
    else:
        run_worker(t)
    elapsed = time.perf_counter() - start
    history = stats["history"]
    result = TrainResult(
        steps=t.step, tokens=t.tokens_seen, train_loss=history[-1]["loss"] if history else math.nan,
        val_loss=final["loss"], val_perplexity=final["perplexity"], initial_val_loss=initial["loss"],
        unigram_entropy=unigram_entropy(t.train_shards), sample=sample, out_dir=str(t.out_dir), seconds=elapsed,
        tokens_per_second=t.tokens_seen / max(elapsed, 1e-9), history=history)
    if server:
        summary = {k: v for k, v in result.__dict__.items() if k != "history"}
        summary["async_sgd"] = {k: v for k, v in stats.items() if k != "history"}
        (t.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    t.metrics.close()
    return result
