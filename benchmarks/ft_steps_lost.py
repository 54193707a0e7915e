"""What a killed worker costs: torchft replica groups (fault_tolerance.*) against a torchrun elastic
restart from the last checkpoint, on the CPU (issue 58).

    python benchmarks/ft_steps_lost.py [--steps 400] [--kill-at 45] [--every 40] [--step-s 0.05]

Both jobs train the tests' tiny model on a small generated corpus with 2 workers and the same
tokens per step (8 sequences): torchrun with 2 DDP ranks (`--max-restarts 1`, c10d rendezvous,
checkpoints every `--every` steps), and 2 torchft replica groups of one process each (4 sequences
each) with a real lighthouse. Every step is paced to take at least `--step-s` seconds (the tiny
model's own step is a few ms; a real step is longer), through tests/ft_driver.py. When the job has
logged step `--kill-at`, one worker is SIGKILLed: torchrun restarts both ranks, which resume from the
newest checkpoint; the killed torchft group is started again at once, while the other trains on.
Reported: the steps trained twice (worker-steps computed again after the kill), the longest pause
of the job's step records (the survivor's for torchft), the steps the survivor trained alone, and the
wall time of the whole job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import make_corpus  # noqa: E402
from tests.test_parallel_dp import free_port, overrides, prepare  # noqa: E402
from tests.test_ft import lighthouse_binary, records  # noqa: E402

DRIVER = str(ROOT / "tests" / "ft_driver.py")


def step_records(out: Path) -> list[int]:
    """The step of every step record of a run folder's metrics.jsonl, in file order (a step trained
    twice appears twice)."""
    return [r["step"] for r in records(out) if "loss" in r]


class Watch:
    """Samples a run folder's step records as they arrive: the longest gap between two new records."""

    def __init__(self, out: Path):
        self.out, self.seen, self.last, self.longest = out, 0, None, 0.0

    def poll(self) -> list[int]:
        steps = step_records(self.out)
        now = time.time()
        if len(steps) > self.seen:
            if self.last is not None:
                self.longest = max(self.longest, now - self.last)
            self.seen, self.last = len(steps), now
        return steps


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_job(corpus: Path, root: Path, args, run: dict) -> dict:
    out = root / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", DRIVER, str(args.step_s),
           str(root / "no-hold")]
    extra = {**run, "parallel.dp_replicate": 2, "checkpoint.every_steps": args.every}
    t0 = time.time()
    proc = subprocess.Popen(cmd + overrides(corpus, out, **extra), stdout=open(root / "torchrun.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env())
    watch = Watch(out)
    while max(watch.poll(), default=0) < args.kill_at:
        assert proc.poll() is None, (root / "torchrun.log").read_text()[-3000:]
        time.sleep(0.01)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    killed_at = max(watch.poll())
    os.kill(int(workers[-1]), signal.SIGKILL)
    while proc.poll() is None:
        watch.poll()
        time.sleep(0.01)
    assert proc.returncode == 0, (root / "torchrun.log").read_text()[-3000:]
    steps = watch.poll()
    redone = len(steps) - len(set(steps))
    return {"killed_at": killed_at, "steps_trained_twice": redone, "worker_steps_trained_twice": 2 * redone,
            "longest_pause_s": round(watch.longest, 2), "wall_s": round(time.time() - t0, 1)}


def torchft_job(corpus: Path, root: Path, args, run: dict) -> dict:
    port = free_port()
    lighthouse = subprocess.Popen([lighthouse_binary(), "--min_replicas", "1", "--bind", f"[::]:{port}",
                                   "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    extra = {**run, "train.global_batch_size": 4, "guard.enabled": "false", "fault_tolerance.enabled": "true",
             "fault_tolerance.replica_groups": 2, "fault_tolerance.lighthouse": f"http://localhost:{port}",
             "fault_tolerance.timeout_s": 20}

    def group(g: int, log: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, DRIVER, str(args.step_s), str(root / "no-hold")]
                                + overrides(corpus, root / f"group{g}", **{**extra, "fault_tolerance.replica_id": g}),
                                stdout=open(root / log, "a"), stderr=subprocess.STDOUT, start_new_session=True,
                                env=env())

    t0 = time.time()
    procs = {0: group(0, "group0.log"), 1: group(1, "group1.log")}
    try:
        survivor = Watch(root / "group0")
        while min(max(survivor.poll(), default=0), max(step_records(root / "group1"), default=0)) < args.kill_at:
            assert all(p.poll() is None for p in procs.values()), (root / "group0.log").read_text()[-3000:]
            time.sleep(0.01)
        killed_at = max(survivor.poll())
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        restarted = time.time()
        procs[1] = group(1, "group1-again.log")
        while procs[0].poll() is None or procs[1].poll() is None:
            survivor.poll()
            time.sleep(0.01)
        assert procs[0].returncode == procs[1].returncode == 0, (root / "group1-again.log").read_text()[-3000:]
    finally:
        for p in [*procs.values(), lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    quorums = {r["step"]: r for r in records(root / "group0") if r.get("event") == "ft_quorum"}
    steps = survivor.poll()
    alone = [s for s, r in quorums.items() if r["replica_groups"] == [0] and s >= killed_at]
    rejoin_log = (root / "group1-again.log").read_text()
    return {"killed_at": killed_at, "steps_trained_twice": len(steps) - len(set(steps)),
            "retried_steps": sum(r["attempts"] > 1 for r in quorums.values()),
            "survivor_steps_alone": len(alone), "group_shares_not_trained": len(alone),
            "rejoined_at_step": min((s for s, r in quorums.items() if r["replica_groups"] == [0, 1] and s > killed_at),
                                    default=None),
            "restart_to_rejoin_s": round(rejoin_seconds(rejoin_log, restarted), 1),
            "longest_pause_s": round(survivor.longest, 2), "wall_s": round(time.time() - t0, 1)}


def rejoin_seconds(log: str, restarted: float) -> float:
    """Seconds from the restart to the restarted group's heal (its log line's timestamp)."""
    import datetime

    for line in log.splitlines():
        if "healing is required" in line:
            stamp = datetime.datetime.fromisoformat(line.split(" ")[0]).timestamp()
            return stamp - restarted
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kill-at", type=int, default=45)
    p.add_argument("--every", type=int, default=40, help="torchrun's checkpoint interval (steps)")
    p.add_argument("--step-s", type=float, default=0.05)
    args = p.parse_args()
    run = {"train.steps": args.steps, "train.log_every": 1, "checkpoint.every_minutes": 0, "train.sample_tokens": 0,
           "train.eval_sequences": 2, "train.micro_batch_size": 2}
    with tempfile.TemporaryDirectory(prefix="ft-steps-lost-") as tmp:
        root = Path(tmp)
        make_corpus(root / "raw")
        corpus = prepare(root)
        results = {"torchrun_restart": torchrun_job(corpus, root, args, run),
                   "torchft": torchft_job(corpus, root, args, run)}
    print(json.dumps({"args": vars(args), **results}, indent=1))


if __name__ == "__main__":
    main()
