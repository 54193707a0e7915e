"""The tiny-mla-moe preset (DeepSeek-V3's architecture in small: lmforge.model.mla, .moe, .mtp) through
`lmforge train` in one process: each MTP depth's loss and the sequence-wise balance loss in
metrics.jsonl and TensorBoard, a resumed run equal to a straight one step for step, and the trained
run folder (the moved expert bias, the MTP layer) exported to a folder transformers'
DeepseekV3ForCausalLM loads with the same logits."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from tests.test_parallel_dp import corpus, launcher, overrides  # noqa: F401  (module-scoped corpus fixture)

SMALL = {"model.n_layers": 2, "model.mla.kv_lora_rank": 16, "model.mla.q_lora_rank": 24,
         "model.mla.qk_nope_head_dim": 8, "model.mla.qk_rope_head_dim": 8, "model.mla.v_head_dim": 8,
         "model.moe.expert_hidden": 32, "model.moe.bias_update_rate": 0.01, "train.log_every": 2,
         "train.tensorboard": "true", "checkpoint.every_steps": 2, "checkpoint.keep_last": 3, "train.steps": 4}


def train(data, out) -> subprocess.CompletedProcess:
    args = overrides(data, out, **SMALL)
    return subprocess.run(launcher() + ["-m", "lmforge", "train", "--config", "tiny-mla-moe", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_tiny_mla_moe_trains_logs_each_depth_resumes_and_exports_to_transformers(corpus, tmp_path):  # noqa: F811
    transformers = pytest.importorskip("transformers")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = train(corpus, straight)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    step2 = "checkpoints/step_00000002"  # stopped after step 2: resumed from its checkpoint
    shutil.copytree(straight / step2, resumed / step2)
    proc = train(corpus, resumed)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and "step" in r and "val_loss" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["mtp_loss_1"] > 0 and r["moe/1/seq_aux_loss"] > 0 and "moe/2/max_load" in r for r in steps)
    again = {r["step"]: r for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())
             if "loss" in r and "step" in r}
    assert sorted(again) == [3, 4]
    for r in steps[2:]:
        assert (again[r["step"]]["loss"], again[r["step"]]["mtp_loss_1"]) == (r["loss"], r["mtp_loss_1"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(straight / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/mtp_loss_1")] == [1, 2, 3, 4]

    from lmforge.ckpt.export import load_run
    from lmforge.interop.hf import export_hf

    _, model = load_run(straight)
    assert model.blocks["1"].mlp.expert_bias.abs().sum() > 0 and model.mtp is not None
    for name, t in load_run(resumed)[1].state_dict().items():  # the resumed run's final weights: bit for bit
        assert torch.equal(t, model.state_dict()[name]), name
    export_hf(straight, tmp_path / "hf")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, model.eval()(tokens), atol=2e-5, rtol=1e-4)
