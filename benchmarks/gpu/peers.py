"""The peers on the same GPU, in the same call: nanoGPT's `train.py` (and llm.c's `train_gpt2cu` where
the device has `nvcc`) at the shape of an lmforge throughput row, on the same tokens, timed as each peer
times itself, and read against lmforge's row (benchmarks/gpu/suite.py's `peer-nanogpt`, `peer-llmc`).

Published figures were measured on other machines; a ratio means something only side by side. The
peers' code is never committed: `suite.py --prepare DIR --nanogpt PATH [--llmc PATH]` copies the files a
peer needs from a local checkout of its public repository (a work tree, or a bare git directory such as
a mirror: its HEAD) into DIR/peers/<peer>/, with COMMIT naming what was copied; the suite reads them
with `--peers DIR/peers` and runs each in a scratch folder of its own.

How each peer is run (what the row reports is each peer's own per-step time, median over the steps
after its warm-up):
- nanoGPT: its train.py as its README runs it (`python train.py --key=value ...`, configurator.py),
  with compile on and bf16 autocast on a GPU, the lmforge row's layers, heads, width, sequence, vocabulary
  (meta.pkl), biases, micro-batch and accumulation; data/<dataset>/train.bin holds the lmforge row's
  synthetic tokens (uint16, as nanoGPT reads them). Evaluation reads no batch (`eval_iters=0`) and nothing
  is saved, so what is timed is its training loop (`iter N: loss L, time T ms`).
- llm.c: `make train_gpt2cu` (no MPI, NCCL or cuDNN: one GPU), then `-e d<layers>` (a GPT-2 of that depth
  from scratch) on the same tokens in llm.c's token-file format, the same micro-batch, sequence and
  tokens per step (`step N/M | ... | T ms | ...`).
"""

from __future__ import annotations

import io
import math
import pickle
import re
import shutil
import statistics
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Peer:
    repo: str  # the public repository, as GitHub names it
    files: tuple[str, ...]  # what the row needs from it (folders whole)


PEERS = {
    "nanogpt": Peer("karpathy/nanoGPT", ("train.py", "model.py", "configurator.py")),
    "llmc": Peer("karpathy/llm.c", ("train_gpt2.cu", "Makefile", "llmc")),
}
LLMC_DEPTHS = {6: (384, 6), 12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25)}  # -e d<L>: width, heads
LLMC_VOCAB = 50257  # llm.c's GPT-2 vocabulary (padded to 50304 inside); its tokens must be below it
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER = 20240520, 1, 256  # llmc/dataloader.h: 256 int32s, then uint16 tokens


class PeerError(ValueError):
    """A checkout that cannot serve, or a shape a peer cannot run; the message says which and the fix."""


def _git(source: Path, *args: str, bare: bool) -> subprocess.CompletedProcess:
    where = ["--git-dir", str(source)] if bare else ["-C", str(source)]
    return subprocess.run(["git", *where, *args], capture_output=True)


