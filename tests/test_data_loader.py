"""PackedLoader: windows, shuffling, rank sharding, resume, eval batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.data.loader import PackedLoader
from lmforge.data.shards import TokenShards, write_token_shards

N_TOKENS = 1201  # token value == its position in the stream (vocab covers it)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> TokenShards:
    d = tmp_path_factory.mktemp("loader") / "ds"
    write_token_shards([np.arange(0, 500), np.arange(500, N_TOKENS)], d, shard_tokens=97,
                       vocab_size=65536, meta={})
    return TokenShards(d)


def _starts(x: torch.Tensor) -> list[int]:
    return x[:, 0].tolist()  # token value == position, so first token == window start


def test_windows_and_shift(shards):
    seq = 10
    loader = PackedLoader(shards, seq_len=seq, batch_size=4, seed=1)
    assert loader.num_windows == (N_TOKENS - 1) // seq == 120
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, seq) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(y, x + 1)  # y is x shifted by one token
    for row in x:
        assert row[0] % seq == 0  # windows start at multiples of seq_len
        assert torch.equal(row, torch.arange(row[0], row[0] + seq))


def test_epoch_is_a_permutation_and_epochs_differ(shards):
    loader = PackedLoader(shards, seq_len=10, batch_size=8, seed=3)
    samples = [s for _ in range(30) for s in _starts(loader.next_batch()[0])]  # 2 epochs
    first, second = samples[:120], samples[120:]
    assert sorted(first) == sorted(second) == list(range(0, 1200, 10))
    assert first != second
    assert loader.state_dict() == {"epoch": 2, "position": 240, "seed": 3}
    other_seed = PackedLoader(shards, seq_len=10, batch_size=8, seed=4)
    assert _starts(other_seed.next_batch()[0]) != samples[:8]
    same_seed = PackedLoader(shards, seq_len=10, batch_size=8, seed=3)
    assert _starts(same_seed.next_batch()[0]) == samples[:8]


def test_two_ranks_are_disjoint_and_interleave_to_one_rank_order(shards):
    one = PackedLoader(shards, seq_len=10, batch_size=6, seed=0)
    ranks = [PackedLoader(shards, seq_len=10, batch_size=3, seed=0, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(20):  # exactly one epoch: 20 * 6 = 120 windows
        expected = _starts(one.next_batch()[0])
        got = [_starts(r.next_batch()[0]) for r in ranks]
        assert got[0] == expected[0::2] and got[1] == expected[1::2]
    assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()


def test_rank_union_covers_epoch_disjointly(shards):
    ranks = [PackedLoader(shards, seq_len=10, batch_size=5, seed=9, rank=r, world_size=3)
             for r in range(3)]
    seen = [[s for _ in range(8) for s in _starts(r.next_batch()[0])] for r in ranks]
    assert all(len(set(a) & set(b)) == 0 for i, a in enumerate(seen) for b in seen[i + 1:])
    assert sorted(sum(seen, [])) == list(range(0, 1200, 10))


@pytest.mark.parametrize("steps", [3, 17])  # 17 crosses the epoch boundary mid-batch
def test_resume_gives_identical_continuation(shards, steps):
    a = PackedLoader(shards, seq_len=10, batch_size=7, seed=5)
    for _ in range(steps):
        a.next_batch()
    sd = a.state_dict()
    cont = [a.next_batch() for _ in range(6)]
    b = PackedLoader(shards, seq_len=10, batch_size=7, seed=999)
    b.load_state_dict(sd)
    for xa, ya in cont:
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_resume_at_another_world_size_keeps_the_global_stream(shards):
    two = [PackedLoader(shards, seq_len=10, batch_size=4, seed=2, rank=r, world_size=2)
           for r in range(2)]
    for _ in range(5):
        for r in two:
            r.next_batch()
    sd = two[0].state_dict()
    nxt = [_starts(r.next_batch()[0]) for r in two]
    one = PackedLoader(shards, seq_len=10, batch_size=8, seed=2)
    one.load_state_dict(sd)
    assert _starts(one.next_batch()[0]) == [s for pair in zip(*nxt) for s in pair]


def test_eval_batches_are_sequential_and_split_over_ranks(shards):
    loader = PackedLoader(shards, seq_len=100, batch_size=5, seed=0)
    batches = list(loader.iter_eval_batches(None))
    assert [x.shape[0] for x, _ in batches] == [5, 5, 2]
    assert [s for x, _ in batches for s in _starts(x)] == list(range(0, 1200, 100))
    assert all(torch.equal(y, x + 1) for x, y in batches)
    assert len(list(loader.iter_eval_batches(2))) == 2
    again = [x for x, _ in loader.iter_eval_batches(None)]
    assert all(torch.equal(a, b) for a, b in zip(again, [x for x, _ in batches]))
    r0, r1 = (PackedLoader(shards, 100, 5, 0, rank=r, world_size=2) for r in range(2))
    s0 = [s for x, _ in r0.iter_eval_batches() for s in _starts(x)]
    s1 = [s for x, _ in r1.iter_eval_batches() for s in _starts(x)]
    assert len(s0) == len(s1) == 6 and sorted(s0 + s1) == list(range(0, 1200, 100))


def test_bad_inputs(shards):
    with pytest.raises(ValueError, match="fewer than seq_len\\+1=1202"):
        PackedLoader(shards, seq_len=1201, batch_size=1, seed=0)
    with pytest.raises(ValueError, match="rank=2"):
        PackedLoader(shards, seq_len=10, batch_size=1, seed=0, rank=2, world_size=2)
    loader = PackedLoader(shards, seq_len=10, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="seq_len changed"):
        loader.load_state_dict({"epoch": 0, "position": 500, "seed": 0})
    with pytest.raises(ValueError, match="position"):
        loader.load_state_dict({"seed": 0})


def test_masking_a_one_row_batch_leaves_its_inputs_alone(tmp_path):
    """mask_doc_boundaries with batch_size 1 wrote -100 into the inputs (x and y shared storage)."""
    import numpy as np

    from lmforge.data.loader import PackedLoader
    from lmforge.data.shards import TokenShards, write_token_shards

    tokens = np.array([5, 0, 7, 8, 0, 9, 3, 4, 0, 6] * 20, dtype=np.int64)
    write_token_shards([tokens], tmp_path / "s", shard_tokens=64, vocab_size=16, meta={})
    loader = PackedLoader(TokenShards(tmp_path / "s"), seq_len=8, batch_size=1, seed=0, mask_doc_boundaries=True,
                          eos_id=0)
    for _ in range(5):
        x, y = loader.next_batch()
        assert (x >= 0).all() and (y[x == 0] == -100).all()
