"""Live fault tolerance across replica groups, on torchft (`fault_tolerance.*`; `pip install "lmforge[ft]"`).

A fault-tolerant job is several *replica groups*: each one an ordinary `lmforge train` (one process,
or a torchrun of any of the layouts: DDP, FSDP2, TP, PP, the group's own layout averaging its ranks'
gradients as usual), the groups being the job's outer data-parallel dimension (HSDP's dp_replicate).
Instead of one process group over the whole job, the groups meet through torchft: a lighthouse
(`torchft_lighthouse`, or `lmforge launch --lighthouse`) forms a *quorum* of the live groups every
step, and each rank averages its gradients with the same rank of the other groups over a process
group that torchft rebuilds whenever the quorum changes (torchft's managed ProcessGroupGloo /
ProcessGroupNCCL). Every group has the same layout, so rank i of each holds the same part of the
model (its FSDP2 shards, TP shards, pipeline stages): what a rank averages and what it sends a
healing group are its local parts (a DTensor's local shard), never a whole parameter. So:

* a group that dies costs the others one failed attempt at the step they are in: the all-reduce
  fails, the step is retried at once with a new quorum of the live groups and the same local
  gradients (nothing is drawn twice: each group's batch of the step is kept), and they go on at
  the smaller quorum. What such a step trains is fault_tolerance.batch_policy's: "shrink" (the
  default), the batches of the groups in the quorum; "keep", the whole global batch, the live
  groups also training the missing groups' micro-batches (`share_plan`, `MissingShares`);
* a group started again (same fault_tolerance.replica_id, same command) joins the next quorum and,
  being behind, receives the weights, the optimizer state and the loop's position (step, tokens,
  data position, LR schedule, loss scale) from a live group through torchft's checkpoint transport
  (HTTP; each rank its own shards, from the same rank of the live group: `PeerState`), then steps
  with the others from that step on;
* the groups must agree on their layout and on what a step trains (`group_layout`: the parallel.*
  keys that decide a rank's part, the process count, the model, fault_tolerance.batch_policy ...):
  a group healing from another compares the sender's with its own before loading anything, and the
  groups of every new quorum compare theirs in one small all-reduce before their first gradients
  (`FaultTolerance.check_layout`); a difference stops the run with a one-line error naming the key;
* every step's quorum (which groups trained it, which data shares each trained, how many sequences
  that was, and how many attempts it took) is a record of the group's step log (metrics.jsonl:
  `{"event": "ft_quorum", "step", "replica_groups", "shares", "sequences", ...}`);
* what a step trained is counted as the quorum trained it (`FaultTolerance.book_step`), the same in
  every group: the loop's tokens seen (every micro-batch of the step's `share_plan`, once: under
  "keep" the whole global batch), and an MoE model's statistics (expert loads, aux / z losses, MTP
  losses: the quorum's sums, in the step's one all-reduce of tokens and NLL), whose
  auxiliary-loss-free bias update is one per step, of the quorum's load, from the biases the step
  began with (so the groups' biases stay equal; under "keep" the missing shares are routed with those
  biases too); this group's tokens/s and MFU count the micro-batches it trained itself.

The steps, as the loop's events call them (lmforge.train.events; every rank of a group alike):

    run_start     the torchft Manager (its server on the group's rank 0, talking to the lighthouse);
                  the first quorum, which heals this group from a peer if it is behind
    step_begin    a quorum for the step (the one run_start formed serves the first step)
    backward_end  the group's gradients, flattened into one buffer (under "keep", with those of the
                  missing groups' micro-batches this group trains besides), averaged over the
                  quorum weighed by each group's target tokens; then the commit vote: on a failure
                  (a peer died, a transfer timed out) the buffer is restored and the step retried
                  with a new quorum, so the optimizer only ever steps on gradients every live group
                  agreed on; the committed step's tokens and statistics booked
    update_end    the step's quorum recorded
    close         the Manager shut down

Data: group g's rank with data-parallel index i reads as data rank g x dp + i of replica_groups x dp
(`data_coordinate`), so the groups read disjoint shares of the one deterministic order: group g's
*share* of a step is its ranks' micro-batches. The loaders are pure functions of their state (the
global position, the same on every rank), so under "keep" a live group reads a missing group's
micro-batches of the step exactly: a loader of that group's data rank, set to the state this
group's own loader had at the step's start (`MissingShares`).

Normalisation: as inside a group (lmforge.parallel.layout: the summed NLL over the global target
count), the step's gradient is the mean over every target token the quorum trained: each group's
gradients (normalised by its own tokens) are weighed by its share of the tokens, which one small
all-reduce of (tokens, summed NLL) gives before the gradients' (torchft's plain average would weigh a
group that trained more micro-batches, or more unmasked targets, like the others). The loss a group
logs is the quorum's: the mean NLL of everything the step trained, equal in every group.

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
it would have merged, and a group started again is healed at its first sync (inside that step's
optimizer step: the loop goes on from the step it received, not its own). The weights at the last
sync and the outer momentum are part of the run's checkpoint (`DiLoCoState`), so a whole-job restart
resumes them exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import socket
from datetime import timedelta

import torch
from torch import nn

from lmforge.ckpt.state import local_optimizer
from lmforge.config import ConfigError
from lmforge.model.moe import MoEStats, moe_layers
from lmforge.model.sharded import local_part
from lmforge.train.events import Handler
from lmforge.train.step_log import StepTokens

log = logging.getLogger("lmforge.ft")

QUORUM_EVENT = "ft_quorum"


def data_coordinate(cfg, dist_info) -> tuple[int, int]:
    """This rank's place in the job's data order: (data rank, number of data ranks). Without fault
    tolerance, the rank's data-parallel coordinate; with it, the group's share of it."""
    f = cfg.fault_tolerance
    if not f.enabled:
        return dist_info.dp_rank, dist_info.dp_size
    return f.replica_id * dist_info.dp_size + dist_info.dp_rank, f.replica_groups * dist_info.dp_size


def share_plan(quorum: list[int], groups: int, micro_batches: int, keep: bool) -> dict[int, dict[int, list[int]]]:
    """Which micro-batches of which data shares each group of `quorum` trains at a step:
    {group: {share: [first, stop)}}, share m being replica group m's part of the step's global batch
    (its ranks' data ranks, `data_coordinate`; `micro_batches` per rank, the same range on each of a
    group's ranks). Each group trains its own share; with `keep` (batch_policy "keep") also the
    missing groups' micro-batches, taken in the order (share, micro-batch) and cut into one run of
    consecutive ones per live group, in ascending order, as equal as can be. A function of the
    quorum alone: every group computes the same plan, so between them they train each micro-batch
    of the step once."""
    live = sorted(quorum)
    plan = {g: {g: [0, micro_batches]} for g in live}
    missing = [m for m in range(groups) if m not in plan]
    if not keep or not missing:
        return plan
    units = len(missing) * micro_batches  # unit u: micro-batch u % micro_batches of share missing[u // micro_batches]
    for q, g in enumerate(live):
        lo, hi = q * units // len(live), (q + 1) * units // len(live)
        for k, m in enumerate(missing):
            first, stop = max(lo, k * micro_batches), min(hi, (k + 1) * micro_batches)
            if first < stop:
                plan[g][m] = [first - k * micro_batches, stop - k * micro_batches]
    return plan


class GradientPart:
    """The flattened gradients of some of a step's micro-batches, normalised by their target tokens
    (as the layout leaves them), with those tokens and their summed NLL (float64 tensors), which
    (share, micro-batch) units they are, and the layout's statistics of their passes (`stats`: MoE
    layers' `MoEStats` by block, MTP's under "mtp"; sums): parts of a step add up weighed by their
    tokens, their statistics summed."""

    def __init__(self, grad: torch.Tensor, targets: torch.Tensor, nll: torch.Tensor, units: frozenset = frozenset(),
                 stats: dict | None = None):
        self.grad, self.targets, self.nll, self.units, self.stats = grad, targets, nll, units, stats or {}

    @classmethod
    def of_last_pass(cls, trainer, loss: torch.Tensor, units: frozenset = frozenset()) -> "GradientPart":
        """The gradients the layout's last forward_backward left (its loss: the mean NLL of its tokens)."""
        from torch._utils import _flatten_dense_tensors

        targets = trainer.layout.last_targets.to(torch.float64)
        return cls(_flatten_dense_tensors(step_grads(trainer)), targets, loss.detach().to(torch.float64) * targets, units,
                   dict(trainer.layout.moe_stats))

    def merged(self, other: "GradientPart") -> "GradientPart":
        targets = self.targets + other.targets
        total = targets.clamp(min=1)
        grad = self.grad * (self.targets / total).to(self.grad.dtype) + other.grad * (other.targets / total).to(self.grad.dtype)
        return GradientPart(grad, targets, self.nll + other.nll, self.units | other.units,
                            sum_stats(self.stats, other.stats))


