"""Context parallelism (parallel.cp) on CPU/gloo against one process.

Real torchrun jobs (tests/cp_driver.py runs several `Trainer(cfg).fit()` in one launch, so torch's
import and the process group are paid once per world size) on a tiny prepared corpus, every run
with the one-process run's seed, data and global batch (8 sequences of 32 tokens per step) and with
`data.mask_doc_boundaries = true`, so the ranks' chunks hold unequal target counts and the global
token normalisation over dp x cp is exercised. Per-step training loss AND gradient norm of 10 steps
must agree to 1e-5 relative, the tolerance of the other layouts (observed <= 4e-7, fp32: only the
reduction order differs):

* CP=2 (DDP over the cp ranks, 4 micro-batches of 2 per step) and CP=4 alone;
* CP=2 x FSDP2 (dp_shard 2: FSDP2 shards over dp_shard x cp = 4 ranks);
* CP=2 x TP=2 with sequence parallelism (each CP rank's 16 tokens split again over the TP ranks).

Each launch also trains 6 steps of plain SGD without clipping (tests/test_parallel_dp.py's `SGD`,
which steps by the gradient itself, so its scale shows): CP=2, CP=2 with GQA (one KV head, against a
GQA one-process run), CP=2 x TP=2 without sequence parallelism, and CP=2 x PP=2 (1F1B, untied
embeddings, against an untied one-process run). On the CPU every run attends on the mask-free path
(lmforge.parallel.context_parallel: flash attention for CPU over each chunk's prefix and diagonal
block, merged by log-sum-exp), with document-boundary masking on.

The CP=2 run's step-5 checkpoint resumes in one process, the CP=2 x FSDP2 run's at CP=4 (DDP):
steps 6-10 again equal to the one-process run. A 4-rank probe measures the hook itself at cp = 1,
2 and 4 on a GQA model with one KV head (fewer KV heads than cp): loss and gradients equal to one
process, per-rank saved activations = (A - KV) / cp + KV (A: one process's, KV: the whole
sequence's K/V; no mask), and bytes through the collectives = the closed form
(lmforge.spec.parallel). Last, a tiny model trains on 8192-token sequences under CP=4.

Without a launch: the CP attention of every rank, simulated in one process (the collectives replaced
by their result), equals dense causal attention in output and in the gradients of q, k and v (fp64,
fp32; GQA), and no tensor of a query-by-key shape is created in its forward and backward.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch

from lmforge.config import ConfigError, ModelConfig, load_config
from lmforge.spec.parallel import cp_activation_bytes, cp_comm_bytes, cp_kv_bytes
from tests.conftest import make_corpus
from tests.test_parallel_dp import SGD, STEPS, TINY, docs_corpus, docs_run, launcher  # noqa: F401  (fixture)

DRIVER = str(Path(__file__).with_name("cp_driver.py"))
TOL = 1e-5  # relative, per step, loss and grad norm; observed <= 4e-7
BASE = {**TINY, "train.sample_tokens": 0, "train.eval_sequences": 8, "checkpoint.save_final": "false",
        "checkpoint.every_minutes": 0}
LAYOUTS = {  # name: (processes, overrides); all of a world size run in one launch
    "cp2": (2, {"parallel.cp": 2, "checkpoint.every_steps": 5}),  # micro-batches of 2: accumulation 4
    "cp4": (4, {"parallel.cp": 4, "train.micro_batch_size": 4}),
    "fsdp2xcp2": (4, {"parallel.dp_shard": 2, "parallel.cp": 2, "train.micro_batch_size": 4,
                      "checkpoint.every_steps": 5}),
    "tp2spxcp2": (4, {"parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.cp": 2,
                      "train.micro_batch_size": 8}),
}
UNTIED = {"model.tie_embeddings": "false"}  # (pipeline stages hold the embedding and the head apart)
GQA = {"model.n_kv_heads": 1}  # 4 query heads share one KV head
SGD_LAYOUTS = {  # name: (processes, overrides, reference): 6 steps of plain SGD without clipping (`SGD`)
    "cp2-sgd": (2, {"parallel.cp": 2}, "single-sgd"),
    "cp2-gqa-sgd": (2, {"parallel.cp": 2, **GQA}, "single-sgd-gqa"),
    "tp2xcp2-sgd": (4, {"parallel.tp": 2, "parallel.cp": 2}, "single-sgd"),  # TP without SP under CP
    "cp2xpp2-sgd": (4, {"parallel.cp": 2, "parallel.pp": 2, **UNTIED}, "single-sgd-untied"),
}
DOC_LAYOUTS = {  # name: (processes, overrides, reference): document masking with restarted positions on best-fit
    # rows (tests/test_parallel_dp.py's `DOCS`): each chunk's mask cut from the whole sequence's document ids
    "cp2-docs": (2, {"parallel.cp": 2}, "single-docs"),
    "tp2spxcp2-docs": (4, {"parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.cp": 2,
                           "train.micro_batch_size": 8}, "single-docs"),
    "cp2xpp2-docs": (4, {"parallel.cp": 2, "parallel.pp": 2, **UNTIED}, "single-docs-untied"),  # ids through the schedule
}
LONG = {**BASE, "parallel.cp": 4, "data.seq_len": 8192, "model.max_seq_len": 8192, "model.dim": 32,
        "model.n_heads": 2, "data.mask_doc_boundaries": "false", "train.global_batch_size": 1,
        "train.micro_batch_size": 1, "train.steps": 3, "schedule.warmup_steps": 1, "train.log_every": 1}
PROBE = {"model": {"vocab_size": 320, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 1, "max_seq_len": 128},
         "batch": 2, "seq_len": 128}


def records(run: Path) -> dict[int, tuple[float, float]]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs if "loss" in r}


def worst(got: dict, want: dict) -> tuple[float, float]:
    """Largest relative difference of the loss and of the grad norm over the steps of `got`."""
    return tuple(max(abs(got[s][i] - want[s][i]) / abs(want[s][i]) for s in got) for i in (0, 1))


def launch(out: Path, nproc: int, runs: dict[str, dict], probe: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """Start tests/cp_driver.py under torchrun for `runs` (and the probe); (the process, its log file)."""
    out.mkdir(parents=True, exist_ok=True)
    spec, log = out / f"spec{nproc}.json", out / f"launch{nproc}.log"
    spec.write_text(json.dumps({"out": str(out), "probe": probe,
                                "runs": [{"name": n, "overrides": o} for n, o in runs.items()]}))
    cmd = launcher(nproc, torchrun=True) + [DRIVER, str(spec)]  # (warm: tests/warm_start.py)
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[1]), log


def finish(launched: tuple[subprocess.Popen, Path]) -> None:
    proc, log = launched
    proc.wait(timeout=600)
    output = log.read_text()
    assert proc.returncode == 0, output[-6000:]
    print("\n".join(line for line in output.splitlines() if "TIMING" in line))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """40 small documents; the validation split (~13k tokens) holds one 8192-token window."""
    from lmforge.data.pipeline import run_prepare
    from lmforge.data.prepare_config import prepare_config_from_dict

    root = tmp_path_factory.mktemp("cp")
    make_corpus(root / "raw", n_docs=40)
    cfg = prepare_config_from_dict({"vocab_size": 320, "val_fraction": 0.2, "workers": 1,
                                    "sources": [{"path": "raw/*.txt"}]}, base_dir=root)
    run_prepare(cfg, root / "prepared")
    return root / "prepared"


@pytest.fixture(scope="module")
def runs(corpus, docs_corpus, tmp_path_factory) -> Path:
    """Both launches at once (2 and 4 processes), the one-process reference meanwhile, then the CP=2
    run's step-5 checkpoint in one process. The 4-process launch resumes its own CP=2 x FSDP2
    step-5 checkpoint at CP=4 (DDP): another CP degree and another layout."""
    from tests.cp_driver import run_trainings

    root = tmp_path_factory.mktemp("cp-runs")
    base = {**BASE, **STEPS, "data.corpus": str(corpus)}  # (BASE, tests/test_parallel_cp_ulysses.py's too: 20 steps)

    def resume(run: str) -> dict:
        return {**base, "checkpoint.resume": str(root / run / "checkpoints" / "step_00000005")}

    layouts = {n: (procs, {**base, **o}) for n, (procs, o) in LAYOUTS.items()}
    layouts |= {n: (procs, {**base, **SGD, **o}) for n, (procs, o, _) in SGD_LAYOUTS.items()}
    docs = {**base, **docs_run(docs_corpus)}
    layouts |= {n: (procs, {**docs, **o}) for n, (procs, o, _) in DOC_LAYOUTS.items()}
    t0 = time.time()
    two = launch(root, 2, {n: o for n, (procs, o) in layouts.items() if procs == 2})
    four = launch(root, 4, {**{n: o for n, (procs, o) in layouts.items() if procs == 4},
                            "resumed-cp4": {**resume("fsdp2xcp2"), "parallel.cp": 4, "train.micro_batch_size": 4},
                            "long": {**LONG, "data.corpus": str(corpus)}}, probe=PROBE)
    try:
        run_trainings({"out": str(root), "runs": [{"name": "single", "overrides": base},
                                                  {"name": "single-sgd", "overrides": {**base, **SGD}},
                                                  {"name": "single-sgd-untied", "overrides": {**base, **SGD, **UNTIED}},
                                                  {"name": "single-sgd-gqa", "overrides": {**base, **SGD, **GQA}},
                                                  {"name": "single-docs", "overrides": docs},
                                                  {"name": "single-docs-untied", "overrides": {**docs, **UNTIED}}]})
        t1 = time.time()
        finish(two)
        t2 = time.time()
        run_trainings({"out": str(root), "runs": [{"name": "resumed-single", "overrides": resume("cp2")}]})
        t3 = time.time()
        finish(four)
    finally:  # (a failure leaves no launch behind: torchrun's agent stops its workers on SIGTERM)
        for proc, _ in (two, four):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"TIMING one process {t1 - t0:.1f} s, 2-process launch {t2 - t0:.1f} s, resumed in one process "
          f"{t3 - t2:.1f} s, 4-process launch {time.time() - t0:.1f} s (the launches overlap)")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_layout_matches_one_process(runs, layout):
    ref, got = records(runs / "single"), records(runs / layout)
    assert sorted(got) == list(range(1, STEPS["train.steps"] + 1)) and got.keys() == ref.keys()
    loss, norm = worst(got, ref)
    print(f"\n{layout}: max relative difference vs one process over {len(got)} steps: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < TOL and norm < TOL, (layout, loss, norm, got, ref)
    summary = json.loads((runs / layout / "summary.json").read_text())
    assert summary["layout"].endswith("+cp"), summary["layout"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SGD_LAYOUTS))
def test_context_parallel_scales_the_gradient_like_one_process(runs, layout):
    """Plain SGD without clipping steps by the gradient itself: a gradient normalised over the wrong
    token count (or summed over the CP ranks one time too many) changes the loss curve. CP alone,
    with GQA (one KV head), under TP without sequence parallelism, and under pipeline parallelism."""
    ref, got = records(runs / SGD_LAYOUTS[layout][2]), records(runs / layout)
    assert sorted(got) == list(range(1, 7)) and got.keys() == ref.keys()
    loss, norm = worst(got, ref)
    print(f"\n{layout}: max relative difference vs one process over 6 SGD steps: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < TOL and norm < TOL, (layout, loss, norm, got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(DOC_LAYOUTS))
def test_context_parallel_document_masking_matches_one_process(runs, layout):
    """data.attention = "document" under CP: each rank's two chunks attend within their documents over
    the gathered keys (masks cut from the whole sequence's document ids, positions restarting per
    document), alone, with TP + SP, and with the ids carried through a pipeline schedule."""
    ref, got = records(runs / DOC_LAYOUTS[layout][2]), records(runs / layout)
    assert sorted(got) == list(range(1, 9)) and got.keys() == ref.keys()
    loss, norm = worst(got, ref)
    print(f"\n{layout}: max relative difference vs one process over 8 steps: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < TOL and norm < TOL, (layout, loss, norm, got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["resumed-single", "resumed-cp4"])
def test_context_parallel_checkpoint_resumes_in_one_process_and_at_cp4(runs, resumed):
    """A CP checkpoint holds the model's parameters (CP does not change them) and the loader's global
    position, so one process (from CP=2) and CP=4 (from CP=2 x FSDP2) continue the very same run."""
    ref, got = records(runs / "single"), records(runs / resumed)
    assert sorted(got) == list(range(6, STEPS["train.steps"] + 1))  # it started from step 5, not from scratch
    loss, norm = worst(got, ref)
    print(f"\n{resumed} from a CP=2 step-5 checkpoint: loss {loss:.1e}, grad norm {norm:.1e} vs one process")
    assert loss < TOL and norm < TOL, (loss, norm, got, ref)


@pytest.fixture(scope="module")
def probe(runs) -> list[dict]:
    return [json.loads((runs / f"probe_rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_context_parallel_attention_equals_one_process_with_fewer_kv_heads_than_cp(probe):
    """One KV head, cp = 2 and 4: the loss and every gradient (summed over the CP ranks) are one process's."""
    for rank, p in enumerate(probe):
        one = p["1"]
        for cp in ("2", "4"):
            assert abs(p[cp]["nll"] - one["nll"]) / one["nll"] < 1e-6, (rank, cp, p[cp]["nll"], one["nll"])
            scale = max(abs(g) for g in one["grad"])
            assert max(abs(a - b) for a, b in zip(p[cp]["grad"], one["grad"])) / scale < 1e-5, (rank, cp)
        assert p["4"]["positions"] == [*range(rank * 16, rank * 16 + 16), *range((7 - rank) * 16, (8 - rank) * 16)]


