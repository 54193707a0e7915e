"""The prefetching loader (lmforge.data.prefetch): same batches in the same order as the plain loader,
checkpoints hold the consumed position (not the prefetched one), resume / rollback / batch ramp-up
are bit-identical to prefetch = 0, and the thread ends with the run."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch

from lmforge.config import ConfigError, load_config
from lmforge.data.loader import PackedLoader
from lmforge.data.prefetch import Prefetcher
from lmforge.train.trainer import Trainer

from .test_ckpt import SMALL, NaNTrainer, assert_same, events, weights


def prefetch_threads() -> set[threading.Thread]:
    """The live prefetch threads (other tests' abandoned trainers may leave theirs: compare sets)."""
    return {t for t in threading.enumerate() if t.name == "lmforge-prefetch" and t.is_alive()}


def loader(small_data) -> PackedLoader:
    from lmforge.data.loader import open_tokens

    return PackedLoader(open_tokens(small_data.train_dir), seq_len=16, batch_size=3, seed=7)


def test_same_batches_same_order_and_consumed_state(small_data):
    others = prefetch_threads()
    plain, pre = loader(small_data), Prefetcher(loader(small_data), depth=3)
    for i in range(10):
        a, b = plain.next_batch(), pre.next_batch()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), i
        assert pre.state_dict() == plain.state_dict()  # the consumed position, not the prefetched one
    for _ in range(500):  # (the thread runs ahead: wait until its queue is full)
        if pre._queue.full():
            break
        threading.Event().wait(0.01)
    assert pre.loader.position >= plain.position + 3 * 3
    assert pre.state_dict() == plain.state_dict()
    saved = pre.state_dict()
    expected = [plain.next_batch() for _ in range(3)]
    again = Prefetcher(loader(small_data), depth=2)
    again.load_state_dict(saved)
    for (x, y), (x2, y2) in zip(expected, [again.next_batch() for _ in range(3)]):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    # going back (a rollback) drops what was prefetched and redraws from the restored position
    pre.load_state_dict(saved)
    assert not pre.running and pre.loader.position == saved["position"]
    assert torch.equal(pre.next_batch()[0], expected[0][0])
    for p in (pre, again):
        p.close()
    assert prefetch_threads() <= others


def test_a_loader_error_reaches_the_consumer(small_data):
    class Broken(PackedLoader):
        def next_batch(self):
            if self.position >= 6:
                raise ValueError("token id 999 out of range in shard x.bin")
            return super().next_batch()

    from lmforge.data.loader import open_tokens

    pre = Prefetcher(Broken(open_tokens(small_data.train_dir), 16, 3, seed=7), depth=4)
    pre.next_batch(), pre.next_batch()
    with pytest.raises(ValueError, match="out of range"):
        pre.next_batch()
    assert not pre.running and pre.state_dict()["position"] == 6


def test_prefetch_config_key():
    assert load_config("tiny").data.prefetch > 0  # on by default
    with pytest.raises(ConfigError, match="data.prefetch"):
        load_config("tiny", {"data.prefetch": -1})


def run(small_data, out, cls=Trainer, **overrides) -> Trainer:
    trainer = cls(load_config("tiny", {**SMALL, **overrides}), out_dir=out, data=small_data)
    trainer.fit()
    return trainer


def losses(out) -> list[tuple]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in recs if "loss" in r and "event" not in r]


RAMP = {"schedule.batch_rampup_start": 4, "schedule.batch_rampup_tokens": 6 * 8 * 32,
        "schedule.batch_rampup_increment": 4}


def test_training_with_prefetch_is_bit_identical_and_resumes(small_data, tmp_path):
    """A batch ramp-up (1 then 2 micro-batches a step): prefetch 0 and 3 give the same losses, grad
    norms and weights bit for bit; resuming the prefetching run's step-8 checkpoint with prefetch
    on gives the same again; no prefetch thread outlives its run."""
    others = prefetch_threads()
    plain = run(small_data, tmp_path / "plain", **RAMP, **{"data.prefetch": 0})
    pre = run(small_data, tmp_path / "pre", **RAMP, **{"data.prefetch": 3})
    assert prefetch_threads() <= others and not pre.loader.running
    assert isinstance(pre.loader, Prefetcher) and not isinstance(plain.loader, Prefetcher)
    assert losses(tmp_path / "plain") == losses(tmp_path / "pre") and len(losses(tmp_path / "pre")) == 12
    assert_same(weights(plain.model), weights(pre.model))
    state = json.loads((tmp_path / "pre" / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    plain_state = json.loads((tmp_path / "plain" / "checkpoints" / "step_00000008" / "trainer_state.json")
                             .read_text())
    assert state["loader"] == plain_state["loader"]  # consumed, not prefetched

    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "pre" / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000008")
    resumed = run(small_data, out, **RAMP, **{"data.prefetch": 3})
    assert resumed.resumed_from.name == "step_00000008"
    assert_same(weights(resumed.model), weights(pre.model))
    assert losses(out) == losses(tmp_path / "pre")[8:]
    assert prefetch_threads() <= others


def test_rollback_with_prefetch_skips_the_same_batches(small_data, tmp_path):
    """The guard's rollback reloads the loader state under a running prefetcher: the same batches are
    skipped and the run ends with the same weights as without prefetch."""
    class Bad(NaNTrainer):
        bad_batches = {5, 6, 7}

    others = prefetch_threads()
    ends = {}
    for depth in (0, 4):
        out = tmp_path / f"p{depth}"
        trainer = run(small_data, out, cls=Bad, **{"data.prefetch": depth})
        evs = events(out)
        assert [e["skip_batches"] for e in evs if e["event"] == "rollback"] == [[5, 6, 7]]
        assert sorted(e["batch"] for e in evs if e["event"] == "skipped_batch") == [5, 6, 7]
        assert trainer.state.batches_drawn == 15
        ends[depth] = (weights(trainer.model), losses(out))
    assert_same(ends[0][0], ends[4][0])
    assert ends[0][1] == ends[4][1]
    assert prefetch_threads() <= others


def test_the_thread_ends_when_the_run_is_preempted(small_data, tmp_path):
    """A preemption (the signal's flag, set as the handler sets it) ends fit with Preempted: the
    checkpoint holds the consumed loader position and no prefetch thread is left."""
    from lmforge.train.preempt import Preempted

    class Stopped(Trainer):
        def train_step(self, micro_batches):
            out = super().train_step(micro_batches)
            if self.state.step == 4:  # (this step is the 6th: train_step runs before the count)
                self.preemption._handle(15, None)
            return out

    others = prefetch_threads()
    with pytest.raises(Preempted):
        run(small_data, tmp_path / "run", cls=Stopped, **{"checkpoint.every_steps": 0})
    assert prefetch_threads() <= others
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["loader"]["position"] == state["train"]["step"] * 8
