"""Which source each training sample comes from: mixture weights, and mixture stages over the run.

The global sample stream (lmforge.data.loader) is cut into *stages* (data.stages): stage i covers the
global samples [G_i, G_{i+1}) and draws its sources with its own weights (a source of weight 0 is not
drawn). Within a stage, the samples come in blocks of ``MIX_BLOCK``: every block holds ``c_s`` samples
of source s (``w_s * MIX_BLOCK`` rounded by largest remainder, at least 1 for a drawn source), spread
evenly through the block in a fixed order (`mixture_block`). Every source keeps one count k of its
samples over the whole run, carried from stage to stage, so it walks through its own epochs whatever
the stages (`MixtureStream.locate`: global index -> (source, k)). The stage starts are global sample
indices computed from the config (`stage_start_samples`: the step where a stage starts times the
global batch, ramp-up included), so the stream is a pure function of the config: a run resumed in
any stage, at any world size, goes on exactly.

A checkpoint records the stages that have begun (`MixStage.record`); a resumed run refuses a config
whose stages differ there (a stage that ran cannot change: its data were trained on), and accepts
stages added after the checkpoint (lmforge.data.loader.PackedLoader.load_state_dict).

`stage_plan` / `format_stage_plan`: the tokens each source gives in each stage and the epochs each
source is repeated over the run (the run header; `lmforge plan`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmforge.config import ConfigError
from lmforge.config.rules import unknown_stage_sources
from lmforge.folders import mixture_entries  # (read by the config check too; lmforge.data.loader imports it here)

MIX_BLOCK = 1000  # samples per mixture block (weights resolved to 1/MIX_BLOCK)


def mixture_block(weights: Sequence[float], block: int = MIX_BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(per-source counts c, block order of source ids, prefix counts (S, block+1)) of positive `weights`."""
    S = len(weights)
    if S == 1:
        block = 1
    block = max(block, S)
    raw = np.asarray(weights, dtype=np.float64) * block
    c = np.maximum(np.floor(raw).astype(np.int64), 1)
    while c.sum() > block:  # the minimum of 1 overshot: take from the largest
        c[np.argmax(c)] -= 1
    rem = raw - np.floor(raw)
    for s in np.argsort(-rem, kind="stable")[: block - int(c.sum())]:
        c[s] += 1
    keys = [((j + 0.5) / c[s], s) for s in range(S) for j in range(int(c[s]))]
    order = np.array([s for _, s in sorted(keys)], dtype=np.int64)
    prefix = np.zeros((S, len(order) + 1), dtype=np.int64)
    for s in range(S):
        prefix[s, 1:] = np.cumsum(order == s)
    return c, order, prefix


@dataclass(frozen=True)
class MixStage:
    """One stage as the loader runs it: its first global sample and its weight per source (the loader's
    source order; normalised, 0 = not drawn); `label` names it in messages; `record` is what a
    checkpoint keeps of it (start step, weights by name, learning-rate hook)."""

    start: int
    weights: tuple[float, ...]
    label: str = "stage 0"
    record: dict = field(default_factory=dict)


class MixtureStream:
    """Global sample index -> (source, the source's own sample index), over the stages."""

    def __init__(self, stages: Sequence[MixStage], n_sources: int) -> None:
        assert stages and stages[0].start == 0, "the first stage starts at sample 0"
        assert all(a.start < b.start for a, b in zip(stages, stages[1:])), [s.start for s in stages]
        self.stages = list(stages)
        self.starts = np.array([s.start for s in stages], dtype=np.int64)
        self.n_sources = n_sources
        self._blocks = []  # per stage: (counts (S,), block order (source ids), prefix (S, block + 1), base (S,))
        base = np.zeros(n_sources, dtype=np.int64)
        for i, stage in enumerate(stages):
            assert len(stage.weights) == n_sources and any(w > 0 for w in stage.weights), stage
            drawn = np.array([s for s, w in enumerate(stage.weights) if w > 0], dtype=np.int64)
            c, order, prefix = mixture_block([stage.weights[s] for s in drawn])
            counts = np.zeros(n_sources, dtype=np.int64)
            counts[drawn] = c
            full = np.zeros((n_sources, prefix.shape[1]), dtype=np.int64)
            full[drawn] = prefix
            self._blocks.append((counts, drawn[order], full, base.copy()))
            if i + 1 < len(stages):
                base = base + self._count(i, stages[i + 1].start - stage.start)

    def _count(self, i: int, n: int) -> np.ndarray:
        """Samples of each source among the first `n` samples of stage i."""
        counts, order, prefix, _ = self._blocks[i]
        blocks, rest = divmod(n, len(order))
        return blocks * counts + prefix[:, rest]

    def stage_of(self, g: int) -> int:
        """The index of the stage global sample `g` belongs to."""
        return int(np.searchsorted(self.starts, g, side="right")) - 1

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, the source's sample index k) of global sample indices `g`."""
        g = np.asarray(g, dtype=np.int64)
        stage = np.searchsorted(self.starts, g, side="right") - 1
        src, k = np.empty_like(g), np.empty_like(g)
        for i in np.unique(stage).tolist():
            sel = stage == i
            counts, order, prefix, base = self._blocks[i]
            blk, pos = np.divmod(g[sel] - self.starts[i], len(order))
            s = order[pos]
            src[sel], k[sel] = s, base[s] + blk * counts[s] + prefix[s, pos]
        return src, k

    def counts_before(self, g: int) -> np.ndarray:
        """Samples of each source among the global samples before `g` (each source's next k)."""
        i = self.stage_of(g)
        return self._blocks[i][3] + self._count(i, g - int(self.starts[i]))

    def begun(self, position: int) -> list[dict]:
        """The records of the stages that have begun by global sample `position` (a sample drawn)."""
        return [s.record for s in self.stages if s.start < position]


