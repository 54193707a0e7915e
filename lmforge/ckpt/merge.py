"""Checkpoint merging: a weighted average of the model weights of saved checkpoints (`lmforge merge`).

    ckpts = select_checkpoints(["runs/wsd"], last=3)                 # or steps=[400, 450, 500], or folders
    merged = merge_checkpoints(ckpts, "runs/wsd-merged", weights=None)   # a run folder

With a warmup-stable-decay schedule, the average of the last checkpoints of the stable phase gives
much of what the decay gives without stopping the run (Megatron-LM's and OLMo-core's checkpoint
merging). Only the model weights are averaged (never the optimizer state): merged = sum_i w_i x
weights_i with the weights `weights` normalised to sum to 1 (default: equal), accumulated in fp32 in
the order the checkpoints are given, and stored in each tensor's own dtype; a tensor that is not
floating point (none in lmforge's models) is taken from the newest checkpoint.

One tensor at a time: each checkpoint's tensor is read whole from its DCP shards
(`WeightReader.of_checkpoint`: torch.distributed.checkpoint's reader, every rank's shard files of a
sharded run, whatever its layout), added into one fp32 accumulator, and the average is streamed into
model.safetensors (lmforge.ckpt.streaming) before the next tensor is read: the peak is one tensor of
the model per checkpoint plus the accumulator, never the model. Checkpoints of any layout merge
(the names and full shapes are the layout-independent ones), and the checkpoints of different
models are refused with the keys that differ.

With `ema`, the checkpoints' EMA of the weights (train.ema_decay: `ema/weights/...`) is averaged
instead (one checkpoint: its EMA as it was at that step); a weight the EMA does not cover (a frozen
one) comes from the model's weights.

The result is a run folder (`lmforge eval`, `generate`, `export` and `finetune.init_from` read it):
config.toml (the newest checkpoint's run config), tokenizer.json (the run's), model.safetensors, and
merge.json recording what was merged (each checkpoint's path, step, weight, loss and tokens seen).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

import lmforge
from lmforge.ckpt.export import WeightReader, checkpoint_ema, save_streaming
from lmforge.ckpt.manager import list_checkpoints, read_meta, verify_checkpoint
from lmforge.config import Config, to_toml
from lmforge.config.loading import build_dataclass
from lmforge.folders import (CHECKPOINTS, CONFIG, MERGE_RECORD, TOKENIZER, WEIGHTS, atomic_write, check_target,
                             folder_kind)

log = logging.getLogger("lmforge.ckpt")

# model settings that do not change the weights' names, shapes or meaning (as lmforge.ckpt.checkpointer's)
_SAME_WEIGHTS_MODEL_KEYS = ("dropout", "init_std")


@dataclass
class Checkpoint:
    path: Path
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def run_dir(self) -> Path | None:
        """The run folder holding it (<run>/checkpoints/step_N), if it is one."""
        run = self.path.parent.parent
        return run if self.path.parent.name == CHECKPOINTS and folder_kind(run) == "run" else None


def select_checkpoints(sources: list[str | Path], last: int | None = None,
                       steps: list[int] | None = None) -> list[Checkpoint]:
    """The checkpoints to merge, oldest first, each verified (checksums): a run folder's newest `last`
    valid ones or those of `steps`, or checkpoint folders given one by one. ValueError says what is
    missing or wrong."""
    sources = [Path(s) for s in sources]
    if not sources:
        raise ValueError("name a run folder (with --last K or --steps a,b,c) or checkpoint folders to merge.")
    runs = [s for s in sources if folder_kind(s) == "run"]
    if runs and len(sources) > 1:
        raise ValueError(f"give one run folder (with --last or --steps) or checkpoint folders, not both: {runs[0]} "
                         f"is a run folder.")
    if runs:
        if (last is None) == (steps is None):
            raise ValueError(f"{runs[0]} is a run folder: choose its checkpoints with --last K or --steps a,b,c.")
        found = {step: path for step, path in list_checkpoints(_checkpoint_root(runs[0]))}
        if steps is not None:
            absent = [s for s in steps if s not in found]
            if absent:
                raise ValueError(f"{runs[0]} has no checkpoint of step(s) {absent}; it has steps {sorted(found)}.")
            paths = [found[s] for s in steps]
        else:
            if last < 1:
                raise ValueError(f"--last {last} must be >= 1.")
            valid = []
            for step in sorted(found, reverse=True):
                try:
                    verify_checkpoint(found[step])
                    valid.append(found[step])
                except ValueError as e:
                    log.warning("merge: skipping %s (%s)", found[step], e)
                if len(valid) == last:
                    break
            if len(valid) < last:
                raise ValueError(f"--last {last}: {runs[0]} has {len(valid)} valid checkpoint(s) (steps "
                                 f"{sorted(found)}); keep more with checkpoint.keep_last / keep_every.")
            paths = valid
    else:
        if last is not None or steps is not None:
            raise ValueError("--last and --steps choose among a run folder's checkpoints; with checkpoint folders, "
                             "name each one.")
        paths = sources
    ckpts = [Checkpoint(p, verify_checkpoint(p)) for p in paths]
    if len({c.path.resolve() for c in ckpts}) < len(ckpts):
        raise ValueError("a checkpoint is named twice; weight it with --weights instead.")
    return sorted(ckpts, key=lambda c: c.step)


def _checkpoint_root(run: Path) -> Path:
    """A run folder's checkpoint folder: checkpoint.dir of its config, else <run>/checkpoints."""
    import os

    from lmforge.config import load_config

    c = load_config(str(run / CONFIG), validate=False).checkpoint
    return Path(os.path.expandvars(c.dir)).expanduser() if c.dir else run / CHECKPOINTS


