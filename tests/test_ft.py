"""Live fault tolerance on torchft (lmforge/train/fault_tolerance.py), with real processes on the CPU.

A real torchft lighthouse, two replica groups of one process each (gloo), a tiny model: one group is
SIGKILLed mid-run; the other keeps stepping without a restart (its step count rises while the first
is dead); the killed group, started again with the same command, rejoins, receives the weights,
optimizer and position from the survivor, and both finish with the same weights, bit for bit. Each
group's step log records the quorum that trained each step. Groups of 2 FSDP2, TP or PP ranks train
as one process does (FSDP2 through a kill and a rejoin too); groups of another layout or batch policy
are refused. The config's checks run in process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge.config import Config, ConfigError
from tests.test_ckpt_fault import assert_bitwise, final_weights, kill_launch
from tests.test_parallel_dp import DOCS, corpus, docs_corpus, free_port, grad_norms, launcher, losses, overrides  # noqa: F401 - fixture reuse

pytest.importorskip("torchft")

DRIVER = str(Path(__file__).with_name("ft_driver.py"))  # (paced steps, and a hold: see there)
STEP_S = 0.02
STEPS = 40
RUN = {"train.steps": STEPS, "train.log_every": 1, "checkpoint.every_minutes": 0, "train.sample_tokens": 0,
       "train.eval_sequences": 2, "guard.enabled": "false", "fault_tolerance.enabled": "true",
       "fault_tolerance.replica_groups": 2, "fault_tolerance.timeout_s": 20}


def lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    assert Path(found).is_file(), "torchft_lighthouse not found next to the interpreter"
    return found


def start_lighthouse(port: int, log: Path, **options) -> subprocess.Popen:
    """A real torchft lighthouse: a quorum needs one group (`min_replicas`); a group silent for 1 s is
    dead; a quorum waits at most 5 s for a live group that has not asked yet (the restarted group's
    first quorum waits for the survivor, which the test holds until then: on a busy machine it may take
    a second or more to ask). `options`: other values of its options (None: its default)."""
    options = {"min_replicas": 1, "join_timeout_ms": 5000, "heartbeat_timeout_ms": 1000, "quorum_tick_ms": 20,
               **options}
    return subprocess.Popen([lighthouse_binary(), "--bind", f"[::]:{port}"]
                            + [a for k, v in options.items() if v is not None for a in (f"--{k}", str(v))],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def start_group(corpus: Path, out: Path, replica: int, port: int, hold: Path, log: Path,  # noqa: F811
                nproc: int = 1, warm: bool = False, **more) -> subprocess.Popen:
    """Replica group `replica`: one process, or with `nproc` a torchrun of that many ranks; `warm`: started
    as forks of the test process's warm server (tests/warm_start.py), for the groups no test kills."""
    extra = {**RUN, "fault_tolerance.replica_id": replica, "fault_tolerance.lighthouse": f"http://localhost:{port}",
             **more}
    return subprocess.Popen(launcher(nproc, warm=warm) + [DRIVER, str(STEP_S), str(hold)]
                            + overrides(corpus, out, **extra), stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # (the last line of a writer killed mid-line, or being written)
            continue
    return out


def steps_done(out: Path) -> int:
    return max((r["step"] for r in records(out) if "loss" in r), default=0)


def quorums(out: Path) -> dict[int, dict]:
    """The last ft_quorum record of each step (a killed group's folder may hold a step twice)."""
    return {r["step"]: r for r in records(out) if r.get("event") == "ft_quorum"}


def wait_for(predicate, procs, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"a process ended (rc {p.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL a group (a torchrun's workers too: `kill_launch`) or the lighthouse, if still running."""
    if proc.poll() is None:
        kill_launch(proc)


def two_groups_then_kill_one(corpus: Path, tmp: Path, port: int, procs: list, hold_both: bool = False,  # noqa: F811
                             **more) -> tuple:
    """Groups 0 and 1 in TMP/group0 and TMP/group1 (logs TMP/group0.log, group1.log; added to `procs`),
    group 0 held at its first step until group 1 is up (however slowly this machine starts it), so
    that the two train together for a while (`hold_both`: group 1 too until group 0 is up, so that
    neither trains much of the run alone before the other comes); then group 1 SIGKILLed after 3
    steps of both, mid-run. The two processes: group 0 running on, the survivor, and group 1 dead."""
    hold, log0, log1 = tmp / "hold", tmp / "group0.log", tmp / "group1.log"
    hold.touch()
    a = start_group(corpus, tmp / "group0", 0, port, hold, log0, **more)
    b = start_group(corpus, tmp / "group1", 1, port, hold if hold_both else tmp / "no-hold", log1, **more)
    procs += [a, b]
    for log in [log1] + ([log0] if hold_both else []):
        wait_for(lambda: log.is_file() and "Start quorum" in log.read_text(), procs, f"{log.stem}'s first quorum")
    hold.unlink()
    wait_for(lambda: sum(r["replica_groups"] == [0, 1] for r in quorums(tmp / "group1").values()) >= 3, procs,
             "steps of both groups")
    kill(b)
    return a, b


def kill_one_and_start_it_again(corpus: Path, tmp: Path, port: int, procs: list, alone: int,  # noqa: F811
                                **more) -> int:
    """`two_groups_then_kill_one`; the survivor, group 0, stepping on alone (no restart) for at least
    `alone` steps, then held while group 1 is started again with the same command (log
    TMP/group1-again.log; it rejoins and takes the survivor's state); then both run to the end, each
    exiting 0. How many ft_quorum records group 1 wrote before its restart."""
    a, b = two_groups_then_kill_one(corpus, tmp, port, procs, **more)
    more.pop("hold_both", None)
    a_out, b_out, hold, log = tmp / "group0", tmp / "group1", tmp / "hold", tmp / "group1-again.log"
    first_leg = len([r for r in records(b_out) if r.get("event") == "ft_quorum"])
    alive_at = steps_done(a_out)
    wait_for(lambda: steps_done(a_out) >= alive_at + alone, [procs[0], a], "survivor steps after the kill")
    assert b.poll() is not None and a.poll() is None
    hold.touch()  # (the survivor waits at its next step until group 1 is up again)
    b = start_group(corpus, b_out, 1, port, tmp / "no-hold", log, **more)
    procs.append(b)
    wait_for(lambda: "Start quorum" in log.read_text(), [procs[0], a, b], "the restarted group's quorum")
    hold.unlink()
    assert a.wait(timeout=120) == 0, (tmp / "group0.log").read_text()[-3000:]
    assert b.wait(timeout=60) == 0, log.read_text()[-3000:]
    return first_leg


@pytest.mark.slow
def test_a_killed_group_costs_no_restart_and_rejoins_with_the_survivors_weights(corpus, tmp_path):  # noqa: F811
    port = free_port()
    a_out, b_out, again = tmp_path / "group0", tmp_path / "group1", tmp_path / "group1-again.log"
    procs = [start_lighthouse(port, tmp_path / "lighthouse.log")]
    try:  # (the survivor keeps stepping, without a restart, while group 1 is dead)
        first_leg = kill_one_and_start_it_again(corpus, tmp_path, port, procs, alone=5)
    finally:
        for p in procs:
            kill(p)

    qa, qb = quorums(a_out), quorums(b_out)
    by_step = {s: tuple(qa[s]["replica_groups"]) for s in sorted(qa)}
    # every step of the run was trained, once per group, each by a recorded quorum (the group that
    # came up second at the start took the first one's state then, as a rejoining group does)
    assert sorted(set(qa) | set(qb)) == list(range(1, STEPS + 1))
    # the survivor: every step from its first to the last, in order: both groups, then group 0 alone
    # from the kill on (at least the 5 steps waited for), then both again to the end
    assert sorted(qa) == list(range(min(qa), STEPS + 1))
    alone = [s for s, g in by_step.items() if g == (0,) and s > min(qb)]
    killed, rejoined = min(alone), max(alone) + 1
    assert alone == list(range(killed, rejoined)) and len(alone) >= 5, by_step
    assert all(by_step[s] == (0, 1) for s in range(max(min(qa), min(qb)), killed)), by_step
    assert all(by_step[s] == (0, 1) for s in range(rejoined, STEPS + 1)), by_step
    # the restarted group began at the survivor's step, not at step 1: it received the loop's position
    second_leg = [r["step"] for r in records(b_out) if r.get("event") == "ft_quorum"][first_leg:]
    assert second_leg == list(range(rejoined, STEPS + 1)), second_leg
    assert "received from a live group" in again.read_text()
    # ... and the weights and the optimizer state: from there on both apply the same averaged
    # gradients to the same weights with the same Adam moments, so they end bit-identical
    assert_bitwise(final_weights(a_out), final_weights(b_out))


# batch_policy "keep" on best-fit packed rows of short documents (`docs_corpus`, padded rows: every
# micro-batch holds another number of targets, so a gradient weighed by anything but tokens shows)
KEEP = {"train.steps": 16, "fault_tolerance.batch_policy": "keep", "data.packing": DOCS["data.packing"],
        "data.packing_buffer": DOCS["data.packing_buffer"], "checkpoint.save_final": "false"}


@pytest.fixture(scope="module")
def one_process(docs_corpus, tmp_path_factory) -> Path:  # noqa: F811
    """The run KEEP's groups are measured against: one process (no fault tolerance) training the 2 x 8
    sequences of each step itself (the same sequences: data rank g of 2 is every other sample of the
    one order, and under a layout of 2 data-parallel ranks data rank 2g + i every fourth)."""
    out = tmp_path_factory.mktemp("one-process")
    one = {**RUN, **KEEP, "fault_tolerance.enabled": "false", "fault_tolerance.replica_groups": 1,
           "fault_tolerance.batch_policy": "shrink", "train.global_batch_size": 16}
    proc = subprocess.run(launcher() + ["-m", "lmforge", "train"] + overrides(docs_corpus, out, **one),
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def assert_steps_match(outs: list[Path], reference: Path) -> None:
    """The groups' runs `outs` logged, between them, every step of `reference`, each with its loss and
    gradient norm (the quorum's; a step twice: the later folder's) within fp32 rounding (the sums add
    in another order; measured <= 5e-7 relative, FSDP2 and TP groups included), and its tokens seen
    exactly (the whole global batch's, once a step, whichever groups trained it: every group's
    record of a step, a restarted group's too, which received the count)."""
    steps = {r["step"]: r for out in outs for r in records(out) if "loss" in r and "val_loss" not in r}
    want_loss, want_norm = losses(reference), grad_norms(reference)
    want_tokens = {r["step"]: r["tokens"] for r in records(reference) if "loss" in r and "val_loss" not in r}
    assert sorted(steps) == sorted(want_loss) == list(range(1, KEEP["train.steps"] + 1))
    for s, r in sorted(steps.items()):
        assert r["loss"] == pytest.approx(want_loss[s], rel=2e-6, abs=0), (s, r, want_loss)
        assert r["grad_norm"] == pytest.approx(want_norm[s], rel=5e-6, abs=0), (s, r, want_norm)
    assert all(r["tokens"] == want_tokens[r["step"]] for out in outs for r in records(out)
               if "loss" in r and "val_loss" not in r), want_tokens


@pytest.mark.slow
def test_keep_trains_the_whole_global_batch_with_a_group_dead(docs_corpus, one_process, tmp_path):  # noqa: F811
    """batch_policy "keep": group 1 of 2 is SIGKILLed mid-run and the survivor trains on alone to the
    end. Every step, whatever its quorum, trains 2 x 8 sequences; the survivor's steps alone record
    both shares as its own; and every step's loss and gradient norm (the quorum's) are those of one
    process training the 16-sequence global batch itself (`one_process`), to fp32 rounding: a share
    skipped, read from the wrong place or trained twice, or the two weighed by anything but their
    target tokens, would differ."""
    port = free_port()
    a_out, b_out, log0 = tmp_path / "group0", tmp_path / "group1", tmp_path / "group0.log"
    lighthouse = start_lighthouse(port, tmp_path / "lighthouse.log")
    procs = [lighthouse]
    try:
        a, b = two_groups_then_kill_one(docs_corpus, tmp_path, port, procs, hold_both=True, **KEEP)
        assert a.wait(timeout=180) == 0, log0.read_text()[-3000:]
    finally:
        for p in procs:
            kill(p)

    qa, qb = quorums(a_out), quorums(b_out)
    # (whichever group asked first trained the first step alone, the other taking its state then)
    assert sorted(set(qa) | set(qb)) == list(range(1, KEEP["train.steps"] + 1))
    together = [s for s, r in qa.items() if r["replica_groups"] == [0, 1]]
    after = list(range(max(together) + 1, KEEP["train.steps"] + 1))  # from the kill to the end: group 0 alone
    assert len(together) >= 3 and len(after) >= 3 and all(qa[s]["replica_groups"] == [0] for s in after), qa
    # every step of either group trained the job's 16 sequences: both shares, whoever trained them
    for r in [*qa.values(), *qb.values()]:
        assert r["sequences"] == 16, r
        alone = r["replica_groups"][0]
        want = {str(alone): {"0": [0, 4], "1": [0, 4]}} if len(r["replica_groups"]) == 1 else \
            {"0": {"0": [0, 4]}, "1": {"1": [0, 4]}}
        assert r["shares"] == want, r
    # ... the same sequences as one process's 16, weighed alike: the same loss and gradient norm at
    # every step (the quorum's: the survivor's, or group 1's before group 0 joined), those of group 0
    # alone after the kill included
    assert_steps_match([b_out, a_out], one_process)


# sharded layouts inside the groups: 2 ranks each, KEEP's run with its final weights
FSDP = {**KEEP, "checkpoint.save_final": "true", "parallel.dp_shard": 2, "parallel.zero_stage": 3}


@pytest.mark.slow
def test_fsdp_groups_match_one_process_through_a_kill_and_a_rejoin(docs_corpus, one_process, tmp_path):  # noqa: F811
    """Two replica groups of 2 FSDP2 ranks each (ZeRO-3: each rank holds half of every parameter, and
    averages its shards of the gradients with the same rank of the other group). Group 1 is SIGKILLed
    mid-run; group 0 steps on alone, training both shares ("keep"); group 1 started again heals (each
    rank its own shards of the weights and Adam moments, from the same rank of group 0) and both
    finish. Every step's loss and gradient norm, whichever groups trained it, are those of
    `one_process` (scale-sensitive: padded rows, groups weighed by target tokens), and both groups end
    with the same weights, bit for bit."""
    port = free_port()
    a_out, b_out = tmp_path / "group0", tmp_path / "group1"
    procs = [start_lighthouse(port, tmp_path / "lighthouse.log")]
    try:
        kill_one_and_start_it_again(docs_corpus, tmp_path, port, procs, alone=3, hold_both=True, nproc=2, **FSDP)
    finally:
        for p in procs:
            kill(p)
    qa = quorums(a_out)
    alone = [s for s, r in qa.items() if r["replica_groups"] == [0]]
    assert len(alone) >= 3 and qa[max(qa)]["replica_groups"] == [0, 1], qa  # (group 0 alone, then both again)
    assert "received from a live group" in (tmp_path / "group1-again.log").read_text()
    assert_steps_match([b_out, a_out], one_process)
    assert_bitwise(final_weights(a_out), final_weights(b_out))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel.tp": 2, "parallel.sequence_parallel": "true"}, {"parallel.pp": 2},
                                    {"parallel.cp": 2}], ids=["tp-sp", "pp", "cp"])
def test_tp_and_pp_groups_match_one_process(docs_corpus, one_process, tmp_path, layout):  # noqa: F811
    """Two replica groups of 2 tensor-parallel ranks with sequence parallelism (each rank half of every
    matrix; the norm weights' gradients partial sums until the clip adds them), 2 pipeline stages
    (each rank one block) or 2 context-parallel ranks (each rank half of every sequence, the weights
    whole, their gradients averaged over the group's cp ranks first), both groups in every step (min_replicas 2; the
    one that asked second took the other's state at the first quorum, each rank its own part): every
    step's loss and gradient norm are those of `one_process`, and both groups end bit-identical."""
    run = {**FSDP, "parallel.dp_shard": 1, "parallel.zero_stage": 0, **layout}
    two_groups_of_two_match(docs_corpus, tmp_path, run, one_process)


def two_groups_of_two_match(corpus: Path, tmp_path: Path, run: dict, reference: Path) -> None:  # noqa: F811
    """Two replica groups of 2 ranks each, `run`'s layout, both in every step (min_replicas 2: the one that
    asked second takes the other's state at the first quorum, each rank its own part): every step's loss and
    gradient norm are `reference`'s, and both groups end bit-identical."""
    port = free_port()
    procs = [start_lighthouse(port, tmp_path / "lighthouse.log", min_replicas=2, join_timeout_ms=100)]
    run = {**run, "fault_tolerance.min_replicas": 2,
           "fault_tolerance.batch_policy": "shrink"}  # (every step has both groups: no policy applies)
    outs = [tmp_path / f"group{g}" for g in range(2)]
    try:
        for g, out in enumerate(outs):
            procs.append(start_group(corpus, out, g, port, tmp_path / "no-hold", tmp_path / f"group{g}.log",
                                     nproc=2, warm=True, **run))
        for g, proc in enumerate(procs[1:]):
            assert proc.wait(timeout=180) == 0, (tmp_path / f"group{g}.log").read_text()[-3000:]
    finally:
        for p in procs:
            kill(p)
    assert all(r["replica_groups"] == [0, 1] for out in outs for r in quorums(out).values())
    assert_steps_match(outs, reference)
    assert_bitwise(final_weights(outs[0]), final_weights(outs[1]))


# (the MoE model of tests/test_parallel_ep.py's size; its load-balancing and z losses off: their statistics are
# each group's micro-batch's, not the job's, docs/checkpoints.md)
MOE_GROUPS = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 64,
              "model.moe.shared_experts": 1, "model.moe.aux_loss_coef": 0.0, "model.moe.z_loss_coef": 0.0}


