"""The decoder-only transformer: token embedding -> N pre-norm blocks -> norm -> logits.

GPT-2 (learned positions, LayerNorm, GELU, tied embeddings, biases) and Llama (RoPE, RMSNorm,
SwiGLU, GQA, untied) are the same class with different `ModelConfig` values; so is DeepSeek-V3
(multi-head latent attention: lmforge.model.mla; Mixture-of-Experts: lmforge.model.moe; multi-token
prediction modules after the main model, trained only: lmforge.model.mtp).

Construction is on the meta device (no memory, no init cost, whatever the size). `build_model`
materialises a whole model on one device; a parallel run instead splits and shards the meta model
first and each rank materialises only its own part (lmforge.model.materialise, with the
initialisation of lmforge.model.init, which gives every layout the same initial weights).
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model import mup
from lmforge.model.init import init_source
from lmforge.model.materialise import materialise
from lmforge.model.accounting import count_params, flops_per_token  # noqa: F401  (re-exported)
from lmforge.model.layers import (Block, KVCache, block_inputs, local_positions, make_norm, rope_tables,
                                  scale_embedding, token_positions)
from lmforge.model.loss import linear_cross_entropy_sum, token_nll_sum
from lmforge.model.gated_deltanet import DeltaNetCache, GatedDeltaNet
from lmforge.model.mla import MLAttention
from lmforge.model.moe import MoE
from lmforge.model.mtp import MTP, with_mtp_loss


def make_block(cfg: ModelConfig, layer: int) -> Block:
    """Block `layer` (0-based; n_layers + k - 1 for multi-token prediction's depth k): Gated DeltaNet
    where model.layer_types makes it linear attention, multi-head latent attention under model.mla,
    the Mixture-of-Experts feed-forward where model.moe puts one."""
    attn = GatedDeltaNet(cfg) if cfg.is_linear_layer(layer) else MLAttention(cfg) if cfg.mla.enabled else None
    return Block(cfg, attn=attn, mlp=MoE(cfg, layer) if cfg.moe.is_moe_layer(layer) else None, layer=layer)


def generation_caches(cfg: ModelConfig) -> list[KVCache | DeltaNetCache]:
    """Empty generation caches, one per block: keys and values for attention, the fixed-size
    convolution and recurrent state for Gated DeltaNet (model.layer_types)."""
    return [DeltaNetCache() if cfg.is_linear_layer(i) else KVCache() for i in range(cfg.n_layers)]


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos_emb == "learned" else None
        self.emb_dropout = nn.Dropout(cfg.dropout)
        # A ModuleDict keyed "0".."n-1" (not a ModuleList): pipeline stages delete the blocks they
        # do not own and the remaining names stay those of the full model, so checkpoints match.
        self.blocks = nn.ModuleDict({str(i): make_block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.output_mult = mup.output_multiplier(cfg)  # μP's logits multiplier 1/m (1 under SP)
        self.mtp = MTP(cfg, make_block) if cfg.mtp_depth else None  # (multi-token prediction: trained only)
        self.tie_weights()
        if cfg.pos_emb == "rope":
            for name, (cos, sin) in self.rope_buffers().items():
                self.register_buffer(f"{name}_cos", cos, persistent=False)
                self.register_buffer(f"{name}_sin", sin, persistent=False)

    def rope_buffers(self, device: torch.device | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The RoPE cos / sin tables by buffer name: `rope` (every block, or the full-attention ones),
        and `rope_local` for model.layer_types' 'sliding_attention' blocks (model.rope_local_theta, plain
        RoPE: Gemma 3 and OLMo 3 scale only the global blocks' frequencies)."""
        cfg = self.cfg
        out = {"rope": rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.rope_theta, device=device, cfg=cfg)}
        if cfg.has_local_layers:
            out["rope_local"] = rope_tables(cfg.rope_dim, cfg.max_seq_len, cfg.local_rope_theta, device=device)
        return out

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (must be redone after `to_empty`,
        which materialises each module's parameters separately)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def reset_buffers(self) -> None:
        """(Re)compute the non-persistent buffers (RoPE tables) on their device, e.g. after `to_empty`."""
        if self.cfg.pos_emb == "rope":
            for name, (cos, sin) in self.rope_buffers(self.rope_cos.device).items():
                getattr(self, f"{name}_cos").copy_(cos)
                getattr(self, f"{name}_sin").copy_(sin)

    # ---- forward ----------------------------------------------------------------------------

    def scale_output(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm's output `h` times μP's logits multiplier (model.parametrization = "mup": 1/m,
        lmforge.model.mup; on the head's input, dim values per token rather than vocab, and the same
        for the fused loss); `h` itself under SP."""
        return h if self.output_mult == 1.0 else h * self.output_mult

    def forward(self, tokens: torch.Tensor, kv_caches: list[KVCache] | None = None,
                targets: torch.Tensor | None = None, loss_chunk: int = 0,
                doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab).

        With `targets` (batch, seq; -100 = ignored): the summed token NLL instead (fp32 scalar),
        computed by `lmforge.model.loss.linear_cross_entropy_sum` over `loss_chunk` tokens at a
        time, fused with the output projection, so the full logits never exist (train.loss_chunk);
        loss_chunk = 0: the plain logits' `token_nll_sum` (what a whole-model compile traces with the
        forward). Inside forward so DDP/FSDP hooks see the output projection's use as usual. With multi-token
        prediction (model.mtp_depth) the modules run here in training (lmforge.model.mtp): the value is
        still the language-model NLL, its backward that of the whole objective.

        `doc_ids` (batch, whole sequence; lmforge.model.documents): attention within each document;
        `positions` (the same shape): per-token positions (documents restarting at 0). Both describe
        the whole sequences, also under context parallelism, where `tokens` are this rank's chunks.
        """
        start = kv_caches[0].length if kv_caches else 0
        seq = tokens.shape[1]
        if start + seq > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start + seq} tokens exceeds model.max_seq_len = {self.cfg.max_seq_len}.")
        if kv_caches and doc_ids is not None:
            raise ValueError("generation with a KV cache takes one document per prompt: no doc_ids")
        positions = local_positions(positions)
        x = scale_embedding(self.cfg, self.tok_emb(tokens))
        if self.pos_emb is not None:
            x = x + self.pos_emb(token_positions(start, seq, tokens.device) if positions is None else positions)
        x = self.emb_dropout(x)
        ropes, masks = block_inputs(self, positions, doc_ids, self.cfg.dropout if self.training else 0.0)
        rope = ropes[False]
        for i, block in enumerate(self.blocks.values()):
            x = block(x, ropes[block.local], kv_caches[i] if kv_caches else None, mask=masks[block.local])
        if targets is not None:
            nll = self.head_nll(self.norm(x), targets, loss_chunk)
            if self.mtp is not None and self.training and torch.is_grad_enabled():
                extra = self.mtp.loss(x, tokens, targets, rope, self.tok_emb,
                                      lambda h, y: self.head_nll(h, y, loss_chunk))
                nll = with_mtp_loss(nll, extra)
            return nll
        return self.lm_head(self.scale_output(self.norm(x)))

    def head_nll(self, h: torch.Tensor, targets: torch.Tensor, loss_chunk: int) -> torch.Tensor:
        """Summed token NLL of the output head on normed hidden states h: with `loss_chunk` > 0 fused with
        a plain nn.Linear head, `loss_chunk` tokens at a time; else (train.loss_chunk = 0: the logits, as
        outside the forward), for a LoRA (or other wrapped) head and for a tensor-parallel one
        (vocab-sharded logits, inside `loss_parallel()`) through the head's own forward. μP's logits multiplier
        (`scale_output`) is applied here, to the main model's and the MTP depths' head inputs alike."""
        h = self.scale_output(h)
        if loss_chunk and type(self.lm_head) is nn.Linear and not hasattr(self.lm_head.weight, "placements"):
            return linear_cross_entropy_sum(h, self.lm_head.weight, targets, loss_chunk)
        return token_nll_sum(self.lm_head(h), targets)

    # ---- accounting -------------------------------------------------------------------------

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = None) -> Transformer:
    """The whole model on `device`, initialised by lmforge.model.init (seed None: a seed drawn from
    torch's global generator)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    with torch.device("meta"):
        model = Transformer(cfg)
    return materialise(model, device, init_source(cfg, seed))
