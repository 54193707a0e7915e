"""`lmforge plan ... --verify` (lmforge/verify/): the planned layout, scaled down, trained on CPU processes
and checked against one process, a resume at another world size and the plan's memory.

It passes for the layouts docs/planning.md's plan commands show (here: the 128k-context Mistral search's Ulysses
CP x FSDP layout, 4 processes; the 70B FSDP line runs with --verify in docs/planning.md itself, so
tests/test_readme_commands.py runs it; benchmarks/RESULTS.md has all six),
and fails, naming the check and the numbers, for a layout broken on purpose: a `sitecustomize` module
on the runs' PYTHONPATH makes every multi-process rank sum its gradients over the data-parallel ranks
instead of averaging them (the bug of a layout that forgets to divide), and the planner's memory
estimate is made wrong in the planning process. Layouts it cannot emulate are refused with the reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.plan.layout import Layout
from lmforge.plan.memory import estimate_memory
from lmforge.verify.certify import MEMORY_PARTS, PARITY_TOL, _ddp_config, compare, memory_check, resume_check
from lmforge.verify.toy import STEPS, CannotEmulate, scale_layout, smallest_divisor, toy_run
from tests import warm_start


@pytest.fixture(autouse=True)
def warm(monkeypatch):
    """The certificate's runs start warm (tests/warm_start.py: PYTHON_EXEC, which lmforge.verify.certify honours)."""
    return warm_start.warm_exec(monkeypatch)


ROOT = Path(__file__).resolve().parents[1]

README_LAYOUTS = {  # the docs' `lmforge plan` lines (docs/planning.md), as typed, plus --verify
    "llama2-70b-fsdp": "--model llama2-70b --gpus 8xH100 --layout dp=8,zero=3,mb=1,ac=full",
    "mistral-7b-128k-search": "--model mistral-7b --set model.max_seq_len=131072 --set data.seq_len=131072 "
                              "--global-batch-tokens 8388608 --gpus 8x8xH100 --search --top 3",
}


