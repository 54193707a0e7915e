"""Maximal Update Parametrization (μP: Yang et al. 2022, "Tensor Programs V: Tuning Large Neural
Networks via Zero-Shot Hyperparameter Transfer"), model.parametrization = "mup".

Under the standard parametrization (SP) the best learning rate moves as the model widens: with one
init_std and one learning rate, a wider hidden matrix's update moves its output by more (its
coordinates add up over more inputs), and activations and logits grow with width. μP scales each
weight's initialisation, learning rate and output so that every layer's update changes its output by
Θ(1) per coordinate at any width: the hyperparameters tuned on a small model (the *base*, of width
model.mup_base_width) hold for a wide one. Everything is relative to the base, so a μP model at the
base width *is* the SP model (same initial weights, learning rates and function; tested), and
m = model.dim / model.mup_base_width is the only number that changes with width.

The weights fall into the paper's classes by which of their dimensions grow with width (fan_in /
fan_out "infinite"); for lmforge's layers (`param_kind`):

* vector-like (finite fan_in, infinite fan_out: "input weights & all biases"): the token and
  position embeddings, every bias, every norm's gain (RMSNorm / LayerNorm, QK-norm);
* output (infinite fan_in, finite fan_out), with an output multiplier: ``lm_head`` (tied or not);
* readout (the same shapes, without a multiplier): the MoE router (lmforge.model.moe);
* hidden (both infinite): the q/k/v projections (separate ``wq/wk/wv`` or the fused ``wqkv``, GQA
  or not), ``wo``, the MLPs (SwiGLU ``gate/up/down``, GELU ``fc/proj``), the MoE experts' stacked
  ``w_gate/w_up/w_down`` (a hidden matrix per expert) and the shared experts; multi-token prediction's
  (model.mtp_depth, lmforge.model.mtp) ``proj`` (2 dim -> dim) and blocks. The MTP depths share the
  embedding and the head, and their head inputs take the same logits multiplier (Transformer.head_nll).

Multi-head latent attention (model.mla) is refused with μP (ModelConfig.check_parametrization): its
latent ranks and per-head widths are config numbers of their own, so whether ``wq_a`` / ``wkv_a`` are
hidden or output-like, ``wq_b`` / ``wkv_b`` hidden or vector-like, depends on how the user scales them
with width, and its softmax scale (with YaRN's mscale) is not the q multiplier below.

The table as implemented, relative to the base model (TP5 Table 3, and for the output layer the
equivalent form with an output multiplier of its Table 8, which the ``mup`` package implements):

    class        init std                   forward multiplier          SGD lr   Adam lr   Muon lr
    vector-like  x 1 (norms 1, biases 0)    1                           x m      x 1       (AdamW part) x 1
    output       x 1                        logits x 1/m                x m      x 1       (AdamW part) x 1
    readout      x 1/m                      1                           x 1/m    x 1/m     x 1/sqrt(m)
    hidden       x 1/sqrt(m)                1                           x 1      x 1/m     x 1
    attention    softmax(q.k x sqrt(base head_dim) / head_dim): 1/head_dim scaling, = 1/sqrt(head_dim) at the base

"x 1" etc. multiply SP's value: init std model.init_std (residual output projections init_std /
sqrt(2 n_layers), then x 1/sqrt(m) as every hidden matrix: fan_in variance scaling), lr optim.lr.
The Adam column holds for every optimizer whose update is normalised entry by entry (Adam, AdamW,
8-bit Adam, Lion: registry `mup_rule` "adam" / "adamw"); SGD and momentum take the SGD column.
LAMB and Adafactor scale each update by the parameter's own norm, which the tables do not cover:
the config refuses them with μP.

Tied embeddings: the vector-like and the output rows agree (init x 1; Adam x 1; SGD x m), so the one
tensor keeps its tie under μP, and the 1/m sits in the forward as a multiplier of the final norm's
output (the mup package's MuSharedReadout, TP5's recipe for tied embeddings).

Weight decay: with decoupled decay (AdamW, Lion, 8-bit Adam, Muon; `mup_rule` "adamw" / "muon") a
group's weight_decay is divided by its lr multiplier, so each step shrinks a weight by the same
lr x weight_decay as at the base width (the mup package's MuAdamW default); L2 decay (Adam, SGD)
is left as configured.

Muon: its update of a hidden matrix is orthogonalised (spectral norm ~1) and scaled by
sqrt(max(1, rows / cols)) (lmforge.optim.muon), so at fixed aspect ratios its size does not depend
on width: it already meets μP's spectral condition (Yang, Simon & Bernstein 2023, "A Spectral
Condition for Feature Learning": ||dW|| ~ sqrt(fan_out / fan_in)), and Muon's matrices keep
optim.muon_lr (x 1). A readout matrix in a Muon group (the router) needs sqrt(fan_out / fan_in),
x 1/sqrt(m); an lm_head moved into Muon (muon_exclude) x sqrt(m) (its logits are x 1/m). The rest of
Muon's parameters run AdamW and take the Adam column. The init scales and forward multipliers apply
whatever the optimizer.

LoRA adapters keep SP's rules (multiplier 1): μP is about pre-training from scratch.

Where it happens: the init scales in lmforge.model.init (by parameter name, so every layout starts
from the one-process weights), the attention multiplier on q in lmforge.model.layers.Attention, the
logits multiplier in lmforge.model.transformer.Transformer.scale_output (called by its head_nll, for
the MTP depths too, and by pipeline stages), the learning-rate multipliers as per-group ``lr`` / ``lr_mult`` in lmforge.optim.optimizers
(schedules multiply the group's lr; sharded layouts keep group keys), and for HF export
lmforge.interop.mup_fold (the exported model is a standard one: the attention factor folded into
the q projection, or into the QK-norm's q gain, the logits multiplier into the final norm).

Hand-written (not the ``mup`` package): it swaps module classes and keeps width information on
every parameter (``infshape``), which meta-device construction, FSDP2 / DTensor parameters and
lmforge's name-keyed initialisation do not carry; here a parameter's class follows from its name.
"""

