"""Worker for tests/test_gpu_semantics.py (run under torchrun, or as one process).

    gpu_semantics_driver.py copies CORPUS OUT [key=value ...]
        Sets up a real Trainer for the layout and counts, over one optimizer step's forward/backward,
        the distinct 16-bit tensors autograd saves that have the shape of one of this rank's matmul
        weights (the autocast copies of the weights). Writes OUT/copies_rank<r>.json.
    gpu_semantics_driver.py copies-cases CORPUS OUT CASES_JSON
        `copies` for each case of CASES_JSON ({name: [key=value, ...]}), one after another in one process
        group (torch's import and the group's setup paid once for all layouts). Writes
        OUT/<name>/copies_rank<r>.json.
    gpu_semantics_driver.py rules CORPUS OUT [key=value ...]
        Runs `trainer_for(cfg).fit()` with every torch.distributed send / recv / collective recorded
        (operation, whether it used the host gloo group, named source, tag, calling function).
        Writes OUT/calls_rank<r>.json.
    gpu_semantics_driver.py precision CORPUS OUT [key=value ...]
        Rank 0 is told its CPU has bf16 units, the others that theirs have not; sets up a real Trainer
        (train.precision = auto) and trains one step. Writes OUT/precision_rank<r>.json: the precision
        the rank trains in, what its own hardware would choose, its MFU peak, the step's loss and how
        many parameters the step copies to 16 bits itself (none under FSDP2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import load_config, parse_cli_overrides

RECORDED = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "all_gather", "all_gather_object",
            "broadcast_object_list", "gather_object", "barrier", "reduce_scatter_tensor", "all_gather_into_tensor")


def config(corpus: str, out: str, pairs: list[str]):
    args = dict(pair.split("=", 1) for pair in pairs)
    args.update({"data.corpus": corpus, "train.out_dir": out})
    return load_config("tiny", parse_cli_overrides([a for k, v in args.items() for a in (f"--{k}", v)]))


def count_weight_copies(corpus: str, out: str, pairs: list[str]) -> dict:
    from lmforge.train.trainer import Trainer

    trainer = Trainer(config(corpus, out, pairs))
    trainer.setup()
    weights = [p.detach() for name, p in trainer.model.named_parameters() if p.dim() == 2 and "emb" not in name]
    weights = [w.to_local() if hasattr(w, "to_local") else w for w in weights]  # (TP: this rank's shard)
    n_weights = len(weights)
    seen: dict[int, torch.Tensor] = {}  # storage address -> the tensor, kept alive so no address is reused

    def is_weight_cast(t: torch.Tensor) -> bool:  # a 16-bit tensor (or its transpose) equal to a cast weight
        return any(w.shape == s.shape and torch.equal(s, w.to(t.dtype)) for w in weights for s in (t, t.t()))

    def pack(saved: torch.Tensor):
        t = saved.to_local() if hasattr(saved, "to_local") else saved  # (TP: a DTensor's shard on this rank)
        if t.dtype in (torch.bfloat16, torch.float16) and t.dim() == 2 and is_weight_cast(t):
            seen.setdefault(t.untyped_storage().data_ptr(), t)
        return saved

    batches = trainer.next_micro_batches()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.forward_backward(batches)
    result = {"copies": len(seen), "weights": n_weights, "micro_batches": len(batches), "layout": trainer.layout.name}
    trainer.end_together()  # (no rank tears its groups down while a peer is still in a collective)
    trainer.close()
    return result


def count_weight_casts(corpus: str, out: str, pairs: list[str]) -> dict:
    """Over one optimizer step's forward/backward of a real Trainer (one process), how often each
    matmul weight is cast from fp32 to 16 bits (aten._to_copy, counted by a TorchDispatchMode), with
    every backward run on a second thread, as CUDA runs it on the autograd engine's device thread
    (activation-checkpoint recomputes then run on that thread too)."""
    import threading

    from torch.utils._python_dispatch import TorchDispatchMode

    from lmforge.train.precision import Precision
    from lmforge.train.trainer import Trainer

    trainer = Trainer(config(corpus, out, pairs))
    trainer.setup()
    weights = {p.untyped_storage().data_ptr(): name for name, p in trainer.model.named_parameters()
               if p.dim() == 2 and "emb" not in name}
    casts = dict.fromkeys(weights.values(), 0)

    class CountCasts(TorchDispatchMode):  # (a dispatch mode is per thread: one on each)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            src = args[0] if args else None
            if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") in (torch.bfloat16, torch.float16)
                    and src.dtype == torch.float32 and src.untyped_storage().data_ptr() in weights):
                casts[weights[src.untyped_storage().data_ptr()]] += 1
            return func(*args, **kwargs)

    def backward_on_a_thread(self, loss: torch.Tensor) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with CountCasts():
                    self.scaler.scale(loss).backward()
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    Precision.backward = backward_on_a_thread
    batches = trainer.next_micro_batches()
    with CountCasts():
        trainer.forward_backward(batches)
    trainer.end_together()  # (no rank tears its groups down while a peer is still in a collective)
    trainer.close()
    return {"casts": casts, "micro_batches": len(batches)}


def record_calls(corpus: str, out: str, pairs: list[str]) -> list[dict]:
    import lmforge.train.trainer as trainer_module
    from lmforge.train import trainer_for

    calls: list[dict] = []
    host: list = [None]
    real_init = trainer_module.init_distributed

    def init(cfg):
        info = real_init(cfg)
        host[0] = info.host_group
        return info

    trainer_module.init_distributed = init

    def wrap(name: str):
        real = getattr(dist, name)

        def call(*args, **kwargs):
            group = kwargs.get("group")
            frame = sys._getframe(1)
            calls.append({"op": name, "host_group": group is not None and group is host[0],
                          "src": "src" in kwargs or (name in ("recv", "irecv") and len(args) > 1),
                          "tag": "tag" in kwargs, "caller": f"{Path(frame.f_code.co_filename).name}:"
                                                            f"{frame.f_code.co_name}"})
            return real(*args, **kwargs)

        setattr(dist, name, call)

    for name in RECORDED:
        wrap(name)
    trainer_for(config(corpus, out, pairs)).fit()
    return calls


def decide_precision(corpus: str, out: str, pairs: list[str]) -> dict:
    """Rank 0 is told its CPU has AVX512-BF16, the others that theirs has not (the
    `lmforge.train.precision.cpu_flags` seam); sets up a real Trainer and trains one step."""
    from lmforge.train import precision
    from lmforge.train.trainer import Trainer

    flags = {"avx2", "avx512f", "avx512_bf16"} if int(os.environ.get("RANK", "0")) == 0 else {"avx2"}
    precision.cpu_flags = lambda: flags
    trainer = Trainer(config(corpus, out, pairs))
    trainer.setup()
    loss, _ = trainer.train_step(trainer.next_micro_batches())
    result = {"precision": trainer.precision.name, "told": precision.detect_hardware_precision(trainer.device).name,
              "peak": trainer.peak.flops, "loss": float(loss),
              "copied": len(list(precision.copied_parameters([trainer.layout.module])))}
    trainer.end_together()  # (no rank tears its groups down while a peer is still in a collective)
    trainer.close()
    return result


def copies_per_case(corpus: str, out: str, cases: dict[str, list[str]], rank: int) -> None:
    """`count_weight_copies` for each case in one process group: the trainers keep the group the first
    one forms (as tests/train_runs_driver.py does), which is torn down once, at the end."""
    import lmforge.train.trainer as trainer_module
    from lmforge.parallel.mesh import destroy_distributed

    trainer_module.destroy_distributed = lambda: None
    try:
        for name, pairs in cases.items():
            result = count_weight_copies(corpus, str(Path(out) / name), pairs)
            (Path(out) / name / f"copies_rank{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_distributed()


def main() -> None:
    mode, corpus, out, *pairs = sys.argv[1:]
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if mode == "copies-cases":
        copies_per_case(corpus, out, json.loads(pairs[0]), rank)
        return
    run = {"copies": count_weight_copies, "rules": record_calls, "precision": decide_precision}[mode]
    result = run(corpus, out, pairs)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{mode}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
