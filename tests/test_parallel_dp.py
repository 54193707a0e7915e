"""Data parallelism on CPU/gloo: DDP, ZeRO-1, ZeRO-2, ZeRO-3 (FSDP2) against one process.

Real `torchrun --nproc_per_node 2` jobs of `lmforge train` on a tiny prepared corpus; each run's
per-step training losses and gradient norms (metrics.jsonl) are compared with a single-process
run of the same seed, data and global batch (8 sequences = 1 process x 4 micro x 2 accumulation =
2 ranks x 2 micro x 2 accumulation). `data.mask_doc_boundaries = true` makes the ranks'
target-token counts unequal, so the loss normalisation (global token count all-reduced, x dp size
against the gradient averaging) is exercised too. The gradient norm (before clipping) sees the
scale of the gradient, which AdamW's update and the clipped loss curve hardly do: a layout that
summed instead of averaged, or dropped the x dp, would log twice or half the one-process norm.
Each layout also trains 6 steps of plain SGD without clipping (`SGD`), whose update is
the gradient itself, so that its loss curve, too, follows the gradient's scale.

The AdamW runs also keep the EMA of the weights (`EMA`, lmforge.train.ema: each rank the EMA of its own
shards) and score a small multiple-choice task in the loop (`TASKS`, on the sharded model): the final
EMA, its validation loss and the task's scores must match one process's too (`assert_extras_match`),
and the run's final checkpoint merged with one process's (lmforge.ckpt.merge, read from the layout's
shards) must be the average of the two runs' weights."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.config import ConfigError, load_config
from tests import warm_start
from tests.conftest import make_tasks

TINY = {
    "model.vocab_size": 320, "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
    "data.seq_len": 32, "data.tokenizer_vocab_size": 320, "data.mask_doc_boundaries": "true",
    "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.steps": 20, "train.eval_every": 0,
    "train.eval_sequences": 8, "train.log_every": 5, "train.sample_tokens": 4, "train.precision": "fp32",
    "train.tensorboard": "false", "train.plot": "false", "train.progress": "lines", "train.threads": 1,
    "schedule.warmup_steps": 3, "optim.lr": 3e-3,
}


SGD = {"optim.name": "sgd", "optim.grad_clip": 0, "optim.weight_decay": 0, "optim.lr": 0.3, "train.steps": 6,
       "schedule.warmup_steps": 2, "train.sample_tokens": 0}
"""A scale-sensitive run: plain SGD (no momentum, no weight decay, no clipping) steps by lr x the
gradient, so a gradient twice or half its true size changes the loss curve (AdamW, and any run
clipped at grad_clip, hardly sees the scale). 6 steps: the tests add it to a launch they make anyway."""

DOCS = {"data.attention": "document", "data.document_positions": "restart", "data.packing": "best_fit",
        "data.packing_buffer": 16, "train.steps": 8, "train.sample_tokens": 0, "checkpoint.save_final": "false",
        "checkpoint.every_minutes": 0}
"""Document masking with positions restarting per document, on best-fit packed rows (lmforge.model.documents,
lmforge.data.packing), 8 steps on `docs_corpus`'s short documents: every parity launch also runs it,
against a one-process run of the same (`docs_run`)."""

STEPS = {"train.steps": 10}
"""The length of this file's AdamW runs (TINY's 20 is other files'): a layout that sums instead of averaging,
or normalises by the wrong token count, logs a wrong gradient norm from step 1 on; 10 steps of the one-process
trajectory are as good a reference as 20, at half the training."""

EMA = {"train.ema_decay": 0.8, "train.ema_start_step": 2}
"""The EMA of the weights from step 2 on, decay 0.8: the last steps weigh most, so a wrong update, a
shard of another rank's or a swap that leaves the EMA in the model shows at the end."""


def tasks(corpus: Path) -> dict:
    """train.eval_tasks = the `corpus` fixture's multiple-choice file (tests.conftest.make_tasks)."""
    return {"train.eval_tasks": str(corpus.parent / "tasks.jsonl")}


