"""DeepSeek-V3's pieces under the layouts, on CPU/gloo, against one process: multi-head latent
attention (lmforge.model.mla) with its heads split by tensor parallelism (the latent projections
replicated) and under context parallelism (the latent and RoPE key all-gathered, not K/V); the
multi-token prediction module (lmforge.model.mtp) under FSDP2 and TP (not with sequence parallelism or
CP, which it refuses); the sequence-wise balance loss
and group-limited routing (lmforge.model.moe) under all of them (under CP a sequence's expert counts
are summed over its CP ranks).

A small model with MLA, an MoE block (4 routed experts, top-2 sigmoid routing in 2 groups, a shared
expert, batch- and sequence-wise balance losses) after a dense one, and one MTP module trains 6
steps of plain SGD without clipping (tests/test_parallel_dp.py's `SGD`: the steps are the gradient
itself), and every layout's loss and gradient norm (before clipping) must match the one-process
run's to 1e-5 relative at every step (fp32; only the reduction order differs), as must the MTP
loss. CP and SP do not run the MTP module (refused up front), so their reference is the same model
without it. One 2-process launch runs the four layouts one after another. (Without the gradient
sum of MLA's shared RoPE key over the TP ranks, tp2 is off by 5e-4 in the loss.)
"""

from __future__ import annotations

import pytest

from tests.test_parallel_dp import SGD, assert_runs_match, corpus, losses, metric, train_runs  # noqa: F401

MODEL = {"model.n_layers": 2, "model.tie_embeddings": "false", "model.mla.kv_lora_rank": 24,
         "model.mla.q_lora_rank": 20, "model.mla.qk_nope_head_dim": 12, "model.mla.qk_rope_head_dim": 8,
         "model.mla.v_head_dim": 12, "model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 64,
         "model.moe.shared_experts": 1, "model.moe.first_dense": 1, "model.moe.router": "sigmoid",
         "model.moe.n_groups": 2, "model.moe.topk_groups": 1, "model.moe.aux_loss_coef": 0.05,
         "model.moe.seq_aux_loss_coef": 0.1, "model.mtp_depth": 1, "model.mtp_loss_weight": 0.5,
         **SGD, "train.log_every": 1}
NO_MTP = {"model.mtp_depth": 0}
LAYOUTS = {  # name: (its overrides, the reference's)
    "fsdp2": ({"parallel.dp_shard": 2, "train.micro_batch_size": 2}, {}),
    "tp2": ({"parallel.tp": 2, "train.micro_batch_size": 4}, {}),
    "cp2": ({"parallel.cp": 2, "train.micro_batch_size": 4, **NO_MTP}, NO_MTP),
    "tp2-sp": ({"parallel.tp": 2, "parallel.sequence_parallel": "true", "train.micro_batch_size": 4, **NO_MTP}, NO_MTP),
}
TOL = 1e-5


@pytest.mark.slow
def test_mla_mtp_and_sequence_balance_match_one_process_under_fsdp_tp_sp_and_cp(corpus, tmp_path):  # noqa: F811
    refs = {"ref": tmp_path / "single", "ref-no-mtp": tmp_path / "single-no-mtp"}
    proc = train_runs(corpus, {refs["ref"]: {}, refs["ref-no-mtp"]: NO_MTP}, **MODEL,
                      **{"train.micro_batch_size": 4})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = {tmp_path / name: own for name, (own, _) in LAYOUTS.items()}
    proc = train_runs(corpus, runs, nproc=2, timeout=600, **MODEL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the MLA latent and RoPE key all-gathered per layer" in proc.stdout + proc.stderr
    for name, (_, ref_overrides) in LAYOUTS.items():
        ref = refs["ref-no-mtp" if ref_overrides else "ref"]
        assert_runs_match(tmp_path / name, ref, f"{name}, SGD without clipping, vs one process", tol=TOL)
        for key in ("moe/1/seq_aux_loss", *(() if ref_overrides else ("mtp_loss_1",))):
            got, want = metric(tmp_path / name, key), metric(ref, key)
            assert sorted(got) == sorted(want) == sorted(losses(ref)), key
            assert all(abs(got[s] - want[s]) <= TOL * abs(want[s]) for s in want), (name, key, got, want)