@pytest.mark.slow
def test_expert_parallel_groups_match_one_process(docs_corpus, tmp_path):  # noqa: F811
    """Two replica groups of 2 ranks holding 2 experts each (parallel.ep = 2 over dp_shard 2), both groups in
    every step: every step's loss and gradient norm are those of one process training the job's global batch
    of the same MoE model, and both groups end bit-identical."""
    run = {**FSDP, **MOE_GROUPS, "parallel.zero_stage": 0, "parallel.ep": 2}
    one = {**RUN, **KEEP, **MOE_GROUPS, "fault_tolerance.enabled": "false", "fault_tolerance.replica_groups": 1,
           "fault_tolerance.batch_policy": "shrink", "train.global_batch_size": 16}
    reference = tmp_path / "one-process"
    proc = subprocess.run(launcher() + ["-m", "lmforge", "train"] + overrides(docs_corpus, reference, **one),
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    two_groups_of_two_match(docs_corpus, tmp_path, run, reference)


@pytest.mark.parametrize("key, value, message", [
    ("replica_id", 2, "fault_tolerance.replica_id = 2 must be < fault_tolerance.replica_groups"),
    ("replica_groups", 0, "fault_tolerance.replica_groups = 0 must be >= 1"),
    ("min_replicas", 3, "fault_tolerance.min_replicas = 3 must be <= fault_tolerance.replica_groups"),
    ("timeout_s", 0, "fault_tolerance.timeout_s = 0 must be > 0"),
    ("lighthouse", "host:29510", "fault_tolerance.lighthouse = 'host:29510' must be a URL"),
    ("diloco_fragments", 0, "fault_tolerance.diloco_fragments = 0 must be >= 1"),
    ("diloco_outer_lr", 0, "fault_tolerance.diloco_outer_lr = 0 must be > 0"),
    ("diloco_outer_momentum", 1.0, "must be > 0 and diloco_outer_momentum = 1.0 in"),
    ("batch_policy", "grow", "fault_tolerance.batch_policy = 'grow' must be 'shrink' or 'keep'"),
])
def test_bad_values_name_the_key(key, value, message):
    cfg = Config()
    cfg.fault_tolerance.replica_groups = 2
    setattr(cfg.fault_tolerance, key, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        cfg.fault_tolerance.check()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("setting, message", [
    ({"guard.enabled": True}, "needs guard.enabled = false"),
    ({"parallel.async_sgd": True}, "parallel.async_sgd"),
    ({"parallel.dp_shard": 2, "fault_tolerance.diloco_sync_every": 4},
     "diloco_sync_every with a sharded layout in the group .* checkpointed as whole parameters"),
    ({"parallel.pp": 2, "fault_tolerance.batch_policy": "keep"}, "'keep' with parallel.pp > 1: a pipeline schedule"),
    ({"fault_tolerance.diloco_sync_every": 4, "train.precision": "fp16"}, "a step the loss scale skips"),
    ({"fault_tolerance.diloco_sync_every": 7, "train.steps": 100}, "must divide train.steps = 100, so that the run "
                                                                    "ends on a sync.*train.steps = 105"),
    ({"fault_tolerance.diloco_sync_every": 4, "fault_tolerance.diloco_fragments": 3},
     "diloco_sync_every = 4 must be a multiple of fault_tolerance.diloco_fragments = 3"),
    ({"fault_tolerance.diloco_sync_every": 4, "fault_tolerance.batch_policy": "keep"},
     "batch_policy = 'keep' with fault_tolerance.diloco_sync_every: DiLoCo's inner steps are each group's own"),
])
def test_layouts_a_replica_group_cannot_be(setting, message):
    from lmforge.config.rules import check_fault_tolerance

    cfg = Config()
    cfg.guard.enabled = False
    cfg.fault_tolerance.enabled = True
    check_fault_tolerance(cfg)  # (one process, no guard: a replica group)
    for layout in ({"dp_shard": 2, "zero_stage": 3}, {"dp_shard": 2, "zero_stage": 1}, {"tp": 2}, {"pp": 2},
                   {"cp": 2}, {"dp_shard": 2, "ep": 2}):  # (so are)
        check_fault_tolerance(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **layout)))
    for dotted, value in setting.items():
        section, key = dotted.split(".")
        setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError, match=message) as e:
        cfg.fault_tolerance.check()
        check_fault_tolerance(cfg)
    assert "\n" not in str(e.value)