def sum_stats(a: dict, b: dict) -> dict:
    """Two passes' layout statistics (`GradientPart.stats`) added up."""
    out = {}
    for k in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            out[k] = x if y is None else y
        elif isinstance(x, MoEStats):
            out[k] = MoEStats(x.acc + y.acc, x.micro_batches + y.micro_batches)
        else:
            out[k] = x + y
    return out


def stats_vector(stats: dict) -> torch.Tensor:
    """`GradientPart.stats` as one float64 vector (the keys in a fixed order, the same in every group
    of one layout), to be summed over the quorum; `stats_from_vector` reads it back."""
    parts = [(s.acc if isinstance(s, MoEStats) else s).reshape(-1).to(torch.float64) for _, s in sorted_stats(stats)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def sorted_stats(stats: dict) -> list:
    return sorted(stats.items(), key=lambda kv: str(kv[0]))


def stats_from_vector(stats: dict, summed: torch.Tensor, micro_batches: int) -> dict:
    """`stats` (a template) with the quorum's sums `summed` (`stats_vector`) in place of its values; each
    MoE layer's `micro_batches`: the quorum's (`micro_batches`, every rank of every group running one
    pass per micro-batch it trains)."""
    out, at = {}, 0
    for k, s in sorted_stats(stats):
        t = s.acc if isinstance(s, MoEStats) else s
        value = summed[at:at + t.numel()].view(t.shape).to(t.dtype)
        at += t.numel()
        out[k] = MoEStats(value, micro_batches) if isinstance(s, MoEStats) else value
    return out


def step_grads(trainer) -> list[torch.Tensor]:
    """This rank's part of the gradients the step accumulated (re-read after each pass: a backward may
    replace them): a sharded layout's DTensor gradient as its local shard (a view: writing it writes the
    gradient), which rank i of every group holds alike."""
    return [local_part(p.grad) for p in trainer.layout.params() if p.grad is not None]


# what decides the part of the model a rank holds (with the process count and the model): the same in every group
LAYOUT_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero_stage", "sequence_parallel", "pp_schedule",
               "pp_virtual_stages")
