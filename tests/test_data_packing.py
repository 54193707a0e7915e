"""Best-fit packing (data.packing = "best_fit", lmforge.data.packing) and mixture stages
(data.stages, lmforge.data.mixture) in the loader: what a row holds, that an epoch of rows trains on
every token once, the same rows at every world size, bit-exact resumes mid-epoch (with the prefetch
thread too), and stages as a function of the config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.data.loader import PackedLoader, TokenMixture
from lmforge.data.mixture import MixStage, MixtureStream, mixture_block, stage_plan, stage_record, stage_start_samples
from lmforge.data.packing import best_fit_decreasing, document_spans, padded_batch, padding_fraction, split_long
from lmforge.data.prefetch import Prefetcher
from lmforge.data.shards import TokenShards, write_token_shards

EOS = 0
SEQ = 16


def corpus(path, n_docs: int, seed: int, first_id: int = 1, max_len: int = 40) -> list[np.ndarray]:
    """Documents of 1..max_len tokens (EOS last), token ids unique over the corpus (ids >= first_id)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, n_docs)
    ids = np.arange(first_id, first_id + int(lengths.sum()))
    docs, at = [], 0
    for n in lengths.tolist():
        docs.append(np.append(ids[at:at + n - 1], EOS))
        at += n - 1
    write_token_shards(docs, path, 500, 1 << 16, {"eos_id": EOS, "documents": n_docs})
    return docs


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    docs = corpus(root / "a", 300, seed=0)
    other = corpus(root / "b", 120, seed=1, first_id=20_000, max_len=90)
    return TokenShards(root / "a"), docs, TokenShards(root / "b")


def loader(shards, batch_size=8, rank=0, world=1, **kw) -> PackedLoader:
    return PackedLoader(shards, SEQ, batch_size, seed=3, rank=rank, world_size=world, packing="best_fit",
                        packing_buffer=kw.pop("packing_buffer", 8), **kw)


def test_spans_pieces_and_best_fit():
    from lmforge.data.shards import write_token_shards as write
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        write([np.array([5, 6, EOS, 7, EOS, EOS, 8, 9])], Path(tmp) / "s", 3, 16, {})
        starts, lengths = document_spans(TokenShards(Path(tmp) / "s"), EOS)
    assert starts.tolist() == [0, 3, 5, 6] and lengths.tolist() == [3, 2, 1, 2]  # the tail: a document too
    # a 40-token document in rows of seq_len 16: pieces start every 16 tokens, overlap by one
    ps, pl, doc = split_long(np.array([100, 0]), np.array([40, 17]), 16)
    assert ps.tolist() == [100, 116, 132, 0] and pl.tolist() == [17, 17, 8, 17] and doc.tolist() == [0, 0, 0, 1]
    targets = [t for s, n in zip(ps[:3], pl[:3]) for t in range(s + 1, s + n)]
    assert targets == list(range(101, 140))  # every token but the first is a target exactly once
    lengths = np.random.default_rng(0).integers(1, 18, 200)
    rows = best_fit_decreasing(lengths, 17)
    assert sorted(i for row in rows for i in row) == list(range(200))
    assert all(lengths[row].sum() <= 17 for row in rows)
    # the rule, by brute force: each item (longest first) goes to the fullest row it fits, else a new one
    want: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable"):
        fits = [r for r in range(len(want)) if lengths[want[r]].sum() + lengths[i] <= 17]
        best = min(fits, key=lambda r: (17 - lengths[want[r]].sum(), r)) if fits else None
        want[best].append(i) if best is not None else want.append([i])
    assert rows == want


def test_rows_start_at_documents_and_pad_only_at_the_end(data):
    shards, docs, _ = data
    one = loader(shards)
    piece_starts = {int(t) for d in docs for t in (d[::SEQ] if len(d) > SEQ + 1 else d[:1])}
    for _ in range(30):
        x, y = one.next_batch()
        for xr, yr in zip(x, y):
            real = yr != -100
            n = int(real.sum()) + 1  # the row's real tokens: its inputs up to the last real target
            assert real[:n - 1].all() and not real[n - 1:].any() and (xr[n:] == EOS).all()  # padding at the end
            assert int(xr[0]) in piece_starts  # a row begins with a document (or a long one's next piece)
            m = min(n, SEQ)  # (x holds the row's first seq_len tokens)
            after_eos = xr[1:m][xr[:m - 1] == EOS]
            assert all(int(t) in piece_starts for t in after_eos)  # and whole documents (or pieces) after it
    assert padding_fraction(np.array([SEQ + 1, 1, 9]), SEQ) == pytest.approx((0 + 16 + 8) / 48)
    x, y = padded_batch(np.array([[5, 6, 7, EOS, EOS], [1, 2, 3, 4, 5]]), np.array([3, 5]))
    assert x.tolist() == [[5, 6, 7, EOS], [1, 2, 3, 4]] and y.tolist() == [[6, 7, -100, -100], [2, 3, 4, 5]]