def test_share_plan_gives_each_micro_batch_of_the_step_to_one_live_group():
    """`share_plan`: each group its own share; under "keep" the missing groups' micro-batches in
    consecutive runs, as even as can be, over the live groups in order; under "shrink" nothing more."""
    from itertools import combinations

    from lmforge.train.fault_tolerance import share_plan

    assert share_plan([0, 1, 2], 3, 4, keep=True) == {0: {0: [0, 4]}, 1: {1: [0, 4]}, 2: {2: [0, 4]}}
    assert share_plan([0, 2], 3, 4, keep=True) == {0: {0: [0, 4], 1: [0, 2]}, 2: {2: [0, 4], 1: [2, 4]}}
    assert share_plan([1], 3, 4, keep=True) == {1: {1: [0, 4], 0: [0, 4], 2: [0, 4]}}
    assert share_plan([0, 1, 3], 4, 4, keep=True) == {0: {0: [0, 4], 2: [0, 1]}, 1: {1: [0, 4], 2: [1, 2]},
                                                     3: {3: [0, 4], 2: [2, 4]}}
    assert share_plan([0, 1], 4, 3, keep=True) == {0: {0: [0, 3], 2: [0, 3]}, 1: {1: [0, 3], 3: [0, 3]}}
    assert share_plan([0], 2, 4, keep=False) == {0: {0: [0, 4]}}
    for n in range(1, 5):  # every quorum of 4 groups, 3 micro-batches each: each (share, micro-batch) once
        for quorum in combinations(range(4), n):
            plan = share_plan(list(quorum), 4, 3, keep=True)
            units = [(m, j) for shares in plan.values() for m, (first, stop) in shares.items() for j in range(first, stop)]
            assert sorted(units) == [(m, j) for m in range(4) for j in range(3)], (quorum, plan)
            loads = [sum(stop - first for first, stop in shares.values()) for shares in plan.values()]
            assert max(loads) - min(loads) <= 1, (quorum, plan)


