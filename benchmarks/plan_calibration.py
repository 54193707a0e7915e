"""The step-time model's constants from a GPU's measurements, and the plan against every measured row.

Reads benchmarks/plan_measured_h100.toml (the H100 rows of benchmarks/RESULTS.md, 2026-11-26, with
their source), derives each constant of `lmforge.plan.hardware.Calibration` from one line of the
profiled row, then plans every row (`lmforge.plan.flops.estimate_step`, the settings of the run:
compile, loss_chunk and how its loss ran, fused QKV, activation checkpointing, micro-batch) and
prints plan vs measured tokens/s, and the profile lines the constants were not fitted to:

    python benchmarks/plan_calibration.py [--json out.json]

How each constant follows (one per profile line of the GPT-2 row "compile, compiled chunk loss,
fused QKV"; the model counts the kernels and their FLOPs or bytes, lmforge.plan.op_time):
  matmul_fraction       the measured large-GEMM rate (790 TFLOP/s) / the dense peak (not a training row)
  gemm_fixed_s          (matmul ms - GEMM FLOPs / that rate) / GEMM kernels
  attention_fraction    PaLM-counted attention FLOPs / attention ms / dense peak
  elementwise_fraction  the loss kernel's bytes / loss ms / HBM bandwidth
  optimizer_fraction    the optimizer step's and the clip's bytes / optimizer ms / HBM bandwidth
  host_launch_s         the host time per launch whose gaps, sum of max(0, t - kernel time), equal
                        step - device busy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tomllib
from pathlib import Path

from lmforge.config import load_config
from lmforge.plan.flops import estimate_step
from lmforge.plan.hardware import Calibration, Cluster, get_device
from lmforge.plan.layout import Layout
from lmforge.plan.op_time import op_times

MEASURED = Path(__file__).resolve().parent / "plan_measured_h100.toml"
SEQ = {"gpt2-124m": 1024, "llama-1b": 2048}


def load_measured(path: Path = MEASURED) -> dict:
    return tomllib.loads(path.read_text())


def row_setup(row: dict):
    """(model config, layout, seq_len) of a measured row: the run's own settings."""
    cfg = load_config(row["preset"], {"model.fused_qkv": row["fused_qkv"]})
    layout = Layout(micro_batch=row["micro_batch"], grad_accum=row["grad_accum"], compile=row["compile"],
                    loss_chunk=row["loss_chunk"], ac=row["ac"], precision="bf16")
    return cfg.model, layout, SEQ[row["preset"]]


def _row(measured: dict, name: str) -> dict:
    return next(r for r in measured["row"] if r["name"] == name)


def _unit(calibration: Calibration) -> Calibration:
    """Every rate at 100% of the spec sheet, no fixed cost, no host time: the model's raw counts."""
    return dataclasses.replace(calibration, gemm_fixed_s=0.0, attention_fraction=1.0, elementwise_fraction=1.0,
                               optimizer_fraction=1.0, host_launch_s=0.0)


def derive(measured: dict) -> Calibration:
    """The calibration that the profiled row's lines give (module docstring)."""
    prof = measured["profile"]
    device = get_device(measured["device"])
    cfg, layout, seq = row_setup(_row(measured, prof["row"]))
    matmul_fraction = prof["large_gemm_tflops"] * 1e12 / device.peak_flops("bf16")
    raw = op_times(cfg, layout, seq, dataclasses.replace(device, calibration=_unit(
        dataclasses.replace(device.calibration, matmul_fraction=matmul_fraction))))
    kinds = raw.by_kind()
    gemms = sum(g.count for g in raw.groups if g.kind == "matmul")
    cal = Calibration(matmul_fraction=matmul_fraction,
                      gemm_fixed_s=(prof["matmul_ms"] / 1e3 - kinds["matmul"]) / gemms,
                      attention_fraction=kinds["attention"] / (prof["attention_ms"] / 1e3),
                      elementwise_fraction=kinds["loss"] / (prof["loss_ms"] / 1e3),
                      optimizer_fraction=kinds["optimizer"] / (prof["optimizer_ms"] / 1e3),
                      host_launch_s=0.0, source=device.calibration.source)
    gaps = (prof["step_ms"] - prof["device_busy_ms"]) / 1e3
    lo, hi = 0.0, 1e-3  # the gaps grow with the host time per launch: bisect
    for _ in range(60):
        mid = (lo + hi) / 2
        dev = dataclasses.replace(device, calibration=dataclasses.replace(cal, host_launch_s=mid))
        lo, hi = (mid, hi) if op_times(cfg, layout, seq, dev).host_gaps_s < gaps else (lo, mid)
    return dataclasses.replace(cal, host_launch_s=(lo + hi) / 2)


