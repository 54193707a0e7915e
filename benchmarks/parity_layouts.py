"""Parity of the layouts that CI does not launch (4 processes on 2 cores, bf16, compile) against one
process: the rows of benchmarks/RESULTS.md that said "by hand".

    python benchmarks/parity_layouts.py --case hsdp2x2 --case ddp-fp16-hook    # some cases
    python benchmarks/parity_layouts.py --all                                  # every case
    python benchmarks/parity_layouts.py --list                                 # the cases and what they run

Each case is the setup of the test file named beside it (the same tiny prepared corpus, seed, data
and global batch of 8 sequences of 32 tokens, 20 steps, `data.mask_doc_boundaries = true`): a
real `torchrun --nproc_per_node N` launch with the case's layout, and the one-process run of the same model and precision (tests/cp_driver.py runs
each: a `Trainer(cfg).fit()` of the tiny preset with the case's overrides). It prints, per case,
the largest relative difference over the steps of the training loss and of the gradient norm
(before clipping), the numbers RESULTS.md shows, and for a CP case the bytes through its
collectives per step. Nothing is asserted: fp32 rows sit near 1e-7 (only the
reduction order differs), lossy ones (fp16 compression, bf16) higher. A case whose launch fails
prints FAILED and its last error line (tp2-compile does, on torch 2.13: why train.compile = "auto"
stays off with tensor parallelism), the others still run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

UNTIED = {"model.tie_embeddings": "false"}
MP = {"model.n_layers": 4, **UNTIED}  # tests/test_parallel_mp.py's model
CP = {"train.sample_tokens": 0, "checkpoint.save_final": "false", "checkpoint.every_minutes": 0}  # test_parallel_cp
BF16 = {"train.precision": "bf16"}
COMPILED = {"train.compile": "true", "train.steps": 6, "schedule.warmup_steps": 2}

# name: (test file whose setup it shares, processes, layout overrides, overrides of both runs)
CASES: dict[str, tuple[str, int, dict, dict]] = {
    "hsdp2x2": ("test_parallel_dp", 4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}, {}),
    "ddp-fp16-hook": ("test_parallel_dp", 2, {"parallel.dp_replicate": 2, "parallel.ddp_comm_hook": "fp16"}, {}),
    "fsdp2xpp2-interleaved": ("test_parallel_mp", 4, {"parallel.dp_shard": 2, "parallel.pp": 2,
                                                      "parallel.pp_schedule": "interleaved",
                                                      "parallel.pp_virtual_stages": 2}, MP),
    "tp2sp-x-pp2-full-ac-bf16": ("test_parallel_mp", 4, {"parallel.tp": 2, "parallel.sequence_parallel": "true",
                                                         "parallel.pp": 2},
                                 {**MP, **BF16, "train.activation_checkpoint": "full"}),
    "cp2xtp2": ("test_parallel_cp", 4, {"parallel.cp": 2, "parallel.tp": 2}, CP),
    "cp2xpp2-1f1b": ("test_parallel_cp", 4, {"parallel.cp": 2, "parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
                     {**CP, **UNTIED}),
    "cp2xddp": ("test_parallel_cp", 4, {"parallel.cp": 2, "parallel.dp_replicate": 2}, CP),
    "cp2xzero1": ("test_parallel_cp", 4, {"parallel.cp": 2, "parallel.dp_shard": 2, "parallel.zero_stage": 1}, CP),
    "cp2-gqa": ("test_parallel_cp", 2, {"parallel.cp": 2}, {**CP, "model.n_kv_heads": 1}),
    "cp2-learned-positions": ("test_parallel_cp", 2, {"parallel.cp": 2}, {**CP, "model.pos_emb": "learned"}),
    "cp2-full-ac": ("test_parallel_cp", 2, {"parallel.cp": 2}, {**CP, "train.activation_checkpoint": "full"}),
    "cp2-selective-ac": ("test_parallel_cp", 2, {"parallel.cp": 2},
                         {**CP, "train.activation_checkpoint": "selective"}),
    "cp2-loss-chunk16": ("test_parallel_cp", 2, {"parallel.cp": 2}, {**CP, "train.loss_chunk": 16}),
    "cp2-compile": ("test_parallel_cp", 2, {"parallel.cp": 2},
                    {**CP, "train.compile": "true", "train.steps": 6, "schedule.warmup_steps": 2}),
    "cp2-bf16": ("test_parallel_cp", 2, {"parallel.cp": 2}, {**CP, **BF16}),
    "cp2-gqa-compile": ("test_parallel_cp", 2, {"parallel.cp": 2},
                        {**CP, "model.n_kv_heads": 1, "train.compile": "true", "train.steps": 6,
                         "schedule.warmup_steps": 2}),
    "cp2-gqa-bf16": ("test_parallel_cp", 2, {"parallel.cp": 2}, {**CP, "model.n_kv_heads": 1, **BF16}),
    # per-block compile under the other layouts (train.compile = "auto" turns it on on CUDA whatever
    # the layout but MoE): both runs compiled, 6 steps
    "tp2-compile": ("test_parallel_mp", 2, {"parallel.tp": 2}, {**MP, **COMPILED}),
    "tp2-sp-compile": ("test_parallel_mp", 2, {"parallel.tp": 2, "parallel.sequence_parallel": "true"},
                       {**MP, **COMPILED}),
    # the whole model as one graph (train.compile = model) under DDP: torch.compile splits it at the buckets
    "ddp-compile-model": ("test_parallel_dp", 2, {"parallel.dp_replicate": 2},
                          {**COMPILED, "train.compile": "model"}),
    "pp2-1f1b-compile": ("test_parallel_mp", 2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
                         {**MP, **COMPILED}),
    "fsdp2-compile": ("test_parallel_dp", 2, {"parallel.dp_shard": 2}, COMPILED),
}


CORPORA = {"test_parallel_dp": (12, 0.1), "test_parallel_mp": (12, 0.1), "test_parallel_cp": (40, 0.2)}  # docs, val


def prepare_corpus(root: Path, n_docs: int, val_fraction: float) -> Path:
    """The tests' tiny corpus (tests/conftest.py's make_corpus), prepared with `lmforge prepare`."""
    from tests.conftest import make_corpus

    make_corpus(root / "raw", n_docs=n_docs)
    out = root / "prepared"
    (root / "prep.toml").write_text(f'[prepare]\noutput_dir = "{out}"\nvocab_size = 320\nval_fraction = '
                                    f'{val_fraction}\n[[prepare.sources]]\npath = "raw/*.txt"\n')
    proc = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(root / "prep.toml")],
                          capture_output=True, text=True, timeout=300, cwd=root)
    if proc.returncode:
        sys.exit(proc.stdout + proc.stderr)
    return out


def launch(work: Path, name: str, nproc: int, overrides: dict) -> Path:
    """One run through tests/cp_driver.py (a real `Trainer(cfg).fit()` of the tiny preset + `overrides`),
    under torchrun for nproc > 1; returns its run folder (WORK/NAME)."""
    from tests.test_parallel_dp import free_port

    spec = work / f"{name}.json"
    spec.write_text(json.dumps({"out": str(work), "runs": [{"name": name, "overrides": overrides}]}))
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                 str(nproc), "--master-port", str(free_port())]
    proc = subprocess.run(head + [str(ROOT / "tests" / "cp_driver.py"), str(spec)], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"{name} ({nproc} processes) failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return work / name


def run_case(name: str, work: Path, cache: dict[str, Path]) -> tuple[float, float, str]:
    """(max relative loss difference, max relative grad-norm difference, CP bytes per step) of `name`."""
    from tests.test_parallel_dp import TINY, grad_norms, losses, max_rel

    test, nproc, layout, shared = CASES[name]
    if test not in cache:
        cache[test] = prepare_corpus(work / f"corpus-{test}", *CORPORA[test])
    both = {**TINY, "data.corpus": str(cache[test]), **shared}
    key = f"reference {test} {sorted(shared.items())}"
    if key not in cache:  # one one-process run per corpus, model and precision
        cache[key] = launch(work, f"reference{len(cache)}", 1, both)
    out, want = launch(work, name, nproc, {**both, **layout}), cache[key]
    comm = ""
    if (out / "cp_comm.json").is_file():
        c = json.loads((out / "cp_comm.json").read_text())
        comm = f"all-gather {c['all_gather_bytes'] // c['steps']:,} B, reduce-scatter " \
               f"{c['reduce_scatter_bytes'] // c['steps']:,} B per step and rank"
    return max_rel(losses(out), losses(want)), max_rel(grad_norms(out), grad_norms(want)), comm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", default=[], choices=sorted(CASES), help="a case to run (repeatable)")
    p.add_argument("--all", action="store_true", help="run every case")
    p.add_argument("--list", action="store_true", help="print the cases and their overrides, run nothing")
    args = p.parse_args(argv)
    names = sorted(CASES) if args.all else args.case
    if args.list or not names:
        for name, (test, nproc, layout, shared) in CASES.items():
            print(f"{name:26s} {nproc} processes (setup of tests/{test}.py)  layout {layout}  both runs {shared}")
        return 0 if args.list else 2
    with tempfile.TemporaryDirectory(prefix="lmforge-parity-") as tmp:
        work = Path(tmp)
        cache: dict[str, Path] = {}  # prepared corpora and one-process runs, shared by the cases
        print(f"{'case':26s} {'processes':>9s} {'loss':>9s} {'grad norm':>9s}  (max relative difference vs 1 process)")
        failed = []
        for name in names:
            t0 = time.perf_counter()
            try:
                loss, grad, comm = run_case(name, work, cache)
            except SystemExit as e:  # a launch that failed: say why, go on with the other cases
                failed.append(name)
                errors = [line for line in str(e.code).splitlines() if "Error: " in line and "ChildFailed" not in line]
                print(f"{name:26s} FAILED: {errors[-1].strip() if errors else str(e.code)[-300:]}", flush=True)
                continue
            print(f"{name:26s} {CASES[name][1]:9d} {loss:9.1e} {grad:9.1e}  ({time.perf_counter() - t0:.0f} s) {comm}",
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
