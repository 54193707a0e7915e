"""GPU semantics proven on the CPU (issue: ready for the GPU cluster).

* NCCL serves CUDA tensors only, has no receive-from-any-source and ignores tags. The default
  process group of a CUDA run is "cuda:nccl,cpu:gloo"; host tensors travel on an explicit gloo
  group. Checked: the backend spec a CUDA run builds; that no receive in lmforge omits its source
  and no message uses a tag (static); and, in real gloo runs, that the checkpoint-due flag and the
  parameter server's messages go over the host gloo group, the group they use on a GPU.
* One 16-bit copy of the weights per step: under bf16 autocast the tensors saved for backward hold
  one cast of each weight however many micro-batches the step has (accumulation in one process, DDP,
  TP, and a 1F1B pipeline with 4 micro-batches in flight), and each weight is cast exactly once per
  step when backward runs on another thread with activation checkpointing (CUDA's autograd device
  thread; lmforge.train.precision).
"""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.test_parallel_dp import TINY, corpus, launcher  # noqa: F401  (module-scoped corpus fixture)

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("gpu_semantics_driver.py")


def run_driver(mode: str, corpus: Path, out: Path, nproc: int, **extra) -> list:  # noqa: F811
    args = {**TINY, **extra}
    launch_driver(nproc, [mode, str(corpus), str(out)] + [f"{k}={v}" for k, v in args.items()])
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(nproc)]


