"""The CPU's MFU peak cannot be pulled down by a busy machine (issue 61 item 3): the best figure this
machine has shown is cached with its date and used where a start-up measurement reads lower, the
header says which, an unwritable cache never stops a run, and MFU never reads above 100%."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

from lmforge.train import peak as peak_mod, profiler
from lmforge.train.peak import REPS, machine_peak
from lmforge.train.profiler import device_peak

DAY = datetime.date(2026, 11, 29)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "peak.json"
    monkeypatch.setenv("LMFORGE_PEAK_CACHE", str(path))
    return path


def test_a_busy_measurement_gives_way_to_the_machines_cached_best(cache):
    flops, how = machine_peak("cpu | 2 threads | fp32", lambda: 100e9, today=DAY)
    assert flops == 100e9 and how == f"best of {REPS}+, measured now (cached in {cache})"
    assert json.loads(cache.read_text())["cpu | 2 threads | fp32"] == {"flops": 100e9, "date": "2026-11-29",
                                                                         "best_of": REPS, "checked": "2026-11-29"}
    later = DAY + datetime.timedelta(days=3)
    flops, how = machine_peak("cpu | 2 threads | fp32", lambda: 40e9, today=later)
    assert flops == 100e9, "a busy start-up must not lower the peak"
    assert how == f"best of {REPS}+, cached 2026-11-29 in {cache}; measured now 40% of it, the machine is busy"
    assert json.loads(cache.read_text())["cpu | 2 threads | fp32"]["checked"] == later.isoformat()
    nxt = later + datetime.timedelta(days=1)
    assert machine_peak("cpu | 2 threads | fp32", lambda: 150e9, today=nxt)[0] == 150e9  # a better one replaces it
    assert json.loads(cache.read_text())["cpu | 2 threads | fp32"] == {"flops": 150e9, "date": nxt.isoformat(),
                                                                         "best_of": REPS, "checked": nxt.isoformat()}
    assert machine_peak("cpu | 4 threads | fp32", lambda: 7e9)[0] == 7e9  # (another key: its own figure)


def test_the_machine_is_measured_once_a_day(cache):
    """A start-up on a day whose check is recorded takes the cached best without measuring; the next day
    measures again (and may raise it)."""
    calls = []

    def measure(rate):
        return lambda: calls.append(rate) or rate

    assert machine_peak("k", measure(100e9), today=DAY)[0] == 100e9
    flops, how = machine_peak("k", measure(300e9), today=DAY)
    assert flops == 100e9 and calls == [100e9], "measured twice in a day"
    assert how == f"best of {REPS}+, cached 2026-11-29 in {cache} (checked today)"
    assert machine_peak("k", measure(300e9), today=DAY + datetime.timedelta(days=1))[0] == 300e9
    assert calls == [100e9, 300e9]


def test_the_run_header_and_mfu_use_the_cached_peak_not_a_slow_start_up(cache, monkeypatch):
    """The issue's run: 127 GFLOP/s on a quiet day, 50 on a busy one; the run computes 57 GFLOP/s.
    Against the busy figure MFU read 100% (the peak raised to the run's rate); against the cached
    best it reads 45%."""
    rates = iter([127e9, 50e9])
    monkeypatch.setattr(profiler, "measure_matmul_flops", lambda *a, **k: next(rates))
    quiet = device_peak(torch.device("cpu"), "fp32")
    assert quiet.flops == 127e9 and "measured now" in quiet.source
    day_before = (datetime.date.today() - datetime.timedelta(days=1)).isoformat()
    data = json.loads(cache.read_text())  # (the quiet figure from yesterday: today's start-up measures)
    cache.write_text(json.dumps({k: {**v, "checked": day_before} for k, v in data.items()}))
    busy = device_peak(torch.device("cpu"), "fp32")
    assert busy.flops == 127e9 and "cached" in busy.source and "the machine is busy" in busy.source, busy.source
    assert busy.utilisation(57e9) == pytest.approx(57 / 127) and busy.raised_from is None


def test_mfu_never_reads_above_100_percent():
    low = profiler.Peak(50e9, "measured fp32 matmul", "cpu", True)
    assert low.utilisation(57e9) == 1.0 and low.raised_from == 50e9 and "raised from" in low.source
    assert low.utilisation(28.5e9) == pytest.approx(0.5)


@pytest.mark.parametrize("how", ["under a file", "corrupt", "off"])
def test_an_unusable_cache_never_stops_the_run(tmp_path, monkeypatch, how):
    if how == "under a file":
        (tmp_path / "file").write_text("x")
        monkeypatch.setenv("LMFORGE_PEAK_CACHE", str(tmp_path / "file" / "peak.json"))
    elif how == "corrupt":
        (tmp_path / "peak.json").write_text("{not json")
        monkeypatch.setenv("LMFORGE_PEAK_CACHE", str(tmp_path / "peak.json"))
    else:
        monkeypatch.setenv("LMFORGE_PEAK_CACHE", "off")
    flops, how_text = machine_peak("k", lambda: 3e9)
    assert flops == 3e9 and how_text.startswith(f"best of {REPS}+")
    if how == "corrupt":  # rewritten whole
        assert json.loads((tmp_path / "peak.json").read_text())["k"]["flops"] == 3e9


def test_the_default_cache_is_in_the_users_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("LMFORGE_PEAK_CACHE", raising=False)
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path))
    assert peak_mod.cache_path() == tmp_path / "peak.json"