def stage_record(start_step: int, names: Sequence[str], weights: Sequence[float], lr_decay: bool = False) -> dict:
    """What a checkpoint keeps of a mixture stage (`MixStage.record`): its start step, its normalised
    weights by source name (0 = not drawn: left out), its learning-rate hook."""
    total = sum(weights)
    rec = {"start_step": int(start_step),
           "weights": {n: round(float(w) / total, 9) for n, w in zip(names, weights) if w > 0}}
    return {**rec, "lr_decay": True} if lr_decay else rec


def configured_stages(specs: Sequence, names: Sequence[str], prepared: Sequence[float],
                      start_samples: Sequence[int]) -> list[MixStage]:
    """data.stages (`specs`, StageConfig) over sources `names` as the loader runs them: before the first
    stage (or without any) the prepared weights `prepared`, labelled "the prepared mixture"; each stage's
    first global sample from `start_samples` (one per `stage_starts(specs)`). A stage naming a source
    that is not among `names` is a ConfigError naming the key."""
    labelled = [(f"data.stages[{i}]", st.name or f"data.stages[{i}]", st) for i, st in enumerate(specs)]
    if not specs or specs[0].start_step > 0:
        labelled.insert(0, ("", "the prepared mixture", None))
    assert len(start_samples) == len(labelled), (len(start_samples), len(labelled))
    out = []
    for (key, label, st), start in zip(labelled, start_samples):
        weights = list(prepared)
        if st is not None and st.weights:
            unknown = sorted(set(st.weights) - set(names))
            if unknown:
                raise ConfigError(unknown_stage_sources(key, st.name, unknown, names))
            weights = [st.weights.get(n, 0.0) for n in names]
        step = st.start_step if st else 0
        out.append(MixStage(int(start), tuple(w / sum(weights) for w in weights), label,
                            stage_record(step, names, weights, bool(st and st.lr_decay))))
    return out


def stage_starts(specs: Sequence) -> list[int]:
    """The start step of each stage `configured_stages` makes of `specs` (the prepared mixture's first)."""
    steps = [st.start_step for st in specs]
    return steps if steps and steps[0] == 0 else [0] + steps


def stage_start_samples(start_steps: Sequence[int], global_batch: int,
                        batch_at: Callable[[int], int] | None = None, seq_len: int = 1) -> list[int]:
    """Global samples before each optimizer step of `start_steps`: steps x global_batch, or, with a
    batch-size ramp-up `batch_at` (tokens seen -> global batch of the next step), the ramp's sum."""
    if batch_at is None:
        return [int(s) * global_batch for s in start_steps]
    out, samples, step = [], 0, 0
    for target in sorted(start_steps):
        while step < target:
            samples += batch_at(samples * seq_len)
            step += 1
        out.append(samples)
    return out


# ---- the plan of the stages ------------------------------------------------------------------------


@dataclass
class StagePlan:
    """Tokens per source per stage and the epochs of each source over the run (`stage_plan`)."""

    names: list[str]
    labels: list[str]
    steps: list[tuple[int, int]]  # per stage: [first step, end step)
    tokens: np.ndarray  # (stages, sources): tokens drawn
    epochs: np.ndarray  # (sources,): tokens drawn over the run / the source's tokens
    warnings: list[str]


