"""Document masking (data.attention = "document", lmforge.model.documents) in one process.

The reference is the definition itself: a packed row of documents, run with the document mask, gives
each document the logits it has when run alone. Checked in float64 for every model family variant
(RoPE and learned positions, GQA, MQA, the sliding window, QK-norm, q/k/v biases), with positions
restarting per document (then equal to rounding: the same computation), and with positions running
on (RoPE: equal to rounding too, since a RoPE score depends only on query-key distances; learned
positions: not equal, the reason "restart" exists). Without the mask the documents do see each other
(the test can fail). Context parallelism's per-chunk masks equal the whole sequence's mask (simulated
ranks, tests/test_parallel_cp.py's helper), and FlexAttention's block mask (the CUDA kernel: its
forward runs on the CPU) equals the dense mask.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig, load_config
from lmforge.model.documents import (DocumentAttention, dense_document_mask, document_ids, document_kernel,
                                     document_positions, flex_document_mask, masked_attention)
from lmforge.model.transformer import build_model
from tests.test_model import VARIANTS

EOS = 0


def packed_row(lengths: list[int], vocab: int = 97, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One row of documents of `lengths` tokens, each ending in EOS (no EOS inside); the documents."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(1, vocab, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    return torch.cat(docs).unsqueeze(0), docs


def test_document_ids_and_positions():
    x = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9], [EOS, 1, 2, 3, 4, 5, 6, 7]])
    ids = document_ids(x, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    inputs = DocumentAttention(EOS, restart_positions=True).inputs(x)
    assert set(inputs) == {"doc_ids", "positions"} and set(DocumentAttention(EOS).inputs(x)) == {"doc_ids"}


def test_dense_mask_is_causal_within_documents_and_the_window():
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    mask = dense_document_mask(ids, ids, 0)[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 1, 1, 1, 1]]
    windowed = dense_document_mask(ids, ids, 0, window=2)[0, 0].int()
    assert windowed[6].tolist() == [0, 0, 0, 0, 0, 1, 1] and windowed[2].tolist() == [0, 1, 1, 0, 0, 0, 0]
    # a chunk of queries at positions 4..6 over keys 0..6 (context parallelism's bottom-right chunk)
    assert dense_document_mask(ids[:, 4:], ids, 4)[0, 0].int().tolist() == mask[4:].tolist()


# the model variants document masking applies to: linear-attention blocks carry a recurrent state across
# the row, and the config refuses data.attention = "document" with them (config.rules.check_linear_attention)
DOCUMENT_VARIANTS = [name for name, v in VARIANTS.items() if not ModelConfig(**v).has_linear_layers]
LENGTHS = [7, 3, 12, 1, 9]  # 32 tokens: documents shorter than a window, one of a single token (its EOS)


@pytest.mark.parametrize("name", DOCUMENT_VARIANTS)
@pytest.mark.parametrize("positions", ["restart", "continue"])
def test_each_document_gets_the_logits_it_has_alone(name, positions):
    cfg = ModelConfig(**VARIANTS[name])
    model = build_model(cfg, seed=0).double()
    x, docs = packed_row(LENGTHS)
    packed = model(x, **DocumentAttention(EOS, positions == "restart").inputs(x))[0]
    causal = model(x)[0]
    exact = cfg.pos_emb == "rope"  # (RoPE: scores depend on query-key distances only)
    start, worst, leak = 0, 0.0, 0.0
    for doc in docs:
        alone = model(doc.unsqueeze(0))[0]
        worst = max(worst, (packed[start:start + len(doc)] - alone).abs().max().item())
        leak = max(leak, (causal[start:start + len(doc)] - alone).abs().max().item())
        start += len(doc)
    assert leak > 1e-3  # without the mask the later documents see the earlier ones
    if positions == "restart":  # the same computation as alone
        assert worst < 1e-9, (name, positions, worst)
    elif exact:  # other rows of the (fp32) RoPE tables: equal to their rounding
        assert worst < 1e-6, (name, positions, worst)
    else:  # learned positions running on: the documents after the first get other position embeddings
        assert worst > 1e-3, (name, positions, worst)


def test_the_documents_loss_and_gradients_equal_the_documents_run_alone():
    """Training sees the same thing: the summed NLL and the gradients of a packed, masked row equal
    the sums over the documents run one by one (a float64 model, GQA + sliding window, restarted
    positions, the chunked loss)."""
    cfg = ModelConfig(**VARIANTS["mistral"])
    x, docs = packed_row(LENGTHS, seed=1)
    y = torch.roll(x, -1, 1)
    y[0, -1] = -100
    a, b = build_model(cfg, seed=0).double(), build_model(cfg, seed=0).double()
    nll = a(x, targets=y, loss_chunk=8, **DocumentAttention(EOS, True).inputs(x))
    nll.backward()
    total, start = 0.0, 0
    for doc in docs:
        t = y[:, start:start + len(doc)]
        total = total + b(doc.unsqueeze(0), targets=t, loss_chunk=8)
        start += len(doc)
    total.backward()
    assert abs(nll.item() - total.item()) < 1e-9 * abs(total.item())
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        # (the loss computes in fp32: lmforge.model.loss; a document seeing another differs by > 1e-2)
        assert ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item() < 1e-6, name


def test_generation_takes_one_document_per_prompt():
    from lmforge.model.layers import KVCache

    model = build_model(ModelConfig(**VARIANTS["llama"]), seed=0)
    x, _ = packed_row([6, 4])
    with pytest.raises(ValueError, match="one document per prompt"):
        model(x, [KVCache() for _ in range(2)], **DocumentAttention(EOS).inputs(x))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("window", [0, 5])
def test_context_parallel_chunk_masks_equal_the_whole_sequence_mask(monkeypatch, cp, window):
    """Each CP rank's attention under its two chunks' document masks (lmforge.parallel.context_parallel,
    simulated ranks) equals attention under the whole sequence's mask: output and the gradients of q,
    k and v, float64, GQA."""
    from tests.test_parallel_cp import simulated_cp_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, 32, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    ids = torch.stack([document_ids(packed_row(LENGTHS, seed=s)[0], EOS)[0] for s in (0, 1)])
    ids[1] = torch.div(torch.arange(32), 3, rounding_mode="floor")  # many short documents, across chunks
    got = simulated_cp_attention(monkeypatch, q, k, v, cp, window=window, doc_ids=ids)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = masked_attention(q, k, v, dense_document_mask(ids, ids, 0, window), 0.0)
    ref.backward(torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(2)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-10, (name, cp, window)


@pytest.mark.parametrize("q_start, window", [(0, 0), (0, 5), (16, 0), (16, 7)])
def test_flex_block_mask_equals_the_dense_mask(q_start, window):
    """The CUDA kernel's block mask (its forward runs on the CPU, eagerly) gives the dense mask's
    attention: the whole sequence, and a chunk of queries over a key prefix (context parallelism)."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([document_ids(packed_row(LENGTHS, seed=s)[0], EOS)[0] for s in (0, 1)])
    q_ids, k_ids = ids[:, q_start:q_start + 16], ids[:, :q_start + 16]
    q = torch.randn(2, 4, q_ids.shape[1], 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(2, 2, k_ids.shape[1], 8, dtype=torch.float64, generator=gen) for _ in range(2))
    block = flex_document_mask(q_ids, k_ids, q_start, window)
    dense = dense_document_mask(q_ids, k_ids, q_start, window)
    assert torch.equal(block.to_dense().bool().any(), torch.tensor(True))
    got = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    want = masked_attention(q, k, v, dense, 0.0)
    assert (got - want).abs().max().item() < 1e-10