def plan(args: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    # warm (tests/warm_start.py): the certificate's ranks start through PYTHON_EXEC, forks of the server
    return subprocess.run([*warm_start.shared().interpreter(), "-m", "lmforge", "plan", *args.split(), "--verify"],
                          capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout)


@pytest.mark.slow
def test_the_readme_layouts_pass(monkeypatch, capsys):
    """The 128k-context Mistral layout, the largest composition docs/planning.md shows (4 processes: FSDP x Ulysses CP),
    planned in this process (the command line's own run is the refusal's test below).
    (The 70B line passes in tests/test_readme_commands.py, where docs/planning.md runs it with --verify as printed,
    and fails here when broken on purpose; a one-process layout's resume on two ranks is checked below, and
    all six README lines in benchmarks/RESULTS.md: CI time.)"""
    from lmforge.cli.plan import plan_main

    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # (the toy's ranks)
    code = plan_main(README_LAYOUTS["mistral-7b-128k-search"].split() + ["--verify"])
    captured = capsys.readouterr()
    out = captured.out[captured.out.index("verify:"):] if "verify:" in captured.out else captured.out
    print(out)
    assert code == 0, out + captured.err[-3000:]
    assert out.count("  PASS  ") == 3 and "verify: PASS (3 checks)" in out, out
    assert "FAIL" not in out


SUM_INSTEAD_OF_AVERAGE = textwrap.dedent('''
    """Planted by tests/test_plan_verify.py: every rank of a multi-process run sums its gradients over the
    data-parallel ranks instead of averaging them (one process is left alone: the reference). AFTER_IMPORTS:
    it only registers a handler, so the tests' warm starts run it too (tests/warm_start.py)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch
        from lmforge.train.events import Handler, register_handler

        class Summed(Handler):
            def backward_end(self, trainer, loss):
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(trainer.dist.dp_size)

        register_handler(Summed)
''')


@pytest.mark.slow
def test_a_broken_layout_fails_with_the_reason(tmp_path, monkeypatch, capsys):
    """One verify run, two planted faults: the gradient bug in the layout's processes (parity fails on the
    gradient norm, twice the one-process norm, and the failure is localised to a module's gradient; the losses agree, as AdamW's update hardly sees the gradient's
    scale, so the resume of the layout's checkpoint passes too), and a memory estimate that halves the
    weights (the memory check fails, naming the ranks and bytes)."""
    import lmforge.verify.certify as certify
    from lmforge.cli.plan import plan_main

    (tmp_path / "sitecustomize.py").write_text(SUM_INSTEAD_OF_AVERAGE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{ROOT}")
    real = certify.estimate_memory

    def wrong(*args, **kwargs):
        mem = real(*args, **kwargs)
        return dataclasses.replace(mem, weights=mem.weights / 2)

    monkeypatch.setattr(certify, "estimate_memory", wrong)
    code = plan_main(README_LAYOUTS["llama2-70b-fsdp"].split() + ["--verify"])
    out = capsys.readouterr().out
    out = out[out.index("verify:"):]
    print(out)
    assert code == 1 and "verify: FAIL (2 of 3 checks" in out, out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  ")}
    parity = next(v for k, v in lines.items() if k.startswith("FAIL  parity"))
    # (the toy trains in bf16, the plan's precision: the steps outside the band are listed)
    step1 = re.search(r"step 1: (?:[^;]*; )?grad norm \S+ vs \S+, difference (\S+) \(relative\) outside the band",
                      parity)
    assert step1 and float(step1.group(1)) == pytest.approx(1.0, abs=0.01), parity  # twice the one-process norm
    # every gradient is 2x: the first in backward order is the head's (the chunked loss uses its weight)
    assert "localised at step 1" in out and "first gradient outside the band (backward order): lm_head: " in out, out
    assert any(k.startswith("PASS  resume") for k in lines), lines
    memory = next(v for k, v in lines.items() if k.startswith("FAIL  memory"))
    assert "rank 0 weights" in memory and "vs planned" in memory, memory


@pytest.mark.parametrize("layout, reason", [
    ("dp=8,zero=3,offload=1", "CPUOffloadPolicy needs a CUDA GPU"),
    ("dp=8,precision=fp8", "FP8"),
    ("dp=3,tp=3", "9 processes, more than the 8"),
])
def test_layouts_it_cannot_emulate_are_refused_with_the_reason(layout, reason):
    with pytest.raises(CannotEmulate, match=reason):
        scale_layout(Layout.parse(layout))


def test_refusal_through_the_command_line_names_the_reason():
    proc = plan("--model llama2-70b --gpus 8xH100 --layout dp=8,zero=3,offload=1", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot emulate this layout on the CPU" in proc.stdout and "CPUOffloadPolicy" in proc.stdout


def test_a_layout_lmforge_refuses_for_the_family_fails_as_a_finding(capsys):
    """Context parallelism over a hybrid model's Gated DeltaNet blocks: lmforge's config refuses it, so the
    certificate fails, naming why (tensor parallelism that does not divide their heads is refused by the
    planner itself, as a layout that splits attention heads). (A pipeline over a tied embedding and ZeRO-1 under a pipeline, the
    examples before issue 59, run now.) In this process: the command line's exit status and output
    are the refusal test's above, and no toy is launched."""
    from lmforge.cli.plan import plan_main

    code = plan_main("--model tiny-hybrid --gpus 4xH100 --layout dp=2,zero=3,cp=2 --verify".split())
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL  config: lmforge refuses the layout" in out and "Gated DeltaNet" in out, out


@pytest.mark.parametrize("n, want", [(1, 1), (2, 2), (8, 2), (6, 2), (9, 3), (7, 7), (128, 2)])
def test_smallest_divisor(n, want):
    assert smallest_divisor(n) == want


def test_each_degree_scales_to_its_smallest_divisor_and_the_rest_is_kept():
    layout = Layout.parse("dp=64,zero=2,tp=8,sp=1,pp=4,sched=interleaved,v=2,ac=selective,mb=2,ga=16")
    toy, notes = scale_layout(layout)
    assert (toy.dp, toy.cp, toy.tp, toy.pp, toy.world_size) == (2, 1, 2, 2, 8)
    assert (toy.zero, toy.sp, toy.pp_schedule, toy.virtual_stages, toy.ac) == (2, True, "interleaved", 2, "selective")
    assert set(notes) == {"dp 64 -> 2", "tp 8 -> 2", "pp 4 -> 2"}, notes


def test_expert_parallelism_keeps_its_share_of_the_data_parallel_ranks():
    toy, _ = scale_layout(Layout.parse("dp=8,zero=3,ep=4"))
    assert (toy.dp, toy.ep) == (4, 2)  # experts split over 2, and replicated over 2 as over 8 / 4
    toy, _ = scale_layout(Layout.parse("dp=8,zero=3,ep=8"))
    assert (toy.dp, toy.ep) == (2, 2)


@pytest.mark.parametrize("preset, layout", [
    ("mistral-7b", "dp=4,zero=2,cp=2,tp=8,sp=1,ac=selective"),
    ("mixtral-8x7b", "dp=8,zero=3,ep=8,tp=2"),
    ("llama2-70b", "dp=2,zero=3,tp=2,pp=2,sched=interleaved,v=2"),
    ("gpt3-175b", "dp=8,zero=1"),
    ("llama2-70b", "dp=4,zero=3,pp=4,sched=zbv,ac=full"),  # the V schedules: 2 stages per rank
    ("llama2-70b", "dp=4,zero=3,pp=2,sched=dualpipev"),
    ("llama2-70b", "dp=2,zero=2,tp=2,pp=2,sched=interleaved-zb,v=2,ema=1"),
    ("deepseek-v3-671b", "dp=64,zero=3,ep=8,tp=2"),  # MLA, MTP, group-limited routing, sequence-wise loss
])
def test_the_toy_keeps_the_family_and_the_layout_and_lmforge_accepts_it(preset, layout):
    cfg = load_config(preset)
    if "pp=" in layout:
        cfg = load_config(preset, {"model.tie_embeddings": False})
    toy = toy_run(cfg, Layout.parse(layout))
    toy.config.validate()
    toy.reference.validate()
    m, real = toy.config.model, cfg.model
    assert (m.activation, m.norm, m.pos_emb, m.tie_embeddings, m.bias) == \
           (real.activation, real.norm, real.pos_emb, real.tie_embeddings, real.bias)
    assert bool(m.n_kv_heads) == bool(real.n_kv_heads) and m.moe.enabled == real.moe.enabled
    assert bool(m.sliding_window) == bool(real.sliding_window)
    assert (m.mla.enabled, bool(m.mla.q_lora_rank), bool(m.mtp_depth)) == \
           (real.mla.enabled, bool(real.mla.q_lora_rank), bool(real.mtp_depth))
    assert (m.moe.n_groups > 1) == (real.moe.n_groups > 1) and m.moe.router == real.moe.router
    assert (toy.config.train.ema_decay > 0) == toy.layout.ema == Layout.parse(layout).ema
    par = toy.config.parallel
    assert par.world_size == toy.world_size <= 8 and toy.reference.parallel.world_size == 1
    assert toy.config.train.global_batch_size == toy.reference.train.global_batch_size
    assert toy.reference.train.micro_batch_size == toy.layout.dp * toy.layout.micro_batch  # the ranks' union
    lay = toy.layout
    assert (par.tp, par.pp, par.cp, par.ep, par.sequence_parallel) == (lay.tp, lay.pp, lay.cp, lay.ep, lay.sp)
    assert toy.config.train.activation_checkpoint == Layout.parse(layout).ac
    assert (par.pp_schedule, toy.layout.stages_per_rank) == (lay.pp_schedule, Layout.parse(layout).stages_per_rank)


def test_the_memory_check_holds_each_rank_to_the_plan_with_the_ema():
    """Ranks that hold what the plan says pass; an EMA the plan counts but a rank does not hold fails, named."""
    toy = toy_run(load_config("llama2-70b"), Layout.parse("dp=8,zero=3,ema=1"))
    plan = estimate_memory(toy.config.model, toy.layout, "adamw", toy.config.data.seq_len, weights="lmforge")
    assert plan.ema > 0
    ranks = [{"rank": r, "pp_rank": 0, **{k: int(getattr(plan, k)) for k in (*MEMORY_PARTS, "ema")}} for r in (0, 1)]
    assert memory_check(toy, "adamw", ranks).passed
    ranks[1]["ema"] = 0
    check = memory_check(toy, "adamw", ranks)
    assert not check.passed and "rank 1 ema 0 B vs planned" in check.detail, check.detail


def test_the_memory_check_holds_plain_zero1_ranks_to_their_own_tensors_state():
    """ZeRO-1 without FSDP2 (ZeroRedundancyOptimizer): each rank is held to the state of the whole tensors
    torch gives it (lmforge.plan.model_states.zero1_state_per_rank), not all to the fullest rank's."""
    from lmforge.plan.model_states import zero1_state_per_rank
    from lmforge.plan.params import stage_specs

    toy = toy_run(load_config("tiny"), Layout.parse("dp=4,zero=1"))
    plan = estimate_memory(toy.config.model, toy.layout, "adamw", toy.config.data.seq_len, weights="lmforge")
    own = zero1_state_per_rank(stage_specs(toy.config.model, 1, 0), toy.layout, "adamw")
    assert len(own) == toy.world_size and plan.optimizer_states == max(own) > min(own)
    ranks = [{"rank": r, "pp_rank": 0, "weights": int(plan.weights), "gradients": int(plan.gradients),
              "optimizer_states": int(own[r])} for r in range(toy.world_size)]
    assert memory_check(toy, "adamw", ranks).passed
    low = own.index(min(own))
    ranks[low]["optimizer_states"] = int(max(own))
    check = memory_check(toy, "adamw", ranks)
    assert not check.passed and f"rank {low} optimizer states" in check.detail, check.detail


def test_a_one_process_layout_resumes_on_two_data_parallel_ranks_with_the_same_batches(tmp_path):
    """(A one-process layout's toy trains beside its reference; its checkpoint resumes on two DDP ranks, each
    taking half of every micro-batch, so the step's batches are the reference's.)"""
    toy = toy_run(load_config("gpt2-124m"), Layout.parse("mb=16,ga=4"))
    assert toy.world_size == 1 and toy.layout.micro_batch == 2
    resumed = load_config(str(_ddp_config(toy, tmp_path)))
    resumed.validate()
    ref, t = toy.reference.train, resumed.train
    assert resumed.parallel.world_size == 2 and resumed.parallel.dp_replicate == 2
    assert (t.micro_batch_size * 2, t.global_batch_size) == (ref.micro_batch_size, ref.global_batch_size)
    assert resumed.model == toy.reference.model and resumed.data == toy.reference.data


def _metrics(steps, loss=2.0, grad_norm=1.0):
    return {s: {"loss": loss + s, "grad_norm": grad_norm} for s in steps}


def test_the_checks_compare_loss_and_gradient_norm_and_see_a_run_that_did_not_resume():
    ref = _metrics(range(1, STEPS + 1))
    assert compare("x", _metrics(range(1, STEPS + 1), grad_norm=1 + PARITY_TOL["grad_norm"] / 2), ref, [1, 2]).passed
    assert not compare("x", _metrics(range(1, STEPS + 1), grad_norm=2.0), ref, [1, 2]).passed  # summed, not averaged
    assert not compare("x", _metrics(range(1, STEPS + 1), loss=2.01), ref, [1, 2]).passed
    assert "missing" in compare("x", _metrics([1]), ref, [1, 2]).detail
    after = range(STEPS // 2 + 1, STEPS + 1)
    assert resume_check(1, _metrics(after), ref).passed
    started_over = resume_check(1, _metrics(range(1, STEPS + 1)), ref)  # identical numbers, but from step 1
    assert not started_over.passed and "did not continue from the checkpoint" in started_over.detail