RUNS_DRIVER = str(Path(__file__).with_name("train_runs_driver.py"))


def docs_run(corpus: Path, **extra) -> dict:
    """The overrides of a `DOCS` run on `corpus` (the `docs_corpus` fixture)."""
    return {**DOCS, "data.corpus": str(corpus), **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(corpus: Path, out: Path, **extra) -> list[str]:
    args = {**TINY, "data.corpus": str(corpus), "train.out_dir": str(out), **extra}
    return [a for k, v in args.items() for a in (f"--{k}", str(v))]


def launcher(nproc: int = 1, torchrun: bool = False, warm: bool = True) -> list[str]:
    """The interpreter, or torchrun with `nproc` processes on a free port; `warm`: started as forks of a process
    that imported torch and lmforge once (tests/warm_start.py), torchrun's workers too."""
    python = warm_start.shared().interpreter() if warm else [sys.executable]
    if nproc == 1 and not torchrun:
        return python
    return python + ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port", str(free_port())]


def train(corpus: Path, out: Path, nproc: int = 1, timeout: int = 180, torchrun: bool = False,
          **extra) -> subprocess.CompletedProcess:
    return subprocess.run(launcher(nproc, torchrun) + ["-m", "lmforge", "train"] + overrides(corpus, out, **extra),
                          capture_output=True, text=True, timeout=timeout)


def train_runs(corpus: Path, runs: dict[Path, dict], nproc: int = 1, timeout: int = 180,
               **shared) -> subprocess.CompletedProcess:
    """Several `lmforge train` runs, one after another in one launch (tests/train_runs_driver.py):
    `runs` maps each run's folder to its own overrides, on top of `shared`."""
    args = [overrides(corpus, out, **{**shared, **own}) for out, own in runs.items()]
    return subprocess.run(launcher(nproc) + [RUNS_DRIVER, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout)


def run_logs(proc: subprocess.CompletedProcess, runs: dict[Path, dict]) -> dict[Path, str]:
    """A `train_runs` launch's output (stdout, then stderr) cut at rank 0's start of each run: {run folder:
    its lines} (other ranks' lines land where they were printed)."""
    parts = [re.split(r"^train_runs_driver: run \d+\n", text, flags=re.M)[1:] for text in (proc.stdout, proc.stderr)]
    assert all(len(p) == len(runs) for p in parts), (len(runs), proc.stdout[-2000:] + proc.stderr[-2000:])
    return {out: out_part + err_part for out, out_part, err_part in zip(runs, *parts)}


def metric(run: Path, key: str) -> dict[int, float]:
    """Per-step values of `key` from a run's metrics.jsonl (the last record of a step wins)."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in recs if key in r and "step" in r}


def losses(run: Path) -> dict[int, float]:
    return metric(run, "loss")


def grad_norms(run: Path) -> dict[int, float]:
    """Global gradient norm of each step, before clipping."""
    return metric(run, "grad_norm")


def max_rel(got: dict[int, float], want: dict[int, float]) -> float:
    """Largest relative difference over the steps of `got` (which `want` must all have)."""
    return max(abs(got[s] - want[s]) / abs(want[s]) for s in got)


def assert_runs_match(got: Path, want: Path, what: str, steps: list[int] | None = None,
                      tol: float | dict[str, float] = 1e-5) -> None:
    """Run `got` logged a loss and a gradient norm (before clipping) for exactly `steps` (default:
    `want`'s steps), each within `tol` relative of `want`'s (or {"losses": .., "grad_norms": ..})."""
    steps = sorted(losses(want)) if steps is None else steps
    assert sorted(losses(got)) == sorted(grad_norms(got)) == steps, (what, losses(got))
    worst = {read.__name__: max_rel(read(got), read(want)) for read in (losses, grad_norms)}
    print(f"\n{what}: max relative difference over steps {steps[0]}-{steps[-1]}: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    limit = tol if isinstance(tol, dict) else dict.fromkeys(worst, tol)
    assert all(worst[k] < limit[k] for k in worst), (what, worst, losses(got), losses(want))


def weights_rel(got: Path, want: Path, name: str) -> float:
    """The largest difference between the tensors of two runs' weights file `name`, relative to the
    largest value of `want`'s tensor."""
    from safetensors.torch import load_file

    a, b = load_file(str(got / name)), load_file(str(want / name))
    assert a.keys() == b.keys(), (got, name)
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def assert_extras_match(got: Path, want: Path, what: str, tol: float = 1e-5) -> None:
    """The EMA of the weights and the in-loop task scores of run `got` against run `want`, and merging:
    the final EMA (model.ema.safetensors) as close to `want`'s as the final weights are to theirs
    (within 4x, or `tol` of each tensor's largest value: AdamW moves an element whose gradient is
    near 0 by about its lr either way, so the TP runs' weights differ from one process's by up to
    2.5e-4 of a tensor's largest value), the final val_loss_ema within `tol` relative, the task
    scores equal; and `got`'s final checkpoint merged with `want`'s equals the average of their weights
    (fp32, as `lmforge merge` accumulates)."""
    import torch
    from safetensors.torch import load_file

    from lmforge.ckpt.merge import merge_checkpoints, select_checkpoints

    worst, live = weights_rel(got, want, "model.ema.safetensors"), weights_rel(got, want, "model.safetensors")
    val, ref_val = metric(got, "val_loss_ema"), metric(want, "val_loss_ema")
    assert sorted(val) == sorted(ref_val) and val, (what, val, ref_val)
    print(f"{what}: EMA of the weights within {worst:.1e} of one process's (the weights: {live:.1e}), val_loss_ema "
          f"{max_rel(val, ref_val):.1e}")
    assert worst < max(tol, 4 * live) and max_rel(val, ref_val) < tol, (what, worst, live, val, ref_val)
    scores = [{k: v for k, v in json.loads(line).items() if k.startswith("task/")}
              for run in (got, want) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = [s for s in scores if s]
    assert len(scored) == 4 and scored[:2] == scored[2:], (what, scored)  # start and end, each run
    steps = [max(losses(run)) for run in (got, want)]
    ckpts = select_checkpoints([run / "checkpoints" / f"step_{step:08d}" for run, step in zip((got, want), steps)])
    merged = merge_checkpoints(ckpts, got.parent / f"{got.name}-merged", weights=[1, 3])
    a, b, m = (load_file(str(f)) for f in (got / "model.safetensors", want / "model.safetensors",
                                            merged / "model.safetensors"))
    assert m.keys() == b.keys(), what
    for k in m:  # the two checkpoints (sorted by step; same step: as given), weighted 1/4, 3/4
        assert torch.equal(m[k], (a[k].float() * 0.25).add_(b[k].float(), alpha=0.75).to(m[k].dtype)), (what, k)


def prepare(root: Path, sources: str = '[[prepare.sources]]\npath = "raw/*.txt"\n', val_fraction: float = 0.1) -> Path:
    """`lmforge prepare` (a real process) of the `sources` tables (TOML, paths relative to `root`) into
    ROOT/prepared, vocabulary 320."""
    out = root / "prepared"
    (root / "prep.toml").write_text(f'[prepare]\noutput_dir = "{out}"\nvocab_size = 320\nval_fraction = {val_fraction}\n'
                                    + sources)
    proc = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(root / "prep.toml")],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    make_tasks(root / "tasks.jsonl")
    return out


@pytest.fixture(scope="module")
def corpus(prepared_corpus) -> Path:
    """`make_corpus`'s 12 documents, prepared (tests/conftest.py's `prepared_corpus`: once per session
    and worker; the ~24 files that import this fixture only read it)."""
    return prepared_corpus


@pytest.fixture(scope="module")
def docs_corpus(prepared_docs_corpus) -> Path:
    """300 documents of 3-60 words (~33 tokens: about one boundary per 32-token sequence), prepared."""
    return prepared_docs_corpus


@pytest.fixture(scope="module")
def single(corpus, docs_corpus, tmp_path_factory) -> Path:
    """The one-process reference: ROOT/adamw (the preset's optimizer, `STEPS`), ROOT/sgd (`SGD`) and
    ROOT/docs (`DOCS`)."""
    root = tmp_path_factory.mktemp("single")
    proc = train_runs(corpus, {root / "adamw": {**STEPS, **EMA, **tasks(corpus)}, root / "sgd": SGD,
                               root / "docs": docs_run(docs_corpus)}, **{"train.micro_batch_size": 4})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = list(range(1, STEPS["train.steps"] + 1))
    assert sorted(losses(root / "adamw")) == sorted(grad_norms(root / "adamw")) == steps
    assert sorted(losses(root / "sgd")) == list(range(1, 7))
    return root


LAYOUTS = {
    "ddp": {"parallel.dp_replicate": 2},
    "zero1": {"parallel.dp_shard": 2, "parallel.zero_stage": 1},
    "zero2": {"parallel.dp_shard": 2, "parallel.zero_stage": 2},
    "zero3": {"parallel.dp_shard": 2, "parallel.zero_stage": 3},
}


COMPRESSED = {  # lossy communication / bf16 runs: they must still learn (`test_compressed_and_mixed_precision_...`)
    "powersgd": {"parallel.dp_replicate": 2, "parallel.ddp_comm_hook": "powersgd", "parallel.powersgd_rank": 2},
    # FSDP2 MixedPrecisionPolicy(bf16 params, fp32 reduce)
    "fsdp-bf16": {"parallel.dp_shard": 2, "train.precision": "bf16"},
}


@pytest.fixture(scope="module")
def launch(corpus, docs_corpus, tmp_path_factory) -> Path:
    """One 2-rank launch for every run of this file's layouts (torch's import and the process group paid
    once): ROOT/<layout>/{<layout> (EMA, tasks), sgd (`SGD`), docs (`DOCS`)} for each of `LAYOUTS`, and
    ROOT/<name>/run for each of `COMPRESSED`."""
    root = tmp_path_factory.mktemp("dp-layouts")
    runs = {}
    for layout, extra in LAYOUTS.items():
        runs.update({root / layout / layout: {**extra, **STEPS, **EMA, **tasks(corpus)},
                     root / layout / "sgd": {**extra, **SGD},
                     root / layout / "docs": {**extra, **docs_run(docs_corpus)}})
    runs.update({root / name / "run": {**STEPS, **extra} for name, extra in COMPRESSED.items()})
    proc = train_runs(corpus, runs, nproc=2, timeout=120 + 60 * len(runs))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_data_parallel_layout_matches_one_process(single, launch, layout):
    folder = launch / layout
    out = folder / layout
    # fp32, same seed/data/global batch: only the reduction order differs (all-reduce / reduce-scatter
    # vs. one process's accumulation). Observed max relative difference over 20 steps ~2e-7 for the
    # loss and 1.4e-6 (DDP, ZeRO-1) to 1.7e-6 (ZeRO-2/3) for the gradient norm (a sum of squares over
    # every parameter: more terms to reorder); the tolerance is 1e-5 relative for both.
    assert_runs_match(out, single / "adamw", f"{layout} vs one process")
    assert_runs_match(folder / "sgd", single / "sgd", f"{layout}, SGD without clipping, vs one process")
    assert_runs_match(folder / "docs", single / "docs", f"{layout}, document masking + best-fit, vs one process")
    assert_extras_match(out, single / "adamw", f"{layout} vs one process")
    # only rank 0 writes the run folder; FSDP gathers the full state dict for the weights
    for name in ("metrics.jsonl", "model.safetensors", "summary.json", "config.toml"):
        assert (out / name).is_file(), name
    from lmforge.ckpt.export import load_run

    _, model = load_run(out)  # the saved (gathered) weights load into an unsharded model
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.slow
def test_fsdp_at_shard_degree_one_matches_one_process(corpus, single, tmp_path):
    """`torchrun --nproc-per-node 1` with zero_stage 3 and dp_shard 1: FSDP2 on a one-rank mesh (what a
    single GPU uses for FSDP2's mixed precision) trains like the plain process. The reference's
    micro-batches (4 sequences), so that the layout is the only difference: with 2 (TINY's), the
    accumulation's rounding alone, amplified by step 13's gradient-norm spike, reached 9e-6 of the
    1e-5 tolerance in one process (the fused q/k/v layout, seed 0)."""
    out = tmp_path / "fsdp1"
    proc = train(corpus, out, nproc=1, torchrun=True,
                 **{**STEPS, "parallel.zero_stage": 3, "train.micro_batch_size": 4})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_runs_match(out, single / "adamw", "FSDP2 at shard degree 1 vs one process")
    assert json.loads((out / "summary.json").read_text())["layout"] == "fsdp"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPRESSED))
def test_compressed_and_mixed_precision_runs_still_learn(single, launch, name):
    """(The fp16_compress_hook run is left out to keep this file short; by hand it matched the
    one-process losses to 8.4e-6 relative over 20 steps.)"""
    out, last = launch / name / "run", STEPS["train.steps"]
    got = losses(out)
    assert got[last] < got[1] - 1.0, got  # lossy communication / bf16, but it still learns
    want = losses(single / "adamw")
    assert got[last] < want[last] * 1.15, (got[last], want[last])  # and lands near the exact run


@pytest.mark.slow
def test_world_size_mismatch_is_a_clear_error_not_a_hang(corpus, tmp_path):
    """torchrun starts 2 processes, the layout says 1: every rank stops before any collective."""
    proc = train(corpus, tmp_path / "run", nproc=2, timeout=120)
    assert proc.returncode != 0
    assert ("the layout of one process (every parallel degree 1) needs 1 process (dp_replicate 1 x dp_shard 1 x cp 1 x "
            "tp 1 x pp 1), but torchrun started 2" in proc.stderr), proc.stderr[-2000:]
    assert "--parallel.dp_shard 2" in proc.stderr  # the layouts that would fit are named


STALL_DRIVER = str(Path(__file__).with_name("stall_driver.py"))


@pytest.mark.slow
def test_a_collective_waiting_past_timeout_s_fails_naming_the_rank(corpus, tmp_path):
    """docs/parallel.md: "a collective that waits longer than parallel.timeout_s fails with an error naming the
    rank". A real 2-rank DDP job in which rank 1 sleeps 120 s before step 1 (tests/stall_driver.py):
    rank 0 waits in step 1's first collective (the all-reduce of the step's target count), fails
    after timeout_s = 5 s with "rank 0 of 2: ... timed out ...", and torchrun ends the job, the
    sleeping rank included, long before the sleep is over (no hang)."""
    timeout_s, sleep_s = 5, 120
    marker = tmp_path / "asleep"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master-port", str(free_port()),
           STALL_DRIVER, "1", "1", str(sleep_s), str(marker)] + overrides(
        corpus, tmp_path / "run", **{"parallel.dp_replicate": 2, "parallel.timeout_s": timeout_s, "train.steps": 4,
                                     "train.log_every": 1})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=sleep_s - 30)
    except subprocess.TimeoutExpired:
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in [proc.pid, *map(int, workers)]:  # (torchrun's workers have process groups of their own)
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job hung past {sleep_s - 30} s:\n{err[-3000:]}")
    ended = time.time()
    assert proc.returncode != 0
    assert marker.is_file(), f"rank 1 never reached step 1 (the job failed earlier):\n{err[-3000:]}"
    waited = ended - float(marker.read_text())
    # it waited for the timeout (not failing early), then ended within seconds (torchrun stops rank 1)
    assert timeout_s - 1 <= waited < timeout_s + 30, (waited, err[-3000:])
    named = [line for line in err.splitlines() if line.startswith("rank 0 of 2: ")]
    assert named and "timed out" in named[0].lower(), err[-3000:]
    print(f"\ncollective timeout: job ended {waited:.1f} s after rank 1 stalled (timeout_s {timeout_s}); {named[0][:160]}")


