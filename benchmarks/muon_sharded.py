"""Muon's step on FSDP2-sharded matrices: dealt over the ranks (lmforge.optim.muon._dealt_updates: one
gather and one scatter per matrix, each rank orthogonalising 1/N of them) against DTensor's own ops on
the shards (Newton-Schulz run on the DTensors, gathering inside every product: what lmforge did before,
and still does under tensor parallelism).

    python benchmarks/muon_sharded.py --ranks 4 --dim 256 --layers 4 --steps 5

Launches `--ranks` gloo processes on this machine (CPU), shards a model's block matrices with
`fully_shard`, and times `Muon.step` (median of `--steps` after one warm-up) in both arms, with the
number of collective calls per step and the bytes of the local tensors handed to them (counted at
torch.distributed's Python entry points, which DTensor's redistributions go through as functional
collectives; rank 0's counts). The two arms' parameters after the steps agree to rounding (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _count_collectives():
    """Wrap the c10d functional collectives and the eager ones DTensor and lmforge call; returns the
    counter dict ({"calls": n, "bytes": b}) the wrappers add to."""
    import torch.distributed._functional_collectives as fc

    counter = {"calls": 0, "bytes": 0}

    def wrap(module, name):
        real = getattr(module, name)

        def counted(tensor, *args, **kwargs):
            counter["calls"] += 1
            t = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
            counter["bytes"] += t.numel() * t.element_size()
            return real(tensor, *args, **kwargs)

        setattr(module, name, counted)

    for name in ("all_gather_tensor", "all_reduce", "reduce_scatter_tensor", "all_to_all_single"):
        wrap(fc, name)
    for name in ("gather", "scatter", "all_gather_into_tensor", "all_reduce", "broadcast"):
        wrap(dist, name)
    return counter


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lmforge.optim.muon as muon
    from lmforge.config import load_config
    from lmforge.model.transformer import build_model

    cfg = load_config("tiny", {"model.dim": args.dim, "model.n_heads": max(args.dim // 64, 1),
                               "model.n_layers": args.layers, "model.vocab_size": 512, "data.tokenizer_vocab_size": 512})
    mesh = init_device_mesh("cpu", (world,))
    counter = _count_collectives()
    results, finals = {}, {}
    real_dims = muon._shard_dims
    for arm in ("dealt", "dtensor-ops"):
        muon._shard_dims = real_dims if arm == "dealt" else (lambda p: None)
        model = build_model(cfg.model, seed=0)
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
        opt = muon.Muon([{"params": params}], lr=0.02, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        times, calls, moved = [], [], []
        for step in range(args.steps + 1):
            for p in params:
                p.grad = type(p).from_local(torch.randn(p.to_local().shape, generator=gen), p.device_mesh,
                                            p.placements, shape=p.shape, stride=p.stride())
            dist.barrier()
            counter.update(calls=0, bytes=0)
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            if step:  # (the first step allocates the momentum buffers)
                times.append(time.perf_counter() - t0)
                calls.append(counter["calls"])
                moved.append(counter["bytes"])
        results[arm] = {"step_s": statistics.median(times), "collectives": calls[-1], "bytes": moved[-1],
                        "matrices": len(params)}
        finals[arm] = [p.detach().full_tensor() for p in params]
    muon._shard_dims = real_dims
    worst = max(float((a - b).abs().max() / b.abs().max())
                for a, b in zip(finals["dealt"], finals["dtensor-ops"], strict=True))
    if rank == 0:
        results["max_rel_difference"] = worst
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args.ranks, os.path.join(tmp, "store"), args, out), nprocs=args.ranks, join=True)
        res = json.loads(Path(out).read_text())
    print(f"{args.ranks} gloo ranks, dim {args.dim}, {args.layers} layers ({res['dealt']['matrices']} matrices), "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'arm':<12} {'step s':>8} {'collectives':>12} {'MB handed (rank 0)':>19}")
    for arm in ("dealt", "dtensor-ops"):
        r = res[arm]
        print(f"{arm:<12} {r['step_s']:>8.3f} {r['collectives']:>12} {r['bytes'] / 1e6:>19.1f}")
    print(f"parameters after the steps: max relative difference {res['max_rel_difference']:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **res}, indent=1))


if __name__ == "__main__":
    main()