def stage_plan(stream: MixtureStream, names: Sequence[str], source_tokens: Sequence[int], step_starts: Sequence[int],
               end_step: int, end_sample: int, seq_len: int, max_epochs: float) -> StagePlan:
    """The stages of `stream` over a run of `end_sample` global samples (`end_step` steps; stage i
    begins at step `step_starts[i]`): tokens each source gives per stage (samples x seq_len), and how
    many times each source is gone through (epochs), with a warning for each source repeated more
    than `max_epochs` times."""
    bounds = [min(int(b), end_sample) for b in stream.starts] + [end_sample]  # (a stage past the end: nothing)
    tokens = np.stack([(stream.counts_before(b) - stream.counts_before(a)) * seq_len
                       for a, b in zip(bounds[:-1], bounds[1:])])
    epochs = tokens.sum(axis=0) / np.maximum(np.asarray(source_tokens, dtype=np.float64), 1)
    warnings = [f"data: source {n!r} is repeated {e:.1f} times over the run (more than data.max_epochs = "
                f"{max_epochs:g}): its {t:,} tokens give {int(d):,}; lower its weights or add data"
                for n, e, t, d in zip(names, epochs, source_tokens, tokens.sum(axis=0)) if e > max_epochs]
    ends = [min(s, end_step) for s in step_starts]
    steps = list(zip(ends, ends[1:] + [end_step]))
    return StagePlan(list(names), [s.label for s in stream.stages], steps, tokens, epochs, warnings)


def stage_plan_lines(stages: Sequence[MixStage], names: Sequence[str], source_tokens: Sequence[int], steps: int,
                     end_sample: int, seq_len: int, max_epochs: float) -> tuple[list[str], list[str]]:
    """Log lines of a run's stages (`stage_plan`: tokens per source per stage, epochs per source) and its
    warnings (a source repeated more than `max_epochs`, a stage not reached); nothing for one source in
    one stage."""
    if len(names) == 1 and len(stages) == 1:
        return [], []
    plan = stage_plan(MixtureStream(stages, len(names)), names, source_tokens,
                      [st.record["start_step"] for st in stages], steps, end_sample, seq_len, max_epochs)
    late = [f"data: {st.label} starts at step {st.record['start_step']}, at or after train.steps = {steps}: "
            f"not reached in this run" for st in stages if st.record["start_step"] >= steps]
    return format_stage_plan(plan), plan.warnings + late


def plan_for_config(cfg, train_dir: Path, batch_at: Callable[[int], int] | None = None) -> tuple[list[str], list[str]]:
    """`stage_plan_lines` of a config over a prepared train mixture folder (<data.corpus>/train), reading
    only its mixture.json and manifests (no torch: `lmforge plan`). `batch_at`: the batch-size ramp-up's
    (lmforge.optim.schedules.BatchRampup.batch_at), None for a constant global batch."""
    from lmforge.data.shards import TokenShards

    entries = mixture_entries(train_dir)
    names = [n for n, _, _ in entries]
    total = sum(w for _, _, w in entries)
    t, d = cfg.train, cfg.data
    starts = stage_start_samples(stage_starts(d.stages) + [t.steps], t.global_batch_size, batch_at, d.seq_len)
    stages = configured_stages(d.stages, names, [w / total for _, _, w in entries], starts[:-1])
    tokens = [len(TokenShards(Path(train_dir) / sub)) for _, sub, _ in entries]
    return stage_plan_lines(stages, names, tokens, t.steps, starts[-1], d.seq_len, d.max_epochs)


def mean_document_tokens(train_dir: Path) -> int:
    """Mean tokens per document of the stream a prepared train mixture's weights draw (a source of weight
    w and L tokens per document gives w / L documents per token), from its manifests' document counts
    (no torch: `lmforge plan`, lmforge.plan.documents); 0 where a source's manifest does not record them."""
    from lmforge.data.shards import TokenShards

    entries = mixture_entries(train_dir)
    total = sum(w for _, _, w in entries)
    per_token = 0.0
    for _, sub, w in entries:
        shards = TokenShards(Path(train_dir) / sub)
        documents = shards.manifest.get("meta", {}).get("documents")
        if not isinstance(documents, int) or documents < 1 or not len(shards):
            return 0
        per_token += w / total * documents / len(shards)
    return round(1 / per_token) if per_token else 0


def format_stage_plan(plan: StagePlan) -> list[str]:
    """Log lines of a `StagePlan`: one per stage reached (its steps, tokens per source), one for the
    epochs (its warnings are `plan.warnings`)."""
    lines = []
    for label, (a, b), row in zip(plan.labels, plan.steps, plan.tokens):
        if a >= b:
            continue
        total = max(int(row.sum()), 1)
        parts = ", ".join(f"{n} {int(t):,} ({t / total:.0%})" for n, t in zip(plan.names, row) if t)
        lines.append(f"data: {label}, steps {a}-{b - 1}: {int(row.sum()):,} tokens: {parts}")
    lines.append("data: epochs per source over the run: " + ", ".join(
        f"{n} {e:.2f}" for n, e in zip(plan.names, plan.epochs)))
    return lines
