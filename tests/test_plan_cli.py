"""`lmforge plan` entry point: tables, JSON, errors."""

from __future__ import annotations

import json

import pytest

from lmforge.plan.cli_plan import plan_main


def test_table_output(capsys):
    rc = plan_main(["--model", "llama2-70b", "--gpus", "8xA100-80GB", "--layout", "zero=3,ac=full", "--price", "2.0"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("Memory per GPU", "optimizer states", "megatron", "lmforge", "DOES NOT FIT", "step time",
                 "GPU-hours", "cost at $2/GPU-hour", "dp=8,zero=3"):
        assert text in out, text


def test_json_output_and_search(capsys):
    rc = plan_main(["--model", "llama2-70b", "--gpus", "8xH100", "--nodes", "64", "--global-batch-tokens",
                    str(1024 * 4096), "--tokens", "2e12", "--mfu", "0.45", "--price", "2.5", "--search",
                    "--top", "3", "--layout", "zero=3", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["cluster"]["world_size"] == 512
    assert rep["layout"]["dp"] == 512 and rep["layout"]["grad_accum"] == 2
    mem = rep["memory"]["megatron"]
    assert mem["bytes_per_param"]["model_states"] == pytest.approx(16 / 512)
    assert rep["compute"]["train_tokens"] == 2e12 and rep["compute"]["cost"] > 0
    assert len(rep["search"]) == 3 and rep["search"][0]["rank"] == 1 and rep["search"][0]["fits"]
    assert rep["search"][0]["reason"]


def test_search_table(capsys):
    assert plan_main(["--model", "gpt2-124m", "--gpus", "8xH100", "--search", "--top", "4", "--weights", "lmforge"]) == 0
    out = capsys.readouterr().out
    assert "Layout search" in out and "Why:" in out and "#1" in out


@pytest.mark.parametrize("argv,needle", [
    (["--model", "tiny", "--gpus", "8xRTX9090"], "unknown GPU 'RTX9090'; known devices: A100-40GB"),
    (["--model", "tiny", "--gpus", "8xH100", "--layout", "dp=8,warp=2"], "unknown layout key 'warp'"),
    (["--model", "tiny", "--gpus", "8xH100", "--layout", "tp=7"], "tp = 7"),
    (["--model", "no-such-model", "--gpus", "8xH100"], "unknown preset 'no-such-model'"),
    (["--model", "tiny", "--gpus", "8xH100", "--mfu", "1.5"], "--mfu 1.5"),
    (["--model", "tiny", "--gpus", "8xH100", "--global-batch-tokens", "100"], "--global-batch-tokens 100"),
    (["--model", "tiny", "--gpus", "8xH100", "--layout", "dp=16"], "16 GPUs"),
])
def test_errors_name_the_bad_value(argv, needle, capsys):
    assert plan_main(argv) == 2
    assert needle in capsys.readouterr().err


def test_auto_precision_follows_the_device(capsys):
    assert plan_main(["--model", "tiny", "--gpus", "V100", "--json", "--precision", "fp16"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp16"
    from lmforge.plan.cli_plan import _resolve_precision
    from lmforge.plan.hardware import CATALOGUE

    assert _resolve_precision("auto", CATALOGUE["V100"]) == "fp16"
    assert _resolve_precision("auto", CATALOGUE["H100-SXM"]) == "bf16"


def test_gpt3_on_one_v100_through_the_cli(capsys):
    # Back-of-envelope convention: 6N FLOPs per token, no recompute, MFU applied as is.
    argv = ["--model", "gpt3-175b", "--gpus", "V100", "--precision", "fp16", "--layout", "ac=none",
            "--tokens", "3e11", "--mfu", "0.277", "--flops", "6N", "--ideal", "--json"]
    assert plan_main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    years = rep["compute"]["train_s"] / (365.25 * 86400)
    assert years == pytest.approx(288, rel=0.01)  # the preset's N is 174.6B, hence 287.5
    assert rep["memory"]["megatron"]["fits"] is False


def test_default_micro_batch_adapts_to_the_replicas(capsys):
    assert plan_main(["--model", "tiny", "--gpus", "2xCPU", "--layout", "dp=2,zero=3", "--json",
                      "--global-batch-tokens", str(6 * 128), "--seq-len", "128"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert lay["dp"] == 2 and lay["micro_batch"] * lay["grad_accum"] == 3
    assert plan_main(["--model", "tiny", "--gpus", "2xCPU", "--layout", "dp=2,mb=2",
                      "--global-batch-tokens", str(6 * 128), "--seq-len", "128"]) == 2
    assert "not divisible" in capsys.readouterr().err
