"""Closed-form facts about parallel layouts, shared by the runtime (`lmforge.parallel`) and the
planner (`lmforge.plan`). Standard library only: the planner imports it without torch."""

from __future__ import annotations


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")
"""parallel.pp_schedule's choices, in the order of torch.distributed.pipelining's classes (PP_SCHEDULE_CLASSES)."""
PP_SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                       "interleaved-zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                       "dualpipev": "ScheduleDualPipeV"}
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")
"""Schedules that split each backward into an input-gradient pass (B) and a weight-gradient pass (W)
run later to fill the bubble (torch's `stage_backward_input` / `stage_backward_weight`)."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules with two stages per rank in a V: rank r holds stages r and 2 pp - 1 - r, so rank 0 holds
the first and the last stage (the embedding and the output head)."""
LOOPED = ("interleaved", "interleaved-zb")
"""Schedules with parallel.pp_virtual_stages stages per rank in a loop: rank r holds r, r + pp, ..."""


def stages_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """Model chunks (pipeline stages) one pipeline rank holds: 2 in a V (zbv, dualpipev), the virtual
    stages v in a loop (interleaved, interleaved-zb), else 1."""
    if schedule in V_SHAPED:
        return 2
    return virtual_stages if schedule in LOOPED else 1


def rank_stages(schedule: str, pp: int, rank: int, virtual_stages: int = 1) -> list[int]:
    """The stage indices pipeline rank `rank` of `pp` holds, in the order its schedule lists them:
    [r, 2pp-1-r] in a V, [r, r + pp, r + 2pp, ...] in a loop (torch's "loop" and "v" placements)."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(stages_per_rank(schedule, virtual_stages))]


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """The blocks pipeline stage `stage` of `n_stages` holds: n_layers / n_stages consecutive ones
    (lmforge.parallel.pipeline builds the stages by it; the planner counts each rank's blocks by it)."""
    per = n_layers // n_stages
    return list(range(stage * per, (stage + 1) * per))


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pipeline rank that holds `stage` (the inverse of `rank_stages`)."""
    if schedule in V_SHAPED and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def pipeline_bubble(pp: int, micro_batches: int, virtual_stages: int = 1, schedule: str | None = None,
                    recompute: float = 0.0) -> float:
    """Idle fraction of a pipelined step, bubble / (m (F + B + W) + bubble), where F, B and W are the
    times of one micro-batch's forward, input-gradient and weight-gradient passes through all of a
    rank's layers (m micro-batches, p = pp ranks, v stages per rank). The model takes F = B = W (a
    matmul's input and weight gradients each cost its forward's FLOPs), plus the `recompute`d share
    of the forward in B (activation checkpointing re-runs it before the input gradient):

    * gpipe, 1f1b: (p-1)(F+B+W), i.e. (p-1)/(m+p-1) (Huang et al. 2019; Narayanan et al. 2021);
    * interleaved: (p-1)(F+B+W)/v, i.e. (p-1)/(vm+p-1) (Narayanan et al. 2021);
    * interleaved-zb: (p-1)(F+B-W)/v: ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
      sec. 2.1; at v = 1 torch's schedule is ZB-H1, the 1/v as for interleaved 1F1B);
    * zbv: (p-1)B/2: ZB-V (Qi et al. sec. 6) with a synchronous optimizer step: the V's ramp of p-1
      half-stage passes stays (the paper's zero bubble also hides it behind the next step with its
      optimizer post-validation, which a step with gradient clipping cannot);
    * dualpipev: (PP/2-1)(F&B+B'-3W) over PP = 2p half-stage chunks (DeepSeek-V3 report, Table 2,
      whose B' is the full backward, B + W here; the DualPipe README gives DualPipeV the same), with
      F&B = F + B + W (no overlap of communication with compute modelled): (p-1)(F+2B-W)/2.

    tests/test_parallel_pp_schedules.py replays torch's own action lists of each schedule with these
    times and finds exactly these fractions (dualpipev at F = B = W; with recompute its formula is
    an upper bound, within 25%). `schedule` None: interleaved where virtual_stages > 1, else 1f1b."""
    schedule = schedule or ("interleaved" if virtual_stages > 1 else "1f1b")
    if pp < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"pp = {pp}, micro_batches = {micro_batches}, virtual_stages = {virtual_stages} must be >= 1")
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
    if pp == 1:
        return 0.0
    f, b, w = 1.0, 1.0 + recompute, 1.0
    v = stages_per_rank(schedule, virtual_stages)
    bubble = (pp - 1) * {"gpipe": f + b + w, "1f1b": f + b + w, "interleaved": (f + b + w) / v,
                         "interleaved-zb": (f + b - w) / v, "zbv": b / 2,
                         "dualpipev": (f + 2 * b - w) / 2}[schedule]
    return bubble / (micro_batches * (f + b + w) + bubble)


def pipeline_in_flight(schedule: str, pp: int, micro_batches: int, rank: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of one
    micro-batch through all of the rank's layers: gpipe all m; 1f1b min(p - rank, m) (the warm-up
    forwards); interleaved p (1 + (p-1)/(p v)) on rank 0 (Narayanan et al.), its own warm-up
    elsewhere; the split-backward schedules keep a micro-batch's activations from its forward to
    its weight-gradient pass (torch's `stage_backward_input` retains the graph for W), and hold p
    on every rank (ZB-H1 and ZB-V: 1F1B's peak, Qi et al.) or p + 1/2 (DualPipeV: DeepSeek's PP + 1
    half-stage chunks). Capped at m. tests/test_parallel_pp_schedules.py counts these from torch's
    action lists."""
    p, m = pp, micro_batches
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("interleaved-zb", "zbv"):
        return float(min(p, m))
    if schedule == "dualpipev":
        return min(p + 0.5, float(m))
    warmup = float(min(p - rank, m))
    if schedule == "interleaved" and rank == 0:
        return min(p * (1 + (p - 1) / (p * virtual_stages)), float(m))
    return warmup


def cp_kv_bytes(micro_batch: int, seq_len: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """Context parallelism: bytes of one layer's K and V for the whole sequences of a micro-batch,
    2 b s (kv_heads / tp) head_dim x dtype bytes. Every CP rank holds them after the all-gather and
    saves them for backward (the K/V term of a CP rank's activations, whatever cp), and it is the
    size of each all-gather output and of each reduce-scatter input."""
    return 2 * micro_batch * seq_len * (kv_heads // tp) * head_dim * dtype_bytes


def cp_latent_bytes(micro_batch: int, seq_len: int, latent_width: int, dtype_bytes: int) -> int:
    """Context parallelism with multi-head latent attention (lmforge.model.mla): bytes of one layer's
    gathered latent and RoPE key (`latent_width` = kv_lora_rank + qk_rope_head_dim per token, the same
    on every TP rank) for the whole sequences of a micro-batch: what its all-gather moves in place of
    K and V (`cp_kv_bytes`)."""
    return micro_batch * seq_len * latent_width * dtype_bytes


def cp_activation_bytes(single_rank_bytes: float, kv_bytes: float, cp: int) -> float:
    """Saved activations of one layer on one CP rank: the rank's 1/cp of the tokens, with the K/V of
    the whole sequence in place of its own share: (A - KV) / cp + KV, where A is the layer's
    activations for the whole sequence on one rank and KV = `cp_kv_bytes` (part of A: attention
    saves K and V in one process too). The attention keeps no mask and no score matrix (its output
    and log-sum-exp, as without CP: lmforge.parallel.context_parallel)."""
    return (single_rank_bytes - kv_bytes) / cp + kv_bytes


def cp_score_elements(seq_len: int, cp: int) -> int:
    """(query, key) scores a CP rank computes per head and sequence: chunk j's c queries against the
    (j + 1) c keys before and at it, for j = i and 2cp-1-i: c^2 (2 cp + 1), c = seq_len / (2 cp), the
    same on every rank: the causal work is balanced (contiguous slices of seq_len / cp tokens would
    give the last rank 2 cp / (cp + 1) times the mean). The kernels compute them block by block and
    keep none (lmforge.parallel.context_parallel); the literature's unfused score term counts them."""
    c = seq_len // (2 * cp)
    return c * c * (2 * cp + 1)


def cp_comm_bytes(kv_bytes: int, cp: int, n_layers: int, micro_batches: int, recomputed_layers: int = 0
                  ) -> dict[str, int]:
    """Context-parallel traffic of one optimizer step on one rank: per layer and micro-batch one K/V
    all-gather (output `kv_bytes`; again in backward for each of the `recomputed_layers` that
    activation checkpointing re-runs) and one reduce-scatter of their gradients (input `kv_bytes`).
    'collective_bytes' is the size of the tensors the collectives produce / consume; a ring
    algorithm sends and receives (cp - 1) / cp of it per rank ('wire_bytes'); 'calls' counts the
    collectives."""
    gathers = (n_layers + recomputed_layers) * micro_batches
    scatters = n_layers * micro_batches
    through = (gathers + scatters) * kv_bytes
    return {"all_gather_bytes": gathers * kv_bytes, "reduce_scatter_bytes": scatters * kv_bytes,
            "collective_bytes": through, "wire_bytes": through * (cp - 1) // cp, "calls": gathers + scatters}


def ulysses_kv_heads(heads: int, kv_heads: int, cp: int) -> int:
    """Ulysses context parallelism (lmforge.parallel.context_parallel): the KV heads a TP rank's
    all-to-all scatters over the cp ranks for `heads` query heads and `kv_heads` KV heads: kv_heads
    when cp divides them, else cp (each KV head replicated cp / kv_heads times: fewer KV heads than
    ranks, GQA). ValueError where the heads do not split so (lmforge.config.layout_rules says it
    first, in the config's words)."""
    if not ulysses_splits(heads, kv_heads, cp):
        raise ValueError(f"Ulysses context parallelism: cp = {cp} must divide the {heads} query heads of a rank, and "
                         f"its {kv_heads} KV heads must be a multiple of cp or divide it")
    return kv_heads if kv_heads % cp == 0 else cp


def ulysses_splits(heads: int, kv_heads: int, cp: int) -> bool:
    """Whether Ulysses' all-to-all can give each of cp ranks 1/cp of a TP rank's `heads` query heads and
    their KV heads (`ulysses_kv_heads`)."""
    return heads % cp == 0 and kv_heads > 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)


def ulysses_bytes(micro_batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                  tp: int, cp: int) -> tuple[int, int]:
    """Ulysses: bytes of one layer's two all-to-all inputs on one rank for a micro-batch: q, k and v of
    the rank's seq_len / cp tokens (heads / tp query heads, `ulysses_kv_heads` KV heads each for k and
    v), and the attention output of the same tokens (heads / tp heads)."""
    tokens = micro_batch * seq_len // cp
    kv = ulysses_kv_heads(heads // tp, kv_heads // tp, cp)
    return tokens * (heads // tp + 2 * kv) * head_dim * dtype_bytes, tokens * (heads // tp) * head_dim * dtype_bytes


def ulysses_comm_bytes(qkv_bytes: int, out_bytes: int, cp: int, n_layers: int, micro_batches: int,
                       recomputed_layers: int = 0) -> dict[str, int]:
    """Ulysses traffic of one optimizer step on one rank: per layer and micro-batch, forward (again for
    each of the `recomputed_layers`) one all-to-all of q, k and v (`qkv_bytes` in and out) and one of
    the attention output (`out_bytes`); backward the same two of their gradients. An all-to-all keeps
    1/cp of its input on the rank and sends (cp - 1) / cp of it ('wire_bytes'); 'calls' counts them."""
    passes = (2 * n_layers + recomputed_layers) * micro_batches  # forwards (with recomputed ones) + backwards
    through = passes * (qkv_bytes + out_bytes)
    return {"all_to_all_bytes": through, "collective_bytes": through, "wire_bytes": through * (cp - 1) // cp,
            "calls": 2 * passes}


def ulysses_activation_bytes(single_rank_bytes: float, kv_bytes: float, cp: int, kv_replication: float = 1.0
                             ) -> float:
    """Saved activations of one layer on one Ulysses CP rank: 1/cp of one process's A (the rank's tokens;
    attention saves q, k, v, its output and log-sum-exp for the whole sequence but heads / cp heads,
    the same bytes), where K/V = `kv_bytes` (part of A) count `kv_replication` times (KV heads
    replicated to cp of them: cp / kv heads, else 1): (A - KV) / cp + KV x replication / cp."""
    return (single_rank_bytes - kv_bytes) / cp + kv_bytes * kv_replication / cp


def recomputed_layers(activation_checkpoint: str, n_layers: int, every: int = 2) -> int:
    """Of `n_layers` blocks, how many activation checkpointing re-runs forward in backward
    (lmforge.parallel.activation_ckpt): all of them under 'full' and 'selective' (the selective
    policy saves the matmul and attention outputs but still re-runs the block, collectives
    included), blocks 0, k, 2k, ... under 'every_k' (k = `every`), none under 'none'."""
    if activation_checkpoint == "none":
        return 0
    return len(range(0, n_layers, every)) if activation_checkpoint == "every_k" else n_layers
