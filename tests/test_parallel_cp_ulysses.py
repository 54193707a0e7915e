"""Ulysses context parallelism (parallel.cp_mode = "ulysses") on CPU/gloo against one process and
against the all-gather CP.

One torchrun launch per process count (tests/cp_driver.py: several `Trainer(cfg).fit()` in one process
group), each run with the one-process run's seed, data and global batch (8 sequences of 32 tokens,
`data.mask_doc_boundaries = true`: the ranks' chunks hold unequal target counts), 10 AdamW steps;
per-step loss AND gradient norm must agree to 1e-5 relative, tests/test_parallel_cp.py's tolerance:

* 2 processes: CP=2 (4 query and 4 KV heads: 2 of each per rank), the same under the all-gather CP
  (today's), CP=2 with a sliding window of 12 tokens (chunks are 8: the window spans chunks), CP=2
  with one KV head (GQA, replicated to the 2 ranks) and CP=2 with document masking (positions
  restarting per document, tests/test_parallel_dp.py's `DOCS`, 8 steps);
* 4 processes: CP=4 with 2 KV heads (each replicated twice: one query head and one KV head per
  rank), CP=2 x FSDP2 (dp_shard 2) and CP=2 x TP=2 with sequence parallelism (2 heads per TP rank,
  1 per CP rank).

Every launch also counts the bytes through the all-to-alls (`UlyssesSharding.comm`), which must be
lmforge.spec.parallel.ulysses_comm_bytes per step, and the 4-process launch probes the hook alone
(tests/cp_driver.py) at cp = 1, 2 and 4 with 2 KV heads: loss and gradients equal one process's, and
the bytes autograd saves per rank are spec.parallel.ulysses_activation_bytes (observed 6 B off of
1.7 MB at cp 2, 1 B of 0.9 MB at cp 4, where the KV heads are replicated). Without a launch: the layout rule (the config and
the planner refuse the same heads), and the planner's Ulysses traffic, memory and search.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from lmforge.config import ConfigError, ModelConfig, load_config
from lmforge.config.layout_rules import LayoutRefused
from lmforge.spec.parallel import (cp_comm_bytes, cp_kv_bytes, ulysses_activation_bytes, ulysses_bytes,
                                   ulysses_comm_bytes, ulysses_kv_heads, ulysses_splits)
from tests.test_parallel_cp import BASE, TOL, corpus, finish, launch, records, worst  # noqa: F401  (fixture)
from tests.test_parallel_dp import docs_corpus, docs_run  # noqa: F401  (fixture)

STEPS = 10
ULYSSES = {"parallel.cp": 2, "parallel.cp_mode": "ulysses"}
WINDOW = {"model.sliding_window": 12}
GQA1, GQA2 = {"model.n_kv_heads": 1}, {"model.n_kv_heads": 2}
RUNS = {  # name: (processes, overrides, one-process reference); "docs" runs are on the documents corpus
    "u-cp2": (2, ULYSSES, "single"),
    "a-cp2": (2, {"parallel.cp": 2}, "single"),  # today's all-gather CP, for Ulysses against it
    "u-cp2-window": (2, {**ULYSSES, **WINDOW}, "single-window"),
    "u-cp2-gqa1": (2, {**ULYSSES, **GQA1}, "single-gqa1"),
    "u-cp2-docs": (2, ULYSSES, "single-docs"),
    "u-cp4-gqa2": (4, {**ULYSSES, **GQA2, "parallel.cp": 4, "train.micro_batch_size": 4}, "single-gqa2"),
    "u-fsdp2xcp2": (4, {**ULYSSES, "parallel.dp_shard": 2, "train.micro_batch_size": 4}, "single"),
    "u-tp2spxcp2": (4, {**ULYSSES, "parallel.tp": 2, "parallel.sequence_parallel": "true",
                        "train.micro_batch_size": 8}, "single"),
}
SINGLE = {"single": {}, "single-window": WINDOW, "single-gqa1": GQA1, "single-gqa2": GQA2}
# tests/cp_driver.py's probe of the hook at cp = 1, 2 and 4 (4 ranks), Ulysses on 4 query heads and 2 KV heads
PROBE = {"model": {"vocab_size": 320, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128},
         "batch": 2, "seq_len": 128, "cp_mode": "ulysses"}


@pytest.fixture(scope="module")
def runs(corpus, docs_corpus, tmp_path_factory):  # noqa: F811  (the imported fixtures)
    """Both launches at once, the one-process references meanwhile."""
    from tests.cp_driver import run_trainings

    root = tmp_path_factory.mktemp("ulysses-runs")
    base = {**BASE, "data.corpus": str(corpus), "train.steps": STEPS}
    docs = {**base, **docs_run(docs_corpus)}

    def overrides(name: str, extra: dict) -> dict:
        return {**(docs if name.endswith("docs") else base), **extra}

    t0 = time.time()
    launched = [launch(root, n, {name: overrides(name, o) for name, (procs, o, _) in RUNS.items() if procs == n},
                       probe=PROBE if n == 4 else None) for n in (2, 4)]
    try:
        run_trainings({"out": str(root), "runs": [{"name": n, "overrides": {**base, **o}} for n, o in SINGLE.items()]
                       + [{"name": "single-docs", "overrides": docs}]})
        t1 = time.time()
        for one in launched:
            finish(one)
    finally:  # (a failure leaves no launch behind)
        for proc, _ in launched:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    print(f"TIMING one process {t1 - t0:.1f} s, both launches {time.time() - t0:.1f} s (they overlap)")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_ulysses_matches_one_process(runs, name):
    ref, got = records(runs / RUNS[name][2]), records(runs / name)
    steps = 8 if name.endswith("docs") else STEPS  # (DOCS runs 8 steps)
    assert sorted(got) == list(range(1, steps + 1)) and got.keys() == ref.keys()
    loss, norm = worst(got, ref)
    print(f"\n{name}: max relative difference vs one process over {steps} steps: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < TOL and norm < TOL, (name, loss, norm, got, ref)


@pytest.mark.slow
def test_ulysses_matches_the_allgather_context_parallelism(runs):
    """The same layout (CP=2) under both modes: the same training within the tolerance."""
    ulysses, allgather = records(runs / "u-cp2"), records(runs / "a-cp2")
    assert ulysses.keys() == allgather.keys() == set(range(1, STEPS + 1))
    loss, norm = worst(ulysses, allgather)
    print(f"\nUlysses vs all-gather CP=2: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss < TOL and norm < TOL, (loss, norm)
    assert "all_to_all_bytes" in json.loads((runs / "u-cp2" / "cp_comm.json").read_text())
    assert "all_gather_bytes" in json.loads((runs / "a-cp2" / "cp_comm.json").read_text())


@pytest.mark.slow
def test_ulysses_communication_matches_the_formula(runs):
    """Bytes through the all-to-alls, counted as they run, against spec.parallel.ulysses_comm_bytes."""
    m = ModelConfig(**{k.removeprefix("model."): v for k, v in BASE.items() if k.startswith("model.")})
    for name, (_, extra, _) in RUNS.items():
        if name.startswith("a-") or name.endswith("docs"):
            continue
        comm = json.loads((runs / name / "cp_comm.json").read_text())
        micro = int(extra.get("train.micro_batch_size", BASE["train.micro_batch_size"]))
        dp, tp, cp = int(extra.get("parallel.dp_shard", 1)), int(extra.get("parallel.tp", 1)), extra["parallel.cp"]
        kv = int(extra.get("model.n_kv_heads", m.n_heads))
        qkv, out = ulysses_bytes(micro, 32, m.n_heads, kv, m.head_dim, 4, tp, cp)
        want = ulysses_comm_bytes(qkv, out, cp, m.n_layers, BASE["train.global_batch_size"] // (micro * dp))
        assert comm["all_to_all_bytes"] == want["all_to_all_bytes"] * comm["steps"], (name, comm, want)
        assert comm["all_to_all_calls"] == want["calls"] * comm["steps"], (name, comm, want)


@pytest.mark.slow
def test_ulysses_hook_saves_one_over_cp_of_the_activations_with_replicated_kv(runs):
    """The probe (the hook alone, cp = 1, 2 and 4 on 4 ranks, 2 KV heads): loss and gradients (summed
    over the CP ranks) equal one process's; per-rank bytes autograd saves (parameters excluded) =
    spec.parallel.ulysses_activation_bytes: 1/cp of one process's, with the K/V counted twice at cp = 4
    (2 KV heads replicated to 4), equal on every rank."""
    probe = [json.loads((runs / f"probe_rank{r}.json").read_text()) for r in range(4)]
    m, b, t = PROBE["model"], PROBE["batch"], PROBE["seq_len"]
    head_dim = m["dim"] // m["n_heads"]
    kv = m["n_layers"] * cp_kv_bytes(b, t, m["n_kv_heads"], head_dim, 4)
    one = probe[0]["1"]
    for cp in (2, 4):
        for rank, p in enumerate(probe):
            assert abs(p[str(cp)]["nll"] - one["nll"]) / one["nll"] < 1e-6, (rank, cp, p[str(cp)]["nll"], one["nll"])
            scale = max(abs(g) for g in one["grad"])
            assert max(abs(a - b) for a, b in zip(p[str(cp)]["grad"], one["grad"])) / scale < 1e-5, (rank, cp)
        saved = {p[str(cp)]["saved_bytes"] for p in probe}
        assert len(saved) == 1, saved
        replication = ulysses_kv_heads(m["n_heads"], m["n_kv_heads"], cp) / m["n_kv_heads"]
        want, got = ulysses_activation_bytes(one["saved_bytes"], kv, cp, replication), saved.pop()
        print(f"\ncp={cp}: saved {got:,} B per rank, formula (A - KV)/cp + KV x {replication:g}/cp = {want:,.0f} B "
              f"(A = {one['saved_bytes']:,} B one process, KV = {kv:,} B)")
        assert abs(got - want) / want < 1e-5, (cp, got, want)


# ---- without a launch --------------------------------------------------------------------------


def simulated_ulysses(monkeypatch, q, k, v, cp: int, window: int = 0, doc_ids=None):
    """Every Ulysses rank's `attention` over whole-sequence q (b, heads, T, d), k, v (b, kv heads, T, d),
    in this process and on this thread: the ranks run one after another, and a run that reaches an
    all-to-all no earlier run reached records what it sends and stops there; the next round replays
    every rank from the start, each all-to-all receiving what the ranks recorded, up to the next one.
    The ranks' work is deterministic (fp64 on the CPU), so the replays redo the same arithmetic. (No
    threads: a thread per rank, meeting at a barrier, hung a full -n 2 run once in torch's lazy
    initialisation.) Returns the output and the gradients of q, k and v (of the outputs' sum weighted
    by noise), the ranks' chunks put back in sequence order, the noise, and the last round's ranks,
    whose byte counts are one full forward + backward."""
    import torch

    from lmforge.parallel.context_parallel import UlyssesSharding

    class Stop(Exception):
        """A rank reached an all-to-all whose blocks not every rank has recorded yet."""

    sent: list[list[torch.Tensor]] = [[] for _ in range(cp)]  # sent[r][i]: rank r's i-th all-to-all
    calls = [0] * cp

    def exchange(self, send):  # what dist.all_to_all_single hands rank `self.rank`
        i = calls[self.rank]
        calls[self.rank] += 1
        if i == len(sent[self.rank]):
            sent[self.rank].append(send.detach().contiguous().clone())
            raise Stop
        assert torch.equal(sent[self.rank][i], send), "a replay must send what its first run sent"
        assert all(len(sent[src]) > i for src in range(cp)), "the ranks must reach the same all-to-alls"
        self.count("all_to_all_bytes", send)
        return torch.stack([sent[src][i][self.rank] for src in range(cp)])

    monkeypatch.setattr(UlyssesSharding, "all_to_all", exchange)
    weight = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(2))

    def rank(s):
        q_r, k_r, v_r = (s.local(t, 2).detach().requires_grad_() for t in (q, k, v))
        masks = None if doc_ids is None else s.document_masks(doc_ids, window, 0.0)
        out = s.attention(q_r, k_r, v_r, 0.0, window, masks)
        out.backward(s.local(weight, 2))
        return out.detach(), q_r.grad, k_r.grad, v_r.grad

    for _ in range(16):  # (forward and backward hold 4 all-to-alls: 5 rounds)
        shards = [UlyssesSharding(None, r, cp, torch.device("cpu")) for r in range(cp)]
        results, calls[:] = {}, [0] * cp
        for s in shards:
            try:
                results[s.rank] = rank(s)
            except Stop:
                pass
        if len(results) == cp:
            break
        assert not results, f"ranks {sorted(results)} finished while others wait at an all-to-all"
    else:
        raise AssertionError("the ranks did not finish in 16 rounds")

    def whole(i: int) -> torch.Tensor:  # the ranks' chunks back in sequence order
        chunks = [None] * (2 * cp)
        for s in shards:
            lo, hi = s.chunks_of[s.rank]
            chunks[lo], chunks[hi] = results[s.rank][i].chunk(2, dim=-2)
        return torch.cat(chunks, dim=-2)

    return [whole(i) for i in range(4)], weight, shards


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window, documents", [(0, False), (5, False), (20, False), (0, True), (6, True)])
def test_ulysses_attention_equals_one_process(monkeypatch, cp, kv_heads, window, documents):
    """The all-to-alls and the chunk order around one process's attention (lmforge.model.layers.
    dense_attention): output and gradients of q, k and v equal one process's, fp64, for as many KV
    heads as query heads and for fewer (2 KV heads at cp 4, 1 at cp 2 and 4: replicated), causal,
    within sliding windows (inside a chunk, across chunks) and within documents; the bytes exchanged
    are the closed form's forward + backward of one layer."""
    import torch

    from lmforge.model.documents import document_mask
    from lmforge.model.layers import dense_attention

    gen = torch.Generator().manual_seed(0)
    b, heads, seq, d = 2, 4, 64, 8
    q = torch.randn(b, heads, seq, d, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(b, kv_heads, seq, d, dtype=torch.float64, generator=gen) for _ in range(2))
    doc_ids = torch.cumsum(torch.rand(b, seq, generator=gen) < 0.1, dim=1) if documents else None
    got, weight, shards = simulated_ulysses(monkeypatch, q, k, v, cp, window, doc_ids)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None if doc_ids is None else document_mask(doc_ids, doc_ids, 0, window, 0.0)
    ref = dense_attention(q, k, v, 0.0, window, mask)
    ref.backward(weight)
    for name, a, want in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
        assert ((a - want).abs().max() / want.abs().max()).item() < 1e-10, (name, cp, kv_heads, window, documents)
    qkv, out = ulysses_bytes(b, seq, heads, kv_heads, d, 8, 1, cp)
    assert {s.comm["all_to_all_bytes"] for s in shards} == {ulysses_comm_bytes(qkv, out, cp, 1, 1)["all_to_all_bytes"]}