def check_same_model(ckpts: list[Checkpoint], readers: list[WeightReader]) -> None:
    """ValueError naming what differs when the checkpoints are not of one model: the model config
    (but dropout / init_std) and every weight's name, shape and dtype."""
    first = ckpts[-1]
    model = first.meta.get("config", {}).get("model", {})
    for ckpt, reader in zip(ckpts, readers):
        other = ckpt.meta.get("config", {}).get("model", {})
        diffs = [f"model.{k}: {other.get(k)!r} in {ckpt.path}, {model.get(k)!r} in {first.path}"
                 for k in sorted(set(model) | set(other)) if k not in _SAME_WEIGHTS_MODEL_KEYS
                 and model.get(k) != other.get(k)]
        if diffs:
            raise ValueError(f"the checkpoints are of different models ({'; '.join(diffs[:4])}); merge checkpoints "
                             f"of one model only.")
        theirs = {k: (reader.shapes[k], reader.dtypes[k]) for k in reader.shapes}
        ours = {k: (readers[-1].shapes[k], readers[-1].dtypes[k]) for k in readers[-1].shapes}
        if theirs != ours:
            names = sorted(set(theirs) ^ set(ours))
            shapes = [f"{k} {theirs[k]} vs {ours[k]}" for k in sorted(set(theirs) & set(ours)) if theirs[k] != ours[k]]
            raise ValueError(f"{ckpt.path} and {first.path} hold different weights ("
                             + "; ".join([f"names only in one: {names[:4]}"] * bool(names) + shapes[:4])
                             + "); merge checkpoints of one model only.")


def merge_weights(readers: list[WeightReader], weights: list[float], write, names: list[str]) -> None:
    """For each of `names` in order: sum_i weights[i] x reader_i's tensor (fp32 accumulation, in the
    readers' order; the tensor's own dtype), passed to `write(name, tensor)` before the next is read."""
    for name in names:
        dtype = readers[-1].dtypes[name]
        if not dtype.is_floating_point:
            write(name, readers[-1].read(name))
            continue
        acc = None
        for reader, w in zip(readers, weights):
            t = reader.read(name).to(torch.float32)
            acc = t.mul_(w) if acc is None else acc.add_(t, alpha=w)
        write(name, acc.to(dtype))


def normalised(weights: list[float] | None, n: int) -> list[float]:
    """The merge weights (equal when None), checked and divided by their sum."""
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ValueError(f"--weights gives {len(weights)} weights for {n} checkpoints.")
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--weights {weights}: each must be >= 0 and finite, and their sum > 0.")
    return [w / sum(weights) for w in weights]


def merge_checkpoints(ckpts: list[Checkpoint], out: str | Path, weights: list[float] | None = None,
                      overwrite: bool = False, command: str = "", ema: bool = False) -> Path:
    """Average the checkpoints' model weights (`ema`: their EMA of the weights) into the run folder `out`
    (module docstring); returns it."""
    out = Path(out)
    if any(c.run_dir is not None and c.run_dir.resolve() == out.resolve() for c in ckpts):
        raise ValueError(f"--out {out} is the run folder the checkpoints come from; its model.safetensors would be "
                         f"replaced. Choose another --out.")
    check_target(out, "run", (CONFIG, WEIGHTS, TOKENIZER, MERGE_RECORD), "--out", overwrite)
    weights = normalised(weights, len(ckpts))
    readers = [WeightReader.of_checkpoint(c.path) for c in ckpts]
    check_same_model(ckpts, readers)
    if ema:
        readers = [checkpoint_ema(c.path, r) for c, r in zip(ckpts, readers)]
    newest = ckpts[-1]
    cfg = build_dataclass(Config, newest.meta["config"], "")
    cfg.train.out_dir, cfg.checkpoint.dir = str(out), ""  # (the folder is its own run, with no checkpoints yet)
    names = list(readers[-1].shapes)  # (the checkpoint's order: the model's)
    if cfg.model.tie_embeddings and "tok_emb.weight" in readers[-1].shapes:
        names = [n for n in names if n != "lm_head.weight"]  # (stored once, as the embedding: lmforge's weights file)
    out.mkdir(parents=True, exist_ok=True)
    specs = [(n, readers[-1].dtypes[n], readers[-1].shapes[n]) for n in names]
    with save_streaming(out / WEIGHTS, specs) as write:
        merge_weights(readers, weights, write, names)
    atomic_write(out / CONFIG, to_toml(cfg))
    tokenizer = next((c.run_dir / TOKENIZER for c in reversed(ckpts) if c.run_dir and (c.run_dir / TOKENIZER).is_file()),
                     None)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / TOKENIZER)
    else:
        log.warning("merge: no tokenizer.json beside the checkpoints; copy the run's into %s for eval / generate", out)
    record = {"merged": [{"path": str(c.path), "step": c.step, "weight": w, "loss": c.meta.get("loss"),
                          "tokens_seen": c.meta.get("tokens_seen"), "layout": c.meta.get("layout"),
                          "world_size": c.meta.get("world_size")} for c, w in zip(ckpts, weights)],
              "what": f"weighted average of the {'EMA of the ' if ema else ''}model weights (not the optimizer state), "
                      f"fp32 accumulation",
              "tensors": len(names), "command": command, "lmforge_version": lmforge.__version__,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    atomic_write(out / MERGE_RECORD, json.dumps(record, indent=2) + "\n")
    return out