def test_the_kernel_choice():
    assert document_kernel("cpu") == "sdpa"
    assert document_kernel("cuda", dropout_p=0.1) == "sdpa"  # FlexAttention has no dropout


@pytest.mark.parametrize("bad, message", [
    ({"data.document_positions": "restart"}, "applies to data.attention = 'document' only"),
    ({"data.attention": "documents"}, "is not one of 'causal', 'document'"),
    ({"data.attention": "document", "model.mla.kv_lora_rank": 32}, r"not supported with model.mla.kv_lora_rank = 32"),
    ({"data.attention": "document", "model.mtp_depth": 1}, r"not supported with model.mtp_depth = 1"),
])
def test_config_errors(bad, message):
    from lmforge.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config("tiny", bad)


def test_a_corpus_without_document_boundaries_is_refused(small_data):
    """Before any model is built: a tokenizer without an end-of-document token, or a single document."""
    from lmforge.config import ConfigError
    from lmforge.data.shards import TokenShards
    from lmforge.train.components import document_attention

    cfg = load_config("tiny", {"data.attention": "document"})
    shards = TokenShards(small_data.train_dir)
    assert document_attention(cfg, small_data.tokenizer.eos_id, shards).eos_id == small_data.tokenizer.eos_id
    with pytest.raises(ConfigError, match="no end-of-document token"):
        document_attention(cfg, None, shards)
    shards.manifest = {**shards.manifest, "meta": {**shards.manifest["meta"], "documents": 1}}
    with pytest.raises(ConfigError, match="single document"):
        document_attention(cfg, small_data.tokenizer.eos_id, shards)
    assert document_attention(load_config("tiny"), None, shards) is None


def test_lmforge_eval_perplexity_attends_within_documents_for_a_document_masked_run():
    """`lmforge eval`'s sliding-window perplexity of a run trained with data.attention = "document"
    (lmforge.cli.eval.run_documents) masks as training did: one window over a packed stream gives
    the masked forward's NLL, not the causal one."""
    from lmforge.cli.eval import run_documents
    from lmforge.eval.perplexity import sliding_window_nll
    from lmforge.model.loss import model_nll_sum

    model = build_model(ModelConfig(**VARIANTS["llama"]), seed=0)
    stream = packed_row(LENGTHS)[0][0]
    x, y = stream[None, :-1], stream[None, 1:]

    class Tok:
        eos_id = EOS

    docs = run_documents(load_config("tiny", {"data.attention": "document"}), Tok())
    assert run_documents(load_config("tiny"), Tok()) is None
    masked, n = sliding_window_nll(model, stream, len(stream) - 1, len(stream) - 1, documents=docs)
    causal, _ = sliding_window_nll(model, stream, len(stream) - 1, len(stream) - 1)
    with torch.no_grad():
        want = model_nll_sum(model, x, y, **docs.inputs(x)).item()
    assert n == len(stream) - 1 and abs(masked - want) < 1e-4 and abs(causal - want) > 1e-2
