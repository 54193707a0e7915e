"""Peak resident memory per rank over a whole `lmforge train` run (start-up, training steps, the
initial and final validation, the sample, the final checkpoint and model.safetensors) for one model
on several layouts: the model-proportional part should fall as 1/n with the ranks that split it.

    python benchmarks/memory_per_rank.py [--layouts fsdp1,fsdp2,fsdp4,fsdp8,tp2,pp2] [--mmap-threshold]

Each layout is one `torchrun` launch of this file with `--rank-run`: it runs `lmforge train` through
`lmforge.cli.main` and then writes the process's peak resident set (VmHWM) and its resident size
after importing torch and lmforge (before the run) to a JSON file per rank. The model (~222M
parameters, 890 MB in fp32: dim 1024, 16 layers, vocab 8192) trains 2 steps of 8 sequences of 128
tokens with AdamW on the default corpus. `--mmap-threshold` sets glibc's MALLOC_MMAP_THRESHOLD_ to
64 kB in the launches, so that freed tensors go back to the kernel and the peak is the tensors' own
(glibc's default keeps freed heap memory and reuses it unevenly).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--model.dim", "1024", "--model.n_layers", "16", "--model.n_heads", "16", "--model.vocab_size", "8192",
         "--model.max_seq_len", "128", "--model.tie_embeddings", "false", "--data.tokenizer_vocab_size", "8192",
         "--data.seq_len", "128", "--train.global_batch_size", "8", "--train.steps", "2", "--train.eval_every", "0",
         "--train.eval_sequences", "4", "--train.sample_tokens", "8", "--train.precision", "fp32",
         "--train.progress", "lines", "--train.plot", "false", "--train.tensorboard", "false",
         "--train.threads", "1", "--checkpoint.async_save", "false"]
LAYOUTS = {  # name: (processes, layout flags, ranks the parameters are split over)
    "fsdp1": (1, ["--parallel.zero_stage", "3"], 1),
    "fsdp2": (2, ["--parallel.dp_shard", "2"], 2),
    "fsdp4": (4, ["--parallel.dp_shard", "4"], 4),
    "fsdp8": (8, ["--parallel.dp_shard", "8"], 8),
    "tp2": (2, ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"], 2),
    "pp2": (2, ["--parallel.pp", "2"], 2),
}


def _bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def rank_run(out: Path, args: list[str]) -> int:
    import torch  # noqa: F401  (the baseline includes torch and lmforge)

    from lmforge.cli import main

    base = _bytes("VmRSS")
    code = main(["train", *args])
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps({"base": base, "peak": _bytes("VmHWM"), "code": code}))
    return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--mmap-threshold", action="store_true")
    p.add_argument("--rank-run", nargs=argparse.REMAINDER)
    a = p.parse_args()
    if a.rank_run:
        return rank_run(Path(a.rank_run[0]), a.rank_run[1:])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if a.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"mmap threshold {'64 kB' if a.mmap_threshold else 'glibc default'}")
    print("| layout | ranks | params split over | peak RSS per rank (GB) | peak - base, max over ranks (GB) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.layouts.split(","):
            nproc, flags, split = LAYOUTS[name]
            out = Path(tmp) / name
            out.mkdir()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   str(free_port()), __file__, "--rank-run", str(out), *MODEL, *flags,
                   "--train.out_dir", str(out / "run")]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            recs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
            peaks = " / ".join(f"{r['peak'] / 1e9:.2f}" for r in recs)
            growth = max(r["peak"] - r["base"] for r in recs)
            print(f"| {name} | {nproc} | {split} | {peaks} | {growth / 1e9:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