def plan_rows(measured: dict, calibration: Calibration | None = None) -> list[dict]:
    """Plan vs measured for every row (the device's own calibration unless one is given)."""
    device = get_device(measured["device"])
    if calibration is not None:
        device = dataclasses.replace(device, calibration=calibration)
    out = []
    for row in measured["row"]:
        cfg, layout, seq = row_setup(row)
        est = estimate_step(cfg, layout, Cluster(device), seq, chunk_loss_compiled=row["chunk_loss_compiled"])
        out.append({"name": row["name"], "measured": row["tokens_per_s"], "plan": est.tokens_per_s,
                    "error": est.tokens_per_s / row["tokens_per_s"] - 1, "step_ms": est.step_s * 1e3,
                    "measured_step_ms": row["step_ms"], "ms_by_kind": {k: v * 1e3 for k, v in est.time_by_kind.items()},
                    "source": row["source"]})
    return out


def profile_checks(measured: dict, calibration: Calibration | None = None) -> list[dict]:
    """The measured profile lines no constant was fitted to, against the plan."""
    device = get_device(measured["device"])
    if calibration is not None:
        device = dataclasses.replace(device, calibration=calibration)
    out = []

    def kinds(name: str) -> dict:
        row = _row(measured, name)
        cfg, layout, seq = row_setup(row)
        ops = op_times(cfg, layout, seq, device, chunk_loss_compiled=row["chunk_loss_compiled"])
        return {k: v * 1e3 for k, v in ops.by_kind().items()} | {"device": ops.device_s * 1e3}

    prof = measured["profile"]
    best = kinds(prof["row"])
    out.append({"line": f"{prof['row']}: elementwise (blocks) ms", "measured": prof["elementwise_ms"],
                "plan": best["elementwise"]})
    out.append({"line": f"{prof['row']}: casts and copies ms", "measured": prof["casts_ms"], "plan": best["casts"]})
    out.append({"line": f"{prof['row']}: device busy ms", "measured": prof["device_busy_ms"], "plan": best["device"]})
    eager = measured["profile_eager_chunk"]
    k = kinds(eager["row"])
    for key in ("matmul", "attention", "loss"):
        out.append({"line": f"{eager['row']}: {key} ms", "measured": eager[f"{key}_ms"], "plan": k[key]})
    out.append({"line": f"{eager['row']}: device busy ms", "measured": eager["device_busy_ms"], "plan": k["device"]})
    one_b = measured["profile_1b"]
    k = kinds(one_b["row"])
    out.append({"line": f"{one_b['row']}: matmul share of device time", "measured": one_b["matmul_share"],
                "plan": k["matmul"] / k["device"]})
    for c in out:
        c["error"] = c["plan"] / c["measured"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    measured = load_measured()
    cal = derive(measured)
    stated = get_device(measured["device"]).calibration
    print(f"Calibration derived from {MEASURED.name} ({measured['device']}, {measured['date']}):")
    for f in dataclasses.fields(Calibration):
        if f.name != "source":
            print(f"  {f.name:22s} derived {getattr(cal, f.name):.4g}   stated in hardware.py {getattr(stated, f.name):.4g}")
    rows = plan_rows(measured)
    print("\n| row | measured tok/s | plan tok/s | plan / measured | step ms measured / plan |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['measured']:,.0f} | {r['plan']:,.0f} | {r['error']:+.1%} | "
              f"{r['measured_step_ms']:.1f} / {r['step_ms']:.1f} |")
    print("\nPlanned ms per op kind:")
    for r in rows:
        print(f"  {r['name']:40s} " + "  ".join(f"{k} {v:.1f}" for k, v in r["ms_by_kind"].items()))
    checks = profile_checks(measured)
    print("\n| profile line (not fitted) | measured | plan | plan / measured |")
    print("|---|---|---|---|")
    for c in checks:
        print(f"| {c['line']} | {c['measured']:g} | {c['plan']:.3g} | {c['error']:+.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": dataclasses.asdict(cal), "rows": rows,
                                               "profile_checks": checks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
