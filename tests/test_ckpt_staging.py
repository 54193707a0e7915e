"""DCP staging of accelerator checkpoints into host buffers kept from save to save
(lmforge.ckpt.manager.device_stager). No GPU here: the DCP path is forced for host tensors
(`staging="dcp"`), which runs the same stager without pinning; on CUDA the buffers are also pinned
(benchmarks/checkpoint_save.py measures it there)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.staging import DefaultStager

from lmforge.ckpt import manager as ckpt_manager
from lmforge.ckpt.checkpointer import load_states, save_states
from lmforge.ckpt.manager import CheckpointManager, device_stager, verify_checkpoint
from lmforge.ckpt.state import ModelOptimizerState, RNGState
from lmforge.config import OptimConfig, load_config
from lmforge.model.transformer import build_model
from lmforge.optim.optimizers import build_optimizer


def step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def staged_buffers(mgr: CheckpointManager) -> dict[int, int]:
    """The stager's host buffers: id of the source storage's object -> data_ptr of its host copy."""
    cache = mgr._stager._state_dict_stager._cached_storage_mapping
    return {id(k): v.data_ptr() for k, v in cache.items()}


def test_the_selected_stager():
    stager, name = device_stager(cuda=False)
    assert name == "cached" and type(stager).__name__ == "DefaultStager"
    assert not stager._config.use_pinned_memory and not stager._config.use_non_blocking_copy
    assert not stager._config.use_async_staging  # synchronous: the next step cannot race the copy
    stager.close()
    if torch.cuda.is_available():
        stager, name = device_stager(cuda=True)
        assert name == "pinned" and stager._config.use_pinned_memory and stager._config.use_non_blocking_copy
        stager.close()


def test_dcp_staging_reuses_its_host_buffers_and_the_saves_validate_and_resume(tmp_path):
    cfg = load_config("tiny")
    model = build_model(cfg.model, "cpu", seed=0)
    opt = build_optimizer(OptimConfig(name="adamw", lr=1e-3), model)
    step(model, opt, 0)
    states = {"model": ModelOptimizerState(model, opt), "rng": RNGState(0)}
    mgr = CheckpointManager(tmp_path / "ckpt", staging="dcp", keep_last=2)
    save_states(mgr, 1, states, {"optimizer": "adamw"})
    mgr.wait()
    assert mgr.staging == "cached" and mgr.last_save["step"] == 1
    first = staged_buffers(mgr)
    n_tensors = len(model.state_dict()) * 3  # (weights, exp_avg, exp_avg_sq)
    assert len(first) >= n_tensors - 5  # (tied weights share a storage)
    stager = mgr._stager
    step(model, opt, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    save_states(mgr, 2, states, {"optimizer": "adamw"})
    mgr.wait()
    assert mgr._stager is stager and staged_buffers(mgr) == first  # the same host buffers, no new ones
    meta = verify_checkpoint(tmp_path / "ckpt" / "step_00000002", test_load=True)
    assert meta["step"] == 2

    fresh = build_model(cfg.model, "cpu", seed=1)
    fresh_opt = build_optimizer(OptimConfig(name="adamw", lr=1e-3), fresh)
    step(fresh, fresh_opt, 5)
    load_states(mgr, tmp_path / "ckpt" / "step_00000002", {"model": ModelOptimizerState(fresh, fresh_opt),
                                                           "rng": RNGState(0)})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k  # the second save's values, not the first's
    mgr.close()
    assert mgr._stager is None


def test_per_save_staging_still_works(tmp_path):
    """The "before" arm of the benchmark (DCP's own staging, fresh host memory per save)."""
    cfg = load_config("tiny")
    model = build_model(cfg.model, "cpu", seed=0)
    opt = build_optimizer(OptimConfig(name="adamw", lr=1e-3), model)
    step(model, opt, 0)
    mgr = CheckpointManager(tmp_path / "ckpt", staging="dcp-per-save")
    save_states(mgr, 1, {"model": ModelOptimizerState(model, opt)}, {"optimizer": "adamw"})
    mgr.close()
    assert mgr.staging == "dcp default" and mgr._stager is None and mgr.last_save["step"] == 1
    verify_checkpoint(tmp_path / "ckpt" / "step_00000001", test_load=True)


def test_a_default_stager_that_closes_itself_after_each_stage_is_not_reused(tmp_path, monkeypatch):
    """torch 2.11's DefaultStager closes its StateDictStager at the end of every stage (its copy
    table emptied: the next stage fails with KeyError: <class 'type'>, which failed the second
    checkpoint of every CUDA run on the H100). Made so here; the manager must notice and not reuse it
    (on a host-only machine: DCP's own per-save staging; on CUDA: BlockingAsyncStager's pinned cache)."""
    real = DefaultStager._stage

    def stage_and_close(self, state_dict, **kwargs):
        out = real(self, state_dict, **kwargs)
        self._state_dict_stager.close()  # what torch 2.11 does here
        return out

    assert ckpt_manager.default_stager_is_reusable()  # (this torch's own behaviour)
    monkeypatch.setattr(DefaultStager, "_stage", stage_and_close)
    assert not ckpt_manager.default_stager_is_reusable()
    assert device_stager(cuda=False) == (None, "dcp default")
    cfg = load_config("tiny")
    model = build_model(cfg.model, "cpu", seed=0)
    opt = build_optimizer(OptimConfig(name="adamw", lr=1e-3), model)
    mgr = CheckpointManager(tmp_path / "ckpt", staging="dcp", keep_last=3)
    states = {"model": ModelOptimizerState(model, opt), "rng": RNGState(0)}
    for n in (1, 2, 3):  # (three saves: the second is the one that failed)
        step(model, opt, n)
        save_states(mgr, n, states, {"optimizer": "adamw"})
        mgr.wait()
    assert mgr.failures == 0, mgr.last_error
    assert mgr.staging == "dcp default" and mgr.last_save["step"] == 3
    verify_checkpoint(tmp_path / "ckpt" / "step_00000003", test_load=True)
    mgr.close()