def copy_peer(name: str, source: Path, dest: Path) -> str:
    """Copy peer `name`'s files from `source` (a work tree, or a bare git directory: its HEAD) into
    `dest`, write dest/COMMIT; returns the commit ("unknown" for a work tree that is not a git checkout).
    A source that cannot serve is refused (PeerError) before anything is written."""
    peer = PEERS[name]
    source = Path(source).expanduser().resolve()
    if (source / peer.files[0]).exists():
        missing = [f for f in peer.files if not (source / f).exists()]
        if missing:
            raise PeerError(f"--{name} {source}: no {missing[0]} there; pass a checkout of https://github.com/{peer.repo}")
        dest.mkdir(parents=True, exist_ok=True)
        for f in peer.files:
            (shutil.copytree if (source / f).is_dir() else shutil.copy2)(source / f, dest / f)
        head = _git(source, "rev-parse", "HEAD", bare=False)
    else:
        archive = _git(source, "archive", "--format=tar", "HEAD", *peer.files, bare=True)
        if archive.returncode:
            raise PeerError(f"--{name} {source}: neither a checkout with {peer.files[0]} nor a git directory holding "
                            f"{', '.join(peer.files)} ({archive.stderr.decode().strip()[:120]}); pass a checkout of "
                            f"https://github.com/{peer.repo}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, filter="data")
        head = _git(source, "rev-parse", "HEAD", bare=True)
    commit = head.stdout.decode().strip() if head.returncode == 0 else "unknown"
    (dest / "COMMIT").write_text(f"{commit} {peer.repo}\n")
    return commit


def peer_commit(folder: Path) -> str:
    f = folder / "COMMIT"
    return f.read_text().split()[0] if f.is_file() else "unknown"


@dataclass(frozen=True)
class Shape:
    """What a peer needs to train the lmforge row's model the same way."""
    n_layer: int
    n_head: int
    dim: int
    seq: int
    vocab: int
    bias: bool
    micro: int
    accum: int
    cuda: bool
    dtype: str  # nanoGPT's: bfloat16 | float16 | float32

    @property
    def tokens_per_step(self) -> int:
        return self.micro * self.seq * self.accum


def shape_of(cfg, cuda: bool) -> Shape:
    """The Shape of an lmforge config (one process: accumulation = global / micro batch)."""
    m = cfg.model
    dtype = {"bf16": "bfloat16", "bf16-pure": "bfloat16", "fp16": "float16"}.get(cfg.train.precision, "float32")
    return Shape(m.n_layers, m.n_heads, m.dim, cfg.data.seq_len, m.vocab_size, bool(m.bias), cfg.train.micro_batch_size,
                 cfg.train.global_batch_size // cfg.train.micro_batch_size, cuda, dtype if cuda else "float32")


def write_nanogpt_run(peer_dir: Path, run_dir: Path, shape: Shape, train: np.ndarray, val: np.ndarray) -> None:
    """A scratch folder nanoGPT's train.py runs in: its files, data/lmforge/{train,val}.bin, meta.pkl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in PEERS["nanogpt"].files:
        shutil.copy2(peer_dir / f, run_dir / f)
    data = run_dir / "data" / "lmforge"
    data.mkdir(parents=True, exist_ok=True)
    if shape.vocab > 2**16:
        raise PeerError(f"vocabulary {shape.vocab}: nanoGPT reads uint16 tokens (at most 65536)")
    train.astype(np.uint16).tofile(data / "train.bin")
    val.astype(np.uint16).tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": shape.vocab}, f)


def nanogpt_command(python: str, shape: Shape, iters: int) -> list[str]:
    """train.py's command: the shape, compile and autocast dtype on a GPU (eager fp32 on the CPU), no
    evaluation batches, no checkpoint, a log line every iteration (nanoGPT's default)."""
    sets = {"dataset": "lmforge", "out_dir": "out", "eval_interval": 10**9, "eval_iters": 0,
            "always_save_checkpoint": False, "log_interval": 1, "max_iters": iters, "wandb_log": False,
            "batch_size": shape.micro, "gradient_accumulation_steps": shape.accum, "block_size": shape.seq,
            "n_layer": shape.n_layer, "n_head": shape.n_head, "n_embd": shape.dim, "bias": shape.bias,
            "dropout": 0.0, "device": "cuda" if shape.cuda else "cpu", "dtype": shape.dtype,
            "compile": shape.cuda}
    return [python, "train.py"] + [f"--{k}={v}" for k, v in sets.items()]


NANOGPT_ITER = re.compile(r"^iter (\d+): loss (\S+), time ([\d.]+)ms", re.M)
LLMC_STEP = re.compile(r"^step\s+(\d+)/\d+ \| loss (\S+) .*?\| ([\d.]+) ms \|", re.M)


def read_steps(text: str, pattern: re.Pattern) -> list[tuple[int, float, float]]:
    """(step, loss, milliseconds) of each step line a peer printed."""
    return [(int(s), float(loss), float(ms)) for s, loss, ms in pattern.findall(text)]


def steady(steps: list[tuple[int, float, float]], skip: int, shape: Shape) -> dict:
    """Median step time over the steps after the first `skip` (compile, allocator), tokens/s, the last loss."""
    timed = [ms for _, _, ms in steps[skip:]]
    if not timed:
        raise PeerError(f"{len(steps)} step lines, none after the {skip} warm-up steps")
    ms = statistics.median(timed)
    last = steps[-1][1]
    if not math.isfinite(last):
        raise PeerError(f"the peer's loss is {last} at step {steps[-1][0]}")
    return {"step_ms_median": ms, "tokens_per_s": shape.tokens_per_step / (ms / 1e3), "steps_timed": len(timed),
            "first_loss": steps[0][1], "last_loss": last}


def llmc_check(shape: Shape) -> None:
    """llm.c builds GPT-2 from a depth alone (-e d<L>); the lmforge row must be that model."""
    want = LLMC_DEPTHS.get(shape.n_layer)
    if want != (shape.dim, shape.n_head) or not shape.bias or shape.seq > 1024:
        raise PeerError(f"llm.c trains GPT-2 shapes only (-e d<L>: {LLMC_DEPTHS}, biases, sequence <= 1024); the "
                        f"row is {shape.n_layer} layers x {shape.dim} wide, {shape.n_head} heads, seq {shape.seq}")


def write_llmc_tokens(path: Path, tokens: np.ndarray) -> None:
    """A token file llm.c's dataloader reads: 256 int32s (magic, version, count), then uint16 tokens.
    Tokens at or above its vocabulary (50257) are folded into it (throughput does not depend on them)."""
    header = np.zeros(LLMC_HEADER, dtype=np.int32)
    header[:3] = (LLMC_MAGIC, LLMC_VERSION, len(tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write((tokens % LLMC_VOCAB).astype(np.uint16).tobytes())


def llmc_commands(shape: Shape, steps: int) -> tuple[list[str], list[str]]:
    """(the build, the run): one GPU, no MPI / NCCL / cuDNN; validation of one batch at the ends, no
    sampling before the last step, no checkpoint."""
    build = ["make", "train_gpt2cu", "NO_MULTI_GPU=1", "NO_USE_MPI=1", "USE_CUDNN=0"]
    run = ["./train_gpt2cu", "-i", "data/train.bin", "-j", "data/val.bin", "-e", f"d{shape.n_layer}",
           "-b", str(shape.micro), "-t", str(shape.seq), "-d", str(shape.tokens_per_step), "-x", str(steps),
           "-v", str(10**6), "-m", "1", "-s", str(10**6), "-g", "1", "-n", "0"]
    return build, run
