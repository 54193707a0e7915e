"""Live fault tolerance across replica groups, on torchft (`fault_tolerance.*`; `pip install "lmforge[ft]"`).

A fault-tolerant job is several *replica groups*: each one an ordinary `lmforge train` (one process,
or a torchrun of DDP ranks: the group's own layout averages its ranks' gradients as usual), the
groups being the job's outer data-parallel dimension (HSDP's dp_replicate). Instead of one process
group over the whole job, the groups meet through torchft: a lighthouse (`torchft_lighthouse`, or
`lmforge launch --lighthouse`) forms a *quorum* of the live groups every step, and each rank averages
its gradients with the same rank of the other groups over a process group that torchft rebuilds
whenever the quorum changes (torchft's managed ProcessGroupGloo / ProcessGroupNCCL). So:

* a group that dies costs the others one failed attempt at the step they are in: the all-reduce
  fails, the step is retried at once with a new quorum of the live groups and the same local
  gradients (nothing is drawn twice: each group's batch of the step is kept), and they go on at
  the smaller quorum (fault_tolerance.batch_policy = "shrink": the step trains the live groups'
  batches);
* a group started again (same fault_tolerance.replica_id, same command) joins the next quorum and,
  being behind, receives the weights, the optimizer state and the loop's position (step, tokens,
  data position, LR schedule, loss scale) from a live group through torchft's checkpoint transport
  (HTTP), then steps with the others from that step on;
* every step's quorum (which groups trained it, and how many attempts it took) is a record of the
  group's step log (metrics.jsonl: `{"event": "ft_quorum", "step", "replica_groups", ...}`).

The steps, as the loop's events call them (lmforge.train.events; every rank of a group alike):

    run_start     the torchft Manager (its server on the group's rank 0, talking to the lighthouse);
                  the first quorum, which heals this group from a peer if it is behind
    step_begin    a quorum for the step (the one run_start formed serves the first step)
    backward_end  the group's gradients, flattened into one buffer, averaged over the quorum; then
                  the commit vote: on a failure (a peer died, a transfer timed out) the buffer is
                  restored and the step retried with a new quorum, so the optimizer only ever
                  steps on gradients every live group agreed on
    update_end    the step's quorum recorded
    close         the Manager shut down

Data: group g's rank with data-parallel index i reads as data rank g x dp + i of replica_groups x dp
(`data_coordinate`), so the groups read disjoint shares of the one deterministic order.

DiLoCo (fault_tolerance.diloco_sync_every = H > 0; Douillard et al. 2023) trades the per-step
all-reduce for one every H steps, for groups that talk slowly to each other (across clusters): each
group takes H optimizer steps on its own share of the data (the *inner* steps, the run's optimizer,
no cross-group traffic), then the groups average their pseudo-gradients (the weights at the last
sync minus their own now) and every group applies the same *outer* step to the weights at the last
sync: SGD with Nesterov momentum (diloco_outer_lr 0.7, diloco_outer_momentum 0.9, the paper's). The
weights after it are the groups' common ones. Streaming DiLoCo (diloco_fragments = F > 1; Douillard
et al. 2025) cuts the model into F fragments of consecutive blocks and syncs one every H / F steps
in turn, so each sync moves 1/F of the weights (`diloco_fragments`). Both are torchft's
`torchft.local_sgd.DiLoCo` (its optimizer hooks drive the quorum and the sync): the quorum is formed
at each sync instead of each step, a sync that fails (a group died) is dropped with the inner steps
it would have merged, and a group started again is healed at the next sync. The weights at the last
sync and the outer momentum are part of the run's checkpoint (`DiLoCoState`), so a whole-job restart
resumes them exactly.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
from torch import nn

from lmforge.train.events import Handler

log = logging.getLogger("lmforge.ft")

QUORUM_EVENT = "ft_quorum"


def data_coordinate(cfg, dist_info) -> tuple[int, int]:
    """This rank's place in the job's data order: (data rank, number of data ranks). Without fault
    tolerance, the rank's data-parallel coordinate; with it, the group's share of it."""
    f = cfg.fault_tolerance
    if not f.enabled:
        return dist_info.dp_rank, dist_info.dp_size
    return f.replica_id * dist_info.dp_size + dist_info.dp_rank, f.replica_groups * dist_info.dp_size


def load_torchft():
    """torchft, or a one-line error saying how to install it."""
    try:
        import torchft
    except ImportError as e:
        raise RuntimeError(f"fault_tolerance.enabled needs torchft ({e}): pip install \"lmforge[ft]\"") from e
    return torchft


class PeerState:
    """What a rejoining group receives from a live one: the same parts a checkpoint holds
    (lmforge.train.trainer `states`) but the per-process RNG, which stays each process's own."""

    PARTS = ("train", "model", "loader", "scheduler", "scaler")

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {name: self.trainer.states[name].state_dict() for name in self.PARTS}

    def load_state_dict(self, sd: dict) -> None:
        for name in self.PARTS:
            self.trainer.states[name].load_state_dict(sd[name])
        log.info("fault tolerance: weights, optimizer and position received from a live group (step %d)",
                 self.trainer.state.step)


