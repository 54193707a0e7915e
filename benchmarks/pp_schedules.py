"""Step time of each pipeline schedule on gloo beside the planner's bubble fraction.

    python benchmarks/pp_schedules.py                        # every schedule, 3 launches each
    python benchmarks/pp_schedules.py --repeats 5 --schedule 1f1b --schedule zbv [--json out.json]

Each launch is a real `torchrun --nproc-per-node 4 -m lmforge train` (pp = 4, one thread per rank,
fp32) of an 8-layer model (dim 256, 4 heads, seq 128) on a small prepared corpus, with 8
micro-batches of 2 sequences per step, so 4 stages for GPipe, 1F1B and ZB-H1 (interleaved-zb, v = 1)
and 8 stages (2 per rank) for interleaved 1F1B, interleaved-zb (v = 2), ZB-V and DualPipeV. The
step time is the trainer's own (`window_step_time_s`, logged every step: forward + backward through
the schedule, the gradient clip's all-reduce, the optimizer step), the median over the steps after
the first `--skip`; a schedule's number is the median over its launches, and the ratio is to 1F1B's.
The launches of the schedules are interleaved (all schedules once, then again), so a change of
load on a shared machine spreads over all of them; the load average is printed before and after.

Beside it: the planner's bubble fraction (`lmforge.spec.parallel.pipeline_bubble`: F = B = W)
and the step time it implies relative to 1F1B, (1 - bubble_1f1b) / (1 - bubble), for the same work.
On a machine with fewer cores than ranks the measured ratios understate the bubbles: an idle rank
gives its core to a busy one. Nothing is asserted; RESULTS.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lmforge.spec.parallel import PP_SCHEDULES, pipeline_bubble  # noqa: E402

PP, MICRO_BATCHES = 4, 8
# schedule: (parallel.pp_schedule, parallel.pp_virtual_stages)
SCHEDULES = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved-v2": ("interleaved", 2),
             "zb-h1": ("interleaved-zb", 1), "interleaved-zb-v2": ("interleaved-zb", 2), "zbv": ("zbv", 1),
             "dualpipev": ("dualpipev", 1)}
MODEL = {"model.vocab_size": 320, "model.dim": 256, "model.n_layers": 8, "model.n_heads": 4, "model.max_seq_len": 128,
         "model.tie_embeddings": "false", "data.seq_len": 128, "data.tokenizer_vocab_size": 320,
         "train.global_batch_size": 2 * MICRO_BATCHES, "train.micro_batch_size": 2, "train.precision": "fp32",
         "train.threads": 1, "train.log_every": 1, "train.eval_every": 0, "train.sample_tokens": 0,
         "train.tensorboard": "false", "train.plot": "false", "train.progress": "lines", "train.compile": "false",
         "checkpoint.every_minutes": 0, "checkpoint.save_final": "false", "schedule.warmup_steps": 1}


def prepare_corpus(root: Path) -> Path:
    from tests.conftest import make_corpus

    make_corpus(root / "raw", n_docs=24)
    out = root / "prepared"
    (root / "prep.toml").write_text(f'[prepare]\noutput_dir = "{out}"\nvocab_size = 320\nval_fraction = 0.1\n'
                                    f'[[prepare.sources]]\npath = "raw/*.txt"\n')
    subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(root / "prep.toml")], cwd=root,
                   check=True, capture_output=True, text=True)
    return out


def launch(corpus: Path, out: Path, name: str, steps: int, port: int) -> list[float]:
    """One 4-rank run of schedule `name`; its per-step times (s)."""
    schedule, v = SCHEDULES[name]
    args = {**MODEL, "data.corpus": str(corpus), "train.out_dir": str(out), "train.steps": steps,
            "parallel.pp": PP, "parallel.pp_schedule": schedule, "parallel.pp_virtual_stages": v}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(PP), "--master-port", str(port),
           "-m", "lmforge", "train"] + [a for k, val in args.items() for a in (f"--{k}", str(val))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["window_step_time_s"] for r in sorted(recs, key=lambda r: r.get("step", 0))
            if "window_step_time_s" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", action="append", choices=list(SCHEDULES), help="(repeatable; default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="launches per schedule")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per launch")
    ap.add_argument("--skip", type=int, default=2, help="first steps of a launch left out (warm-up)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    names = a.schedule or list(SCHEDULES)
    assert set(PP_SCHEDULES) >= {SCHEDULES[n][0] for n in names}
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = prepare_corpus(Path(tmp))
        for rep in range(a.repeats):
            for i, name in enumerate(names):
                steps = launch(corpus, Path(tmp) / f"{name}-{rep}", name, a.steps, 29600 + (rep * 17 + i) % 300)
                times[name].append(statistics.median(steps[a.skip:]))
                print(f"  {name} launch {rep + 1}: median step {times[name][-1] * 1e3:.0f} ms", flush=True)
    load_after = os.getloadavg()
    ref = "1f1b" if "1f1b" in names else names[0]
    rows = []
    for name in names:
        schedule, v = SCHEDULES[name]
        bubble = pipeline_bubble(PP, MICRO_BATCHES, v, schedule)
        planned = (1 - pipeline_bubble(PP, MICRO_BATCHES, SCHEDULES[ref][1], SCHEDULES[ref][0])) / (1 - bubble)
        med = statistics.median(times[name])
        rows.append({"schedule": name, "stages": PP * (2 if schedule in ("zbv", "dualpipev") else v),
                     "planned_bubble": bubble, "planned_ratio": planned, "step_s_median": med,
                     "step_s_launches": times[name], "measured_ratio": med / statistics.median(times[ref])})
    print(f"\npp = {PP}, {MICRO_BATCHES} micro-batches of 2 x 128 tokens, dim 256, 8 layers, fp32, gloo, 1 thread per "
          f"rank on {os.cpu_count()} cores; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"{'schedule':18s} {'stages':>6s} {'planned bubble':>14s} {'planned / ' + ref:>14s} "
          f"{'step (median)':>14s} {'measured / ' + ref:>15s}   launches (ms)")
    for r in rows:
        print(f"{r['schedule']:18s} {r['stages']:6d} {r['planned_bubble']:14.3f} {r['planned_ratio']:14.3f} "
              f"{r['step_s_median'] * 1e3:11.0f} ms {r['measured_ratio']:15.3f}   "
              + ", ".join(f"{t * 1e3:.0f}" for t in r["step_s_launches"]))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "load_before": load_before, "load_after": load_after,
                                      "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
