"""`lmforge plan` entry point: tables, JSON, errors."""

from __future__ import annotations

import json
import re

import pytest

from lmforge.cli.plan import plan_main


def test_table_output(capsys):
    rc = plan_main(["--model", "llama2-70b", "--gpus", "8xA100-80GB", "--layout", "zero=3,ac=full", "--price", "2.0"])
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("Memory per GPU", "optimizer states", "lmforge /GPU", "megatron /GPU", "zero-paper /GPU",
                 "DOES NOT FIT", "step time", "MFU (model FLOPs, PaLM)", "HFU (hardware FLOPs, with recompute)",
                 "GPU-hours", "cost at $2/GPU-hour", "dp=8,zero=3"):
        assert text in out, text


def test_json_output_and_search(capsys):
    rc = plan_main(["--model", "llama2-70b", "--gpus", "8xH100", "--nodes", "64", "--global-batch-tokens",
                    str(1024 * 4096), "--tokens", "2e12", "--price", "2.5", "--search",
                    "--top", "3", "--layout", "zero=3", "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["cluster"]["world_size"] == 512
    assert rep["layout"]["dp"] == 512 and rep["layout"]["grad_accum"] == 2
    assert rep["conventions"] == ["lmforge", "megatron", "zero-paper"]
    assert rep["memory"]["zero-paper"]["bytes_per_param"]["model_states"] == pytest.approx(16 / 512)
    assert rep["memory"]["megatron"]["bytes_per_param"]["model_states"] == pytest.approx(18 / 512)
    assert rep["search_fit_convention"] == "lmforge"
    assert set(rep["search"][0]["memory_gb_per_gpu_by_convention"]) == {"lmforge", "megatron", "zero-paper"}
    assert rep["compute"]["train_tokens"] == 2e12 and rep["compute"]["cost"] > 0
    assert len(rep["search"]) == 3 and rep["search"][0]["rank"] == 1 and rep["search"][0]["fits"]
    assert rep["search"][0]["reason"]


def test_search_table(capsys):
    assert plan_main(["--model", "gpt2-124m", "--gpus", "8xH100", "--search", "--top", "4", "--weights", "lmforge"]) == 0
    out = capsys.readouterr().out
    assert "Layout search" in out and "Why:" in out and "#1" in out
    assert "fit-checked with the lmforge convention" in out and "GB lmforge" in out and "GB megatron" not in out


@pytest.mark.parametrize("weights,fit,columns", [
    ("all", "lmforge", ("GB lmforge", "GB megatron", "GB zero-paper")),
    ("megatron,zero-paper", "megatron", ("GB megatron", "GB zero-paper")),
    ("zero-paper", "zero-paper", ("GB zero-paper",)),
])
def test_search_states_its_fit_convention_and_every_memory_asked_for(weights, fit, columns, capsys):
    assert plan_main(["--model", "llama2-70b", "--gpus", "64x8xH100", "--search", "--top", "3", "--weights", weights]) == 0
    out = capsys.readouterr().out
    assert f"fit-checked with the {fit} convention" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("#  layout"))
    assert all(col in header for col in columns) and header.count("GB ") == len(columns)
    assert f"'fits' is by {fit}" in out


_T = ["--model", "tiny", "--gpus", "8xH100"]


@pytest.mark.parametrize("argv,needle", [
    (["--model", "tiny", "--gpus", "8xRTX9090"], "unknown GPU 'RTX9090'; known devices: A100-40GB"),
    (_T + ["--layout", "dp=8,warp=2"], "unknown layout key 'warp'"),
    (_T + ["--layout", "tp=7"], "tp = 7"),
    (["--model", "no-such-model", "--gpus", "8xH100"], "unknown preset 'no-such-model'"),
    (_T + ["--mfu", "1.5"], "--mfu 1.5"),
    (_T + ["--mfu", "nan"], "--mfu nan"),
    (_T + ["--global-batch-tokens", "100"], "--global-batch-tokens 100"),
    (_T + ["--layout", "dp=16"], "16 GPUs"),
    # issue 17, item 6
    (_T + ["--global-batch-tokens=-1024"], "--global-batch-tokens -1024 must be an integer >= 1"),
    (_T + ["--global-batch-tokens", "0"], "--global-batch-tokens 0 must be an integer >= 1"),
    (_T + ["--seq-len", "0"], "--seq-len 0 must be an integer >= 1"),
    (_T + ["--tokens=-1e9"], "--tokens -1e+09 must be a finite number > 0"),
    (_T + ["--tokens", "nan"], "--tokens nan must be a finite number > 0"),
    (_T + ["--tokens", "inf"], "--tokens inf must be a finite number > 0"),
    (_T + ["--price=-2"], "--price -2 must be a finite number >= 0"),
    (_T + ["--price", "inf"], "--price inf must be a finite number >= 0"),
    (_T + ["--usable", "1.5"], "--usable 1.5 must be in (0, 1]"),
    (_T + ["--usable", "0"], "--usable 0 must be in (0, 1]"),
    (_T + ["--search", "--top", "0"], "--top 0 must be an integer >= 1"),
    (_T + ["--search", "--top=-1"], "--top -1 must be an integer >= 1"),
    (_T + ["--layout", "dp=2"], "dp x cp x tp x pp = 2 x 1 x 1 x 1 = 2 GPUs but --gpus gives 8"),
    (_T + ["--layout", "sp=1"], "sp = 1 needs tp >= 2"),
    (_T + ["--weights", "both,megatron-lm"], "unknown convention 'megatron-lm'"),
    (_T + ["--allow-offload"], "--allow-offload widens the layout search; add --search"),
    (_T + ["--search", "--allow-offload", "--host-memory-gb", "-5"], "--host-memory-gb -5 must be a finite number > 0"),
    (_T + ["--nodes", "0"], "--nodes 0 must be an integer >= 1"),
    (_T + ["--set", "foo"], "--set 'foo': use KEY=VALUE"),
    (_T + ["--set", "model.max_seqlen=5"], "unknown config key 'model.max_seqlen'; did you mean 'model.max_seq_len'?"),
    (_T + ["--set", "data.seq_len=100000"], "data.seq_len = 100000 exceeds model.max_seq_len = 256"),
])
def test_errors_name_the_bad_value(argv, needle, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_no_fit_hint_names_allow_offload(capsys):
    assert plan_main(["--model", "llama2-70b", "--gpus", "1xA100-40GB", "--search"]) == 0
    out = capsys.readouterr().out
    assert "No layout fits" in out and "--allow-offload" in out
    assert "DOES NOT FIT" not in out  # (no default layout nobody asked for)


def test_search_leads_with_the_search_then_details_its_best(capsys):
    """Issue 50 item 7: `plan --search` printed a "DOES NOT FIT 3.16 TB" table for a default layout
    nobody asked for before the search; it now opens with the search and details its best layout.
    With --layout, the typed layout comes first and the search after it."""
    assert plan_main(["--model", "gpt3-175b", "--gpus", "64x8xH100", "--search", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Layout search") and "DOES NOT FIT" not in out
    best = re.search(r"^  1  (\S+)", out, flags=re.M).group(1)
    assert f"layout {best}\n  note: the search's best layout" in out
    layout = "dp=8,zero=3,tp=8,pp=8,mb=1,ac=selective,sp=1"
    assert plan_main(["--model", "gpt3-175b", "--gpus", "64x8xH100", "--search", "--top", "2", "--layout", layout]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lmforge plan: gpt3-175b") and out.index("Memory per GPU") < out.index("Layout search")


def test_auto_precision_follows_the_device(capsys):
    assert plan_main(["--model", "tiny", "--gpus", "V100", "--json", "--precision", "fp16"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp16"
    from lmforge.cli.plan import _resolve_precision
    from lmforge.plan.hardware import CATALOGUE

    assert _resolve_precision("auto", CATALOGUE["V100"]) == "fp16"
    assert _resolve_precision("auto", CATALOGUE["H100-SXM"]) == "bf16-pure"  # (the trainer's rule: spec.precision)


def test_gpt3_on_one_v100_through_the_cli(capsys):
    """Lambda's 355 years at 28 TFLOP/s (MFU 28/125 of the V100's fp16 peak), from the preset as is:
    its full recompute is not model work and must not add a third (it said 474 years)."""
    argv = ["--model", "gpt3-175b", "--gpus", "V100", "--precision", "fp16", "--tokens", "3e11",
            "--mfu", str(28 / 125), "--flops", "6N", "--ideal", "--json"]
    assert plan_main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["layout"]["ac"] == "full"
    assert rep["compute"]["train_years"] == pytest.approx(355, rel=0.01)
    assert rep["compute"]["mfu"] == pytest.approx(0.224) and rep["compute"]["hfu"] == pytest.approx(0.224 * 4 / 3)
    assert rep["memory"]["megatron"]["fits"] is False


def test_preset_token_counts_are_the_papers(capsys):
    """Default training tokens (the preset's run, batch ramp-up included): GPT-3 300B, Llama 2 2T,
    Chinchilla 1.4T."""
    for preset, tokens in (("gpt3-175b", 300e9), ("llama2-70b", 2e12), ("chinchilla-70b", 1.4e12)):
        assert plan_main(["--model", preset, "--gpus", "8xH100", "--json", "--layout", "zero=3,ac=full"]) == 0
        rep = json.loads(capsys.readouterr().out)
        assert rep["compute"]["train_tokens"] == pytest.approx(tokens, rel=2e-3), preset


def test_chinchilla_preset_says_what_it_approximates(capsys):
    """Chinchilla's published shape counts 64.95B parameters, not the 70B of its name: the plan
    reports the count and the preset says why (and what else it approximates)."""
    from pathlib import Path

    assert plan_main(["--model", "chinchilla-70b", "--gpus", "8xH100", "--json", "--layout", "zero=3,ac=full"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["memory"]["lmforge"]["params_total"] / 1e9 == pytest.approx(64.95, abs=0.01)
    text = (Path(__file__).resolve().parents[1] / "lmforge" / "presets" / "chinchilla-70b.toml").read_text()
    assert "64.95B" in text and "70B" in text and "RoPE stands in" in text


def test_default_micro_batch_adapts_to_the_replicas(capsys):
    assert plan_main(["--model", "tiny", "--gpus", "2xCPU", "--layout", "dp=2,zero=3", "--json",
                      "--global-batch-tokens", str(6 * 128), "--seq-len", "128"]) == 0
    lay = json.loads(capsys.readouterr().out)["layout"]
    assert lay["dp"] == 2 and lay["micro_batch"] * lay["grad_accum"] == 3
    assert plan_main(["--model", "tiny", "--gpus", "2xCPU", "--layout", "dp=2,mb=2",
                      "--global-batch-tokens", str(6 * 128), "--seq-len", "128"]) == 2
    assert "not divisible" in capsys.readouterr().err


@pytest.mark.parametrize("preset, params", [
    ("llama3.1-8b", 8_030_261_248), ("llama3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768),
    ("qwen2.5-7b", 7_615_616_512), ("qwen3-8b", 8_190_735_360), ("mistral-7b", 7_241_732_096)])
def test_family_presets_are_planned(preset, params, capsys):
    """`lmforge plan --model <preset>` plans each open-weight family's preset, counting the published
    parameters (q/k/v biases and QK-norm weights included), and finds a layout that fits on 8 H100s."""
    assert plan_main(["--model", preset, "--gpus", "8xH100", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["memory"]["lmforge"]["params_total"] == params
    assert plan_main(["--model", preset, "--gpus", "8xH100", "--search", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["search"][0]["fits"]


MEGATRON_GPT3 = ["--model", "gpt3-175b", "--gpus", "64x8xH100", "--layout", "dp=8,zero=1,tp=8,pp=8,mb=1,ac=selective,sp=1"]


def test_a_presets_fsdp_flag_is_dropped_from_a_typed_layout_it_does_not_apply_to(capsys):
    """Megatron's own GPT-3 layout, typed as a user would: the preset's FSDP-only
    parallel.fsdp_reduce_every_micro_batch is dropped (a pipeline reduces once per step; ZeRO-1 without
    TP or PP is not FSDP) and the output says so; an FSDP layout without a pipeline keeps it; typed or chosen by the
    user (reduce_every=1, --set) where it does not apply, it is still an error naming it."""
    assert plan_main(MEGATRON_GPT3) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert "dp=8,zero=1,tp=8,pp=8" in first and "reduce_every" not in first
    assert "note: parallel.fsdp_reduce_every_micro_batch = true (the preset's) dropped" in out and "pp = 8" in out
    layout_notes = lambda rep: [n for n in rep["notes"] if not n.startswith("precision bf16-pure: ")]  # noqa: E731
    assert plan_main(MEGATRON_GPT3[:-1] + ["dp=512,zero=1,mb=1,ac=full", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert not rep["layout"]["fsdp_reduce_every_micro_batch"] and "ZeRO-1, not FSDP" in layout_notes(rep)[0]
    assert plan_main(MEGATRON_GPT3[:-1] + ["dp=64,zero=1,tp=8,mb=1,ac=full", "--json"]) == 0  # (ZeRO-1 under TP: FSDP2)
    rep = json.loads(capsys.readouterr().out)
    assert rep["layout"]["fsdp_reduce_every_micro_batch"] and layout_notes(rep) == []
    assert plan_main(MEGATRON_GPT3[:-1] + ["zero=3,tp=8,mb=1,ac=full", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["layout"]["fsdp_reduce_every_micro_batch"] and layout_notes(rep) == []
    assert plan_main(MEGATRON_GPT3[:-1] + ["dp=8,zero=1,tp=8,pp=8,mb=1,reduce_every=1"]) == 2
    assert "reduce_every = 1 needs pp = 1" in capsys.readouterr().err
    assert plan_main(MEGATRON_GPT3 + ["--set", "parallel.fsdp_reduce_every_micro_batch=true"]) == 2
    err = capsys.readouterr().err
    assert "parallel.fsdp_reduce_every_micro_batch = true does not apply" in err and "pp = 8" in err


def test_mfu_belongs_to_the_back_of_envelope_estimate(capsys):
    """The layout model has no flat MFU any more: --mfu without --ideal is refused, --ideal needs it."""
    assert plan_main(["--model", "gpt2-124m", "--gpus", "8xH100", "--mfu", "0.4"]) == 2
    assert "--mfu 0.4 is the end-to-end MFU of --ideal" in capsys.readouterr().err
    assert plan_main(["--model", "gpt2-124m", "--gpus", "8xH100", "--ideal"]) == 2
    assert "give --mfu" in capsys.readouterr().err
    assert plan_main(["--model", "gpt2-124m", "--gpus", "H100", "--layout", "mb=16,ga=4"]) == 0
    out = capsys.readouterr().out
    for kind in ("matmuls", "attention (SDPA)", "elementwise", "loss", "casts", "optimizer", "host gaps"):
        assert kind in out, kind


def test_cross_group_traffic_of_a_fault_tolerant_job(capsys):
    """fault_tolerance with replica groups: each rank's cross-group bytes, a ring all-reduce's 2 (G - 1) / G of
    its parameters every step, or DiLoCo's once per diloco_sync_every steps (streaming: 1/F of them every
    H / F steps), printed under the step estimate and in --json."""
    from lmforge.plan.cross_group import cross_group_traffic

    every = cross_group_traffic(1_000_000, 4, 2)
    assert (every.burst_bytes, every.per_step_bytes, every.sync_every) == (4e6, 4e6, 1)
    diloco = cross_group_traffic(1_000_000, 4, 4, diloco_sync_every=100, fragments=4, gbps=1.0)
    assert (diloco.burst_bytes, diloco.per_step_bytes, diloco.every_step_bytes, diloco.sync_every) == \
        (1.5e6, 6e4, 6e6, 25)
    assert diloco.seconds_per_sync == pytest.approx(1.5e-3)
    argv = ["--model", "llama-1b", "--gpus", "8xH100", "--set", "fault_tolerance.enabled=true", "--set",
            "fault_tolerance.replica_groups=2", "--set", "guard.enabled=false", "--set",
            "fault_tolerance.diloco_sync_every=100", "--set", "fault_tolerance.diloco_fragments=4",
            "--set", "train.steps=1000"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "Cross-group traffic (2 replica groups; DiLoCo, a sync every 25 step(s), streaming: 1 of 4 fragments" in out
    assert "per-step averaging would move 4.305 GB every step (100x)" in out, out[-600:]
    assert plan_main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cross_group"]["sync_every"] == 25 and report["cross_group"]["groups"] == 2
    # FSDP2 over 8 ranks inside each group: a rank averages its shards, 1/8 of the parameters, every step
    sharded = argv[:10] + ["--set", "parallel.dp_shard=8", "--json"]
    assert plan_main(sharded) == 0
    assert json.loads(capsys.readouterr().out)["cross_group"]["per_step_bytes"] == pytest.approx(4.305e9 / 8, rel=1e-3)
