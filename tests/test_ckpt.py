"""Checkpoints in one process: atomicity, checksums, validation, rotation, safety, resume, guard."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from lmforge.ckpt.manager import list_checkpoints, verify_checkpoint
from lmforge.ckpt.safe_io import CheckpointSecurityError, safe_read_metadata
from lmforge.config import ConfigError, load_config
from lmforge.train.guard import SpikeGuard
from lmforge.train.trainer import Trainer

SMALL = {
    "model.vocab_size": 320, "model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.max_seq_len": 64,
    "data.seq_len": 32, "data.tokenizer_vocab_size": 320,
    "train.global_batch_size": 8, "train.micro_batch_size": 4, "train.steps": 12, "train.eval_every": 0,
    "train.eval_sequences": 8, "train.log_every": 4, "train.sample_tokens": 0, "train.precision": "fp32",
    "train.tensorboard": False, "train.plot": False, "train.progress": "none",
    "schedule.warmup_steps": 2, "optim.lr": 3e-3, "checkpoint.every_steps": 4,
}
DROPOUT = {"model.dropout": 0.1}
"""The straight run's and its resumes': dropout draws from torch's generator every step, so a resume that
did not restore the RNG state (lmforge.ckpt.state.RNGState) drops other units than the straight run and
ends elsewhere (with dropout 0, skipping the RNG state passed every test here)."""


def run(small_data, out, cls=Trainer, **overrides):
    trainer = cls(load_config("tiny", {**SMALL, **overrides}), out_dir=out, data=small_data)
    trainer.fit()
    return trainer


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def events(out) -> list[dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "event" in r]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def straight(small_data, tmp_path_factory):
    """12 uninterrupted steps with checkpoints at 4, 8, 12: the reference."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return out, weights(run(small_data, out, **DROPOUT).model)


def test_checkpoint_folder_layout_and_rotation(straight):
    out, _ = straight
    ckpts = list_checkpoints(out / "checkpoints")
    assert [s for s, _ in ckpts] == [12, 8]  # keep_last = 2: step 4 was rotated away after 12 validated
    meta = verify_checkpoint(ckpts[0][1], test_load=True)
    assert meta["step"] == 12 and meta["optimizer"] == "adamw" and meta["torch_version"] == torch.__version__
    assert {"trainer_state.json", ".metadata"} <= set(meta["files"])
    assert all(len(rec["sha256"]) == 64 for rec in meta["files"].values())
    state = json.loads((ckpts[0][1] / "trainer_state.json").read_text())
    assert state["train"]["step"] == 12 and state["loader"]["position"] == 12 * 8
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_keep_every_keeps_milestones(small_data, tmp_path):
    out = tmp_path / "run"
    run(small_data, out, **{"train.steps": 8, "checkpoint.every_steps": 2, "checkpoint.keep_last": 1,
                            "checkpoint.keep_every": 4, "checkpoint.async_save": False})
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [8, 4]