BATCH = {"train.global_batch_size": 64, "train.micro_batch_size": 16}  # divisible by dp = 2 and 4


def test_layout_errors_without_torchrun(tmp_path, monkeypatch):
    from lmforge.parallel.mesh import check_layout, init_distributed

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config("tiny", {**BATCH, "parallel.dp_replicate": 2})
    with pytest.raises(ConfigError, match="not launched by torchrun"):
        init_distributed(cfg)
    cfg = load_config("tiny", {**BATCH, "parallel.dp_shard": 2, "parallel.cpu_offload": True})
    with pytest.raises(ConfigError, match="cpu_offload = true needs a CUDA GPU"):
        check_layout(cfg, 2, cuda=False)
    check_layout(cfg, 2, cuda=True)  # fine where a GPU exists
    cfg = load_config("tiny", {**BATCH, "parallel.dp_replicate": 2, "parallel.ddp_comm_hook": "bf16"})
    with pytest.raises(ConfigError, match="fp16"):
        check_layout(cfg, 2, cuda=False)
    cfg = load_config("tiny", {**BATCH, "parallel.tp": 2})
    with pytest.raises(ConfigError, match=r"parallel.tp = 2 needs 2 processes .*this is a single process"):
        init_distributed(cfg)
    assert init_distributed(load_config("tiny")).distributed is False  # one process: no process group
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 1"):  # FSDP2 at shard degree 1
        init_distributed(load_config("tiny", {"parallel.zero_stage": 3}))