def test_launch_takes_its_lighthouse_option_and_leaves_torchrun_the_rest(tmp_path):
    from lmforge.launch import LIGHTHOUSE_PORT, min_replicas_option, take_lighthouse_option

    # the lighthouse's quorum needs the job's fault_tolerance.min_replicas groups, read from the workers'
    # config as they read it: an override (either spelling), else their --config file, else 1
    assert min_replicas_option(["train", "--fault_tolerance.min_replicas", "2"]) == 2
    assert min_replicas_option(["train", "--fault_tolerance.min_replicas=3", "--optim.lr", "1e-3"]) == 3
    assert min_replicas_option(["train", "--fault-tolerance.min-replicas", "2"]) == 2
    assert min_replicas_option(["train", "--fault_tolerance.replica_groups", "2"]) == 1
    config = tmp_path / "job.toml"
    config.write_text("[fault_tolerance]\nenabled = true\nreplica_groups = 3\nmin_replicas = 3\n")
    assert min_replicas_option(["train", "--config", str(config), "--train.steps", "5"]) == 3
    assert min_replicas_option(["train", "--config", str(config), "--fault_tolerance.min_replicas", "2"]) == 2
    assert min_replicas_option(["train", "--config", str(tmp_path / "missing.toml")]) == 1  # (the workers say why)
    assert min_replicas_option(["eval", "--fault_tolerance.min_replicas", "2"]) == 1

    subs = {"train"}
    argv = ["--nproc-per-node", "2", "train", "--lighthouse"]  # (after the sub-command: the worker's)
    assert take_lighthouse_option(argv, subs) == (argv, None)
    assert take_lighthouse_option(["--lighthouse", "--nproc-per-node", "2", "train", "--x", "1"], subs) == \
        (["--nproc-per-node", "2", "train", "--x", "1"], LIGHTHOUSE_PORT)
    assert take_lighthouse_option(["--nproc-per-node", "2", "--lighthouse=29600", "train"], subs) == \
        (["--nproc-per-node", "2", "train"], 29600)
    with pytest.raises(ValueError, match="--lighthouse=abc: give a port number"):
        take_lighthouse_option(["--lighthouse=abc", "train"], subs)



