"""PNG plots of one or several runs (overlaid), from their `metrics.jsonl`. matplotlib, Agg backend.

    plot_runs([run_a, run_b], out_dir) -> {"loss": out_dir/loss.png, "lr": ..., "grad_norm": ..., "throughput": ...}
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from lmforge.folders import METRICS
from lmforge.report.records import TASK_PREFIX, split_metrics, task_metrics

# (expert_load: Mixture-of-Experts runs only; val_sources: runs validated per source of a prepared
# mixture; tasks: runs with train.eval_tasks)
PLOTS = ("loss", "lr", "grad_norm", "throughput", "expert_load", "val_sources", "tasks")



def _window(record: dict, name: str) -> float:
    """A record's `window_<name>` (NaN when absent); runs written before the window fields were named
    so carry it as `<name>`."""
    return record.get(f"window_{name}", record.get(name, float("nan")))

def run_label(run_dir: Path, all_dirs: list[Path]) -> str:
    """Shortest readable name: the folder name, or parent/name when names collide."""
    names = [d.name for d in all_dirs]
    return run_dir.name if names.count(run_dir.name) == 1 else f"{run_dir.parent.name}/{run_dir.name}"


def load_run_metrics(run_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, val, event) records of a run's metrics.jsonl; ([], [], []) without one. Lines that
    are not whole JSON records (the last line of a killed run, a damaged file) are skipped, so
    a report always renders what is readable."""
    records = [rec for rec in _records(run_dir) if "event" in rec or _is_number(rec.get("step"))
               and _is_number(rec.get("val_loss", rec.get("loss")))]
    return split_metrics(records)


def load_task_metrics(run_dir: Path) -> list[dict]:
    """The task records (train.eval_tasks) of a run's metrics.jsonl, by step; [] without any."""
    return task_metrics([rec for rec in _records(run_dir) if _is_number(rec.get("step"))])


def task_names(records: list[dict]) -> list[str]:
    """The tasks that task records score, in first-seen order."""
    names = [k.removeprefix(TASK_PREFIX).rsplit("/", 1)[0] for r in records for k in r if k.startswith(TASK_PREFIX)]
    return list(dict.fromkeys(names))


def _records(run_dir: Path) -> list[dict]:
    """The whole JSON objects of a run's metrics.jsonl (other lines skipped)."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _finite(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if _is_number(y) and math.isfinite(y)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(run_dirs: list[Path], out_dir: Path) -> dict[str, Path]:
    """Write loss.png (train solid, validation dashed with markers), lr.png, grad_norm.png and
    throughput.png (tokens/s, and MFU on a second axis for a single run) into `out_dir`."""
    plt = _pyplot()
    run_dirs = [Path(d) for d in run_dirs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {d: load_run_metrics(d) for d in run_dirs}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths: dict[str, Path] = {}
    single = len(run_dirs) == 1

    def figure(title: str, ylabel: str, log_y: bool = False):
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if log_y:
            ax.set_yscale("log")
        return fig, ax

    def save(fig, ax, name: str, *twins) -> None:
        # one legend for the axes and their twins (a second axis' own legend lands on the first's)
        handles, labels = (sum(x, []) for x in zip(*(a.get_legend_handles_labels() for a in (ax, *twins))))
        if handles:
            ax.legend(handles, labels, fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths[name] = path

    fig, ax = figure("loss (train solid, validation dashed)", "cross-entropy (nats/token)")
    for i, d in enumerate(run_dirs):
        train, val, events = data[d]
        c, label = colors[i % len(colors)], run_label(d, run_dirs)
        xs, ys = _finite([r["step"] for r in train], [r["loss"] for r in train])
        ax.plot(xs, ys, color=c, lw=1.2, alpha=0.9, label=f"{label} train" if single else label)
        xs, ys = _finite([r["step"] for r in val], [r["val_loss"] for r in val])
        if xs:
            ax.plot(xs, ys, color=c, lw=1.5, ls="--", marker="o", ms=4, label=f"{label} val")
        xs, ys = _finite([r["step"] for r in val], [r.get("val_loss_ema") for r in val])
        if xs:  # (train.ema_decay: the EMA of the weights, validated beside them)
            ax.plot(xs, ys, color=c, lw=1.2, ls=":", marker="s", ms=3, label=f"{label} val, EMA")
        spikes = [e for e in events if e.get("event") == "loss_spike" and _is_number(e.get("loss"))
                  and _is_number(e.get("step"))]
        if spikes:
            ax.scatter([e["step"] for e in spikes], [e["loss"] for e in spikes], color=c, marker="x", s=40,
                       label=f"{label} loss spikes")
    save(fig, ax, "loss")

    fig, ax = figure("learning rate", "lr")
    for i, d in enumerate(run_dirs):
        train = data[d][0]
        xs, ys = _finite([r["step"] for r in train], [r.get("lr") for r in train])
        ax.plot(xs, ys, color=colors[i % len(colors)], label=run_label(d, run_dirs))
    save(fig, ax, "lr")

    fig, ax = figure("gradient norm (before clipping)", "L2 norm", log_y=True)
    for i, d in enumerate(run_dirs):
        train = data[d][0]
        xs, ys = _finite([r["step"] for r in train], [r.get("grad_norm") for r in train])
        ax.plot(xs, [max(y, 1e-12) for y in ys], color=colors[i % len(colors)], lw=1, label=run_label(d, run_dirs))
    save(fig, ax, "grad_norm")

    fig, ax = figure("throughput", "tokens/s")
    for i, d in enumerate(run_dirs):
        train = data[d][0]
        ax.plot([r["step"] for r in train], [_window(r, "tokens_per_s") for r in train],
                color=colors[i % len(colors)], label=f"{run_label(d, run_dirs)} tokens/s")
    twins = []
    if single and data[run_dirs[0]][0] and {"window_mfu", "mfu"} & data[run_dirs[0]][0][-1].keys():
        ax2 = ax.twinx()
        train = data[run_dirs[0]][0]
        ax2.plot([r["step"] for r in train], [100 * _window(r, "mfu") for r in train], color="gray",
                 ls=":", label="MFU %")
        ax2.set_ylabel("MFU (%)")
        twins.append(ax2)
    save(fig, ax, "throughput", *twins)
    if any(_moe_layers(data[d][0]) for d in run_dirs):
        plot_expert_load(plt, run_dirs, data, colors, out_dir, paths)
    if any(_val_sources(data[d][1]) for d in run_dirs):
        fig, ax = figure("validation loss per source (the mix's thick)", "cross-entropy (nats/token)")
        styles = ["--", ":", "-.", (0, (5, 1)), (0, (1, 3))]
        for i, d in enumerate(run_dirs):
            val, c, label = data[d][1], colors[i % len(colors)], run_label(d, run_dirs)
            xs, ys = _finite([r["step"] for r in val], [r["val_loss"] for r in val])
            ax.plot(xs, ys, color=c, lw=2.5, marker="o", ms=4, label=f"{label} mix")
            for j, source in enumerate(_val_sources(val)):
                xs, ys = _finite([r["step"] for r in val], [r.get(f"val_loss/{source}") for r in val])
                ax.plot(xs, ys, color=c if not single else colors[(j + 1) % len(colors)], lw=1.2,
                        ls=styles[j % len(styles)], marker=".", label=f"{label} {source}")
        save(fig, ax, "val_sources")
    tasks = {d: load_task_metrics(d) for d in run_dirs}
    if any(tasks.values()):
        fig, ax = figure("downstream tasks: accuracy (solid), byte-normalised (dashed), chance (dotted)", "accuracy")
        k = 0
        for d in run_dirs:
            for name in task_names(tasks[d]):
                c, label = colors[k % len(colors)], f"{run_label(d, run_dirs)} {name}"
                k += 1
                steps = [r["step"] for r in tasks[d]]
                for metric, ls in (("acc", "-"), ("acc_norm", "--"), ("chance", ":")):
                    xs, ys = _finite(steps, [r.get(f"{TASK_PREFIX}{name}/{metric}") for r in tasks[d]])
                    ax.plot(xs, ys, color=c, ls=ls, marker="o" if metric == "acc" else None, ms=3,
                            label=label if metric == "acc" else None)
        save(fig, ax, "tasks")
    return paths


def _val_sources(val: list[dict]) -> list[str]:
    """The sources a run validated on their own (`val_loss/<source>` keys: lmforge.train.validation)."""
    return sorted({k.split("/", 1)[1] for r in val for k in r if k.startswith("val_loss/")})


def _moe_layers(train: list[dict]) -> list[str]:
    """The MoE layers a run's metrics hold (lmforge.parallel.expert_parallel.moe_metrics), by block index."""
    keys = {k.split("/")[1] for r in train for k in r if k.startswith("moe/") and k.endswith("/max_load")}
    return sorted(keys, key=int)