@pytest.mark.slow
def test_context_parallel_saved_activations_scale_as_one_over_cp_plus_kv(probe):
    """Per-rank bytes autograd saves (parameters excluded): the rank's 1/cp of one process's, with the
    K/V of the whole sequence (which one process also saves) in place of its 1/cp share; no mask
    (the attention builds none). Equal on every rank (balanced)."""
    m, b, t = PROBE["model"], PROBE["batch"], PROBE["seq_len"]
    kv = m["n_layers"] * cp_kv_bytes(b, t, m["n_kv_heads"], m["dim"] // m["n_heads"], 4)
    one = probe[0]["1"]["saved_bytes"]
    for cp in (2, 4):
        saved = {p[str(cp)]["saved_bytes"] for p in probe}
        assert len(saved) == 1, saved  # every rank holds the same: the chunks balance memory too
        want = cp_activation_bytes(one, kv, cp)
        got = saved.pop()
        print(f"\ncp={cp}: saved {got:,} B per rank, formula (A - KV)/cp + KV = {want:,.0f} B "
              f"(A = {one:,} B one process, KV = {kv:,} B)")
        # observed: 6 B of 1,716,746 at cp 2, 1 B of 891,141 at cp 4 (<= 3.5e-6: a few bytes of small
        # tensors that do not divide by cp); 1e-5 relative (~17 B here) leaves room for those and
        # still catches any [c, c] mask (20,480 B at cp 2, 1.2%), which a 1% bound did not reliably
        assert abs(got - want) / want < 1e-5, (cp, got, want)


@pytest.mark.slow
def test_context_parallel_communication_matches_the_formula(runs, probe):
    """Bytes through the all-gathers and reduce-scatters the CP layer calls, counted as they run,
    against lmforge.spec.parallel.cp_comm_bytes: per step, per rank."""
    m = ModelConfig(**{k.removeprefix("model."): v for k, v in BASE.items() if k.startswith("model.")})
    for name, (_, extra) in LAYOUTS.items():
        comm = json.loads((runs / name / "cp_comm.json").read_text())
        micro = int(extra.get("train.micro_batch_size", BASE["train.micro_batch_size"]))
        dp = int(extra.get("parallel.dp_shard", 1))
        tp = int(extra.get("parallel.tp", 1))
        kv = cp_kv_bytes(micro, 32, m.kv_heads // tp, m.head_dim, 4)
        want = cp_comm_bytes(kv, extra["parallel.cp"], m.n_layers, BASE["train.global_batch_size"] // (micro * dp))
        for key in ("all_gather_bytes", "reduce_scatter_bytes"):
            assert comm[key] == want[key] * comm["steps"], (name, key, comm, want)
    # the probe's backward alone: one reduce-scatter per layer, no all-gather
    pm = PROBE["model"]
    kv = cp_kv_bytes(PROBE["batch"], PROBE["seq_len"], pm["n_kv_heads"], pm["dim"] // pm["n_heads"], 4)
    assert probe[0]["4"]["comm_backward"]["reduce_scatter_bytes"] == pm["n_layers"] * kv
    assert probe[0]["4"]["comm_backward"]["all_gather_bytes"] == 0


@pytest.mark.slow
def test_8192_token_sequences_train_under_cp4(runs):
    got = records(runs / "long")
    assert sorted(got) == [1, 2, 3]
    assert got[3][0] < got[1][0] - 0.2, got  # it learns (observed 5.77 -> 5.43)
    comm = json.loads((runs / "long" / "cp_comm.json").read_text())
    assert comm["all_gather_bytes"] == 3 * 2 * cp_kv_bytes(1, 8192, 2, 16, 4)


def test_chunks_and_positions():
    """Rank i holds chunks i and 2cp-1-i, and its positions are theirs (no process group is needed)."""
    from lmforge.parallel.context_parallel import SequenceSharding

    seq = torch.arange(16).view(1, 16)
    held = []
    for rank in range(4):
        s = SequenceSharding(None, rank, 4, torch.device("cpu"))
        held.append(s.local(seq)[0].tolist())
        with s.sharded(16):
            assert s.positions.tolist() == held[-1]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(sum(held, [])) == list(range(16))


def simulated_cp_attention(monkeypatch, q, k, v, cp: int, record=None, window: int = 0, doc_ids=None):
    """Every CP rank's `SequenceSharding.attention` over whole-sequence q (b, heads, T, d) and k, v
    (b, kv heads, T, d), in this process: the all-gather is replaced by the ranks' K/V it would
    return, the reduce-scatter by the sum over the ranks of what they send. Forward and backward
    (the gradient of the outputs' sum weighted by `q`-shaped noise) run inside `record` (a
    context manager) if given; `doc_ids` (b, T): under each rank's document masks. Returns the output
    and the gradients of q, k and v, in sequence order."""
    import lmforge.parallel.context_parallel as context_parallel
    from lmforge.parallel.context_parallel import SequenceSharding

    shards = [SequenceSharding(None, r, cp, torch.device("cpu")) for r in range(cp)]
    gathered = torch.cat([torch.stack((s.local(k, 2), s.local(v, 2))) for s in shards]).detach()
    sent: list[torch.Tensor] = []
    monkeypatch.setattr(context_parallel, "_all_gather", lambda out, local, group=None: out.copy_(gathered))
    monkeypatch.setattr(context_parallel, "_reduce_scatter",
                        lambda out, send, op=None, group=None: (sent.append(send.detach().clone()), out.zero_()))
    weight = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(2))
    outs, dqs = [], []
    for s in shards:
        q_r, k_r, v_r = (s.local(t, 2).detach().requires_grad_() for t in (q, k, v))
        masks = None if doc_ids is None else s.document_masks(doc_ids, window, 0.0)
        with record or contextlib.nullcontext():
            out = s.attention(q_r, k_r, v_r, 0.0, window, masks)
            out.backward(s.local(weight, 2))
        outs.append(out.detach())
        dqs.append(q_r.grad)
    # reduce-scatter: rank r receives the sum over all ranks of their gradient for its chunks
    dkv = torch.stack(sent).sum(0).unflatten(0, (cp, 2))  # (rank, k/v, b, kv heads, 2c, d)

    def whole(parts: list[torch.Tensor]) -> torch.Tensor:  # the ranks' chunks back in sequence order
        chunks = [None] * (2 * cp)
        for (lo, hi), part in zip((s.chunks_of[s.rank] for s in shards), parts):
            chunks[lo], chunks[hi] = part.chunk(2, dim=-2)
        return torch.cat(chunks, dim=-2)

    return whole(outs), whole(dqs), whole(list(dkv[:, 0])), whole(list(dkv[:, 1]))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_cp_attention_equals_dense_causal_attention(monkeypatch, cp, kv_heads, dtype, tol):
    """The mask-free path (CPU: flash attention for CPU over each chunk's prefix and its diagonal
    block, merged by log-sum-exp, with its own backward) against one process's causal SDPA: output
    and gradients of q, k and v, for every rank (the simulated collectives put the ranks' parts back
    together), with as many KV heads as query heads and with one (GQA)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 8, dtype=dtype, generator=gen)
    k, v = (torch.randn(2, kv_heads, 64, 8, dtype=dtype, generator=gen) for _ in range(2))
    got = simulated_cp_attention(monkeypatch, q, k, v, cp)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4)
    ref.backward(torch.randn(q.shape, dtype=dtype, generator=torch.Generator().manual_seed(2)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
        assert ((a - b).abs().max() / b.abs().max()).item() < tol, (name, cp, kv_heads, dtype)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [5, 8, 20, 64])
def test_cp_sliding_window_attention_equals_dense_windowed_attention(monkeypatch, cp, window):
    """model.sliding_window under CP (windows inside a chunk, of a chunk, across chunks, and the
    whole sequence) against one process's attention with the same window (lmforge.model.layers'
    mask): output and gradients of q, k and v, GQA, fp64."""
    from lmforge.model.layers import window_mask

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, 64, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    got = simulated_cp_attention(monkeypatch, q, k, v, cp, window=window)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = window_mask(0, 64, 64, window, q.device)
    assert (mask is None) == (window == 64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                           enable_gqa=True)
    ref.backward(torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(2)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-10, (name, cp, window)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cp_attention_creates_no_query_by_key_tensor(monkeypatch, cp, dtype):
    """Causal-only CP builds no mask and no score matrix: every tensor an op returns in the forward
    and backward of every rank's attention (TorchDispatchMode sees each one) has at most one
    dimension as long as a chunk (c = T / 2cp), so nothing of shape [c, keys], let alone [T, T],
    exists. (Before, each rank built two additive masks of c x (j + 1) c.) GQA, one KV head."""
    from torch.utils._python_dispatch import TorchDispatchMode

    t = 512
    c = t // (2 * cp)
    shapes: list[tuple[str, tuple[int, ...]]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    shapes.append((str(func), tuple(o.shape)))
            return out

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, t, 8, generator=gen).to(dtype)
    k, v = (torch.randn(1, 1, t, 8, generator=gen).to(dtype) for _ in range(2))
    simulated_cp_attention(monkeypatch, q, k, v, cp, record=Record())
    assert any("flash_attention_for_cpu_backward" in f for f, _ in shapes), shapes  # (it saw the kernels)
    long = [(f, s) for f, s in shapes if sum(d >= c for d in s) >= 2 or math.prod(s) >= t * t]
    assert not long, long[:5]


def test_lower_right_bias_holds_no_storage_and_aligns_bottom_right():
    """The CUDA path's bias: torch's lower-right causal bias without the unused (2, q, kv) float
    tensor its factory allocates; SDPA reads its lengths (on the CPU it materialises the mask: the
    semantics are checked here, the kernels on CUDA). With dropout on the CPU the chunk takes that
    path: same result as SDPA with the dense boolean mask under the same seed."""
    from lmforge.parallel.context_parallel import _lower_right, chunk_attention

    bias = _lower_right(8, 24)
    assert torch.Tensor.numel(bias) == 0 and (bias.seq_len_q, bias.seq_len_kv) == (8, 24)
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16, generator=gen), torch.randn(2, 1, 24, 16, generator=gen), torch.randn(2, 1, 24, 16, generator=gen)
    dense = torch.ones(8, 24, dtype=torch.bool).tril(16)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-6)
    torch.manual_seed(5)
    dropped = chunk_attention(q, k, v, 0.5)
    torch.manual_seed(5)
    assert torch.equal(dropped, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense, dropout_p=0.5, enable_gqa=True))


def test_document_masking_leaves_the_cp_ranks_unequal_target_counts(corpus):
    """Why the target count is summed over the CP ranks: with document-boundary masking each rank's
    chunks of the same sequences hold a different number of targets."""
    from lmforge.data.loader import PackedLoader, open_tokens
    from lmforge.data.prepare import load_prepared
    from lmforge.model.loss import count_targets
    from lmforge.parallel.context_parallel import SequenceSharding

    data = load_prepared(corpus)
    loader = PackedLoader(open_tokens(data.train_dir), 32, 64, seed=1337, mask_doc_boundaries=True,
                          eos_id=data.tokenizer.eos_id)
    _, y = loader.next_batch()
    counts = [int(count_targets(SequenceSharding(None, r, 4, torch.device("cpu")).local(y))) for r in range(4)]
    assert sum(counts) == int(count_targets(y)) < y.numel() and len(set(counts)) > 1, counts


@pytest.mark.parametrize("bad, message", [
    ({"parallel.cp": 3}, "parallel.cp = 3 must divide data.seq_len / 2 = 64"),
    ({"parallel.cp": 2, "data.seq_len": 250}, "choose parallel.cp among"),
    ({"parallel.cp": 4, "parallel.tp": 4, "parallel.sequence_parallel": True, "data.seq_len": 8,
      "model.n_heads": 4}, r"each CP rank's 2 tokens \(data.seq_len / cp\) must be divisible by parallel.tp = 4"),
    ({"parallel.cp": 0}, "parallel.cp = 0 must be >= 1"),
    ({"parallel.async_sgd": True, "parallel.dp_replicate": 2, "parallel.cp": 2}, "cp = 1"),
])
def test_context_parallel_config_validation(bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", {"train.global_batch_size": 64, "train.micro_batch_size": 16, **bad})


def test_context_parallel_layouts_are_checked_before_any_process_group():
    from lmforge.parallel.mesh import check_layout

    batch = {"train.global_batch_size": 64, "train.micro_batch_size": 16}
    cfg = load_config("tiny", {**batch, "parallel.cp": 2, "parallel.dp_shard": 2, "parallel.tp": 2,
                               "model.n_kv_heads": 2})  # kv heads = tp = cp: all allowed
    check_layout(cfg, 8, cuda=False)
    with pytest.raises(ConfigError, match=r"needs 8 processes \(dp_replicate 1 x dp_shard 2 x cp 2 x tp 2 x pp 1\), but torchrun started 4"):
        check_layout(cfg, 4, cuda=False)
    load_config("tiny", {**batch, "parallel.cp": 8, "model.n_kv_heads": 1})  # one KV head, 8 CP ranks: fine
