"""`lmforge report`: PNG plots (valid images) and an HTML page that references them; runs overlaid."""

from __future__ import annotations

import re

import pytest
import torch

from lmforge.config import load_config
from lmforge.cli.report import report_main
from lmforge.train.trainer import Trainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = {
    "model.vocab_size": 320, "model.dim": 32, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
    "data.seq_len": 32, "data.tokenizer_vocab_size": 320,
    "train.global_batch_size": 8, "train.micro_batch_size": 8, "train.steps": 10, "train.eval_every": 5,
    "train.eval_sequences": 16, "train.log_every": 5, "train.sample_tokens": 8, "train.precision": "fp32",
    "schedule.warmup_steps": 2, "train.progress": "none", "train.tensorboard": False,
}


@pytest.fixture(scope="module")
def runs(small_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    torch.set_num_threads(1)
    out = []
    for name, lr in (("lr-3e-3", 3e-3), ("lr-1e-3", 1e-3)):
        cfg = load_config("tiny", {**SMALL, "optim.lr": lr, "train.plot": name == "lr-3e-3"})
        Trainer(cfg, out_dir=root / name, data=small_data).fit()
        out.append(root / name)
    return out


def assert_valid_png(path):
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_MAGIC, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= 300 and im.size[1] >= 200


def test_training_writes_its_own_plots(runs):
    for name in ("loss", "lr", "grad_norm", "throughput"):
        assert_valid_png(runs[0] / "report" / f"{name}.png")
    assert not (runs[1] / "report").exists()  # train.plot = false


def test_report_compares_runs_in_png_and_html(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert report_main([str(r) for r in runs] + ["--out", str(out)]) == 0
    assert "2 runs" in capsys.readouterr().out
    page = (out / "index.html").read_text()
    srcs = re.findall(r"<img src='([^']+)'", page)
    assert srcs == ["loss.png", "lr.png", "grad_norm.png", "throughput.png"]  # relative references
    for src in srcs:
        assert_valid_png(out / src)
    for run in runs:
        assert run.name in page
        assert (run / "sample.txt").read_text().strip()[:5] in page  # sample text
    assert "[optim]" in page and "lr = 0.003" in page and "lr = 0.001" in page  # both configs
    assert torch.__version__ in page and "platform" in page  # hardware
    assert "val loss" in page and "MFU" in page and "tokens/s" in page  # final metrics
    # ranked by validation loss: the higher LR learns faster in 10 steps and comes first
    first = page.index("<td class='l'>lr-3e-3</td>")
    assert first < page.index("<td class='l'>lr-1e-3</td>")


def test_single_run_report_default_folder_and_embed(runs, tmp_path):
    assert report_main([str(runs[1])]) == 0
    assert (runs[1] / "report" / "index.html").is_file()
    out = tmp_path / "embedded"
    assert report_main([str(runs[1]), "--out", str(out), "--embed"]) == 0
    page = (out / "index.html").read_text()
    assert page.count("src='data:image/png;base64,") == 4


def test_report_of_nothing_is_a_clear_error(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "no run folder" in capsys.readouterr().err


def test_report_of_damaged_or_unfinished_runs_renders_what_is_readable(tmp_path, capsys):
    """A killed run's metrics.jsonl ends in a cut line, an unfinished run has no summary.json, a
    damaged one a garbled one: each used to stop `lmforge report` with a traceback (JSONDecodeError,
    AttributeError on a JSON list). Now each run's page says what is missing and shows the rest."""
    import json

    records = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "window_tokens_per_s": 1000.0}
               for s in (1, 2, 3)] + [{"step": 3, "val_loss": 4.8, "val_perplexity": 121.5}]
    lines = [json.dumps(r) for r in records]
    runs = {"cut": ('{"val_loss": 4.', lines + ['{"step": 4, "loss": 4.']),  # name: (summary.json, metrics)
            "list": ("[4.8]", lines + ["[1, 2]", '{"step": "x"}']),
            "unfinished": (None, lines),
            "odd": ('{"val_loss": "n/a", "hardware": "cpu", "sample": 7}', lines)}
    for name, (summary, metric_lines) in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(metric_lines))
        if summary is not None:
            (tmp_path / name / "summary.json").write_text(summary)
    out = tmp_path / "cmp"
    assert report_main([str(tmp_path / n) for n in runs] + ["--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert "summary.json is unreadable (JSONDecodeError)" in page
    assert "summary.json holds a JSON list, not an object" in page
    assert "no summary.json: the run has not finished" in page
    assert page.count("<td>4.8000</td>") == 4  # every run's validation record (the cut line is skipped)
    for name in ("loss", "lr", "grad_norm", "throughput"):
        assert_valid_png(out / f"{name}.png")
    assert capsys.readouterr().err == ""


def test_no_plot_has_overlapping_legends(runs, tmp_path, monkeypatch):
    """Issue 50 item 6: the single-run throughput plot drew an MFU legend over the tokens/s legend.
    Every figure the report draws (one run, and two overlaid) has legends whose boxes do not meet."""
    from matplotlib.figure import Figure

    from lmforge.report.plots import plot_runs

    seen = {}
    real = Figure.savefig

    def record(fig, path, *a, **kw):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [lg.get_window_extent(renderer) for ax in fig.axes if (lg := ax.get_legend()) is not None]
        seen[str(path)] = boxes
        return real(fig, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", record)
    plot_runs([runs[0]], tmp_path / "one")
    plot_runs(runs, tmp_path / "two")
    assert len(seen) == 8
    for path, boxes in seen.items():
        assert boxes, f"{path}: no legend"
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), f"{path}: legends overlap"
    # the single run's throughput legend names both curves
    one = [p for p in seen if p.endswith("one/throughput.png")]
    assert len(seen[one[0]]) == 1


def test_routine_events_are_not_health_events(runs, tmp_path):
    """A checkpoint is routine: listed under Events, never styled as a warning under Health events."""
    import json

    run = runs[1]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"event"' in line]
    assert any(e["event"] == "checkpoint" for e in events)
    out = tmp_path / "page"
    assert report_main([str(run), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    assert "<h3>Events</h3>" in page and "<h3>Health events</h3>" not in page
    assert "<li class='warn'>checkpoint" not in page
