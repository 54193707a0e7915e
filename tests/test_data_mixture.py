"""PackedLoader over weighted mixtures: proportions, rank sharding, resume at other world sizes,
document-boundary masking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.data.loader import MIX_BLOCK, PackedLoader, TokenMixture, _mixture_block
from lmforge.data.shards import TokenShards, write_token_shards

SEQ = 8


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> TokenMixture:
    """web: tokens 0..999 (125 windows); books: tokens 1000..1400 (50 windows)."""
    root = tmp_path_factory.mktemp("mix")
    write_token_shards([np.arange(0, 1001)], root / "web", 97, 4096, {"eos_id": 4095})
    write_token_shards([np.arange(1000, 1401)], root / "books", 50, 4096, {"eos_id": 4095})
    return TokenMixture([("web", TokenShards(root / "web"), 0.7),
                         ("books", TokenShards(root / "books"), 0.3)])


def _sample_ids(x: torch.Tensor) -> list[int]:
    return x[:, 0].tolist()  # first token identifies source and window


def _take(loader: PackedLoader, steps: int) -> list[int]:
    return [s for _ in range(steps) for s in _sample_ids(loader.next_batch()[0])]


def test_block_counts_are_exact_and_spread():
    c, order, prefix = _mixture_block([0.7, 0.3], 1000)
    assert c.tolist() == [700, 300] and len(order) == 1000
    assert max(np.diff(np.flatnonzero(order == 1))) <= 4  # books never bunch up
    c, order, _ = _mixture_block([1 / 3, 1 / 3, 1 / 3], 1000)
    assert sorted(c.tolist()) == [333, 333, 334]
    c, _, _ = _mixture_block([0.9999, 0.0001], 1000)
    assert c.tolist() == [999, 1]  # every source appears at least once per block


def test_realised_proportions_within_tolerance(mixture):
    loader = PackedLoader(mixture, SEQ, batch_size=50, seed=0)
    samples = np.array(_take(loader, 100))  # 5000 samples = 5 whole blocks
    books = samples >= 1000
    assert books.sum() == 5 * 300  # whole blocks: exact
    for n in (137, 1000, 2345, 4999):  # any prefix: within 1/MIX_BLOCK + one block rounding
        assert abs(books[:n].mean() - 0.3) <= 1 / MIX_BLOCK + 3 / n
    # each source goes through its own epochs: every window of a source once per epoch
    web = samples[~books][:125]
    assert sorted(web.tolist()) == list(range(0, 1000, SEQ))
    bk = samples[books][:100]
    assert sorted(bk[:50].tolist()) == sorted(bk[50:].tolist()) == list(range(1000, 1400, SEQ))
    assert bk[:50].tolist() != bk[50:].tolist()  # reshuffled per epoch


def test_weights_override_and_mismatched_vocab(mixture, tmp_path):
    write_token_shards([np.arange(10)], tmp_path / "other", 10, 300, {})
    with pytest.raises(ValueError, match="different vocab sizes"):
        TokenMixture([("a", mixture.shards[0], 1), ("b", TokenShards(tmp_path / "other"), 1)])
    with pytest.raises(ValueError, match="weight 0 must be > 0"):
        TokenMixture([("a", mixture.shards[0], 0)])


def test_two_ranks_disjoint_union_is_one_rank(mixture):
    one = PackedLoader(mixture, SEQ, batch_size=10, seed=3)
    ranks = [PackedLoader(mixture, SEQ, batch_size=5, seed=3, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(40):
        ref = _sample_ids(one.next_batch()[0])
        got = [_sample_ids(r.next_batch()[0]) for r in ranks]
        assert got[0] == ref[0::2] and got[1] == ref[1::2]
    # disjoint within an epoch of the whole data: positions are disjoint by construction
    a = PackedLoader(mixture, SEQ, batch_size=5, seed=3, rank=0, world_size=2)
    b = PackedLoader(mixture, SEQ, batch_size=5, seed=3, rank=1, world_size=2)
    sa = [s for _ in range(5) for s in _sample_ids(a.next_batch()[0])]
    sb = [s for _ in range(5) for s in _sample_ids(b.next_batch()[0])]
    assert not set(sa) & set(sb)


@pytest.mark.parametrize("steps", [4, 30])  # 30*7*0.3 > 50: past a books epoch
def test_resume_mid_epoch_continues_identically(mixture, steps):
    a = PackedLoader(mixture, SEQ, batch_size=7, seed=5, mask_doc_boundaries=True)
    for _ in range(steps):
        a.next_batch()
    sd = a.state_dict()
    cont = [a.next_batch() for _ in range(10)]
    b = PackedLoader(mixture, SEQ, batch_size=7, seed=5, mask_doc_boundaries=True)
    b.load_state_dict(sd)
    for xa, ya in cont:
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("data", ["mixture", "single"])
def test_resume_from_2_to_4_ranks_keeps_global_order(mixture, data):
    d = mixture if data == "mixture" else mixture.shards[0]
    ref = PackedLoader(d, SEQ, batch_size=16, seed=11)  # global batch 16 on one rank
    stream = _take(ref, 30)
    two = [PackedLoader(d, SEQ, batch_size=8, seed=11, rank=r, world_size=2) for r in range(2)]
    for _ in range(9):
        for r in two:
            r.next_batch()
    sd = two[1].state_dict()
    assert sd["position"] == 9 * 16
    four = [PackedLoader(d, SEQ, batch_size=4, seed=11, rank=r, world_size=4) for r in range(4)]
    for r in four:
        r.load_state_dict(sd)
    for step in range(9, 30):
        per_rank = [_sample_ids(r.next_batch()[0]) for r in four]
        merged = [per_rank[i % 4][i // 4] for i in range(16)]
        assert merged == stream[step * 16:(step + 1) * 16]


def test_resume_rejects_changed_mixture(mixture):
    a = PackedLoader(mixture, SEQ, batch_size=4, seed=0)
    a.next_batch()
    sd = a.state_dict()
    other = TokenMixture([("web", mixture.shards[0], 0.5), ("books", mixture.shards[1], 0.5)])
    with pytest.raises(ValueError, match="stage 0 .changed.*A stage that has run cannot change"):
        PackedLoader(other, SEQ, batch_size=4, seed=0).load_state_dict(sd)
    with pytest.raises(ValueError, match="sources or seq_len changed"):
        PackedLoader(mixture, SEQ + 1, batch_size=4, seed=0).load_state_dict(sd)


def test_doc_boundary_masking(tmp_path):
    eos = 9
    docs = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6, 7, 8, 1, 2])]
    stream = np.concatenate([np.append(d, eos) for d in docs] * 20)
    write_token_shards([stream], tmp_path / "s", 64, 16, {"eos_id": eos})
    sh = TokenShards(tmp_path / "s")
    plain = PackedLoader(sh, 10, batch_size=4, seed=0)
    masked = PackedLoader(sh, 10, batch_size=4, seed=0, mask_doc_boundaries=True)
    for _ in range(5):
        (x0, y0), (x1, y1) = plain.next_batch(), masked.next_batch()
        assert x0.shape == y1.shape == (4, 10) and torch.equal(x0, x1)
        assert torch.equal(y1 == -100, x1 == eos)  # only targets after an EOS input
        assert torch.equal(y1[x1 != eos], y0[x0 != eos])
        assert (y1 == eos).any()  # predicting the end of a document is still trained
    ev = next(iter(masked.iter_eval_batches(1)))
    assert torch.equal(ev[1] == -100, ev[0] == eos)
    write_token_shards([stream], tmp_path / "n", 64, 16, {})
    with pytest.raises(ValueError, match="mask_doc_boundaries needs eos_id"):
        PackedLoader(TokenShards(tmp_path / "n"), 10, 4, 0, mask_doc_boundaries=True)
    PackedLoader(TokenShards(tmp_path / "n"), 10, 4, 0, mask_doc_boundaries=True, eos_id=eos)


def test_eval_batches_cover_all_sources(mixture):
    loader = PackedLoader(mixture, SEQ, batch_size=32, seed=0)
    firsts = [s for x, y in loader.iter_eval_batches() for s in _sample_ids(x)]
    assert firsts == list(range(0, 1000, SEQ)) + list(range(1000, 1400, SEQ))
