"""Autoregressive sampling with a KV cache: temperature, top-k, top-p, stop sequences, seed."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lmforge.model.transformer import Transformer, generation_caches


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k and outside the smallest set with cumulative prob >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass *before* it already reaches top_p (the first always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate_tokens(model: Transformer, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.8,
                    top_k: int = 50, top_p: float = 1.0, seed: int | None = None, use_cache: bool = True,
                    eos_id: int | None = None) -> Iterator[int]:
    """Yield new token ids one at a time. temperature 0 = greedy. Stops at eos_id or max_seq_len."""
    if not prompt:
        raise ValueError("generation needs a non-empty prompt (at least one token).")
    if temperature < 0:
        raise ValueError(f"temperature = {temperature} must be >= 0.")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    if seed is not None:
        gen.manual_seed(seed)
    max_len = model.cfg.max_seq_len
    tokens = list(prompt[-max_len:])
    caches = generation_caches(model.cfg) if use_cache else None
    pending = torch.tensor([tokens], device=device)
    try:
        for _ in range(max_new_tokens):
            if len(tokens) >= max_len and caches is not None:
                # context full: fall back to recomputing over the last max_len - 1 tokens
                caches = None
            if caches is None:
                window = torch.tensor([tokens[-(max_len - 1):] if len(tokens) >= max_len else tokens], device=device)
                logits = model(window)[0, -1].float()
            else:
                logits = model(pending, caches)[0, -1].float()
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                probs = _filter_logits(logits / temperature, top_k, top_p).softmax(-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            tokens.append(nxt)
            yield nxt
            if eos_id is not None and nxt == eos_id:
                return
            pending = torch.tensor([[nxt]], device=device)
    finally:
        model.train(was_training)


def stream_text(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, *, stop: list[str] | None = None,
                **kwargs) -> Iterator[str]:
    """Yield the continuation of `prompt` as text pieces while tokens arrive; stops at end-of-text
    or just before the first stop string. The last len(longest stop) - 1 characters are held back
    until they cannot start a stop string, so no part of one is ever yielded."""
    stops = [s for s in stop or () if s]
    hold = max((len(s) for s in stops), default=1) - 1
    out: list[int] = []
    text = emitted = ""
    for tok in generate_tokens(model, tokenizer.encode(prompt), max_new_tokens, eos_id=tokenizer.eos_id, **kwargs):
        if tok == tokenizer.eos_id:
            break
        out.append(tok)
        text = tokenizer.decode(out)
        hits = [text.index(s) for s in stops if s in text]
        if hits:
            yield text[len(emitted):min(hits)]
            return
        safe = len(text) - hold
        if safe > len(emitted):
            yield text[len(emitted):safe]
            emitted = text[:safe]
    if len(text) > len(emitted):
        yield text[len(emitted):]


def generate_text(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, *, stop: list[str] | None = None,
                  **kwargs) -> str:
    """Prompt text -> generated continuation text (without the prompt), cut at the first stop string."""
    return "".join(stream_text(model, tokenizer, prompt, max_new_tokens, stop=stop, **kwargs))