def test_heads_split_over_the_ranks_or_kv_heads_are_replicated():
    assert ulysses_kv_heads(8, 8, 4) == 8 and ulysses_kv_heads(8, 2, 4) == 4 and ulysses_kv_heads(8, 1, 8) == 8
    assert not ulysses_splits(6, 6, 4) and not ulysses_splits(12, 6, 4) and ulysses_splits(12, 2, 4)
    with pytest.raises(ValueError, match="must be a multiple of cp or divide it"):
        ulysses_kv_heads(12, 6, 4)


def test_config_and_planner_refuse_heads_that_do_not_split_by_the_same_rule():
    """The tiny preset's 6 heads over cp = 4: `lmforge train` and `lmforge plan --layout` name the rule."""
    from lmforge.plan.layout import Layout

    with pytest.raises(LayoutRefused, match=r"^parallel.cp_mode = 'ulysses' with parallel.cp = 4: its all-to-all") \
            as exc:
        load_config("tiny", {"parallel.cp": 4, "parallel.cp_mode": "ulysses"})
    assert exc.value.refusals[0].rule == "ulysses-whole-heads"
    assert "choose parallel.cp among [2, 3, 6]" in str(exc.value)
    cfg = load_config("tiny")
    with pytest.raises(LayoutRefused, match=r"^layout cpm = 'ulysses' with cp = 4") as planned:
        Layout.parse("cp=4,cpm=ulysses").validate(cfg.model, cfg.data.seq_len)
    assert planned.value.refusals[0].rule == "ulysses-whole-heads"
    load_config("tiny", {"parallel.cp": 4})  # the all-gather takes any head count
    with pytest.raises(ConfigError, match="parallel.cp_mode"):
        load_config("tiny", {"parallel.cp": 2, "parallel.cp_mode": "ring"})
    with pytest.raises(ValueError, match="layout cp_mode = 'ring' is not one of allgather, ulysses"):
        Layout.parse("cp=2,cpm=ring")