# DiLoCo: H = 4 inner steps per sync over 8 steps (2 syncs); streaming DiLoCo: 2 fragments, one synced
# every 2 steps in turn (4 syncs). min_replicas 2: every sync waits for both groups
DILOCO = {"train.steps": 8, "train.log_every": 1, "checkpoint.every_minutes": 0, "train.sample_tokens": 0,
          "train.eval_sequences": 2, "guard.enabled": "false", "fault_tolerance.enabled": "true",
          "fault_tolerance.replica_groups": 2, "fault_tolerance.min_replicas": 2, "fault_tolerance.timeout_s": 30,
          "fault_tolerance.diloco_sync_every": 4}


def diloco_reference(corpus: Path, tmp: Path, fragments: int) -> list[tuple[dict[int, float], dict]]:  # noqa: F811
    """Both groups in this process, without torchft: each Trainer steps on its own share of the data
    (the same config; fault_tolerance.replica_id picks the share); after every 4 / `fragments` steps,
    for the fragment whose turn it is, the two pseudo-gradients (the weights at its last sync minus the
    group's) are averaged, and each group's weights are set to the last sync's and stepped by its own
    copy of the outer Nesterov SGD with that average as the gradient: DiLoCo written out. Each group's
    per-step losses and final weights."""
    from lmforge.config import load_config, parse_cli_overrides
    from lmforge.train.fault_tolerance import diloco_fragments
    from lmforge.train.trainer import Trainer

    trainers, frags, outer, last_sync = [], [], [], []
    for g in range(2):
        argv = overrides(corpus, tmp / f"reference{g}", **DILOCO, **{"fault_tolerance.replica_id": g,
                                                                     "fault_tolerance.diloco_fragments": fragments})
        t = Trainer(load_config("tiny", parse_cli_overrides(argv)))
        t.setup()
        trainers.append(t)
        frags.append(diloco_fragments(t.model, fragments))
        outer.append([torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in frags[g]])
        last_sync.append([{n: p.detach().clone() for n, p in f.named_parameters()} for f in frags[g]])
    losses = [{}, {}]
    interval, syncs = 4 // fragments, 0
    for step in range(1, DILOCO["train.steps"] + 1):
        for g, t in enumerate(trainers):
            losses[g][step] = float(t.train_step(t.next_micro_batches())[0])
        if step % interval:
            continue
        k = syncs % fragments  # (torchft: the fragment of the number of syncs committed so far)
        local = [dict(frags[g][k].named_parameters()) for g in range(2)]
        average = {n: ((last_sync[0][k][n] - local[0][n].detach()) + (last_sync[1][k][n] - local[1][n].detach())) / 2
                   for n in local[0]}
        for g in range(2):
            with torch.no_grad():
                for n, p in frags[g][k].named_parameters():
                    p.copy_(last_sync[g][k][n])
                    p.grad = average[n].clone()
            outer[g][k].step()
            outer[g][k].zero_grad()
            last_sync[g][k] = {n: p.detach().clone() for n, p in frags[g][k].named_parameters()}
        syncs += 1
    weights = [{n: p.detach().clone() for n, p in t.model.state_dict().items()} for t in trainers]
    for t in trainers:
        t.close()
    return list(zip(losses, weights))