@pytest.mark.parametrize("bad, message", [
    ({"parallel.zero_stage": 1}, "parallel.dp_shard >= 2"),
    ({"parallel.zero_stage": 4, "parallel.dp_shard": 2}, "zero_stage = 4"),
    ({"parallel.zero_stage": 1, "parallel.dp_shard": 2, "parallel.dp_replicate": 2}, "dp_replicate = 1"),
    ({"parallel.dp_shard": 2, "parallel.ddp_comm_hook": "powersgd"}, "applies to DDP only"),
    ({"parallel.cpu_offload": True}, "needs FSDP"),
    ({"parallel.timeout_s": 0}, "timeout_s"),
    ({"parallel.powersgd_rank": 0}, "powersgd_rank"),
])
def test_parallel_config_validation(bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", {**BATCH, **bad})



def _fp16_overflow_worker(rank: int, init_file: str, out: str) -> None:
    """2 FSDP2 ranks; an inf lands in rank 1's gradient shard only; report what each rank did."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lmforge.train.precision import make_precision

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4, bias=False)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make_precision("fp16", torch.device("cpu")).scaler
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if rank == 1:
            model.weight.grad.to_local()[0, 0] = float("inf")
        before = model.weight.to_local().clone()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        stepped = not torch.equal(before, model.weight.to_local())
        Path(out, f"rank{rank}.json").write_text(json.dumps({"stepped": stepped, "scale": scaler.get_scale()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fp16_overflow_in_one_shard_skips_the_step_on_every_rank(tmp_path):
    """With FSDP2 each rank holds a different slice of every gradient, so an fp16 overflow can sit in
    one rank's slice only. If that rank alone skipped the step, the shards would silently diverge.
    lmforge's GradScaler sees DTensor gradients, whose overflow check DTensor all-reduces: both ranks
    skip and halve the loss scale together (why no ShardedGradScaler is needed with FSDP2)."""
    import torch.multiprocessing as mp

    mp.spawn(_fp16_overflow_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got == [{"stepped": False, "scale": 2.0**15}] * 2, got
