"""An IsoFLOP grid (Hoffmann et al. 2022, approach 2's runs, which approach 3 fits too): models of several
sizes from one preset's family, each trained at several compute budgets C for D = C / (6 N) tokens.

A model of the grid is the preset with another width and depth ("DIMxLAYERS"): the heads keep the preset's
head width (n_heads = dim / head_dim) and its ratio of query to key/value heads; everything else (the
family's options: norm, activation, GQA, positions, vocabulary, tied embeddings, MoE) is the preset's.
Each trial trains `round(D / batch tokens)` steps with its cosine (or other) schedule spread over them
(as Hoffmann et al. match the schedule to the run's length), warm-up capped at a tenth of the steps.
N is the non-embedding parameter count (lmforge/spec/scaling_law.py says why), D the tokens actually trained.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config import ConfigError, load_config
from lmforge.model.accounting import count_params


@dataclass(frozen=True)
class GridPoint:
    budget: float  # FLOPs (6 N D) asked for
    dim: int
    n_layers: int
    overrides: dict  # the trial's config keys
    n_params: int  # N: non-embedding parameters
    tokens: int  # D: steps x batch tokens

    @property
    def flops(self) -> float:
        return 6.0 * self.n_params * self.tokens


def parse_models(text: str) -> list[tuple[int, int]]:
    """'64x2,128x4' -> [(64, 2), (128, 4)] (width x depth)."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        dim, sep, layers = item.lower().partition("x")
        if not sep or not dim.isdigit() or not layers.isdigit() or int(dim) < 1 or int(layers) < 1:
            raise ConfigError(f"--models {text!r}: {item!r} is not DIMxLAYERS; use e.g. --models 64x2,96x3,128x4")
        out.append((int(dim), int(layers)))
    if not out:
        raise ConfigError(f"--models {text!r} names no model; use e.g. --models 64x2,96x3,128x4")
    return out


def parse_budgets(text: str) -> list[float]:
    """'1e12,3e12' -> [1e12, 3e12] (FLOPs)."""
    try:
        out = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"--budgets {text!r}: use FLOPs separated by commas, e.g. --budgets 1e12,3e12,1e13") from None
    if not out or any(not b > 0 for b in out):
        raise ConfigError(f"--budgets {text!r}: give one or more budgets > 0 in FLOPs, e.g. --budgets 1e12,3e12")
    return sorted(out)


def shape_overrides(preset_cfg, dim: int, n_layers: int) -> dict:
    """The config keys that make the preset's model DIMxLAYERS (its head width and GQA ratio kept)."""
    m = preset_cfg.model
    head_dim = m.head_dim
    if dim % head_dim:
        raise ConfigError(f"--models: width {dim} is not a multiple of the family's head width {head_dim} "
                          f"(model.dim / model.n_heads of {preset_cfg.preset!r}); use multiples of {head_dim}, or "
                          f"set --model.n_heads to change the head width")
    heads = dim // head_dim
    out = {"model.dim": dim, "model.n_layers": n_layers, "model.n_heads": heads}
    if m.n_kv_heads is not None:
        group = m.n_heads // m.kv_heads
        if heads % group:
            raise ConfigError(f"--models: {heads} heads at width {dim} cannot keep {preset_cfg.preset!r}'s "
                              f"{group} query heads per key/value head; choose a width of a multiple of "
                              f"{group * head_dim}")
        out["model.n_kv_heads"] = heads // group
    return out


def isoflop_grid(config: str, base: dict, models: list[tuple[int, int]], budgets: list[float],
                 min_steps: int = 20) -> tuple[list[GridPoint], list[str]]:
    """The grid's trials (each budget x each model that gets at least `min_steps` steps) and notes on
    the points left out."""
    preset = load_config(config, base)
    batch_tokens = preset.train.global_batch_size * preset.data.seq_len
    warmup = preset.schedule.warmup_steps
    points, notes = [], []
    for budget in budgets:
        for dim, n_layers in models:
            shape = shape_overrides(preset, dim, n_layers)
            cfg = load_config(config, {**base, **shape})
            n = count_params(cfg.model)["non_embedding"]
            steps = round(budget / (6 * n) / batch_tokens)
            if steps < min_steps:
                notes.append(f"{dim}x{n_layers} (N = {n:,}) at {budget:.3g} FLOPs: {steps} steps of {batch_tokens} "
                             f"tokens, fewer than {min_steps}: left out")
                continue
            trial = {**shape, "train.steps": steps, "schedule.warmup_steps": min(warmup, steps // 10)}
            points.append(GridPoint(budget, dim, n_layers, trial, n, steps * batch_tokens))
    if not points:
        raise ConfigError(f"the grid is empty: every model gets fewer than {min_steps} steps; raise --budgets or "
                          f"lower the batch (train.global_batch_size x data.seq_len = {batch_tokens} tokens)")
    return points, notes


def grid_table(points: list[GridPoint]) -> str:
    rows = [("budget (FLOPs)", "model", "N (non-emb.)", "D (tokens)", "steps", "D / N", "6ND")]
    for p in points:
        rows.append((f"{p.budget:.3g}", f"{p.dim}x{p.n_layers}", f"{p.n_params:,}", f"{p.tokens:,}",
                     str(p.overrides["train.steps"]), f"{p.tokens / p.n_params:.1f}", f"{p.flops:.3g}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
