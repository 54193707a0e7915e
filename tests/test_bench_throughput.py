"""benchmarks/train_throughput.py --quick on a very small config: it runs the real Trainer and
the reference loop and reports finite positive numbers in the documented JSON schema; the reference
gets the same torch options as lmforge, and MFU is given against the peak the run used only."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
         "data.seq_len=64", "data.tokenizer_vocab_size=300", "train.micro_batch_size=4",
         "train.global_batch_size=8"]


def load_bench():
    spec = importlib.util.spec_from_file_location("train_throughput", ROOT / "benchmarks" / "train_throughput.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_mode_reports_finite_positive_numbers(tmp_path):
    bench = load_bench()
    out = tmp_path / "bench.json"
    argv = ["--quick", "--guard-arm", "--threads", "1", "--warmup", "1", "--reps", "2", "--json", str(out)]
    for s in SMALL:
        argv += ["--set", s]
    res = bench.main(argv)
    on_disk = json.loads(out.read_text())
    assert on_disk["schema"] == res["schema"] == "lmforge.train_throughput/2"
    for key in ("date", "git_commit", "command", "machine", "config", "protocol", "peak_flops", "peak_used",
                "peak_source", "arms", "paired_ratios"):
        assert key in on_disk, key
    assert on_disk["config"]["grad_accum_steps"] == 2
    assert on_disk["config"]["tokens_per_step_per_rank"] == 8 * 64
    assert len(on_disk["machine"]["load_average"]) == 3
    assert set(on_disk["arms"]) == {"lmforge", "reference", "lmforge_no_guard"}
    # --quick is fp32: MFU against the fp32 peak the run used, never against a bf16 peak it did not use
    assert on_disk["config"]["precision"] == "fp32" and on_disk["peak_used"] == "fp32"
    assert set(on_disk["peak_flops"]) == {"fp32", "run"} and on_disk["peak_flops"]["run"] == on_disk["peak_flops"]["fp32"]
    fpt, peak = on_disk["config"]["flops_per_token"], on_disk["peak_flops"]["run"]
    for name, arm in on_disk["arms"].items():
        for key in ("step_time_s_median", "step_time_s_best", "tokens_per_s_median", "tokens_per_s_best",
                    "cpu_s_per_step_median", "mfu", "peak_mem_gb"):
            assert positive(arm[key]), (name, key, arm[key])
        assert not [k for k in arm if k.startswith("mfu_vs")], arm
        assert arm["mfu"] == arm["tokens_per_s_median"] * fpt / peak
        assert len(arm["step_times_s"]) == 2
    # the reference runs with lmforge's torch options (fused AdamW on this CPU by default); what lmforge
    # adds itself is not given to it: the plain logits + cross-entropy, whatever train.loss_chunk is
    assert on_disk["config"]["reference_optimizer_fast_path"] == on_disk["config"]["optimizer_fast_path"] == "fused"
    assert on_disk["arms"]["lmforge"]["data_s_per_step_median"] > 0
    for key in ("lmforge/reference", "lmforge_no_guard/reference", "lmforge/lmforge_no_guard"):
        assert positive(on_disk["paired_ratios"][key]), key
    table = bench.format_table(on_disk)
    assert "| lmforge |" in table and "| reference |" in table and "6N + 12*L*d*s" in table
    assert "MFU vs fp32 peak" in table and "bf16" not in table, table


def test_interop_threads_are_set_with_torchs_own_call():
    """--interop-threads calls torch.set_num_interop_threads (there is no torch.set_interop_threads: the
    option used to crash). In a fresh process: the inter-op pool can be sized only before it starts."""
    code = ("import argparse, importlib.util, torch; spec = importlib.util.spec_from_file_location('tt', %r); "
            "tt = importlib.util.module_from_spec(spec); spec.loader.exec_module(tt); "
            "tt.apply_threads(argparse.Namespace(threads=1, interop_threads=3)); "
            "print(torch.get_num_threads(), torch.get_num_interop_threads())"
            % str(ROOT / "benchmarks" / "train_throughput.py"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "3"]
