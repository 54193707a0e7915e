"""One HTML page per report: plots, final metrics, config, hardware, health events and samples.

The page references the PNGs beside it by relative path (move the folder as a whole), or embeds
them as data URIs with `embed=True` (one file that can be mailed around).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
from pathlib import Path
from typing import Any

from lmforge.folders import CONFIG, METRICS, SAMPLE, SUMMARY
from lmforge.report.plots import PLOTS, load_run_metrics, load_task_metrics, plot_runs, run_label, task_names
from lmforge.report.records import TASK_PREFIX

_CSS = """
body { font-family: -apple-system, 'Segoe UI', Roboto, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; font-size: .92em; }
th, td { border: 1px solid #ddd; padding: .3em .6em; text-align: right; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; }
.plots img { width: 49%; min-width: 420px; }
pre { background: #f8f8f8; padding: .8em; overflow-x: auto; font-size: .85em; white-space: pre-wrap; }
.warn { color: #a40; } .muted { color: #777; font-size: .9em; }
"""

FINAL_KEYS = [("val_loss", "val loss", "{:.4f}"), ("val_perplexity", "val ppl", "{:.2f}"),
              ("val_loss_ema", "val loss (EMA)", "{:.4f}"),
              ("train_loss", "train loss", "{:.4f}"), ("initial_val_loss", "initial val loss", "{:.4f}"),
              ("steps", "steps", "{:,}"), ("tokens", "tokens", "{:,}"), ("seconds", "time (s)", "{:.1f}"),
              ("tokens_per_second", "tokens/s", "{:,.0f}"), ("mfu", "MFU", "{:.2%}"),
              ("data_share", "data time", "{:.1%}"), ("checkpoint_s", "ckpt blocking (s)", "{:.2f}"),
              ("peak_mem_gb", "peak mem (GB)", "{:.2f}"), ("loss_spikes", "loss spikes", "{}"),
              ("grad_norm_warnings", "grad-norm warnings", "{}")]


# events a healthy run logs as it goes (listed plainly under "Events"); every other event (a loss
# spike, a skipped update, a rollback, a failed or invalid checkpoint or backup, ...) is a health event
ROUTINE_EVENTS = frozenset({"checkpoint", "backup", "backup_skipped", "backup_adopted", "restored_from_backup",
                            "preempted"})


def find_runs(paths: list[Path]) -> list[Path]:
    """Run folders (holding metrics.jsonl); a folder without one contributes its sub-folders that
    have one (a sweep folder -> its trials)."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / METRICS).is_file():
            runs.append(p)
        elif p.is_dir():
            runs.extend(sorted(d.parent for d in p.glob(f"*/{METRICS}")))
            runs.extend(sorted(d.parent for d in p.glob(f"*/*/{METRICS}")))
    if not runs:
        raise ValueError(f"no run folder (with {METRICS}) in {', '.join(map(str, paths))}")
    return list(dict.fromkeys(runs))


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return html.escape(str(value))


def read_summary(run_dir: Path) -> tuple[dict, str]:
    """(summary.json of a run, a note when it is missing or unreadable): a report shows what it
    can of an unfinished or damaged run instead of failing."""
    path = Path(run_dir) / SUMMARY
    if not path.is_file():
        return {}, f"no {SUMMARY}: the run has not finished (or was stopped); metrics come from {METRICS}."
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        return {}, f"{SUMMARY} is unreadable ({type(exc).__name__}); final metrics are not shown."
    if not isinstance(data, dict):
        return {}, f"{SUMMARY} holds a JSON {type(data).__name__}, not an object; final metrics are not shown."
    return data, ""


def _number_or_inf(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else math.inf


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tasks_table(records: list[dict]) -> str:
    """The Downstream tasks table of a run (train.eval_tasks): accuracy, byte-normalised accuracy and
    chance of each task at each evaluation; '' without task records."""
    names = task_names(records)
    if not names:
        return ""
    head = "".join(f"<th>{html.escape(n)} acc</th><th>{html.escape(n)} acc_norm</th>" for n in names)
    rows = "".join(f"<tr><td>{r['step']}</td>" + "".join(
        f"<td>{_fmt(r.get(f'{TASK_PREFIX}{n}/acc'), '{:.3f}')}</td><td>{_fmt(r.get(f'{TASK_PREFIX}{n}/acc_norm'), '{:.3f}')}</td>"
        for n in names) + "</tr>" for r in records)
    chance = ", ".join(f"{html.escape(n)} {_fmt(records[-1].get(f'{TASK_PREFIX}{n}/chance'), '{:.3f}')}" for n in names)
    return (f"<h3>Downstream tasks</h3><table><tr><th>step</th>{head}</tr>{rows}</table>"
            f"<p class='muted'>Zero-shot multiple choice scored in training (train.eval_tasks); chance: {chance}.</p>")


def build_report(run_paths: list[Path], out_dir: Path, embed: bool = False, title: str | None = None) -> Path:
    """Plots + `index.html` in `out_dir`; returns the HTML path."""
    runs = find_runs(run_paths)
    out_dir = Path(out_dir)
    pngs = plot_runs(runs, out_dir)
    labels = {r: run_label(r, runs) for r in runs}
    read = {r: read_summary(r) for r in runs}
    summaries = {r: summary for r, (summary, _) in read.items()}
    title = title or (f"lmforge run {labels[runs[0]]}" if len(runs) == 1 else f"lmforge: {len(runs)} runs compared")
    ranked = sorted(runs, key=lambda r: _number_or_inf(summaries[r].get("val_loss")))

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             f"<p class='muted'>generated {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC} from "
             f"{', '.join(html.escape(str(r)) for r in runs)}</p>"]

    parts.append("<h2>Final metrics</h2><table><tr><th class='l'>run</th>"
                 + "".join(f"<th>{h}</th>" for _, h, _ in FINAL_KEYS) + "</tr>")
    for r in ranked:
        s = summaries[r]
        parts.append(f"<tr><td class='l'>{html.escape(labels[r])}</td>"
                     + "".join(f"<td>{_fmt(s.get(k), f)}</td>" for k, _, f in FINAL_KEYS) + "</tr>")
    parts.append("</table><p class='muted'>Ranked by validation loss. MFU = tokens/s x FLOPs/token "
                 "(6N + 12*L*d*s) / device peak; the peak's source is listed under hardware.</p>")

    parts.append("<h2>Plots</h2><div class='plots'>")
    for name in PLOTS:
        if name not in pngs:
            continue
        if embed:
            src = "data:image/png;base64," + base64.b64encode(pngs[name].read_bytes()).decode()
        else:
            src = pngs[name].name  # relative: the PNGs sit beside index.html
        parts.append(f"<img src='{src}' alt='{name}'>")
    parts.append("</div>")

    for r in runs:
        s = summaries[r]
        hw = s.get("hardware") if isinstance(s.get("hardware"), dict) else {}
        parts.append(f"<h2>Run {html.escape(labels[r])}</h2>")
        if read[r][1]:
            parts.append(f"<p class='warn'>{html.escape(read[r][1])}</p>")
        rows = {**hw, "peak FLOP/s": _fmt(s.get("peak_flops"), "{:.3g}"), "peak source": s.get("peak_source", "-"),
                "parameters": _fmt(s.get("n_params"), "{:,}"), "FLOPs/token": _fmt(s.get("flops_per_token"), "{:,.0f}")}
        parts.append("<h3>Hardware</h3><table>" + "".join(
            f"<tr><th class='l'>{html.escape(str(k))}</th><td class='l'>{html.escape(str(v))}</td></tr>"
            for k, v in rows.items()) + "</table>")
        _, val, events = load_run_metrics(r)
        health = [e for e in events if e.get("event") not in ROUTINE_EVENTS]
        routine = [e for e in events if e.get("event") in ROUTINE_EVENTS]
        for title, chosen, css in (("Health events", health, " class='warn'"), ("Events", routine, "")):
            if chosen:
                parts.append(f"<h3>{title}</h3><ul>" + "".join(
                    f"<li{css}>{html.escape(str(e.get('message', e.get('event', ''))))}</li>" for e in chosen[:50])
                    + (f"<li>... {len(chosen) - 50} more</li>" if len(chosen) > 50 else "") + "</ul>")
        if val:
            ema = any("val_loss_ema" in v for v in val)
            parts.append("<h3>Validation</h3><table><tr><th>step</th><th>val loss</th><th>perplexity</th>"
                         + ("<th>val loss, EMA of the weights</th>" if ema else "") + "</tr>"
                         + "".join(f"<tr><td>{v['step']}</td><td>{_fmt(v['val_loss'], '{:.4f}')}</td>"
                                   f"<td>{_fmt(v.get('val_perplexity'), '{:.2f}')}</td>"
                                   + (f"<td>{_fmt(v.get('val_loss_ema'), '{:.4f}')}</td>" if ema else "")
                                   + "</tr>" for v in val)
                         + "</table>")
        parts.append(_tasks_table(load_task_metrics(r)))
        sample = _read_text(r / SAMPLE) or s.get("sample", "")
        if sample:
            parts.append(f"<h3>Sample</h3><pre>{html.escape(str(sample))}</pre>")
        config = _read_text(r / CONFIG)
        if config:
            parts.append(f"<details><summary>config.toml</summary><pre>{html.escape(config)}</pre></details>")
    parts.append("</body></html>")
    out = out_dir / "index.html"
    out.write_text("\n".join(parts), encoding="utf-8")
    return out