def diloco_fragments(model: nn.Module, n: int) -> list[nn.Module]:
    """The model's parameters in `n` fragments of consecutive blocks (streaming DiLoCo; 1 = the whole
    model): the first fragment also holds the embeddings, the last every other parameter (the final
    norm, the head, multi-token prediction's modules); each parameter in exactly one (a head tied to
    the embedding is the embedding's). Each fragment is a module holding the model's own Parameter
    objects (registered under their names with '.' as '_'), which torchft syncs one at a time."""
    n_blocks = len(model.blocks)
    cuts = [round(i * n_blocks / n) for i in range(n + 1)]
    block_fragment = {str(key): next(f for f in range(n) if cuts[f] <= i < cuts[f + 1])
                      for i, key in enumerate(model.blocks.keys())}
    fragments = [nn.Module() for _ in range(n)]
    for name, param in model.named_parameters():  # (tied parameters once, under their first name)
        head, _, rest = name.partition(".")
        if head == "blocks":
            f = block_fragment[rest.split(".", 1)[0]]
        else:
            f = 0 if head in ("tok_emb", "pos_emb") else n - 1
        fragments[f].register_parameter(name.replace(".", "_"), param)
    return fragments


class DiLoCoState:
    """DiLoCo's state beyond the model's, a part of the run's checkpoint: per fragment the weights at
    its last sync (what the next pseudo-gradient is measured from) and the outer optimizer's
    momentum, and how many syncs committed and inner steps were taken since the last one (where the
    groups are in torchft's schedule). Restored before the run starts; torchft's DiLoCo, built at
    run_start, then takes them."""

    def __init__(self, model: nn.Module, f):
        self.fragments = diloco_fragments(model, f.diloco_fragments)
        self.outer = [torch.optim.SGD(frag.parameters(), lr=f.diloco_outer_lr, momentum=f.diloco_outer_momentum,
                                      nesterov=f.diloco_outer_momentum > 0) for frag in self.fragments]
        self.diloco = None  # torchft's DiLoCo (run_start)
        self.manager = None
        self.restored: dict | None = None  # a checkpoint's part, until torchft's DiLoCo exists

    def _originals(self) -> list[dict[str, torch.Tensor]]:
        if self.diloco is not None:
            return [frag.original_parameters for frag in self.diloco._fragments]
        return [{n: p.detach().cpu().clone() for n, p in frag.named_parameters()} for frag in self.fragments]

    def state_dict(self) -> dict:
        sd: dict = {"original": {}, "momentum": {}, "has_momentum": False,
                    "outer_steps": self.manager.current_step() if self.manager is not None else 0,
                    "inner_steps": self.diloco._local_step if self.diloco is not None else 0}
        for i, (orig, opt, frag) in enumerate(zip(self._originals(), self.outer, self.fragments)):
            for n, p in frag.named_parameters():
                sd["original"][f"{i}_{n}"] = orig[n]
                buf = opt.state.get(p, {}).get("momentum_buffer")
                sd["has_momentum"] |= buf is not None
                sd["momentum"][f"{i}_{n}"] = buf if buf is not None else torch.zeros_like(p)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd["has_momentum"]:
            for i, (opt, frag) in enumerate(zip(self.outer, self.fragments)):
                for n, p in frag.named_parameters():
                    opt.state[p]["momentum_buffer"] = sd["momentum"][f"{i}_{n}"].to(p.device).clone()
        self.restored = sd

    def start(self, manager, optimizer: torch.optim.Optimizer, sync_every: int, step: int) -> None:
        """torchft's DiLoCo over `optimizer` (its step hooks count the inner steps and sync), at the
        schedule's position: the restored one, or a fresh run's (`step` inner steps, none synced)."""
        from torchft.local_sgd import DiLoCo

        interval = sync_every // len(self.fragments)
        restored = self.restored
        manager.load_state_dict({"step": restored["outer_steps"] if restored else step // interval,
                                 "batches_committed": 0})
        self.manager = manager
        self.diloco = DiLoCo(manager, self.fragments, optimizer, self.outer, sync_every, pin_memory=False)
        if restored is not None:
            for i, frag in enumerate(self.diloco._fragments):
                for n, t in frag.original_parameters.items():
                    t.copy_(restored["original"][f"{i}_{n}"])
        self.diloco._local_step = restored["inner_steps"] if restored else step % interval
        self.diloco.__enter__()


