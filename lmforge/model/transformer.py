"""The decoder-only transformer: token embedding -> N pre-norm blocks -> norm -> logits.

GPT-2 (learned positions, LayerNorm, GELU, tied embeddings, biases) and Llama (RoPE, RMSNorm,
SwiGLU, GQA, untied) are the same class with different `ModelConfig` values.

Construction is on the meta device (no memory, no init cost, whatever the size). `build_model`
materialises a whole model on one device; a parallel run instead splits and shards the meta model
first and each rank materialises only its own part (lmforge.model.materialise, with the
initialisation of lmforge.model.init, which gives every layout the same initial weights).
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.init import init_source
from lmforge.model.materialise import materialise
from lmforge.model.accounting import count_params, flops_per_token  # noqa: F401  (re-exported)
from lmforge.model.layers import (Block, KVCache, attention_mask, local_positions, make_norm, rope_rows, rope_tables,
                                  token_positions)
from lmforge.model.loss import linear_cross_entropy_sum, token_nll_sum
from lmforge.model.moe import MoE


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.pos_emb == "learned" else None
        self.emb_dropout = nn.Dropout(cfg.dropout)
        # A ModuleDict keyed "0".."n-1" (not a ModuleList): pipeline stages delete the blocks they
        # do not own and the remaining names stay those of the full model, so checkpoints match.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        for i, block in self.blocks.items():  # Mixture-of-Experts feed-forwards (model.moe): lmforge.model.moe
            if cfg.moe.is_moe_layer(int(i)):
                block.mlp = MoE(cfg, int(i))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        if cfg.pos_emb == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg=cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding with the output projection (must be redone after `to_empty`,
        which materialises each module's parameters separately)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def reset_buffers(self) -> None:
        """(Re)compute the non-persistent buffers (RoPE tables) on their device, e.g. after `to_empty`."""
        if self.cfg.pos_emb == "rope":
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                                   device=self.rope_cos.device, cfg=self.cfg)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, kv_caches: list[KVCache] | None = None,
                targets: torch.Tensor | None = None, loss_chunk: int = 0,
                doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab).

        With `targets` (batch, seq; -100 = ignored): the summed token NLL instead (fp32 scalar),
        computed by `lmforge.model.loss.linear_cross_entropy_sum` over `loss_chunk` tokens at a
        time, fused with the output projection, so the full logits never exist (train.loss_chunk).
        Inside forward so DDP/FSDP hooks see the output projection's use as usual.

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
        x = self.tok_emb(tokens)
        if self.pos_emb is not None:
            x = x + self.pos_emb(token_positions(start, seq, tokens.device) if positions is None else positions)
        x = self.emb_dropout(x)
        rope = rope_rows((self.rope_cos, self.rope_sin), positions) if self.cfg.pos_emb == "rope" else None
        mask = attention_mask(doc_ids, self.cfg.sliding_window, self.cfg.dropout if self.training else 0.0)
        for i, block in enumerate(self.blocks.values()):
            x = block(x, rope, kv_caches[i] if kv_caches else None, mask=mask)
        if targets is not None:
            h = self.norm(x)
            if type(self.lm_head) is nn.Linear:  # a LoRA (or other wrapped) head runs its own forward
                return linear_cross_entropy_sum(h, self.lm_head.weight, targets, loss_chunk)
            return token_nll_sum(self.lm_head(h), targets)
        return self.lm_head(self.norm(x))

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