def launch_driver(nproc: int, args: list[str]) -> None:
    proc = subprocess.run(launcher(nproc) + [str(DRIVER), *args], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_cuda_run_builds_nccl_with_gloo_beside_it():
    from lmforge.parallel.mesh import backend_spec

    assert backend_spec("cuda") == "cuda:nccl,cpu:gloo"
    assert backend_spec("cpu") == "gloo"
    # asynchronous SGD with ranks sharing a GPU (the GPU suite's async-2): NCCL refuses them
    assert backend_spec("cuda", shared_gpu=True) == "gloo"


def _calls(node: ast.AST):
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            yield call


def test_no_receive_without_a_source_and_no_tags_in_lmforge():
    bad = []
    for path in sorted((ROOT / "lmforge").rglob("*.py")):
        for call in _calls(ast.parse(path.read_text())):
            kwargs = {k.arg for k in call.keywords}
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            if call.func.attr in ("recv", "irecv") and "src" not in kwargs and len(call.args) < 2:
                bad.append(f"{where}: {call.func.attr} without a source")
            if call.func.attr in ("send", "recv", "isend", "irecv") and "tag" in kwargs:
                bad.append(f"{where}: {call.func.attr} with a tag (NCCL ignores tags)")
    assert not bad, bad


@pytest.mark.slow
def test_checkpoint_due_and_parameter_server_use_the_host_gloo_group(corpus, tmp_path):  # noqa: F811
    # synchronous DDP, a checkpoint due by the clock at every log step before the last (steps 2 and 4)
    sync = run_driver("rules", corpus, tmp_path / "ddp", 2, **{"parallel.dp_replicate": 2, "train.steps": 6,
                                                               "checkpoint.every_minutes": 1e-9, "train.log_every": 2})
    due = [c for calls in sync for c in calls if c["caller"] == "checkpointing.py:due"]  # (Checkpoints.due)
    assert len(due) == 2 * 2 and all(c["op"] == "broadcast" and c["host_group"] for c in due), due
    # asynchronous SGD: every parameter-server message on the host group, every receive naming its source
    asy = run_driver("rules", corpus, tmp_path / "async", 3, **{"parallel.dp_replicate": 3, "parallel.async_sgd": "true",
                                                                "train.global_batch_size": 6,
                                                                "train.steps": 6, "model.tie_embeddings": "false"})
    ps = [c for calls in asy for c in calls if c["caller"].startswith("param_server.py")]
    assert {c["op"] for c in ps} == {"send", "recv"} and len(ps) > 20
    assert all(c["host_group"] for c in ps), [c for c in ps if not c["host_group"]]
    every = [c for calls in sync + asy for c in calls]
    assert all(c["src"] for c in every if c["op"] in ("recv", "irecv")) and not any(c["tag"] for c in every)


BF16 = {"train.precision": "bf16", "train.global_batch_size": 8, "train.micro_batch_size": 2, "train.steps": 4,
        "model.tie_embeddings": "false", "model.n_layers": 2, "schedule.warmup_steps": 1}


def test_one_bf16_weight_copy_per_step_under_accumulation(corpus, tmp_path, monkeypatch):  # noqa: F811
    """4 micro-batches in one process: the tensors saved for backward hold one 16-bit cast of each
    weight, not one per micro-batch; without the step-wide cache (the old behaviour) they hold 4."""
    from tests.gpu_semantics_driver import count_weight_copies

    pairs = [f"{k}={v}" for k, v in {**TINY, **BF16, "checkpoint.resume": "none"}.items()]
    got = count_weight_copies(str(corpus), str(tmp_path / "one"), pairs)
    assert got["micro_batches"] == 4 and 0 < got["copies"] <= got["weights"], got

    import contextlib

    from lmforge.train.precision import Precision

    monkeypatch.setattr(Precision, "step", lambda self, *modules: contextlib.nullcontext())  # a cast per forward
    old = count_weight_copies(str(corpus), str(tmp_path / "old"), pairs)
    assert old["copies"] == 4 * got["copies"], (old, got)


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_one_16_bit_cast_per_weight_per_step_with_backward_on_another_thread(corpus, tmp_path, monkeypatch, ac,  # noqa: F811
                                                                             precision):
    """CUDA runs backward on the autograd engine's device thread, where an activation-checkpoint
    recompute enters and leaves autocast. With autocast's weight-cast cache (the old mechanism) that
    emptied the step's cache: each of the 4 micro-batches cast every weight again (and recomputed
    blocks more). With the step's managed 16-bit copies each weight is cast exactly once per step
    (bf16-pure, without autocast, too)."""
    from lmforge.train.precision import Precision
    from tests.gpu_semantics_driver import count_weight_casts

    monkeypatch.setattr(Precision, "backward", Precision.backward)  # (the driver replaces it: restored after)
    pairs = [f"{k}={v}" for k, v in {**TINY, **BF16, "checkpoint.resume": "none", "train.precision": precision,
                                      "train.activation_checkpoint": ac}.items()]
    got = count_weight_casts(str(corpus), str(tmp_path), pairs)
    assert got["micro_batches"] == 4 and got["casts"] and set(got["casts"].values()) == {1}, got


PARALLEL_COPIES = {"ddp": {"parallel.dp_replicate": 2, "train.global_batch_size": 16},
                   "tp2": {"parallel.tp": 2},
                   "pp2-1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}}
LAYOUT_NAMES = {"ddp": "ddp", "tp2": "tp", "pp2-1f1b": "pp"}  # (lmforge.parallel's Layout.name)


@pytest.fixture(scope="module")
def parallel_copies(corpus, tmp_path_factory) -> dict[str, list]:  # noqa: F811
    """Each layout of PARALLEL_COPIES counted in one 2-process launch (one process group for the three)."""
    out = tmp_path_factory.mktemp("copies")
    cases = {name: [f"{k}={v}" for k, v in {**TINY, **BF16, **extra}.items()] for name, extra in PARALLEL_COPIES.items()}
    launch_driver(2, ["copies-cases", str(corpus), str(out), json.dumps(cases)])
    return {name: [json.loads((out / name / f"copies_rank{r}.json").read_text()) for r in range(2)] for name in cases}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(PARALLEL_COPIES))
def test_one_bf16_weight_copy_per_step_in_parallel_layouts(parallel_copies, layout):
    for rank in parallel_copies[layout]:
        assert rank["micro_batches"] == 4 and 0 < rank["copies"] <= rank["weights"], (layout, rank)
    # (each case trained under its own layout, though the three share one launch)
    assert {rank["layout"] for rank in parallel_copies[layout]} == {LAYOUT_NAMES[layout]}