class FaultTolerance(Handler):
    """The replica group's side of the fault-tolerant job (the module's docstring). Idle unless
    fault_tolerance.enabled."""

    def __init__(self):
        self.manager = None
        self.store = None  # a one-process group's own TCPStore (under torchrun: the launcher's)
        self.held_quorum = False  # run_start's quorum not yet used by a step
        self.attempts = 0
        self.last_quorum_id: int | None = None
        self.diloco: DiLoCoState | None = None  # fault_tolerance.diloco_sync_every > 0
        self.outer_steps = 0

    def states(self, trainer) -> dict:
        f = trainer.cfg.fault_tolerance
        if not (f.enabled and f.diloco_sync_every):
            return {}
        self.diloco = DiLoCoState(trainer.model, f)
        return {"diloco": self.diloco}

    # ---- setup ---------------------------------------------------------------------------------

    def run_start(self, trainer) -> None:
        f = trainer.cfg.fault_tolerance
        if not f.enabled:
            return
        load_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        info = trainer.dist
        timeout = timedelta(seconds=f.timeout_s)
        if info.distributed:  # torchrun's store (its agent's, at MASTER_ADDR:MASTER_PORT)
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            from torch.distributed import TCPStore

            self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self.store.port
        pg = ProcessGroupNCCL(timeout=timeout) if info.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        peer = PeerState(trainer)
        lighthouse = f.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse and info.rank == 0:
            raise RuntimeError("fault_tolerance.enabled but no lighthouse: set fault_tolerance.lighthouse, "
                               "$TORCHFT_LIGHTHOUSE, or start the run with `lmforge launch --lighthouse`.")
        self.manager = Manager(
            pg=pg, load_state_dict=peer.load_state_dict, state_dict=peer.state_dict,
            min_replica_size=f.min_replicas,
            # one quorum at a time, before the step's forward: a rejoining group is healed before it
            # computes anything, and a failed step's retry forms its new quorum at once
            use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=info.rank, world_size=info.world_size, store_addr=store_addr, store_port=store_port,
            lighthouse_addr=lighthouse or None, replica_id=f"lmforge_group_{f.replica_id}",
            hostname=socket.gethostname(),
            # the groups build their weights from one seed, but a group resumed from its own
            # checkpoint may not hold what the others do: every group starts from the first's. Not
            # under DiLoCo, whose first quorum comes at the first sync: there it would replace a group's
            # first inner steps by another's (a group behind is healed by its step count all the same)
            init_sync=not f.diloco_sync_every,
            max_retries=f.max_retries)
        if self.diloco is not None:  # DiLoCo: torchft's hooks on the optimizer form the quorum at each sync
            self.diloco.start(self.manager, trainer.optimizer, f.diloco_sync_every, trainer.state.step)
            self.outer_steps = self.manager.current_step()
            return
        # (the Manager counts committed steps; a group resumed from a checkpoint starts at its step)
        self.manager.load_state_dict({"step": trainer.state.step, "batches_committed": 0})
        # a quorum of the live groups; a group behind the others is healed here (torchft's checkpoint
        # transport; `PeerState`)
        self.manager.start_quorum()
        self.held_quorum = True

    # ---- per step ------------------------------------------------------------------------------

    def step_begin(self, trainer, step: int) -> None:
        if self.manager is None or self.diloco is not None:
            return
        self.attempts = 1
        if self.held_quorum:
            self.held_quorum = False
        else:
            self.manager.start_quorum()

    def backward_end(self, trainer, loss) -> None:
        if self.manager is None or self.diloco is not None:  # (DiLoCo: the inner steps are each group's own)
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in trainer.layout.params() if p.grad is not None]
        local = _flatten_dense_tensors(grads)  # this group's gradients, kept for a retry
        while True:
            flat = local.clone()
            self.manager.allreduce(flat).wait()  # (an error is recorded, not raised: the vote sees it)
            if self.manager.should_commit():
                break
            # a peer died or timed out mid-step: the same step again, with the live groups
            self.attempts += 1
            log.warning("fault tolerance: step %d not committed by quorum %s; retrying with a new quorum",
                        trainer.state.step + 1, self.manager._quorum_id)
            self.manager.start_quorum()
        for g, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(averaged)

    def update_end(self, trainer, step: int) -> None:
        if self.manager is None:
            return
        if self.diloco is not None:  # a record at each sync: committed (an outer step) or dropped
            synced = self.diloco.diloco._local_step == 0
            if synced:
                committed = self.manager.current_step() > self.outer_steps
                self.outer_steps = self.manager.current_step()
                groups = self.replica_groups(trainer)
                record = {"step": step, "event": QUORUM_EVENT, "quorum_id": self.manager._quorum_id,
                          "replica_groups": groups, "quorum_size": len(groups), "diloco_sync": True,
                          "committed": committed, "outer_steps": self.outer_steps,
                          "fragment": (self.outer_steps - 1) % len(self.diloco.fragments) if committed else None}
                if trainer.run.rank0 and trainer.metrics is not None:
                    trainer.metrics.write(record)
            return
        groups = self.replica_groups(trainer)
        record = {"step": step, "event": QUORUM_EVENT, "quorum_id": self.manager._quorum_id,
                  "replica_groups": groups, "quorum_size": len(groups), "attempts": self.attempts}
        if self.manager._quorum_id != self.last_quorum_id:
            self.last_quorum_id = self.manager._quorum_id
            trainer.log_event({**record, "event": "ft_quorum_change",
                               "message": f"fault tolerance: step {step} trained by replica groups {groups}"})
        if trainer.run.rank0 and trainer.metrics is not None:
            trainer.metrics.write(record)

    def replica_groups(self, trainer) -> list[int]:
        """The fault_tolerance.replica_id of every group in this step's quorum. torchft names each
        member of the managed process group by a global rank, replica index x group size + group
        rank (from the trailing digits of our replica ids, `lmforge_group_<id>`); its process group
        keeps the list it was configured with."""
        ranks = getattr(self.manager._pg, "_global_ranks", None) or []
        return sorted(r // trainer.dist.world_size for r in ranks)

    def log_window(self, trainer) -> dict:
        if self.manager is None:
            return {}
        return {"ft_quorum_size": self.manager.num_participants()}

    def close(self, trainer, error) -> None:
        if self.diloco is not None and self.diloco.diloco is not None:
            self.diloco.diloco.__exit__(None, None, None)  # (its hooks off the optimizer)
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        self.store = None