PROCESSES = "processes per group"
PARAMETERS = "trainable parameter elements on this rank"


def group_layout(trainer) -> dict[str, int | str]:
    """What every replica group of a job must share, by the key that sets it: the layout (so that rank i
    of each group holds the same part of the same model, and the gradients it averages and the state it
    sends line up), and how the groups split and train a step. Values are ints or strings (the model
    section: a digest of it); the last entry, this rank's trainable elements, catches what the keys
    miss (LoRA, frozen parameters)."""
    cfg, f = trainer.cfg, trainer.cfg.fault_tolerance
    model = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True, default=str)
    out: dict[str, int | str] = {PROCESSES: trainer.dist.world_size}
    out.update({f"parallel.{k}": getattr(cfg.parallel, k) for k in LAYOUT_KEYS})
    out.update({"fault_tolerance.batch_policy": f.batch_policy, "fault_tolerance.replica_groups": f.replica_groups,
                "train.global_batch_size": cfg.train.global_batch_size,
                "model.*": hashlib.sha256(model.encode()).hexdigest()[:12]})
    out[PARAMETERS] = sum(local_part(p).numel() for p in trainer.layout.params() if p.requires_grad)
    return {k: int(v) if isinstance(v, bool) else v for k, v in out.items()}


def layout_error(key: str, mine, theirs: str, want=None) -> ConfigError:
    """The one-line error of groups that differ in `key` (`group_layout`): `theirs` says who differs,
    `want` (if known) is the value this group should have had."""
    fix = {PROCESSES: "launch every group with the same torchrun --nnodes x --nproc-per-node",
           "model.*": "give every group the same model.* settings",
           PARAMETERS: "give every group the same model.*, finetune.* and parallel.* settings"}.get(
        key, f"start every group with the same {key}" if want is None else f"start this group with {key} = {want!r}")
    shown = "" if key == "model.*" else f" = {mine!r}"
    return ConfigError(f"fault tolerance: this replica group has {key}{shown}, but {theirs}: every group of a job "
                       f"needs the same layout and batch policy; {fix}.")


def layout_vector(layout: dict[str, int | str]) -> torch.Tensor:
    """`group_layout` as float64 numbers, exact (strings as 48-bit digests), then negated: one MAX
    all-reduce of it gives every entry's largest and smallest value over the groups."""
    values = [v if isinstance(v, int) else int(hashlib.sha256(v.encode()).hexdigest()[:12], 16)
              for v in layout.values()]
    t = torch.tensor(values, dtype=torch.float64)
    return torch.cat([t, -t])


