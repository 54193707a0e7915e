"""Fine-tuning building blocks: instruction data with the loss on responses only, LoRA
adapters, and loading pre-trained weights (lmforge runs and transformers folders)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lmforge.config import ModelConfig
from lmforge.data.instruct import InstructLoader, tokenize_examples
from lmforge.model.lora import (ADAPTED_MODULES, FusedQKVLoRA, LoRALinear, apply_lora, lora_parameters, merge_lora,
                                merged_state_dict)
from lmforge.model.transformer import build_model
from lmforge.train.finetune import checkpoint_model_config, load_pretrained
from tests.tiny_lm import MODEL, tiny_tokenizer, write_run

PAIRS = [
    ("Q: where did the cat sit?\nA:", " on the mat."),
    ("Q: where did the dog run?\nA:", " to the park."),
    ("Q: where did the bird sing?\nA:", " in the tree."),
    ("Q: who sat on the mat?\nA:", " the cat."),
    ("Q: who ran to the park?\nA:", " the dog."),
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in PAIRS))
    return path


def _model(seed=0, **kw):
    return build_model(ModelConfig(**{**MODEL, "init_std": 0.1, **kw}), seed=seed)


# ---- instruction data ------------------------------------------------------------------------


def test_labels_cover_response_and_eos_only(tok, data):
    loader = InstructLoader(data, tok, seq_len=32, batch_size=1, seed=0)
    for i, (prompt, response) in enumerate(PAIRS):
        x, y = loader.row(i)
        p, r = tok.encode(prompt), tok.encode(response) + [tok.eos_id]
        n = len(p) + len(r) - 1
        assert x[:n].tolist() == (p + r)[:-1]
        assert y[:len(p) - 1].eq(-100).all()           # targets inside the prompt
        assert y[len(p) - 1:n].tolist() == r           # the response and its end-of-text
        assert y[n:].eq(-100).all() and x[n:].eq(tok.eos_id).all()  # padding (no pad token: eos)


def test_packing_keeps_whole_examples_and_masks_across_them(tok, data):
    packed = InstructLoader(data, tok, seq_len=48, batch_size=1, seed=0, pack=True)
    plain = InstructLoader(data, tok, seq_len=48, batch_size=1, seed=0)
    assert packed.num_rows < plain.num_rows == 5
    learned = sum(int((packed.row(i)[1] != -100).sum()) for i in range(packed.num_rows))
    assert learned == sum(len(tok.encode(r)) + 1 for _, r in PAIRS)  # every response token once, nothing else


def test_bad_lines_and_long_prompts_are_named(tok, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "answer": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing key 'response'"):
        InstructLoader(bad, tok, 16, 1, 0)
    bad.write_text('{"prompt": "a", "response": "b"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        InstructLoader(bad, tok, 16, 1, 0)
    bad.write_text(json.dumps({"prompt": "the cat sat on the mat " * 10, "response": "x"}) + "\n")
    with pytest.raises(ValueError, match="record 1: the prompt has .* tokens, leaving no room"):
        InstructLoader(bad, tok, 16, 1, 0)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "a:", "response": " the cat sat on the mat" * 5}) + "\n")
    rows = tokenize_examples(long, tok, 16)  # the response is cut to fit seq_len + 1 tokens
    assert rows.truncated == 1 and len(rows.tokens[0]) == 17 and rows.learn[0].sum() == 17 - len(tok.encode("a:"))


def test_order_is_deterministic_per_epoch_resumable_and_split_across_ranks(tok, data):
    def batches(loader, n):
        return [loader.next_batch()[0] for _ in range(n)]

    one = InstructLoader(data, tok, 32, batch_size=2, seed=3)
    stream = torch.cat(batches(one, 6))  # 12 samples: 2.4 epochs of 5 rows
    epoch0 = {tuple(r.tolist()) for r in stream[:5]}
    assert len(epoch0) == 5  # an epoch is a permutation of all rows
    assert not torch.equal(stream[:5], stream[5:10])  # reshuffled in the next epoch
    assert torch.equal(torch.cat(batches(InstructLoader(data, tok, 32, 2, seed=3), 6)), stream)
    # resume after 2 batches: the rest is identical
    a = InstructLoader(data, tok, 32, 2, seed=3)
    batches(a, 2)
    b = InstructLoader(data, tok, 32, 2, seed=3)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert torch.equal(torch.cat(batches(b, 4)), stream[4:])
    # two ranks with batch 1 each take the same global samples as one rank with batch 2
    r0, r1 = (InstructLoader(data, tok, 32, 1, seed=3, rank=r, world_size=2) for r in (0, 1))
    for i in range(6):
        assert torch.equal(torch.cat([r0.next_batch()[0], r1.next_batch()[0]]), stream[2 * i:2 * i + 2])
    # validation: every row once, in file order, split across ranks
    val = [y for _, y in InstructLoader(data, tok, 32, 2, seed=3).iter_eval_batches()]
    assert [b.shape[0] for b in val] == [2, 2, 1]
    assert torch.equal(torch.cat(val), torch.stack([one.row(i)[1] for i in range(5)]))
    r1_val = list(InstructLoader(data, tok, 32, 2, seed=3, rank=1, world_size=2).iter_eval_batches())
    assert torch.equal(torch.cat([x for x, _ in r1_val]), torch.stack([one.row(i)[0] for i in (1, 3)]))
    with pytest.raises(ValueError, match="the data, seq_len or packing changed"):
        InstructLoader(data, tok, 48, 2, seed=3, pack=True).load_state_dict(a.state_dict())


def test_prompt_tokens_contribute_no_gradient(tok, data):
    model = _model()
    x, y = InstructLoader(data, tok, 32, batch_size=5, seed=0).next_batch()
    logits = model(x)
    logits.retain_grad()
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    loss.backward()
    loss = loss.detach()
    ignored = y == -100
    assert logits.grad[ignored].abs().max() == 0  # prompt and padding positions: exactly zero
    assert (logits.grad[~ignored].abs().amax(-1) > 0).all()
    # the loss is the mean NLL of the response tokens alone, by hand
    logp = logits.detach().log_softmax(-1)
    by_hand = -torch.stack([logp[b, t, y[b, t]] for b, t in (~ignored).nonzero().tolist()]).mean()
    assert abs(loss.item() - by_hand.item()) < 1e-5
    # weight gradients equal those of a loss computed on the response positions alone, and
    # differ from a loss that also learns the prompt (the mask is what removes the prompt)
    grads = [p.grad.clone() for p in model.parameters()]
    pos = ~ignored

    def weight_grads(loss_fn):
        model.zero_grad()
        loss_fn(model(x)).backward()
        return [p.grad.clone() for p in model.parameters()]

    response_only = weight_grads(lambda lg: F.cross_entropy(lg[pos], y[pos]))
    assert all((g - r).abs().max() < 1e-6 for g, r in zip(grads, response_only))
    full = torch.cat([x[:, 1:], torch.full((5, 1), tok.eos_id)], 1)  # every next token as a target
    full[:, -1] = -100
    with_prompt = weight_grads(lambda lg: F.cross_entropy(lg.flatten(0, 1), full.flatten(), ignore_index=-100))
    assert max((g - w).abs().max() for g, w in zip(grads, with_prompt)) > 1e-4


# ---- LoRA ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused_qkv", [False, True], ids=["separate-qkv", "fused-qkv"])
def test_lora_starts_as_the_base_model_trains_only_adapters_and_merges_exactly(tok, data, fused_qkv):
    model = _model(fused_qkv=fused_qkv)
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = model(tokens)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    adapted = apply_lora(model, "wq,wk,wv,wo,mlp.up", rank=4, alpha=8, seed=0)
    # (fused: one FusedQKVLoRA with an adapter per part of q, k, v instead of three LoRALinear)
    assert len(adapted) == 2 * (3 if fused_qkv else 5)
    assert all(isinstance(model.get_submodule(n), FusedQKVLoRA if n.endswith("wqkv") else LoRALinear) for n in adapted)
    with torch.no_grad():
        assert torch.equal(model(tokens), base_logits)  # B = 0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and len(trainable) == 20
    x, y = InstructLoader(data, tok, 32, batch_size=5, seed=0).next_batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        for n, p in model.named_parameters():
            assert (p.grad is not None) == (n in trainable), n
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # a few LoRA steps learn the responses
    for k, v in base_state.items():  # the base weights never moved
        assert torch.equal(model.state_dict()[k], v), k
    with torch.no_grad():
        tuned = model(tokens)
        assert (tuned - base_logits).abs().max() > 1e-3
        from_tensors = merged_state_dict(model.state_dict(), rank=4, alpha=8, cfg=model.cfg)  # e.g. gathered from FSDP
        merge_lora(model)
        assert all(torch.equal(from_tensors[k], v) for k, v in model.state_dict().items())
        assert (model(tokens) - tuned).abs().max() < 1e-5
    assert set(model.state_dict()) == set(base_state)  # plain base names again: save/export as usual
    assert not any(isinstance(m, ADAPTED_MODULES) for m in model.modules())


def test_lora_rejects_unknown_targets_and_tied_head():
    with pytest.raises(ValueError, match="'wqkv' matches no linear layer; available: .*wq"):
        apply_lora(_model(fused_qkv=False), "wqkv")  # (the separate layout has no wqkv)
    with pytest.raises(ValueError, match="shares its weight with the token embedding"):
        apply_lora(_model(tie_embeddings=True), "lm_head")
    with pytest.raises(ValueError, match="rank = 0"):
        apply_lora(_model(), "wq", rank=0)


# ---- pre-trained weights -------------------------------------------------------------------


def test_load_pretrained_from_run_folder_and_transformers_folder(tok, tmp_path):
    from lmforge.interop.hf import export_hf

    source = _model(seed=1)
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = source(tokens)
    run = write_run(tmp_path / "run", source, tok)
    export_hf(source, tmp_path / "hf")
    assert checkpoint_model_config(run) == source.cfg and checkpoint_model_config(tmp_path) is None
    for origin in (run, tmp_path / "hf", run / "model.safetensors"):
        model = _model(seed=2)
        load_pretrained(model, origin)
        with torch.no_grad():
            assert (model(tokens) - want).abs().max() < 1e-5, origin
    with pytest.raises(ValueError, match=r"model.dim: 32 vs 64.*model.n_layers: 3 vs 2"):
        load_pretrained(_model(dim=32, n_layers=3), run)
    with pytest.raises(ValueError, match="model.tie_embeddings: False vs True"):
        load_pretrained(_model(tie_embeddings=False), tmp_path / "hf")
    with pytest.raises(ValueError, match=r"tok_emb.weight has shape \(320, 64\), the model config implies \(320, 32\)"):
        load_pretrained(_model(dim=32), run / "model.safetensors")
    with pytest.raises(ValueError, match="does not exist"):
        load_pretrained(_model(), tmp_path / "nowhere")