def test_resume_is_bitwise_equal_to_a_straight_run(small_data, straight, tmp_path):
    """Stop after the step-8 checkpoint (by deleting the later one), resume, compare weights bit for bit."""
    ref_out, ref = straight
    out = tmp_path / "run"
    shutil.copytree(ref_out / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000008")
    resumed = run(small_data, out, **DROPOUT)
    assert resumed.resumed_from.name == "step_00000008"
    assert_same(weights(resumed.model), ref)


def test_resume_from_an_explicit_path(small_data, straight, tmp_path):
    """checkpoint.resume = <folder>: that checkpoint (here another run's step 8), verified first; a
    damaged one is an error naming the key, never a silent fresh start."""
    ref_out, ref = straight
    good = tmp_path / "saved" / "step_00000008"
    shutil.copytree(ref_out / "checkpoints" / "step_00000008", good)
    resumed = run(small_data, tmp_path / "run", **DROPOUT, **{"checkpoint.resume": str(good)})
    assert resumed.resumed_from == good and resumed.state.step == 12
    assert_same(weights(resumed.model), ref)
    (good / "trainer_state.json").write_text("{}")  # its sha256 no longer matches meta.json
    with pytest.raises(ValueError, match=r"checkpoint.resume = .*step_00000008.*trainer_state.json"):
        run(small_data, tmp_path / "other", **DROPOUT, **{"checkpoint.resume": str(good)})


def test_corrupt_newest_checkpoint_is_skipped(small_data, straight, tmp_path):
    ref_out, ref = straight
    out = tmp_path / "run"
    shutil.copytree(ref_out / "checkpoints", out / "checkpoints")
    shard = next((out / "checkpoints" / "step_00000012").glob("*.distcp"))
    with open(shard, "r+b") as fh:  # truncate the newest checkpoint's shard
        fh.truncate(shard.stat().st_size // 2)
    with pytest.raises(ValueError, match="truncated"):
        verify_checkpoint(shard.parent)
    trainer = run(small_data, out, **DROPOUT)
    assert trainer.resumed_from.name == "step_00000008"
    assert any(e["event"] == "checkpoint_invalid" and "step_00000012" in e["path"] for e in events(out))
    assert_same(weights(trainer.model), ref)  # re-did steps 9-12 exactly
    verify_checkpoint(out / "checkpoints" / "step_00000012")  # and replaced the corrupt one

    flipped = out / "checkpoints" / "step_00000012" / "trainer_state.json"
    flipped.write_text(flipped.read_text().replace('"step": 12', '"step": 11'))
    with pytest.raises(ValueError, match="checksum"):
        verify_checkpoint(flipped.parent)


def test_incompatible_config_is_refused(small_data, straight, tmp_path):
    ref_out, _ = straight
    out = tmp_path / "run"
    shutil.copytree(ref_out / "checkpoints", out / "checkpoints")
    with pytest.raises(ConfigError, match=r"model\.dim: checkpoint 64, config 96"):
        run(small_data, out, **DROPOUT, **{"model.dim": 96})
    with pytest.raises(ConfigError, match="optim.name: checkpoint 'adamw', config 'lion'"):
        run(small_data, out, **DROPOUT, **{"optim.name": "lion"})
    assert len(list_checkpoints(out / "checkpoints")) == 2  # refusing touched nothing


def test_disk_full_during_a_save_keeps_the_old_checkpoints(small_data, straight, tmp_path, monkeypatch):
    """ENOSPC in the middle of writing the step-8 shard: the step-4 checkpoint stays valid, the partial
    folder is removed, the failure is logged and training goes on to save step 12."""
    real = FileSystemWriter.write_data
    calls = {"n": 0}

    def write_data(self, plan, planner):
        calls["n"] += 1
        if calls["n"] == 2:
            with open(os.path.join(self.path, "__0_0.distcp"), "wb") as fh:
                fh.write(b"\0" * 1000)  # a partly written shard, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    out = tmp_path / "run"
    trainer = run(small_data, out, **DROPOUT)
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [12, 4]
    for _, path in list_checkpoints(out / "checkpoints"):
        verify_checkpoint(path, test_load=True)
    assert not list((out / "checkpoints").glob("*.tmp"))
    failed = [e for e in events(out) if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 8 and "No space left" in failed[0]["error"]
    assert trainer.ckpt.failures == 1
    assert_same(weights(trainer.model), straight[1])  # the failed save did not disturb training


def test_async_save_snapshots_the_state(small_data, tmp_path):
    """Training goes on while the checkpoint is written: the file must hold the state at save time."""

    trainer = Trainer(load_config("tiny", {**SMALL, "checkpoint.every_steps": 0}), out_dir=tmp_path / "run",
                      data=small_data)
    trainer.setup()
    trainer.train_step(trainer.next_micro_batches())
    trainer.state.step = 1
    before = weights(trainer.model)
    trainer.save_checkpoint()
    for p in trainer.model.parameters():  # modify in place right away, while the write is in flight
        p.data.add_(1.0)
    trainer.ckpt.wait()
    fresh = Trainer(load_config("tiny", SMALL), out_dir=tmp_path / "run", data=small_data)
    fresh.setup()
    assert fresh.resumed_from is not None and fresh.state.step == 1
    assert_same(weights(fresh.model), before)


def test_metadata_cannot_execute_code(tmp_path, straight):
    ref_out, _ = straight
    ckpt = tmp_path / "evil"
    shutil.copytree(ref_out / "checkpoints" / "step_00000012", ckpt)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointSecurityError, match="posix.system|os.system"):
        safe_read_metadata(ckpt)
    assert not marker.exists()


def test_paths_cannot_escape_the_checkpoint_folder(tmp_path, straight):
    ref_out, _ = straight
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ref_out / "checkpoints" / "step_00000012", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"]["../../etc/passwd"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointSecurityError, match="escapes"):
        verify_checkpoint(ckpt)


def test_guard_rules():
    g = SpikeGuard(sigma=3.0, window=50, min_history=10, rollback_after=2)
    assert g.check(float("nan"), 1.0).skip and "non-finite loss" in g.check(float("inf"), 1.0).reason
    g = SpikeGuard(sigma=3.0, window=50, min_history=10, rollback_after=2)
    for i in range(20):
        assert not g.check(3.0 + 0.01 * (i % 3), 1.0).skip
    v = g.check(9.0, 1.0)
    assert v.skip and "loss spike" in v.reason and not v.rollback
    v = g.check(3.0, 50.0)
    assert v.skip and "gradient-norm spike" in v.reason and v.rollback  # second in a row
    assert not g.check(3.01, 1.0).skip and g.consecutive == 0
    assert len(g.losses) == 21  # skipped values never enter the window


class NaNTrainer(Trainer):
    """Plants non-finite gradients on chosen batches (a corrupt batch, in effect)."""

    bad_batches: set[int] = set()

    def forward_backward(self, micro_batches):
        loss = super().forward_backward(micro_batches)
        if self.state.batches_drawn - 1 in self.bad_batches:
            next(self.model.parameters()).grad.fill_(float("nan"))
            return loss * float("nan")
        return loss


def test_planted_nan_batch_is_skipped(small_data, tmp_path):
    trainer = NaNTrainer(load_config("tiny", {**SMALL, "checkpoint.every_steps": 0}), out_dir=tmp_path / "run",
                         data=small_data)
    trainer.bad_batches = {5}
    trainer.setup()
    for _ in range(5):
        trainer.train_step(trainer.next_micro_batches())
        trainer.state.step += 1
    before = weights(trainer.model)
    trainer.train_step(trainer.next_micro_batches())  # batch 5: NaN -> no update
    assert_same(weights(trainer.model), before)
    trainer.state.step += 1
    trainer.train_step(trainer.next_micro_batches())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.guard.n_skipped == 1


def test_repeated_bad_batches_roll_back_and_are_skipped(small_data, tmp_path):
    out = tmp_path / "run"

    class Bad(NaNTrainer):
        bad_batches = {5, 6, 7}  # three in a row after the step-4 checkpoint: rollback_after = 3

    trainer = run(small_data, out, cls=Bad)
    evs = events(out)
    rollback = [e for e in evs if e["event"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["to_step"] == 4 and rollback[0]["skip_batches"] == [5, 6, 7]
    assert sorted(e["batch"] for e in evs if e["event"] == "skipped_batch") == [5, 6, 7]
    assert trainer.state.step == 12 and trainer.state.batches_drawn == 15 and trainer.state.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollbacks"] == 1 and summary["skipped_updates"] == 3
