"""`lmforge merge` (lmforge.ckpt.merge): the weighted average of saved checkpoints' model weights, one
tensor at a time, into a run folder with a record of what was merged; checkpoints of other models are
refused with the keys that differ. Checkpoints of every parallel layout merged with one process's:
tests/test_parallel_dp.py's `assert_extras_match`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lmforge.ckpt.export import WeightReader
from lmforge.ckpt.merge import merge_checkpoints, select_checkpoints
from tests.test_ckpt import SMALL, run

STEPS = {"train.steps": 12, "checkpoint.every_steps": 4, "checkpoint.keep_last": 3}


@pytest.fixture(scope="module")
def trained(small_data, tmp_path_factory):
    """A 12-step run with checkpoints at steps 4, 8 and 12."""
    out = tmp_path_factory.mktemp("merge") / "run"
    run(small_data, out, **STEPS)
    return out


def checkpoint_weights(run_dir, step) -> dict[str, torch.Tensor]:
    reader = WeightReader.of_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}")
    return {name: reader.read(name) for name in reader.shapes}


def test_merge_is_the_weighted_average_and_records_it(trained, small_data, tmp_path):
    """--steps 4,12 with weights 1,3: 1/4 x step 4 + 3/4 x step 12, tensor by tensor in fp32 (bit for bit
    against the same arithmetic); the tied head stored once; config, tokenizer and merge.json beside it;
    `lmforge eval` reads the folder. --last 3 = steps 4, 8, 12 with equal weights."""
    out = merge_checkpoints(select_checkpoints([trained], steps=[12, 4]), tmp_path / "m", weights=[1, 3])
    a, b, merged = checkpoint_weights(trained, 4), checkpoint_weights(trained, 12), load_file(str(out / "model.safetensors"))
    assert set(merged) == set(a) - {"lm_head.weight"}  # (tied: stored once, as the embedding)
    for name, t in merged.items():  # sorted by step: step 4 first, weighted 1/4 (the weights follow that order)
        assert torch.equal(t, (a[name] * 0.25).add_(b[name], alpha=0.75)), name
    record = json.loads((out / "merge.json").read_text())
    assert [(m["step"], m["weight"]) for m in record["merged"]] == [(4, 0.25), (12, 0.75)]
    assert record["merged"][1]["loss"] > 0 and "not the optimizer state" in record["what"]
    assert (out / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()
    assert f'out_dir = "{out}"' in (out / "config.toml").read_text()

    last = merge_checkpoints(select_checkpoints([trained], last=3), tmp_path / "last3")
    c = checkpoint_weights(trained, 8)
    for name, t in load_file(str(last / "model.safetensors")).items():
        assert torch.equal(t, (a[name] * (1 / 3)).add_(c[name], alpha=1 / 3).add_(b[name], alpha=1 / 3)), name
    from lmforge.cli.eval import EvalOptions, run_eval

    assert run_eval(EvalOptions(str(last), data=str(small_data.val_dir), samples=0))["perplexity"]["loss"] > 0


def test_merge_streams_one_tensor_at_a_time(trained, tmp_path, monkeypatch):
    """Each tensor is read from every checkpoint and written before the next one is read: the peak is
    one tensor per checkpoint, never the model."""
    events: list[tuple[str, str]] = []
    original = WeightReader.of_checkpoint.__func__

    def of_checkpoint(cls, folder, prefix="model/weights/"):
        reader = original(cls, folder, prefix)
        read = reader.read
        reader.read = lambda name: events.append(("read", name)) or read(name)
        return reader

    import lmforge.ckpt.merge as merge

    monkeypatch.setattr(WeightReader, "of_checkpoint", classmethod(of_checkpoint))
    real_streaming = merge.save_streaming

    def save_streaming(path, specs):
        import contextlib

        @contextlib.contextmanager
        def writer():
            with real_streaming(path, specs) as write:
                yield lambda name, t: events.append(("write", name)) or write(name, t)

        return writer()

    monkeypatch.setattr(merge, "save_streaming", save_streaming)
    merge_checkpoints(select_checkpoints([trained], last=2), tmp_path / "m")
    writes = [name for kind, name in events if kind == "write"]
    assert len(writes) > 5
    for i, name in enumerate(writes):  # between two writes: the next tensor's two reads, nothing else
        start = events.index(("write", writes[i - 1])) + 1 if i else 0
        assert events[start:events.index(("write", name))] == [("read", name)] * 2, (name, events[start:start + 4])


def test_merge_refuses_what_it_cannot_average(trained, small_data, tmp_path, capsys):
    from lmforge.cli.merge import merge_main

    other = tmp_path / "other"  # another model: 32 wide
    run(small_data, other, **{**STEPS, "train.steps": 4, "model.dim": 32})
    ckpts = [trained / "checkpoints" / "step_00000004", other / "checkpoints" / "step_00000004"]
    with pytest.raises(ValueError, match=r"different models \(model\.dim: 64 in .*run.*, 32 in .*other"):
        merge_checkpoints(select_checkpoints(ckpts), tmp_path / "m")
    for kwargs, message in [({"last": 4}, "has 3 valid checkpoint"), ({"steps": [5]}, r"no checkpoint of step\(s\) \[5\]"),
                            ({}, "with --last K or --steps")]:
        with pytest.raises(ValueError, match=message):
            select_checkpoints([trained], **kwargs)
    with pytest.raises(ValueError, match="the run folder the checkpoints come from"):
        merge_checkpoints(select_checkpoints([trained], last=2), trained, overwrite=True)
    with pytest.raises(ValueError, match="3 weights for 2 checkpoints"):
        merge_checkpoints(select_checkpoints([trained], last=2), tmp_path / "w", weights=[1, 1, 1])
    with pytest.raises(ValueError, match="holds no EMA of the weights"):
        merge_checkpoints(select_checkpoints([trained], last=1), tmp_path / "e", ema=True)
    assert merge_main([*map(str, ckpts), "--out", str(tmp_path / "cli")]) == 2  # `lmforge merge`: one line, status 2
    assert "error: the checkpoints are of different models" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
