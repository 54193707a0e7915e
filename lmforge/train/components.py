"""What a run is built from, before any parallelism: the data (corpus, tokenizer, shards, loaders)
and the model (built on the meta device, with the source of its weights: initialisation or pre-trained;
LoRA adapters, FP8 linears)."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmforge.config import Config, ConfigError, ScheduleConfig
from lmforge.data.loader import PackedLoader, open_tokens
from lmforge.data.mixture import MixStage, configured_stages, stage_start_samples, stage_starts
from lmforge.data.mixture import stage_plan_lines as mixture_plan_lines
from lmforge.data.prepare import PreparedData, load_prepared, prepare_default
from lmforge.data.shards import TokenShards
from lmforge.folders import PREPARE_RECORD
from lmforge.model.documents import DocumentAttention
from lmforge.model.init import init_source
from lmforge.model.materialise import Source
from lmforge.model.transformer import Transformer
from lmforge.optim.schedules import config_batch_rampup

log = logging.getLogger("lmforge.train")


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
        if not (path / PREPARE_RECORD).is_file():
            raise ValueError(
                f"data.corpus = {cfg.data.corpus!r} is neither 'default' nor a folder written by "
                f"`lmforge prepare` (no {PREPARE_RECORD} there); run `lmforge prepare --config C` first.")
        return load_prepared(path)
    return prepare_default(cache_dir(cfg), tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.tokenizer_vocab_size,
                           val_fraction=cfg.data.val_fraction)


@dataclass
class Loaders:
    train_shards: object  # TokenShards or a TokenMixture
    val_shards: TokenShards
    train: object  # PackedLoader, or an InstructLoader for supervised fine-tuning
    val_instruct: object | None  # held-out instruction data, if any


def prepare_data_once(cfg: Config, dist) -> PreparedData:
    """The dataset, prepared (or read from its cache) by one rank first, then read by the others:
    rank 0 when every rank sees the same cache folder, else each node's local rank 0 (node-local
    disks: every node prepares its own copy)."""
    if not dist.distributed:
        return prepare_data(cfg)
    from lmforge.parallel.mesh import folder_is_shared

    shared = cfg.data.corpus != "default" or folder_is_shared(cache_dir(cfg), dist)
    first = dist.rank == 0 if shared else dist.local_rank == 0
    if not shared and dist.rank == 0:
        log.info("data: the cache %s is not shared by all ranks: each node prepares its own copy", cache_dir(cfg))
    if not first:
        torch.distributed.barrier(group=dist.host_group)
    data = prepare_data(cfg)
    if first:
        torch.distributed.barrier(group=dist.host_group)
    return data


def build_loaders(cfg: Config, data: PreparedData, dp_rank: int, dp_size: int) -> Loaders:
    """This rank's train loader (rank r of W data-parallel ranks takes global samples r, r+W, ...:
    the 1-rank order, split) and the validation data."""
    t, ft = cfg.train, cfg.finetune
    verify = cfg.data.verify_checksums
    train_shards = open_tokens(data.train_dir, verify_checksums=verify)  # one shard set, or a weighted mixture
    val_shards = TokenShards(data.val_dir, verify_checksums=verify)
    for split, shards in (("train", train_shards), ("validation", val_shards)):
        if shards.max_id >= cfg.model.vocab_size:  # (an embedding lookup would fail, or assert on a GPU)
            raise ValueError(
                f"data.corpus: the {split} shards hold token id {shards.max_id} but model.vocab_size = "
                f"{cfg.model.vocab_size}: they were written with a larger vocabulary or are corrupt; re-run "
                f"`lmforge prepare` (data.verify_checksums = 'always' re-hashes every shard at start-up), or raise "
                f"model.vocab_size.")
    d = cfg.data
    loader = PackedLoader(train_shards, d.seq_len, t.micro_batch_size, seed=t.seed, rank=dp_rank,
                          world_size=dp_size, mask_doc_boundaries=d.mask_doc_boundaries,
                          eos_id=data.tokenizer.eos_id, packing=d.packing, packing_buffer=d.packing_buffer,
                          stages=mix_stages(cfg, train_shards))
    val_instruct = None
    if ft.data:  # supervised fine-tuning: prompt/response rows, loss on the response only
        from lmforge.data.instruct import InstructLoader

        sft = dict(tokenizer=data.tokenizer, seq_len=cfg.data.seq_len, batch_size=t.micro_batch_size,
                   rank=dp_rank, world_size=dp_size, pack=ft.pack)
        holdout = 0.0 if ft.val_data else ft.val_fraction  # validation rows held out of finetune.data
        loader = InstructLoader(ft.data, seed=t.seed, holdout=holdout, **sft)
        if ft.val_data or holdout:
            val_instruct = InstructLoader(ft.val_data or ft.data, seed=0, holdout=holdout, split="val",
                                          **{**sft, "rank": 0, "world_size": 1})
    return Loaders(train_shards, val_shards, loader, val_instruct)


def mix_stages(cfg: Config, train_shards) -> list[MixStage]:
    """data.stages as the loader runs them (lmforge.data.mixture.configured_stages), each stage's first
    global sample through the batch schedule (ramp-up included). An unknown source is a ConfigError,
    raised before any model is built."""
    names = list(getattr(train_shards, "names", None) or [""])
    prepared = list(getattr(train_shards, "weights", None) or [1.0])
    rampup = config_batch_rampup(cfg)
    starts = stage_start_samples(stage_starts(cfg.data.stages), cfg.train.global_batch_size,
                                 rampup.batch_at if rampup else None, cfg.data.seq_len)
    return configured_stages(cfg.data.stages, names, prepared, starts)


def stage_schedule(cfg: Config) -> ScheduleConfig:
    """schedule.* with data.stages' learning-rate hook: a stage with lr_decay = true starts the WSD decay
    at its start_step (the decay then spans the rest of the run)."""
    steps = cfg.train.steps
    decay = [st for st in cfg.data.stages if st.lr_decay and st.start_step < steps]
    if not decay:
        return cfg.schedule
    return dataclasses.replace(cfg.schedule, decay_fraction=(steps - decay[0].start_step) / steps)


def stage_plan_lines(cfg: Config, train_shards) -> tuple[list[str], list[str]]:
    """The run header's lines about data.stages over the sources of `train_shards`, and its warnings
    (lmforge.data.mixture.stage_plan_lines; `lmforge plan`: lmforge.data.mixture.plan_for_config)."""
    rampup = config_batch_rampup(cfg)
    end = stage_start_samples([cfg.train.steps], cfg.train.global_batch_size, rampup.batch_at if rampup else None,
                              cfg.data.seq_len)[0]
    sources = list(getattr(train_shards, "shards", None) or [train_shards])
    return mixture_plan_lines(mix_stages(cfg, train_shards), list(getattr(train_shards, "names", None) or [""]),
                              [len(st) for st in sources], cfg.train.steps, end, cfg.data.seq_len,
                              cfg.data.max_epochs)


def document_attention(cfg: Config, eos_id: int | None, train_shards) -> DocumentAttention | None:
    """data.attention = "document" for this corpus (lmforge.model.documents), checked before any model is
    built: documents end at the tokenizer's end-of-document id, which the corpus must have, and it must
    hold more than one document; None for causal attention."""
    d = cfg.data
    if d.attention != "document":
        return None
    if eos_id is None:
        raise ConfigError(f"data.attention = 'document' needs document boundaries, but the tokenizer of "
                          f"data.corpus = {d.corpus!r} has no end-of-document token; prepare the corpus with an "
                          f"eos_token (lmforge prepare) or set data.attention = 'causal'.")
    counts = [s.manifest.get("meta", {}).get("documents") for s in getattr(train_shards, "shards", [train_shards])]
    if all(isinstance(n, int) for n in counts) and sum(counts) <= 1:
        raise ConfigError(f"data.attention = 'document': data.corpus = {d.corpus!r} holds a single document, so "
                          f"there are no document boundaries to mask; set data.attention = 'causal'.")
    return DocumentAttention(eos_id, restart_positions=d.document_positions == "restart")


def build_training_model(cfg: Config, device: torch.device) -> tuple[Transformer, Source]:
    """The model before parallelism, on the meta device (no memory whatever its size), with LoRA
    adapters and FP8 linears in place (each changes modules that activation checkpointing, compile
    and FSDP later wrap), and the source of its weights: the initialisation by name
    (lmforge.model.init) or, with finetune.init_from, the pre-trained weights read slice by slice
    (adapters initialised). `lmforge.parallel.parallelize` materialises each rank's part from it."""
    t, ft = cfg.train, cfg.finetune
    with torch.device("meta"):
        model = Transformer(cfg.model)
    source = init_source(cfg.model, t.seed)
    if ft.init_from:
        from lmforge.train.finetune import pretrained_source

        source = pretrained_source(cfg.model, ft.init_from, fallback=source)
    if ft.lora_rank:
        from lmforge.model.lora import apply_lora

        adapted = apply_lora(model, ft.lora_targets, ft.lora_rank, ft.lora_alpha, ft.lora_dropout, seed=t.seed)
        log.info("LoRA: rank %d on %d layers; %s trainable parameters", ft.lora_rank, len(adapted),
                 f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,}")
    if t.fp8:
        from lmforge.config.rules import fp8_all_gather
        from lmforge.model.fp8 import apply_fp8

        asked = fp8_all_gather(cfg)
        # (gloo has no float8 type: on the CPU FSDP2 gathers the shards in high precision, the same arithmetic)
        gather = asked and device.type == "cuda"
        how = "; FSDP2 gathers them in FP8" if gather else \
            "; FSDP2 gathers them in high precision on gloo (no float8 type)" if asked else ""
        log.info("fp8: %d block linears converted to torchao Float8Linear (%s scales%s)",
                 apply_fp8(model, device, t.fp8_recipe, gather), t.fp8_recipe, how)
    return model, source