@pytest.mark.slow
@pytest.mark.parametrize("fragments", [1, 2])
def test_diloco_and_streaming_diloco_match_the_updates_written_out(corpus, tmp_path, fragments):  # noqa: F811
    """Two groups with a real lighthouse, each 8 inner steps with a DiLoCo sync every 4 (or, streaming,
    one of 2 fragments every 2): every step's loss and the final weights of each group are those of
    `diloco_reference`, bit for bit (an average of two is exact in fp32); the syncs are recorded."""
    port = free_port()
    lighthouse = start_lighthouse(port, tmp_path / "lighthouse.log", min_replicas=2, join_timeout_ms=100,
                                  heartbeat_timeout_ms=None)
    outs = [tmp_path / f"group{g}" for g in range(2)]
    procs = [lighthouse]
    try:
        for g, out in enumerate(outs):
            extra = {**DILOCO, "fault_tolerance.replica_id": g, "fault_tolerance.diloco_fragments": fragments,
                     "fault_tolerance.lighthouse": f"http://localhost:{port}"}
            procs.append(subprocess.Popen(launcher() + ["-m", "lmforge", "train"]
                                          + overrides(corpus, out, **extra),
                                          stdout=open(tmp_path / f"group{g}.log", "ab"), stderr=subprocess.STDOUT,
                                          start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        for g, proc in enumerate(procs[1:]):
            assert proc.wait(timeout=240) == 0, (tmp_path / f"group{g}.log").read_text()[-3000:]
    finally:
        for p in procs:
            kill(p)
    reference = diloco_reference(corpus, tmp_path, fragments)
    for out, (want_losses, want_weights) in zip(outs, reference):
        got = {r["step"]: r["loss"] for r in records(out) if "loss" in r and "val_loss" not in r}
        assert got == want_losses, (got, want_losses)
        assert_bitwise(final_weights(out), {k: v for k, v in want_weights.items() if k in final_weights(out)})
        syncs = [r for r in records(out) if r.get("event") == "ft_quorum"]
        assert [r["step"] for r in syncs] == list(range(4 // fragments, 9, 4 // fragments)), syncs
        assert all(r["committed"] and r["replica_groups"] == [0, 1] for r in syncs), syncs
        assert [r["fragment"] for r in syncs] == [i % fragments for i in range(len(syncs))], syncs


@pytest.mark.slow
def test_diloco_survives_a_killed_group_and_heals_it_at_the_next_sync(corpus, tmp_path):  # noqa: F811
    """DiLoCo (a sync every 2 steps) through `kill_one_and_start_it_again`: the survivor keeps taking inner
    steps and syncs alone (committed) while group 1 is dead, without a restart; group 1, started again
    from nothing, is healed at its first sync (the weights, the outer state and the loop's position) and
    both sync together from there to the end, finishing with the same weights, bit for bit."""
    port = free_port()
    a_out, b_out, again = tmp_path / "group0", tmp_path / "group1", tmp_path / "group1-again.log"
    procs = [start_lighthouse(port, tmp_path / "lighthouse.log")]
    try:
        first_leg = kill_one_and_start_it_again(corpus, tmp_path, port, procs, alone=5,
                                                **{"fault_tolerance.diloco_sync_every": 2})
    finally:
        for p in procs:
            kill(p)
    syncs = [r for r in records(a_out) if r.get("event") == "ft_quorum"]
    # the survivor: a sync record every 2 steps from its first to the last, in one leg (no restart)
    assert [r["step"] for r in syncs] == list(range(syncs[0]["step"], STEPS + 1, 2)), syncs
    alone = [r["step"] for r in syncs if r["replica_groups"] == [0] and r["committed"]]
    assert len(alone) >= 2, syncs  # (it synced alone while group 1 was dead)
    assert syncs[-1]["replica_groups"] == [0, 1] and syncs[-1]["committed"], syncs[-1]
    # group 1's second leg: healed from the survivor, then on to the end with it
    second = [r for r in records(b_out) if r.get("event") == "ft_quorum"][first_leg:]
    assert "received from a live group" in again.read_text()
    # (healed at its first sync, step 2 of its own, to the survivor's step: its syncs are the survivor's from there)
    assert second[0]["step"] > 2 and [r["step"] for r in second] == list(range(second[0]["step"], STEPS + 1, 2)), second
    assert all(r["replica_groups"] == [0, 1] and r["committed"] for r in second), second
    assert_bitwise(final_weights(a_out), final_weights(b_out))


class _Manager:
    """What torchft's DiLoCo asks of its Manager before any sync (no lighthouse, no process group)."""
    _use_async_quorum = False

    def __init__(self):
        self.step, self.fns = 0, {}

    def register_state_dict_fn(self, key, load, save):
        self.fns[key] = (load, save)

    def load_state_dict(self, sd):
        self.step = sd["step"]

    def current_step(self):
        return self.step


@pytest.mark.slow
def test_a_group_of_another_batch_policy_fails_with_one_line(corpus, tmp_path):  # noqa: F811
    """Group 1 started with fault_tolerance.batch_policy = "keep" into a job whose group 0 runs "shrink": at
    the quorum where they meet, the group that takes the other's state (or, meeting at one step, both)
    stops with a one-line config error naming the key, exit status 2, instead of training along; a group
    that did not fail finishes alone."""
    port = free_port()
    hold, logs = tmp_path / "hold", [tmp_path / "group0.log", tmp_path / "group1.log"]
    lighthouse = start_lighthouse(port, tmp_path / "lighthouse.log")
    procs = [lighthouse]
    short = {"train.steps": 10, "checkpoint.save_final": "false"}
    try:
        hold.touch()  # (group 0 waits at its first step until group 1 asks for a quorum)
        procs.append(start_group(corpus, tmp_path / "group0", 0, port, hold, logs[0], warm=True, **short))
        procs.append(start_group(corpus, tmp_path / "group1", 1, port, tmp_path / "no-hold", logs[1], warm=True,
                                 **short, **{"fault_tolerance.batch_policy": "keep"}))
        wait_for(lambda: logs[1].is_file() and "Start quorum" in logs[1].read_text(), procs, "group 1's quorum")
        hold.unlink()
        codes = [p.wait(timeout=120) for p in procs[1:]]
    finally:
        for p in procs:
            kill(p)
    assert 2 in codes and set(codes) <= {0, 2}, codes
    for code, log in zip(codes, logs):
        if code == 2:
            errors = [line for line in log.read_text().splitlines() if "error" in line.lower()]
            assert len(errors) == 1 and errors[0].startswith("config error: fault tolerance: this replica group has "
                                                              "fault_tolerance.batch_policy = "), errors


def test_groups_of_other_layouts_are_refused_naming_the_key(corpus, tmp_path):  # noqa: F811
    """The layout check's two paths in process: a healing group compares the sender's `group_layout`
    with its own before loading anything (`PeerState`), and the groups of a new quorum compare theirs
    in one MAX all-reduce (`FaultTolerance.check_layout`, here against a stand-in Manager): another
    fault_tolerance.batch_policy, or another parallel.dp_shard (a sender's layout as a 2-rank FSDP2
    group would send it), is a one-line error naming the key; the same layout passes."""
    from lmforge.config import load_config, parse_cli_overrides
    from lmforge.train.fault_tolerance import FaultTolerance, PeerState, group_layout, layout_vector
    from lmforge.train.trainer import Trainer

    trainers = []
    for g, policy in enumerate(["shrink", "keep"]):
        argv = overrides(corpus, tmp_path / f"group{g}", **{**RUN, "fault_tolerance.replica_id": g,
                                                            "fault_tolerance.batch_policy": policy})
        trainers.append(Trainer(load_config("tiny", parse_cli_overrides(argv))))
        trainers[-1].setup()
    shrink, keep = trainers

    class Quorum:  # what check_layout asks of torchft's Manager: the other group's numbers, all-reduced MAX
        _quorum_id, _pg = 7, type("PG", (), {"_global_ranks": [0, 1]})

        def __init__(self, other: torch.Tensor):
            self.other = other

        def num_participants(self):
            return 2

        def allreduce(self, t, reduce_op):
            torch.maximum(t, self.other, out=t)
            return type("Done", (), {"wait": lambda self: None})()

        def errored(self):
            return None

    try:
        sent = PeerState(shrink).state_dict()
        with pytest.raises(ConfigError) as e:
            PeerState(keep).load_state_dict(sent)
        assert str(e.value).startswith("fault tolerance: this replica group has fault_tolerance.batch_policy = "
                                       "'keep', but the live group it receives its state from has 'shrink'")
        assert str(e.value).endswith("start this group with fault_tolerance.batch_policy = 'shrink'.")
        sent["layout"] = {**sent["layout"], "parallel.dp_shard": 2}
        with pytest.raises(ConfigError, match=r"has parallel.dp_shard = 1, but the live group .* has 2.*start this "
                                              r"group with parallel.dp_shard = 2\.$") as e2:
            PeerState(shrink).load_state_dict(sent)
        ft = FaultTolerance()
        ft.manager = Quorum(layout_vector(group_layout(shrink)))
        ft.check_layout(shrink)  # (the same layout: nothing to say)
        ft.checked_quorum = None
        with pytest.raises(ConfigError, match=r"has fault_tolerance.batch_policy = 'keep', but the groups of its "
                                              r"quorum \[0, 1\] have another value") as e3:
            ft.check_layout(keep)
        assert all("\n" not in str(x.value) for x in (e, e2, e3))
    finally:
        for t in trainers:
            t.close()


class _Alone:
    """torchft's Manager as a quorum of group 0 alone sees it (its all-reduces leave the tensors as they are)."""
    _quorum_id, _pg = 1, type("PG", (), {"_global_ranks": [0]})

    def start_quorum(self):
        pass

    def num_participants(self):
        return 1

    def allreduce(self, t, reduce_op):
        return type("Done", (), {"wait": lambda self: None})()

    def should_commit(self):
        return True

    def shutdown(self, wait):
        pass


def test_keep_counts_what_a_group_trains_for_a_dead_one_in_tokens_and_moe_statistics(corpus, tmp_path):  # noqa: F811
    """batch_policy "keep", in process: group 0 of 2 alone in its quorum (a stand-in Manager) trains both
    shares of each step, a Mixture-of-Experts model with the auxiliary-loss-free bias update, against one
    process training the 16-sequence batch itself. The step counts 16 sequences' tokens (tokens_seen and
    this group's tokens/s); its MoE statistics are those of both shares (the expert loads, the micro-batches)
    and its bias update is one, of both shares' load, with the missing share routed by the step's biases:
    the expert biases stay bit-identical to the one process's, and so the losses to fp32 rounding."""
    from lmforge.config import load_config, parse_cli_overrides
    from lmforge.model.moe import moe_layers
    from lmforge.train.fault_tolerance import FaultTolerance
    from lmforge.train.step_log import StepTokens
    from lmforge.train.trainer import Trainer

    moe = {"model.moe.num_experts": 4, "model.moe.top_k": 2, "model.moe.router": "sigmoid",
           "model.moe.aux_loss_coef": 0, "model.moe.bias_update_rate": 0.05}
    runs = {"group": {**RUN, **moe, "fault_tolerance.replica_id": 0, "fault_tolerance.batch_policy": "keep"},
            "one": {**RUN, **moe, "fault_tolerance.enabled": "false", "fault_tolerance.replica_groups": 1,
                    "train.global_batch_size": 16}}
    trainers = {}
    try:
        for name, extra in runs.items():
            trainers[name] = Trainer(load_config("tiny", parse_cli_overrides(overrides(corpus, tmp_path / name, **extra))))
            trainers[name].setup()
        group, one = trainers["group"], trainers["one"]
        ft = next(h for h in group.handlers.handlers if isinstance(h, FaultTolerance))
        ft.manager = _Alone()
        tokens, moved = 16 * one.cfg.data.seq_len, False
        for step in (1, 2):
            ft.step_begin(group, step)
            group.steplog.step_tokens = StepTokens(8 * one.cfg.data.seq_len, 8 * one.cfg.data.seq_len)  # (the loop's)
            got = float(group.train_step(group.next_micro_batches())[0])
            want = float(one.train_step(one.next_micro_batches())[0])
            assert got == pytest.approx(want, rel=2e-6, abs=0), (step, got, want)
            assert group.steplog.step_tokens == StepTokens(tokens, tokens)
            stats, ref = group.layout.moe_stats, one.layout.moe_stats
            assert sorted(stats) == sorted(ref) and ref
            for i in ref:
                assert torch.equal(stats[i].tokens_per_expert, ref[i].tokens_per_expert), (step, i)
                assert stats[i].tokens == ref[i].tokens == tokens and stats[i].micro_batches == ref[i].micro_batches
            for (i, a), (_, b) in zip(moe_layers(group.layout.model).items(), moe_layers(one.layout.model).items()):
                assert torch.equal(a.expert_bias, b.expert_bias), (step, i, a.expert_bias, b.expert_bias)
                moved |= bool(a.expert_bias.any())
        assert moved  # (the biases did move: the update is one of both shares' load, not of none)
    finally:
        for t in trainers.values():
            t.close()


def test_a_state_sent_before_the_first_step_leaves_both_optimizers_fresh(corpus, tmp_path):  # noqa: F811
    """A group asked for its state at the job's start (torchft's init sync) sends the optimizer as it
    is, unstepped: torch's get_optimizer_state_dict would otherwise leave the sender's AdamW (and
    hand the receiver) a state of one step at lr 0, which AdamW's bias correction counts, so the
    whole job would train off a run without fault tolerance from its second step on."""
    from lmforge.config import load_config, parse_cli_overrides
    from lmforge.train.fault_tolerance import PeerState
    from lmforge.train.trainer import Trainer

    trainers = []
    for g in range(2):
        argv = overrides(corpus, tmp_path / f"group{g}", **{**RUN, "fault_tolerance.replica_id": g})
        trainers.append(Trainer(load_config("tiny", parse_cli_overrides(argv))))
        trainers[-1].setup()
    try:
        sent = PeerState(trainers[0]).state_dict()
        assert sent["fresh_optimizer"] and not trainers[0].optimizer.state
        PeerState(trainers[1]).load_state_dict(sent)
        assert not trainers[1].optimizer.state
        trainers[1].train_step(trainers[1].next_micro_batches())  # (a stepped optimizer's state is sent as it is)
        again = PeerState(trainers[1]).state_dict()
        assert not again["fresh_optimizer"] and all(int(s["step"]) == 1 for s in trainers[1].optimizer.state.values())
    finally:
        for t in trainers:
            t.close()


def test_diloco_fragments_hold_every_parameter_once_in_block_order():
    from lmforge.config import load_config
    from lmforge.model.transformer import build_model
    from lmforge.train.fault_tolerance import diloco_fragments

    model = build_model(load_config("tiny", {"model.n_layers": 4}).model, seed=0)  # (tied embeddings)
    frags = diloco_fragments(model, 2)
    names = [[n for n, _ in f.named_parameters()] for f in frags]
    assert names[0][0] == "tok_emb_weight" and all(n.startswith(("tok_emb", "blocks_0_", "blocks_1_")) for n in names[0])
    assert all(n.startswith(("blocks_2_", "blocks_3_", "norm", "lm_head")) for n in names[1]) and "norm_weight" in names[1]
    ids = [id(p) for f in frags for p in f.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # every parameter once, the tied head too


def test_diloco_state_round_trips_through_a_checkpoint_and_resumes_the_schedule():
    """DiLoCoState (the run's checkpoint part): the weights at each fragment's last sync, the outer
    momentum and the schedule's position (syncs committed, inner steps since) come back exactly, into
    torchft's DiLoCo built on a fresh model."""
    from lmforge.config import load_config
    from lmforge.model.transformer import build_model
    from lmforge.train.fault_tolerance import DiLoCoState

    cfg = load_config("tiny", {"model.n_layers": 2, "fault_tolerance.diloco_sync_every": 4,
                               "fault_tolerance.diloco_fragments": 2})
    model = build_model(cfg.model, seed=0)
    state = DiLoCoState(model, cfg.fault_tolerance)
    state.start(_Manager(), torch.optim.AdamW(model.parameters()), 4, step=0)
    for i, frag in enumerate(state.diloco._fragments):
        for n, t in frag.original_parameters.items():
            t.add_(i + 1)
    for opt in state.outer:
        for p in opt.param_groups[0]["params"]:
            opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
    state.manager.step, state.diloco._local_step = 3, 1
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else
                 {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v)
             for k, v in state.state_dict().items()}
    assert saved["has_momentum"] and saved["outer_steps"] == 3 and saved["inner_steps"] == 1

    fresh = build_model(cfg.model, seed=1)
    again = DiLoCoState(fresh, cfg.fault_tolerance)
    again.load_state_dict(saved)
    again.start(_Manager(), torch.optim.AdamW(fresh.parameters()), 4, step=0)
    assert again.manager.current_step() == 3 and again.diloco._local_step == 1
    got = again.state_dict()
    for key in saved["original"]:
        assert torch.equal(got["original"][key], saved["original"][key]), key
        assert torch.equal(got["momentum"][key], saved["momentum"][key]), key
