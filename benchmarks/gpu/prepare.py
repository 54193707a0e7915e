"""Prepare a GPU window on a connected CPU machine: `python benchmarks/gpu/suite.py --prepare DIR`.

DIR (inside this source tree; `.gpu-window`, which .gitignore lists, is the usual one) gets
  cache/   the default corpus and the data the rows train on (the tiny preset's shards; the 8192-token
           vocabulary's shards for the `families` row), as LMFORGE_CACHE reads it
  wheels/  every wheel a row needs that the GPU machine lacks (WHEELS), for its Python 3.12 on x86-64
           Linux, whatever this machine's Python is
  peers/   with --nanogpt PATH / --llmc PATH: the files the peer rows run, copied from local checkouts of
           the public repositories (benchmarks/gpu/peers.py), with the commit copied
and the exact call of the device tool's `run` that uses them is printed: a bash command of at most
2,000 characters run at the repository root on the device, DIR carried beside the working tree (at
most 64 MiB in all and 8 paths; DIR is checked to stay far under: PREPARED_LIMIT), the results coming
back from $OUT.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the rows need that the lent machine (torch 2.11, Python 3.12, no index) lacks. torchao 0.17.0:
# its prebuilt extensions load on torch >= 2.11 (its __init__ checks); torchao.float8 is pure Python
# on torch's _scaled_mm; no runtime dependencies. Rows: fp8-1b.
WHEELS = {"torchao==0.17.0": "fp8-1b (torchao.float8)",
          # flash-linear-attention's kernels (fla.ops, Triton, which torch's CUDA wheels bring) and its one runtime
          # dependency: the families row's Gated DeltaNet takes them (model.deltanet.kernel = auto)
          "fla-core==0.6.0": "families (Gated DeltaNet's Triton kernels)", "einops==0.8.2": "fla-core's dependency"}
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux2014_x86_64", "--only-binary", ":all:"]
PREPARED_LIMIT = 32 * 2**20  # the carry limit is 64 MiB with the working tree's untracked files: keep far under
COMMAND_LIMIT = 2000  # characters of one device `run` command
OUT_TMP = "/tmp/gpu-suite"  # (on the device: the suite's folder, archived into $OUT at the end)


def build_cache(cache: Path) -> None:
    """The default corpus and the rows' prepared data, into `cache` (LMFORGE_CACHE's layout). A corpus
    already in this machine's cache is copied rather than fetched again (it is checked against its
    pinned sha256 when prepared either way)."""
    from lmforge.config import load_config
    from lmforge.data.corpus import DEFAULT_CORPUS
    from lmforge.train.components import cache_dir

    cache = cache.resolve()
    have = cache_dir(load_config("tiny")) / "corpus" / DEFAULT_CORPUS.name
    if have.is_dir() and have.resolve() != (cache / "corpus" / DEFAULT_CORPUS.name).resolve():
        shutil.copytree(have, cache / "corpus" / DEFAULT_CORPUS.name, dirs_exist_ok=True)
    env = {**os.environ, "LMFORGE_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    code = ("from lmforge.config import load_config; from lmforge.train.components import prepare_data; "
            "print('prepared', prepare_data(load_config('tiny')))")
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "family_shapes.py"), "--prepare-only"], env=env,
                   cwd=ROOT, check=True)
    print(f"{cache}: the default corpus, the tiny preset's shards and the families' (vocabulary 8192)")


def download_wheels(folder: Path, find_links: str = "") -> list[Path]:
    """WHEELS for the GPU machine's Python into `folder` (from the package index, or `find_links`)."""
    folder.mkdir(parents=True, exist_ok=True)
    source = ["--no-index", "--find-links", str(Path(find_links).resolve())] if find_links else []
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                    *PLATFORM, *source, "-d", str(folder), *WHEELS], check=True)
    return sorted(folder.glob("*.whl"))


def size_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def copy_peers(folder: Path, sources: dict[str, str]) -> list[str]:
    """The peers' files (benchmarks/gpu/peers.py) from local checkouts into folder/peers/<peer>/; one
    line each: which commit. Never committed: the folder is the window's, which git ignores."""
    import peers

    lines = []
    for name, source in sources.items():
        if source:
            commit = peers.copy_peer(name, Path(source), folder / "peers" / name)
            lines.append(f"{name}: {peers.PEERS[name].repo} at {commit} from {source}")
    return lines


def run_call(rel: str, carried: bool, budget_min: float, with_peers: bool = False) -> tuple[str, dict]:
    """The device command (and the `run` arguments) that runs the suite with the prepared folder. The
    archive leaves the training rows' run folders out (their checkpoints made it 16+ MiB on 2026-11-27,
    over what the tool brings back); their logs, JSON and profiles travel."""
    command = (f"python3 benchmarks/gpu/suite.py --out {OUT_TMP} --wheels {rel}/wheels --cache {rel}/cache "
               f"--budget-min {budget_min:g}{f' --peers {rel}/peers' if with_peers else ''}; rc=$?; tar czf $OUT/gpu-suite.tgz --exclude=runs -C {Path(OUT_TMP).parent} "
               f"{Path(OUT_TMP).name}; cp {OUT_TMP}/gpu_suite.md {OUT_TMP}/gpu_suite.json $OUT/; exit $rc")
    assert len(command) <= COMMAND_LIMIT, len(command)
    return command, {"command": command, "carry": [rel] if carried else [], "timeout_s": 600}


def git_ignored(rel: str) -> bool:
    """Whether git ignores the folder `rel` (then the device tool carries it only when `carry` names it)."""
    return subprocess.run(["git", "check-ignore", "-q", rel.rstrip("/") + "/"], cwd=ROOT).returncode == 0


def prepare(folder: Path, find_links: str = "", budget_min: float = 9.0, peer_sources: dict | None = None) -> int:
    folder = folder.resolve()
    try:
        rel = folder.relative_to(ROOT).as_posix()
    except ValueError:
        print(f"--prepare {folder}: name a folder inside the source tree ({ROOT}), e.g. .gpu-window: the device "
              f"tool carries paths of the working tree only", file=sys.stderr)
        return 2
    try:  # (first: a checkout that cannot serve is refused before minutes of cache and downloads)
        for line in copy_peers(folder, peer_sources or {}):
            print("peer " + line)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    build_cache(folder / "cache")
    wheels = download_wheels(folder / "wheels", find_links)
    total = size_of(folder)
    print("wheels: " + ", ".join(f"{w.name} ({w.stat().st_size / 2**20:.1f} MiB)" for w in wheels))
    print(f"prepared: {rel}/ {total / 2**20:.1f} MiB (limit {PREPARED_LIMIT / 2**20:.0f} MiB; the device tool carries "
          f"at most 64 MiB)")
    if total > PREPARED_LIMIT:
        print(f"{rel} is {total / 2**20:.1f} MiB: over {PREPARED_LIMIT / 2**20:.0f} MiB, too close to the 64 MiB the "
              f"device tool carries; remove what the rows do not need", file=sys.stderr)
        return 1
    carried = git_ignored(rel)
    command, call = run_call(rel, carried, budget_min, (folder / "peers").is_dir())
    import json

    print("\nthe device call (the device tool's `run`; start the window with it, nothing else first):")
    print(json.dumps(call, indent=1))
    if not carried:
        print(f"note: {rel} is not git-ignored, so it travels as untracked files of the working tree (no carry "
              f"needed); do not commit it", file=sys.stderr)
    print(f"\nthen: tar xzf gpu-suite.tgz; python benchmarks/gpu/suite.py --record-times gpu-suite/gpu_suite.json "
          f"(the measured seconds become the next plan's)")
    return 0