class MissingShares:
    """batch_policy "keep": the micro-batches of the groups missing from a step's quorum that this
    group trains (`share_plan`), read and trained as the missing group would have (the same
    sequences, in the same order). Each rank reads through a loader of its own for the missing
    group's data rank (built once, by `build_loaders`), set to the state this rank's own loader had
    at the step's start: the loaders are pure functions of their global state, so it draws exactly
    the batches the missing rank would have."""

    def __init__(self):
        self.readers: dict[int, object] = {}  # data rank -> its loader (set to the step's start each time)
        self.start_state: dict | None = None  # this rank's loader state at the step's start

    def begin_step(self, trainer) -> None:
        self.start_state = copy.deepcopy(trainer.loader.state_dict())  # (a prefetcher's: the consumed one)

    def batches(self, trainer, units: list[tuple[int, int]]) -> list:
        """The micro-batches (share, index) `units`, in that order, on this rank's device."""
        from lmforge.train.components import build_loaders

        f, info = trainer.cfg.fault_tolerance, trainer.dist
        out = []
        for share in sorted({m for m, _ in units}):
            wanted = sorted(j for m, j in units if m == share)
            rank = share * info.dp_size + info.dp_rank  # (the missing group's rank with this rank's dp index)
            if rank not in self.readers:
                self.readers[rank] = build_loaders(trainer.cfg, trainer.data, rank, f.replica_groups * info.dp_size).train
            reader = self.readers[rank]
            reader.load_state_dict(copy.deepcopy(self.start_state))
            drawn = [reader.next_batch() for _ in range(wanted[-1] + 1)]  # (in order: a reader draws only forward)
            out += [(drawn[j][0].to(trainer.device), drawn[j][1].to(trainer.device)) for j in wanted]
        return out

    def train(self, trainer, assigned: dict[int, list[int]], own: int, extra: GradientPart | None) -> GradientPart | None:
        """The gradients of the missing groups' micro-batches `assigned` to this group ({share: [first,
        stop)}, its own share `own` left out): those of `extra` (what an earlier attempt at the step
        trained) plus the units it lacks. An attempt whose smaller quorum gives this group more units
        trains only the new ones; one that took a unit away (a group came back mid-step) starts over,
        so that no micro-batch is counted twice."""
        units = frozenset((m, j) for m, (first, stop) in assigned.items() if m != own for j in range(first, stop))
        if extra is not None and not extra.units <= units:
            extra = None
        todo = sorted(units - (extra.units if extra is not None else frozenset()))
        if not todo:
            return extra
        batches = self.batches(trainer, todo)
        for g in step_grads(trainer):  # (the group's own gradients are kept, flattened, by the caller)
            g.zero_()
        loss = trainer.forward_backward(batches)
        part = GradientPart.of_last_pass(trainer, loss, frozenset(todo))
        log.info("fault tolerance: step %d: trained %d micro-batches of the missing groups' shares %s",
                 trainer.state.step + 1, len(todo), sorted({m for m, _ in todo}))
        return part if extra is None else extra.merged(part)


def load_torchft():
    """torchft, or a one-line error saying how to install it."""
    try:
        import torchft
    except ImportError as e:
        raise RuntimeError(f"fault_tolerance.enabled needs torchft ({e}): pip install \"lmforge[ft]\"") from e
    return torchft


class PeerState:
    """What a rejoining group receives from a live one: the same parts a checkpoint holds
    (lmforge.train.trainer `states`) but the per-process RNG, which stays each process's own. Each
    rank sends and receives its own part: sharded tensors (FSDP2, TP: DTensors) travel as their local
    shards, and the receiver puts each back on its own mesh as its own state places it (the same
    shard, both groups having the same layout, which the sender's `group_layout` shows first)."""

    PARTS = ("train", "model", "loader", "scheduler", "scaler")

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        optimizer = local_optimizer(self.trainer.optimizer)
        fresh = not optimizer.state  # (no step taken yet: a group asked for its state at the job's start)
        sd = {name: local_shards(self.trainer.states[name].state_dict()) for name in self.PARTS}
        if fresh:
            # torch's get_optimizer_state_dict gives a fresh optimizer its state by stepping it once at lr 0,
            # which Adam counts as its first step (its bias correction): undone here, and the receiver
            # starts fresh too, so that both take their first step as a run without fault tolerance does
            optimizer.state.clear()
        return {**sd, "fresh_optimizer": fresh, "layout": group_layout(self.trainer)}

    def load_state_dict(self, sd: dict) -> None:
        mine, theirs = group_layout(self.trainer), sd["layout"]
        for key, value in mine.items():
            if theirs.get(key) != value:
                other = "another model" if key == "model.*" else f"{theirs.get(key)!r}"
                raise layout_error(key, value, f"the live group it receives its state from has {other}", theirs.get(key))
        for name in self.PARTS:
            state = self.trainer.states[name]
            state.load_state_dict(as_placed(sd[name], state.state_dict()))
        if sd.get("fresh_optimizer"):
            local_optimizer(self.trainer.optimizer).state.clear()
        log.info("fault tolerance: weights, optimizer and position received from a live group (step %d)",
                 self.trainer.state.step)


