"""`lmforge prepare` on many workers gives the single-process bytes (issue 21).

One mixed corpus (jsonl split by byte range, parquet split by row groups, txt; exact and near
duplicates spread across files and formats) is prepared:

* by one process (the reference);
* by 4 real worker processes per stage, as a Slurm array runs them (`--stage S --rank r
  --world 4`), one of which is SIGKILLed mid-way and re-run alone;
* by 2 torchrun "nodes" on loopback with separate scratch folders, reading the corpus from and
  writing the output to a real S3 server (moto) on loopback.

Every output file but prepare.json (timings) must have the same sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.data.pipeline import run_prepare
from lmforge.data.prepare_config import load_prepare_config
from lmforge.data.stages import STAGES, SINGLE, assignment
from tests import warm_start

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i}" for i in range(3000)] + ["the", "of", "and", "ünï", "日本"]


def _doc(rng: random.Random, n_words: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(12))
                     for _ in range(n_words // 12)) + "\n"


def _edit(doc: str, k: int) -> str:
    words = doc.split(" ")
    words[5 + k] = "EDITED"
    return " ".join(words)


PLANTED_EXACT = 4  # copies of earlier documents (two across formats, one with CRLF)
PLANTED_NEAR = 3   # one-word edits of earlier documents, in later files


def make_corpus(root: Path) -> Path:
    """raw/web/*.jsonl, raw/pq/*.parquet, raw/books/*.txt; returns the folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = random.Random(7)
    docs = [_doc(rng, 120) for _ in range(150)]
    raw = root / "raw"
    for d in ("web", "pq", "books"):
        (raw / d).mkdir(parents=True)
    lines = [json.dumps({"text": d}) for d in docs[:70]]
    lines.insert(40, json.dumps({"text": docs[3]}))                        # exact, same file
    lines.insert(60, json.dumps({"text": docs[10].replace("\n", "\r\n")}))  # exact after cleaning
    (raw / "web" / "a.jsonl").write_text("\n".join(lines) + "\n")
    (raw / "web" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                 for d in docs[70:100] + [_edit(docs[1], 0)]))
    rows = docs[100:130] + [docs[80], _edit(docs[75], 1)]                    # exact + near
    pq.write_table(pa.table({"text": rows}), raw / "pq" / "c.parquet", row_group_size=5)
    for k, d in enumerate(docs[130:] + [docs[101], _edit(docs[120], 2)]):  # exact + near
        (raw / "books" / f"{k:02d}.txt").write_text(d)
    return raw


CONFIG = """[prepare]
output_dir = "{out}"
vocab_size = 400
val_fraction = 0.1
shard_tokens = 900
chunk_bytes = 6000
dedup_ranges = 3
sample_bytes = 40000
near_dedup = true
parallelism = "threads"

[[prepare.sources]]
name = "web"
path = "{raw}/web/*.jsonl"
weight = 0.5

[[prepare.sources]]
name = "pq"
path = "{raw}/pq"
weight = 0.3

[[prepare.sources]]
name = "books"
path = "{raw}/books/*.txt"
weight = 0.2
"""


def write_config(path: Path, raw: str, out: str) -> Path:
    path.write_text(CONFIG.format(raw=raw, out=out))
    return path


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "prepare.json"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    raw = make_corpus(root)
    cfg = load_prepare_config(write_config(root / "c.toml", str(raw), str(root / "one")))
    res = run_prepare(cfg)
    return root, raw, res, tree_hashes(root / "one")


def test_reference_removes_the_planted_duplicates_and_splits_files(reference):
    _, _, res, files = reference
    c = res.record["clean"]
    assert (c["duplicates"], c["near_duplicates"]) == (PLANTED_EXACT, PLANTED_NEAR)
    assert c["kept"] == 150
    assert res.record["units"] > 10  # a.jsonl by byte range, c.parquet by row groups
    assert res.record["timing"]["stages"]["scan"]["workers"] == 1
    sample = res.record["tokenizer_sample"]  # a content-hash sample from every source
    assert 0.2 < sample["fraction"] < 0.6 and min(sample["documents"].values()) > 0
    assert {"train/web/manifest.json", "train/pq/manifest.json", "train/books/manifest.json",
            "val/manifest.json", "tokenizer.json", "train/mixture.json"} <= set(files)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _stage_procs(cfg: Path, stage: str, ranks, world: int, log: Path) -> list:
    return [subprocess.Popen([sys.executable, "-m", "lmforge", "prepare", "--config", str(cfg),
                              "--stage", stage, "--rank", str(r), "--world", str(world)],
                             env=_env(), stdout=subprocess.PIPE, stderr=open(log, "a"), text=True)
            for r in ranks]


def _wait(procs) -> None:
    for p in procs:
        p.wait(timeout=120)
        assert p.returncode == 0, p.args


@pytest.mark.slow
def test_four_worker_processes_one_killed_and_rerun_alone_give_the_same_bytes(reference,
                                                                                tmp_path):
    root, raw, _, want = reference
    cfg = write_config(tmp_path / "c.toml", str(raw), str(tmp_path / "four"))
    log = tmp_path / "workers.log"
    work = tmp_path / "four" / ".work"
    for stage in STAGES:
        if stage in SINGLE:
            _wait(_stage_procs(cfg, stage, [0], 4, log))
            continue
        procs = _stage_procs(cfg, stage, range(4), 4, log)
        if stage != "scan":
            _wait(procs)
            continue
        # SIGKILL worker 2 once it has finished some but not all of its scan units. It runs in
        # slices of a few milliseconds (SIGSTOP / SIGCONT), so the test sees it between units
        # however fast a unit goes on this machine, and kills it while it is stopped.
        procs[2].send_signal(signal.SIGSTOP)
        plan = None
        deadline = time.time() + 120
        while time.time() < deadline:
            procs[2].send_signal(signal.SIGCONT)
            time.sleep(0.003)
            procs[2].send_signal(signal.SIGSTOP)
            plans = list(work.glob("*/plan.json"))
            if plans and plan is None:
                try:
                    plan = json.loads(plans[0].read_text())
                except ValueError:
                    pass
            if plan is not None:
                owner = assignment([u["bytes"] for u in plan["units"]], 4)
                mine = {f"{u:06d}.json" for u, r in enumerate(owner) if r == 2}
                done = {p.name for p in work.glob("*/done/scan/*.json")} & mine
                if done:
                    break
        assert procs[2].poll() is None, "worker 2 finished before it could be killed"
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait()
        done = {p.name for p in work.glob("*/done/scan/*.json")} & mine
        assert 0 < len(done) < len(mine), (len(done), len(mine))
        _wait(procs[:2] + procs[3:])
        # the next stage refuses to start and names the dead worker
        bad = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(cfg),
                              "--stage", "dedup", "--rank", "0", "--world", "4"],
                             env=_env(), capture_output=True, text=True)
        assert bad.returncode == 2
        assert (f"stage 'dedup' needs stage 'scan' to be finished: {len(mine) - len(done)} of "
                f"{len(plan['units'])} tasks missing (workers 2 of 4)") in bad.stderr
        # overall progress, per worker, with MB/s and what each filter removed so far
        st = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config", str(cfg),
                             "--status"], env=_env(), capture_output=True, text=True)
        assert st.returncode == 0, st.stderr
        n_done = len(list(work.glob("*/done/scan/*.json")))
        assert f"scan       {n_done}/{len(plan['units'])} tasks, " in st.stdout
        assert "removed so far: bad_utf8 0, empty 0, too_short 0, too_long 0" in st.stdout
        assert "MB/s over 3 worker(s)" in st.stdout and "  scan worker 3: " in st.stdout
        # worker 2 re-run alone: only its unfinished units
        again = subprocess.run([sys.executable, "-m", "lmforge", "prepare", "--config",
                                str(cfg), "--stage", "scan", "--rank", "2", "--world", "4"],
                               env=_env(), capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
        assert (f"[3/4] scan: {len(done)} of my {len(mine)} tasks already done; skipping them"
                in again.stderr)
    assert tree_hashes(tmp_path / "four") == want
    assert not work.exists()
    rec = json.loads((tmp_path / "four" / "prepare.json").read_text())
    assert rec["timing"]["stages"]["tokenize"]["workers"] == 4
    assert set(rec["timing"]["stages"]["scan"]["per_worker"]) == {"0", "1", "2", "3"}


# ---------------------------------------------------------------------------------------
# two nodes on loopback, S3 in and out
# ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from moto.server import ThreadedMotoServer
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
    client.create_bucket(Bucket="corpus")
    yield client
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def _download(client, bucket: str, prefix: str) -> dict[str, str]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            rel = o["Key"][len(prefix):]
            if rel != "prepare.json":
                body = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
                out[rel] = hashlib.sha256(body).hexdigest()
    return dict(sorted(out.items()))


@pytest.mark.slow
def test_two_torchrun_nodes_with_s3_input_and_output_give_the_same_bytes(reference, s3,
                                                                         tmp_path):
    root, raw, _, want = reference
    for f in sorted(raw.rglob("*")):
        if f.is_file():
            s3.upload_file(str(f), "corpus", f"raw/{f.relative_to(raw)}")
    cfg = write_config(tmp_path / "c.toml", "s3://corpus/raw", "s3://corpus/out")
    port = _free_port()
    nodes = []
    for node in range(2):
        scratch = tmp_path / f"scratch{node}"
        scratch.mkdir()
        nodes.append(subprocess.Popen(
            [*warm_start.shared().interpreter(), "-m", "torch.distributed.run", "--nnodes", "2",  # (warm)
             "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "prep", "-m", "lmforge",
             "prepare", "--config", str(cfg), "--scratch", str(scratch)],
            env={**_env(), "OMP_NUM_THREADS": "1"}, cwd=scratch,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(outs)
    assert _download(s3, "corpus", "out/") == want
    rec = json.loads(s3.get_object(Bucket="corpus", Key="out/prepare.json")["Body"].read())
    assert rec["timing"]["stages"]["scan"]["workers"] == 2
    assert _download(s3, "corpus", "out/.work/") == {}  # the work folder is gone
    assert "lmforge prepare -> s3://corpus/out" in "".join(outs)
    # nothing was written next to the config: the nodes shared only S3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "scratch0", "scratch1"]


def test_worker_identity_from_the_launchers(monkeypatch):
    from lmforge.data.pipeline import worker_from_env
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert worker_from_env() is None
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "17")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "64")
    assert worker_from_env() == (17, 64)  # an array task: --stage S
    assert worker_from_env(slurm_array=False) is None  # a plain run in an array job stays local
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert worker_from_env(slurm_array=False) == (3, 8)


def test_s3_mistakes_are_one_line_errors(reference, s3, tmp_path):
    root, raw, _, _ = reference
    cfg = load_prepare_config(write_config(tmp_path / "c.toml", str(raw), "s3://nobucket/out"))
    with pytest.raises(ValueError, match=r"^s3://nobucket: no such bucket at http://127\.0\.0\.1"):
        run_prepare(cfg)
    cfg.s3_endpoint = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with pytest.raises(ValueError, match=r"^s3://nobucket/out: cannot reach it \(.*\)\. Check the "
                                         r"URL, prepare\.s3_endpoint"):
        run_prepare(cfg)


@pytest.mark.slow
def test_slurm_prepare_script_runs_as_written_and_gives_the_same_bytes(reference, tmp_path):
    """examples/slurm_prepare.sh under stand-ins for sbatch (tests/fake_slurm.py: array tasks run
    concurrently with SLURM_ARRAY_TASK_ID / _COUNT, each job before the next is submitted): one
    array job per parallel stage, one-task jobs for the others, each depending on the one before,
    and the bytes of one process."""
    from tests import fake_slurm

    root, raw, _, want = reference
    cfg = write_config(tmp_path / "c.toml", str(raw), str(tmp_path / "slurm"))
    env = {**_env(), **fake_slurm.install(tmp_path / "bin")}
    env["PATH"] = f"{env['PATH']}:{Path(sys.executable).parent}"  # `lmforge` of this environment
    proc = subprocess.run(["bash", str(ROOT / "examples" / "slurm_prepare.sh"), str(cfg), "3"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = [line.split(" ", 3) for line in Path(env["FAKE_SLURM_LOG"]).read_text().splitlines()]
    assert [j[3].split("--stage ")[1].split()[0] for j in jobs] == list(STAGES)  # every stage, in order
    assert [j[2] for j in jobs] == ["1" if s in SINGLE else "3" for s in STAGES]
    assert [j[1] for j in jobs] == ["-"] + [f"afterok:{j[0]}" for j in jobs[:-1]]
    assert proc.stdout.startswith("submitted: scan 1000 -> dedup 1001")
    assert tree_hashes(tmp_path / "slurm") == want
    rec = json.loads((tmp_path / "slurm" / "prepare.json").read_text())
    assert rec["timing"]["stages"]["tokenize"]["workers"] == 3