from __future__ import annotations

import math

from lmforge.config import ModelConfig

KINDS = ("vector", "output", "readout", "hidden", "adapter")

# multiplier = m ** exponent, per optimizer rule (lmforge.spec.optimizers's `mup_rule`) and class
_ADAM = {"vector": 0.0, "output": 0.0, "readout": -1.0, "hidden": -1.0, "adapter": 0.0}
LR_EXPONENTS: dict[str, dict[str, float]] = {
    "adam": _ADAM,
    "adamw": _ADAM,
    "sgd": {"vector": 1.0, "output": 1.0, "readout": -1.0, "hidden": 0.0, "adapter": 0.0},
    # Muon's own (orthogonalised) groups; its AdamW groups use "adamw"
    "muon": {"vector": 0.0, "output": 0.5, "readout": -0.5, "hidden": 0.0, "adapter": 0.0},
}
INIT_STD_EXPONENTS: dict[str, float] = {"vector": 0.0, "output": 0.0, "readout": -1.0, "hidden": -0.5,
                                        "adapter": 0.0}
DECOUPLED_DECAY = ("adamw", "muon")  # rules whose weight decay is lr x weight_decay per step

_VECTOR_LIKE_MATRICES = ("tok_emb.weight", "pos_emb.weight")


def param_kind(name: str, ndim: int) -> str:
    """The μP class of parameter `name` (any wrapper prefixes allowed) with `ndim` dims: 'vector',
    'output', 'readout', 'hidden' or 'adapter' (the module docstring's table)."""
    if name.endswith(("lora_a", "lora_b")):
        return "adapter"
    if ndim < 2 or name.endswith(_VECTOR_LIKE_MATRICES):
        return "vector"
    if name.endswith("lm_head.weight"):
        return "output"
    if name.endswith(("router.weight", "shared_gate.weight")):  # (dim -> experts, dim -> 1: readouts)
        return "readout"
    return "hidden"


def enabled(cfg: ModelConfig) -> bool:
    return cfg.parametrization == "mup"


def width_mult(cfg: ModelConfig) -> float:
    """m = model.dim / model.mup_base_width under μP, 1 under SP."""
    return cfg.dim / cfg.mup_base_width if enabled(cfg) else 1.0


def init_std_factor(cfg: ModelConfig, kind: str) -> float:
    """What SP's init std of a `kind` weight is multiplied by."""
    return width_mult(cfg) ** INIT_STD_EXPONENTS[kind]


def lr_multiplier(cfg: ModelConfig, kind: str, rule: str) -> float:
    """What optim.lr (Muon's matrices: optim.muon_lr) of a `kind` parameter is multiplied by under the
    optimizer rule `rule` ("adam", "adamw", "sgd", "muon")."""
    return width_mult(cfg) ** LR_EXPONENTS[rule][kind]


def attention_factor(cfg: ModelConfig) -> float:
    """The multiplier of q (after QK-norm, before RoPE: both linear per position) that turns SDPA's
    1/sqrt(head_dim) into μP's sqrt(base head_dim) / head_dim: sqrt(base head_dim / head_dim)."""
    return math.sqrt(cfg.mup_head_dim / cfg.head_dim) if enabled(cfg) else 1.0


def output_multiplier(cfg: ModelConfig) -> float:
    """The multiplier of the logits (applied to the final norm's output): 1/m."""
    return 1.0 / width_mult(cfg)
