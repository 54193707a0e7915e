"""Cross-group traffic of a fault-tolerant job (`fault_tolerance.*`; lmforge.train.fault_tolerance): what
each rank sends to the same rank of the other replica groups, per step and per sync.

Per-step averaging all-reduces each rank's whole gradient over the G groups every step; DiLoCo
(`fault_tolerance.diloco_sync_every` = H) all-reduces the pseudo-gradients, the same number of
elements, once per H steps; streaming DiLoCo (`diloco_fragments` = F) 1/F of them every H / F steps.
A ring all-reduce sends and receives 2 (G - 1) / G of the buffer per rank. The elements are the
parameter's dtype: fp32 master weights (and gradients) under autocast and fp32, bf16 in bf16-pure
runs. The parameters are each rank's own: the whole model in one process or DDP ranks, its shards
under FSDP2, TP or PP inside the group (the same rank of each group holds the same part).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CrossGroupTraffic:
    groups: int
    diloco: bool
    sync_every: int        # steps between two syncs (1: every step)
    fragments: int
    burst_bytes: float     # each rank's bytes sent (and received) at one sync
    per_step_bytes: float  # the same, averaged over the steps
    every_step_bytes: float  # what per-step averaging would move every step (the comparison)
    gbps: float            # the cross-group link per rank (GB/s)

    @property
    def seconds_per_sync(self) -> float:
        return self.burst_bytes / (self.gbps * 1e9)

    def as_dict(self) -> dict:
        return {**self.__dict__, "seconds_per_sync": self.seconds_per_sync}

    def lines(self) -> list[str]:
        gb = 1e9
        mode = "gradients averaged every step" if not self.diloco else (
            f"DiLoCo, a sync every {self.sync_every} step(s)"
            + (f", streaming: 1 of {self.fragments} fragments each" if self.fragments > 1 else ""))
        out = [f"Cross-group traffic ({self.groups} replica groups; {mode}), per rank:",
               f"  {self.burst_bytes / gb:,.3f} GB per sync, {self.seconds_per_sync:,.2f} s at {self.gbps:g} GB/s; "
               f"{self.per_step_bytes / gb:,.4f} GB per step on average"]
        if self.per_step_bytes < self.every_step_bytes:
            out.append(f"  per-step averaging would move {self.every_step_bytes / gb:,.3f} GB every step "
                       f"({self.every_step_bytes / self.per_step_bytes:,.0f}x)")
        return out


def cross_group_traffic(params: int, bytes_per_param: int, groups: int, diloco_sync_every: int = 0,
                        fragments: int = 1, gbps: float = 50.0) -> CrossGroupTraffic:
    """Each rank's cross-group bytes for a model of `params` parameters of `bytes_per_param` bytes over
    `groups` replica groups; `gbps`: the cross-group link per rank (GB/s)."""
    ring = 2 * (groups - 1) / groups
    whole = ring * params * bytes_per_param
    if not diloco_sync_every:
        return CrossGroupTraffic(groups, False, 1, 1, whole, whole, whole, gbps)
    burst = whole / fragments
    return CrossGroupTraffic(groups, True, diloco_sync_every // fragments, fragments, burst, whole / diloco_sync_every,
                             whole, gbps)