def test_ulysses_refuses_multi_head_latent_attention():
    from lmforge.plan.layout import Layout, lmforge_refusals

    cfg = load_config("tiny-mla-moe")
    layout = Layout(dp=2, zero=3, cp=2, cp_mode="ulysses", micro_batch=1, grad_accum=4)
    assert "ulysses-no-mla" in [r.rule for r in lmforge_refusals(cfg, layout, cfg.data.seq_len)]
    assert "ulysses-no-mla" not in [r.rule for r in lmforge_refusals(cfg, Layout(dp=2, zero=3, cp=2, micro_batch=1,
                                                                                 grad_accum=4), cfg.data.seq_len)]


def test_layout_key_round_trips():
    from lmforge.plan.layout import Layout

    layout = Layout.parse("dp=2,zero=3,cp=4,cpm=ulysses,tp=2")
    assert layout.cp_mode == "ulysses" and ",cp=4,cpm=ulysses," in layout.short()
    assert Layout.parse(layout.short()) == layout
    assert "cpm" not in Layout.parse("dp=2,cp=4").short()


def test_plan_counts_ulysses_traffic_and_memory():
    """GPT-3 (96 heads, no GQA) at tp 8 (12 heads per rank), cp 4: the planner's traffic is the closed
    form; per layer an all-gather CP rank moves cp / 2 = 2 times the bytes of a Ulysses rank (K/V of the
    whole sequence in and out, against q, k, v and the output of its own tokens), and holds more K/V.
    Llama-2-70B (8 KV heads) at tp 8 has one KV head per rank, replicated 4 times: Ulysses holds the
    whole sequence's K/V like the all-gather."""
    from lmforge.plan.activations import activation_bytes_per_layer
    from lmforge.plan.flops import cp_comm
    from lmforge.plan.layout import Layout

    gpt3 = load_config("gpt3-175b").model
    seq = 32768
    ulysses = Layout.parse("dp=2,zero=3,cp=4,cpm=ulysses,tp=8,mb=1,ga=8,ac=none")
    allgather = Layout.parse("dp=2,zero=3,cp=4,tp=8,mb=1,ga=8,ac=none")
    layers = gpt3.n_layers
    tokens = seq // 4
    want = ulysses_comm_bytes(tokens * (12 + 24) * 128 * 2, tokens * 12 * 128 * 2, 4, layers, 8)
    assert cp_comm(gpt3, ulysses, seq) == want
    gathered = cp_comm(gpt3, allgather, seq)
    assert gathered == cp_comm_bytes(cp_kv_bytes(1, seq, 96, 128, 2, 8), 4, layers, 8)
    assert math.isclose(gathered["wire_bytes"] / want["wire_bytes"], 4 / 2, rel_tol=1e-9)
    assert activation_bytes_per_layer(gpt3, ulysses, seq, "lmforge") < activation_bytes_per_layer(gpt3, allgather, seq,
                                                                                                  "lmforge")
    llama = load_config("llama2-70b").model
    u, a = (Layout.parse(f"dp=2,zero=3,cp=4,{mode}tp=8,mb=1,ga=8,ac=none") for mode in ("cpm=ulysses,", ""))
    assert math.isclose(activation_bytes_per_layer(llama, u, seq, "lmforge"),
                        activation_bytes_per_layer(llama, a, seq, "lmforge"), rel_tol=1e-12)


def test_search_considers_both_modes():
    from lmforge.plan.hardware import parse_cluster
    from lmforge.plan.search import enumerate_layouts

    gpt3 = load_config("gpt3-175b").model
    layouts = enumerate_layouts(gpt3, parse_cluster("8x8xH100"), 64, seq_len=32768)
    modes = {(lay.cp, lay.cp_mode) for lay in layouts}
    assert {(1, "allgather"), (2, "allgather"), (2, "ulysses"), (8, "ulysses")} <= modes
    assert (1, "ulysses") not in modes
    # where the heads of a TP rank do not split over cp, only the all-gather
    assert not any(lay.cp_mode == "ulysses" and (gpt3.n_heads // lay.tp) % lay.cp for lay in layouts)
