"""Peak resident memory of each rank over the phases of a run that hold the model: materialising it
(lmforge.parallel.parallelize), a validation forward (`layout.inference_model()`), making the EMA of the
weights (lmforge.train.ema: "ema") and a validation forward with it swapped in ("ema_eval"), and
streaming the final weights to rank 0 (`layout.full_weights()` into model.safetensors).

    [torchrun --nproc-per-node N] tests/memory_phases_driver.py CORPUS OUT CASES_JSON

CASES_JSON maps a case name to config overrides (on the "tiny" preset with data.corpus = CORPUS). Before
each phase, freed memory is handed back to the kernel (`malloc_trim`) and the kernel's high-water
mark is reset (`/proc/self/clear_refs` 5); the phase's peak is then read back from `VmHWM` (Linux):
its growth over the resident size the phase started from is what the phase allocated, whatever the
process held before. Each rank writes OUT/<case>.rank<r>.json: {"init": peak growth in bytes, "eval":
..., "save": ..., "model_bytes": the whole model's fp32 parameters, "largest_param": bytes}.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import sys
from pathlib import Path

import torch

from lmforge.cli import exit_now

_LIBC = ctypes.CDLL("libc.so.6")


def _bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


@contextlib.contextmanager
def phase(record: dict, name: str):
    """Record the peak resident growth of the block under `name`."""
    gc.collect()
    _LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = _bytes("VmRSS")
    yield
    record[name] = _bytes("VmHWM") - start


def measure(cfg, info, x: torch.Tensor, out: Path | None) -> dict:
    from lmforge.ckpt.export import save_streaming
    from lmforge.eval.perplexity import evaluate_loss
    from lmforge.parallel.parallelize import parallelize
    from lmforge.train.components import build_training_model

    record: dict = {}
    with phase(record, "init"):
        model, source = build_training_model(cfg, info.device)
        record["model_bytes"] = 4 * sum(p.numel() for p in model.parameters())
        record["largest_param"] = 4 * max(p.numel() for p in model.parameters())
        layout = parallelize(model, cfg, info, "fp32", source)
    with phase(record, "eval"):
        evaluate_loss(layout.inference_model(), [(x, x)], contextlib.nullcontext, info.device)
    from lmforge.train.ema import WeightEMA

    with phase(record, "ema"):
        ema = WeightEMA(layout.model, 0.9, roots=layout.forward_roots())
        ema.update(1)
    with phase(record, "ema_eval"):
        with ema.swapped_in():
            evaluate_loss(layout.inference_model(), [(x, x)], contextlib.nullcontext, info.device)
    with phase(record, "save"):
        rank0 = info.rank == 0 and out is not None
        specs = layout.weight_specs()  # (a collective under pipeline parallelism)
        with save_streaming(out, specs) if rank0 else contextlib.nullcontext() as write:
            for name, tensor in layout.full_weights():
                if rank0:
                    write(name, tensor)
    return record


def main(corpus: str, out: str, cases: dict) -> int:
    from lmforge.config import load_config
    from lmforge.parallel.mesh import destroy_distributed, init_distributed

    for case, overrides in cases.items():
        cfg = load_config("tiny", {"data.corpus": corpus, **overrides})
        info = init_distributed(cfg)
        x = torch.randint(0, 300, (1, cfg.data.seq_len), generator=torch.Generator().manual_seed(0))
        # the same steps on a model of a few kB first: imports and one-time set-up stay out of the phases
        measure(load_config("tiny", {"data.corpus": corpus, **overrides, "model.dim": 64, "model.n_heads": 4}),
                info, x, None)
        record = measure(cfg, info, x, Path(out) / f"{case}.safetensors")
        (Path(out) / f"{case}.rank{info.rank}.json").write_text(json.dumps(record))
        if info.distributed:
            torch.distributed.barrier()
    if torch.distributed.is_initialized():
        destroy_distributed()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