def test_an_epoch_of_rows_holds_every_token_once(data):
    """All the rows of epoch 0 (read straight from the packer) hold each token of the source once (a long
    document's piece boundaries twice: the last token of a piece is the first of the next, so that it is
    a target once): best fit wastes padding, never data."""
    from collections import Counter

    shards, docs, _ = data
    packer = loader(shards).packers[0]
    held, row = Counter(), 0
    while (buf := packer._buffer_holding(row)).epoch == 0:
        tokens, fill = packer.rows(np.arange(row, buf.end_row))
        for t, n in zip(tokens, fill):
            held.update(t[:n].tolist())
        row = buf.end_row
    want = Counter(t for d in docs for t in d.tolist())
    want.update(t for d in docs if len(d) > SEQ + 1 for t in d[SEQ:-1:SEQ].tolist())
    assert held == want and row > 0


@pytest.mark.parametrize("mixed", [False, True])
def test_same_rows_at_every_world_size_and_resume_mid_epoch(data, mixed):
    shards, _, other = data
    src = TokenMixture([("a", shards, 0.6), ("b", other, 0.4)]) if mixed else shards
    ref = loader(src, batch_size=8)
    stream = [ref.next_batch() for _ in range(40)]  # several buffers, past an epoch of b
    two = [loader(src, batch_size=4, rank=r, world=2) for r in range(2)]
    for step in range(12):
        got = [r.next_batch() for r in two]
        for i in range(8):
            assert torch.equal(got[i % 2][0][i // 2], stream[step][0][i])
            assert torch.equal(got[i % 2][1][i // 2], stream[step][1][i])
    states = [r.state_dict() for r in two]
    assert states[0] == states[1] and states[0]["packing"]["buffer"] == 8  # one state on every rank
    four = [loader(src, batch_size=2, rank=r, world=4) for r in range(4)]
    for r in four:
        r.load_state_dict(states[1])
    for step in range(12, 40):
        got = [r.next_batch() for r in four]
        for i in range(8):
            assert torch.equal(got[i % 4][0][i // 4], stream[step][0][i])
            assert torch.equal(got[i % 4][1][i // 4], stream[step][1][i])


def test_prefetched_best_fit_batches_and_state_are_the_plain_loaders(data):
    shards, _, _ = data
    plain, ahead = loader(shards), Prefetcher(loader(shards), depth=3)
    try:
        for _ in range(7):
            a, b = plain.next_batch(), ahead.next_batch()
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert ahead.state_dict() == plain.state_dict()
        resumed = loader(shards)
        resumed.load_state_dict(ahead.state_dict())
        for _ in range(5):
            a, b = plain.next_batch(), resumed.next_batch()
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        ahead.close()


def test_switching_packing_on_resume_is_refused(data):
    shards, _, _ = data
    a = loader(shards)
    a.next_batch()
    with pytest.raises(ValueError, match="data.packing: the checkpoint's loader packed best_fit"):
        PackedLoader(shards, SEQ, 8, seed=3).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="packing_buffer 8, this config packs best_fit with packing_buffer 9"):
        loader(shards, packing_buffer=9).load_state_dict(a.state_dict())


def test_padding_is_never_attended_to():
    """Changing the padding's tokens changes no real position's logits (causal and document masks)."""
    from lmforge.config import ModelConfig
    from lmforge.model.documents import DocumentAttention
    from lmforge.model.transformer import build_model

    model = build_model(ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, max_seq_len=64), seed=0)
    x = torch.randint(1, 97, (2, 24))
    x[:, 9], x[:, 15] = EOS, EOS  # two documents, then padding from 16 on
    other = x.clone()
    other[:, 16:] = torch.randint(1, 97, (2, 8))
    for docs in ({}, DocumentAttention(EOS).inputs(x)):
        assert torch.equal(model(x, **docs)[:, :16], model(other, **docs)[:, :16])


# ---- mixture stages ------------------------------------------------------------------------------------


def stages(*specs) -> list[MixStage]:
    """MixStage list from (start sample, weights) pairs over sources ["a", "b"]."""
    return [MixStage(start, tuple(w / sum(ws) for w in ws), f"stage {i}", stage_record(start, ["a", "b"], ws))
            for i, (start, ws) in enumerate(specs)]


def test_one_stage_is_the_plain_mixture_and_each_source_keeps_its_count():
    one = MixtureStream(stages((0, (0.7, 0.3))), 2)
    c, order, prefix = mixture_block([0.7, 0.3])
    g = np.arange(5000)
    src, k = one.locate(g)
    blk, i = np.divmod(g, len(order))
    assert (src == order[i]).all() and (k == blk * c[src] + prefix[src, i]).all()
    two = MixtureStream(stages((0, (0.7, 0.3)), (1234, (0.0, 1.0)), (3000, (0.5, 0.5))), 2)
    src, k = two.locate(g)
    assert (src[1234:3000] == 1).all()  # the second stage draws b only
    for s in (0, 1):  # each source's samples are numbered 0, 1, 2, ... across the stages
        assert k[src == s].tolist() == list(range(int((src == s).sum())))
    assert two.counts_before(3000).tolist() == [int((src[:3000] == s).sum()) for s in (0, 1)]
    assert [len(two.begun(p)) for p in (0, 1234, 1235, 3001)] == [0, 1, 2, 3]


def test_stage_starts_follow_the_batch_schedule():
    assert stage_start_samples([0, 10, 25], 32) == [0, 320, 800]
    # a ramp-up from 8 to 32 sequences over 4096 tokens of 16-token sequences
    from lmforge.optim.schedules import BatchRampup

    ramp = BatchRampup(8, 32, 4096, 8, 16)
    samples, step, starts = 0, 0, []
    for target in (0, 5, 40):
        while step < target:
            samples += ramp.batch_at(samples * 16)
            step += 1
        starts.append(samples)
    assert stage_start_samples([0, 5, 40], 32, ramp.batch_at, 16) == starts


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_a_resume_in_the_second_stage_at_another_world_size_continues_the_stream(data, packing):
    shards, _, other = data
    mix = TokenMixture([("a", shards, 0.6), ("b", other, 0.4)])
    plan = stages((0, (0.6, 0.4)), (80, (0.0, 1.0)))

    def make(batch, rank=0, world=1, st=plan):
        return PackedLoader(mix, SEQ, batch, seed=3, rank=rank, world_size=world, packing=packing,
                            packing_buffer=8, stages=st)

    ref = make(8)
    stream = [ref.next_batch()[0] for _ in range(20)]  # stage 1 from step 10 (sample 80) on
    late = torch.cat(stream[10:])
    assert not ((late > 0) & (late < 20_000)).any()  # b only in stage 1 (a's ids are below 20000)
    assert ((torch.cat(stream[:10]) > 0) & (torch.cat(stream[:10]) < 20_000)).any()
    two = [make(4, r, 2) for r in range(2)]
    for _ in range(13):
        for r in two:
            r.next_batch()
    sd = two[0].state_dict()
    assert [s["start_step"] for s in sd["stages"]] == [0, 80]
    one = make(8)
    one.load_state_dict(sd)
    for step in range(13, 20):
        assert torch.equal(one.next_batch()[0], stream[step])
    # a stage that has run cannot change; a later one may be added
    changed = stages((0, (0.6, 0.4)), (80, (0.5, 0.5)))
    with pytest.raises(ValueError, match="stage 1 .changed.*cannot change"):
        make(8, st=changed).load_state_dict(sd)
    with pytest.raises(ValueError, match="stage 1 .removed"):
        make(8, st=plan[:1]).load_state_dict(sd)
    later = make(8, st=plan + stages((0, (1, 1)), (120, (1.0, 0.0)))[1:])
    later.load_state_dict(sd)
    assert torch.equal(later.next_batch()[0], stream[13])
    earlier = stages((0, (0.6, 0.4)), (40, (1.0, 0.0)), (80, (0.0, 1.0)))
    with pytest.raises(ValueError, match="stage 1 .changed"):
        make(8, st=earlier).load_state_dict(sd)


def test_stage_plan_counts_tokens_and_warns_on_repetition():
    stream = MixtureStream(stages((0, (0.5, 0.5)), (1000, (0.0, 1.0))), 2)
    plan = stage_plan(stream, ["a", "b"], [8000, 3000], [0, 100], 200, 2000, 16, max_epochs=4.0)
    assert plan.tokens.tolist() == [[8000, 8000], [0, 16000]]
    assert plan.epochs.tolist() == [1.0, 8.0]
    assert len(plan.warnings) == 1 and "'b' is repeated 8.0 times" in plan.warnings[0]
    from lmforge.data.mixture import format_stage_plan

    lines = format_stage_plan(plan)
    assert lines[0].startswith("data: stage 0, steps 0-99: 16,000 tokens: a 8,000 (50%), b 8,000 (50%)")
    assert lines[1].startswith("data: stage 1, steps 100-199: 16,000 tokens: b 16,000 (100%)")
    short = stage_plan(stream, ["a", "b"], [8000, 3000], [0, 100], 50, 500, 16, max_epochs=4.0)
    assert short.tokens.tolist() == [[4000, 4000], [0, 0]] and len(format_stage_plan(short)) == 2  # not reached


@pytest.mark.parametrize("bad, message", [
    ({"data.stages": [{"start_step": 10, "weights": {"a": 0.0}}]}, r"data.stages\[0\].weights.a = 0.0 must be > 0"),
    ({"data.stages": [{"start_step": 10, "weights": {"a": -1.0}}]}, r"data.stages\[0\].weights.a = -1.0 must be > 0"),
    ({"data.stages": [{"start_step": 50}, {"start_step": 30}]},
     r"data.stages\[1\].start_step = 30 must come after the previous stage's start_step = 50"),
    ({"data.stages": [{"start_step": 50}, {"start_step": 50}]}, r"must come after the previous"),
    ({"data.stages": [{"start_step": 50, "lr_decay": True}]}, r"lr_decay = true .* schedule.name = 'cosine'"),
    ({"data.stages": [{"start_step": 5, "lr_decay": True}], "schedule.name": "wsd"}, r"falls in the warmup"),
    ({"data.stages": [{"start_step": 50, "lr_decay": True}, {"start_step": 60, "lr_decay": True}],
      "schedule.name": "wsd"}, r"more than one stage"),
    ({"data.stages": [{"start_step": 5, "weights": {"a": "x"}}]}, r"data.stages\[0\].weights.a = 'x' must be a number"),
    ({"data.packing": "bestfit"}, r"data.packing = 'bestfit' is not one of 'concat', 'best_fit'"),
    ({"data.packing_buffer": 0}, r"data.packing_buffer = 0 must be >= 1"),
])
def test_bad_stage_and_packing_configs_are_one_line_errors(bad, message):
    from lmforge.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message) as e:
        load_config("tiny", bad)
    assert "\n" not in str(e.value)


def test_an_unknown_source_is_refused_before_any_model_is_built(data):
    from lmforge.config import ConfigError, load_config
    from lmforge.train.components import mix_stages

    shards, _, other = data
    mix = TokenMixture([("a", shards, 0.6), ("b", other, 0.4)])
    cfg = load_config("tiny", {"data.stages": [{"start_step": 10, "weights": {"b": 1.0, "books": 2.0}}]})
    with pytest.raises(ConfigError, match=r"data.stages\[0\].weights names unknown sources \['books'\]; the "
                                          r"prepared mixture's sources: \['a', 'b'\]"):
        mix_stages(cfg, mix)
    ok = mix_stages(load_config("tiny", {"data.stages": [{"start_step": 10, "weights": {"b": 1.0}}]}), mix)
    assert [(s.start, s.weights, s.label) for s in ok] == [(0, (0.6, 0.4), "the prepared mixture"),
                                                            (320, (0.0, 1.0), "data.stages[0]")]


def test_lmforge_plan_reads_the_same_stage_plan_as_the_run_header(data):
    """`lmforge plan`'s entry (lmforge.data.mixture.plan_for_config: mixture.json and manifests only, no
    torch) prints the lines the run header prints from the opened mixture."""
    import json

    from lmforge.config import load_config
    from lmforge.data.loader import open_tokens
    from lmforge.data.mixture import plan_for_config
    from lmforge.train.components import stage_plan_lines

    shards, _, other = data
    root = shards.dir.parent
    (root / "mixture.json").write_text(json.dumps({"sources": [{"name": "a", "dir": "a", "weight": 0.6},
                                                               {"name": "b", "dir": "b", "weight": 0.4}]}))
    cfg = load_config("tiny", {"data.stages": [{"start_step": 100, "weights": {"b": 1.0}, "name": "anneal"},
                                               {"start_step": 900, "weights": {"a": 1.0}}]})
    lines, warnings = plan_for_config(cfg, root)
    assert (lines, warnings) == stage_plan_lines(cfg, open_tokens(root))
    assert lines[1].startswith("data: anneal, steps 100-249: 614,400 tokens: b 614,400 (100%)")
    assert any("'b' is repeated" in w for w in warnings) and any("starts at step 900" in w for w in warnings)