def plot_expert_load(plt, run_dirs: list[Path], data: dict, colors, out_dir: Path, paths: dict) -> None:
    """expert_load.png: each MoE layer's max / mean expert load over the steps (1 = balanced; top), and
    for the first run with MoE layers the share of its first MoE layer's assignments going to each
    expert, step by step (bottom, a heat map)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), dpi=100)
    styles = ["-", "--", ":", "-."]
    for i, d in enumerate(run_dirs):
        train = data[d][0]
        for j, layer in enumerate(_moe_layers(train)):
            xs, ys = _finite([r["step"] for r in train], [r.get(f"moe/{layer}/max_load") for r in train])
            top.plot(xs, ys, color=colors[(i + j) % len(colors)], ls=styles[i % len(styles)], lw=1,
                     label=f"{run_label(d, run_dirs)} block {layer}")
    top.set_title("expert load: busiest expert / mean, per MoE block (1 = balanced)")
    top.set_xlabel("step")
    top.set_ylabel("max / mean load")
    top.grid(True, alpha=0.3)
    if len(top.get_legend_handles_labels()[0]) <= 12:
        top.legend(fontsize=7)
    run = next(d for d in run_dirs if _moe_layers(data[d][0]))
    train = data[run][0]
    layer = _moe_layers(train)[0]
    rows = [(r["step"], r[f"moe/{layer}/tokens_per_expert"]) for r in train if f"moe/{layer}/tokens_per_expert" in r]
    if rows:
        shares = [[c / max(sum(counts), 1) for c in counts] for _, counts in rows]
        image = bottom.imshow([list(col) for col in zip(*shares)], aspect="auto", origin="lower", cmap="viridis",
                              extent=(rows[0][0] - 0.5, rows[-1][0] + 0.5, -0.5, len(shares[0]) - 0.5))
        fig.colorbar(image, ax=bottom, label="share of assignments")
    bottom.set_title(f"{run_label(run, run_dirs)}: block {layer}, share of each expert's assignments")
    bottom.set_xlabel("step")
    bottom.set_ylabel("expert")
    fig.tight_layout()
    path = out_dir / "expert_load.png"
    fig.savefig(path)
    plt.close(fig)
    paths["expert_load"] = path