def local_shards(tree):
    """A state dict with each DTensor replaced by this rank's shard of it (a plain tensor: what travels)."""
    if isinstance(tree, dict):
        return {k: local_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local_shards(v) for v in tree]
    return local_part(tree)


def as_placed(received, template):
    """`received` (`local_shards` of a peer's state) with each tensor that `template` (this rank's own
    state of the same part) holds as a DTensor made one again, on this rank's mesh, placements and
    global shape: what the part's load_state_dict takes."""
    from torch.distributed.tensor import DTensor

    if isinstance(template, DTensor) and isinstance(received, torch.Tensor):
        return DTensor.from_local(received.to(template.device), template.device_mesh, template.placements,
                                  run_check=False, shape=template.shape, stride=template.stride())
    if isinstance(template, dict) and isinstance(received, dict):
        return {k: as_placed(v, template[k]) if k in template else v for k, v in received.items()}
    return received


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
        self.missing = MissingShares()  # (batch_policy "keep")
        self.plan: dict[int, dict[int, list[int]]] = {}  # the committed step's `share_plan`
        self.checked_quorum: int | None = None  # the last quorum whose groups compared their layouts
        self.expert_bias: dict[int, torch.Tensor] = {}  # MoE layers' selection biases at the step's start

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
        self.start_quorum(trainer)
        self.held_quorum = True

    def start_quorum(self, trainer) -> None:
        """A quorum for the step (a new one after a failed attempt), its groups' layouts compared if new."""
        self.manager.start_quorum()
        self.check_layout(trainer)

    def check_layout(self, trainer) -> None:
        """The groups of a quorum not seen before compare their `group_layout`s (one MAX all-reduce of
        a few numbers, before any gradient: groups of another layout would average gradients that do
        not line up, or hang on buffers of other sizes); a difference is a one-line error in every
        group of the quorum. A group that heals compared the sender's already (`PeerState`). Every group
        of a quorum sees it for the first time at the same attempt, so all of them all-reduce, or none;
        an all-reduce that fails (a peer died) leaves the verdict to the next quorum's check."""
        quorum = self.manager._quorum_id
        if quorum == self.checked_quorum:
            return
        self.checked_quorum = quorum
        if self.manager.num_participants() < 2:
            return
        from torch.distributed import ReduceOp

        mine = group_layout(trainer)
        seen = layout_vector(mine).to(trainer.device)
        self.manager.allreduce(seen, reduce_op=ReduceOp.MAX).wait()
        if self.manager.errored():
            return
        n = len(mine)
        for (key, value), high, low in zip(mine.items(), seen[:n].tolist(), (-seen[n:]).tolist()):
            if high != low:
                others = "another model" if key == "model.*" else \
                    f"values from {low:.0f} to {high:.0f}" if isinstance(value, int) else "another value"
                raise layout_error(key, value, f"the groups of its quorum {self.replica_groups(trainer)} have {others}")

    # ---- per step ------------------------------------------------------------------------------

    def step_begin(self, trainer, step: int) -> None:
        if self.manager is None or self.diloco is not None:
            return
        self.attempts = 1
        if self.held_quorum:
            self.held_quorum = False
        else:
            self.start_quorum(trainer)
        if trainer.cfg.fault_tolerance.batch_policy == "keep":  # (after the quorum: it may have healed the loader)
            self.missing.begin_step(trainer)
        # (after the quorum too: it may have healed the model) the MoE selection biases the step routes
        # with: every pass of the step routes with them, and the step's update of them is the quorum's
        self.expert_bias = {i: layer.expert_bias.clone() for i, layer in moe_layers(trainer.layout.model).items()
                            if layer.cfg.bias_update_rate}

    def backward_end(self, trainer, loss) -> None:
        """The step's gradients averaged over the quorum, weighed by target tokens (the module's
        docstring), until a quorum commits; `loss` becomes the quorum's mean loss (in place: the
        loop logs this tensor)."""
        if self.manager is None or self.diloco is not None:  # (DiLoCo: the inner steps are each group's own)
            return
        from torch._utils import _unflatten_dense_tensors
        from torch.distributed import ReduceOp

        f, me = trainer.cfg.fault_tolerance, trainer.cfg.fault_tolerance.replica_id
        own = GradientPart.of_last_pass(trainer, loss)  # this group's own share, kept for a retry
        extra = None  # (keep) the missing groups' micro-batches this group trained
        while True:
            plan = share_plan(self.replica_groups(trainer), f.replica_groups, trainer.micro_batches_per_step(),
                              f.batch_policy == "keep")
            if f.batch_policy == "keep":
                self.restore_expert_bias(trainer)  # (the missing shares route as their own group would have)
                extra = self.missing.train(trainer, plan.get(me, {}), me, extra)
            mine = own if extra is None else own.merged(extra)
            # the quorum's tokens and summed NLL, and its statistics of the layers (MoE, MTP), first
            totals = torch.cat([torch.stack([mine.targets, mine.nll]), stats_vector(mine.stats).to(mine.targets.device)])
            self.manager.allreduce(totals, reduce_op=ReduceOp.SUM).wait()
            flat = mine.grad * (mine.targets / totals[0].clamp(min=1)).to(mine.grad.dtype)
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()  # (an error is recorded, not raised: the vote sees it)
            if self.manager.should_commit():
                break
            # a peer died or timed out mid-step: the same step again, with the live groups
            self.attempts += 1
            log.warning("fault tolerance: step %d not committed by quorum %s; retrying with a new quorum",
                        trainer.state.step + 1, self.manager._quorum_id)
            self.start_quorum(trainer)
        self.plan = plan
        loss.copy_(totals[1] / totals[0].clamp(min=1))
        grads = step_grads(trainer)
        for g, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(averaged)
        self.book_step(trainer, plan, mine.stats, totals[2:])

    def restore_expert_bias(self, trainer) -> None:
        """The MoE selection biases as the step began (a pass of the step updated them: `MoE.take_stats`)."""
        layers = moe_layers(trainer.layout.model)
        for i, bias in self.expert_bias.items():
            layers[i].expert_bias.copy_(bias)

    def book_step(self, trainer, plan: dict, stats: dict, summed: torch.Tensor) -> None:
        """What the committed step trained, counted as the quorum trained it: its tokens (the loop's
        tokens_seen: every micro-batch of the plan, in every group alike; this group's tokens/s: its
        part of the plan), its layers' statistics (the quorum's sums, `summed`: what the step log
        records) and the MoE bias update of them (from the step's biases: the same in every group, and
        once a step however many passes this group ran)."""
        per_unit = trainer.cfg.train.micro_batch_size * trainer.dist.dp_size * trainer.cfg.data.seq_len
        units = {g: sum(stop - first for first, stop in shares.values()) for g, shares in plan.items()}
        trainer.steplog.step_tokens = StepTokens(per_unit * sum(units.values()),
                                         per_unit * units.get(trainer.cfg.fault_tolerance.replica_id, 0))
        if not stats:
            return
        trainer.layout.moe_stats.clear()
        trainer.layout.moe_stats.update(stats_from_vector(stats, summed, sum(units.values())))
        self.restore_expert_bias(trainer)
        layers = moe_layers(trainer.layout.model)
        for i in self.expert_bias:
            layers[i].update_bias(trainer.layout.moe_stats[i])

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
        per_micro_batch = trainer.cfg.train.micro_batch_size * trainer.dist.dp_size  # (sequences, over the group's ranks)
        record = {"step": step, "event": QUORUM_EVENT, "quorum_id": self.manager._quorum_id,
                  "replica_groups": groups, "quorum_size": len(groups), "attempts": self.attempts,
                  # {group: {share: [first, stop) micro-batches}} (`share_plan`) and the sequences they hold
                  "shares": {str(g): {str(m): r for m, r in shares.items()} for g, shares in self.plan.items()},
                  "sequences": per_micro_batch * sum(stop - first for shares in self.plan.values()
                                                     for first, stop in shares.values())}
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

