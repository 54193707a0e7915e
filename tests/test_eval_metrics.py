"""Perplexity (full context and sliding window), BLEU/chrF and fluency metrics, each against an
independent hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.eval.bleu import bleu_chrf, hypothesis, load_bleu_items
from lmforge.eval.fluency import distinct_n, fluency_report, repetition_rate
from lmforge.eval.perplexity import sliding_window_nll
from lmforge.model.transformer import build_model

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=64, init_std=0.2)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(**CFG), seed=0).eval()


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n))


def _nll_by_hand(model, context: torch.Tensor, target: int) -> float:
    """-log p(target | context) from the model's logits of the last context position."""
    with torch.no_grad():
        logits = model(context[None])[0, -1].double()
    return float(-(logits[target] - torch.logsumexp(logits, 0)))


def test_perplexity_is_exp_of_mean_token_nll_when_the_text_fits(model):
    tokens = _tokens(40)
    nll, count = sliding_window_nll(model, tokens, window=64, stride=32)
    by_hand = [_nll_by_hand(model, tokens[:j], int(tokens[j])) for j in range(1, 40)]
    assert count == 39
    assert abs(nll - sum(by_hand)) < 1e-3
    assert abs(math.exp(nll / count) - math.exp(sum(by_hand) / 39)) < 1e-3 * math.exp(nll / count)


@pytest.mark.parametrize("loss_chunk", [0, 5], ids=["logits", "chunked"])
@pytest.mark.parametrize("window,stride", [(8, 1), (8, 3), (8, 8)])
def test_sliding_window_scores_each_token_once_with_its_window_context(model, window, stride, loss_chunk):
    """Each target is scored once, by the first window that reaches it, from that window's
    tokens only: recomputed here one target (one forward pass) at a time. With `loss_chunk` (what
    `lmforge eval` passes for vocabularies of 8192 and more) the model's chunked loss scores them,
    a few tokens at a time, ignored targets included."""
    tokens = _tokens(30)
    nll, count = sliding_window_nll(model, tokens, window, stride, batch_size=3, loss_chunk=loss_chunk)
    expected, scored, begin = 0.0, 0, 0
    while scored < 29:
        end = min(begin + window, 29)
        for j in range(scored + 1, end + 1):
            expected += _nll_by_hand(model, tokens[begin:j], int(tokens[j]))
        scored, begin = end, begin + stride
    assert count == 29
    assert abs(nll - expected) < 1e-3
    if stride == 1:  # every token after the first window sees exactly `window` tokens of context
        last = _nll_by_hand(model, tokens[29 - window:29], int(tokens[29]))
        full = _nll_by_hand(model, tokens[:29], int(tokens[29]))
        assert abs(last - full) > 1e-4  # and that context differs from the full prefix


def test_sliding_window_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="stride"):
        sliding_window_nll(model, _tokens(10), window=4, stride=5)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sliding_window_nll(model, _tokens(1), window=4, stride=2)


def test_bleu_and_chrf():
    same = bleu_chrf(["the cat sat on the mat"], [["the cat sat on the mat"]])
    assert same["bleu"] == pytest.approx(100.0) and same["chrf"] == pytest.approx(100.0)
    other = bleu_chrf(["the cat sat on the mat"], [["a dog ran in the big park"]])
    assert other["bleu"] < 10 and other["chrf"] < 40
    # a second reference that matches lifts the score to 100
    two = bleu_chrf(["the cat sat on the mat"], [["a dog ran in the big park", "the cat sat on the mat"]])
    assert two["bleu"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="2 hypotheses but 1"):
        bleu_chrf(["a", "b"], [["a"]])


def test_a_generation_answered_on_the_next_line_is_scored_not_emptied():
    """`lmforge eval --bleu` with the README's `ROMEO:` prompts printed BLEU 0.0 and chrF 0.0: the
    greedy text begins with a newline and was cut there, leaving every hypothesis empty."""
    generated = "\nBut soft, what light\nthrough yonder window"
    assert hypothesis(generated, "\n") == "But soft, what light"
    assert hypothesis(generated, "") == hypothesis(generated, None) == "But soft, what light\nthrough yonder window"
    assert hypothesis("  ran to the park. The", ".") == "ran to the park"
    assert hypothesis("\n\n", "\n") == ""
    scores = bleu_chrf([hypothesis(generated, "\n")], [["But soft, what light"]])
    assert scores["bleu"] == pytest.approx(100.0) and scores["chrf"] == pytest.approx(100.0)


def test_bleu_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "reference": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl:2: missing key 'reference' or 'references'"):
        load_bleu_items(path)
    path.write_text('{"prompt": "a", "reference": "b"}\n\n{"prompt": "c", "reference": "d",}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl:3: invalid JSON"):
        load_bleu_items(path)
    path.write_text('{"prompt": "a", "references": ["b", ""]}\n')
    with pytest.raises(ValueError, match="item 1: 'reference' must be a non-empty string"):
        load_bleu_items(path)


def test_bleu_with_a_varying_number_of_references_per_item(tmp_path):
    """Items with 1, 3 and 2 references (was refused): sacrebleu's padding, so an item's score uses
    exactly its own references. Check: padding an item's list with copies of its own references
    changes nothing, while padding it with a reference that matches changes the score."""
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p1", "reference": "the cat sat on a mat"}\n'
                    '{"prompt": "p2", "references": ["a dog ran in a park", "the dog ran in the big park", "x"]}\n'
                    '{"prompt": "p3", "references": ["birds sang in the old tree", "a bird sang"]}\n')
    prompts, refs = load_bleu_items(path)
    assert prompts == ["p1", "p2", "p3"] and [len(r) for r in refs] == [1, 3, 2]
    hyps = ["the cat sat on the mat today", "a dog ran in the big park", "a bird sang in the tree"]
    varying = bleu_chrf(hyps, refs)
    padded = bleu_chrf(hyps, [r + [r[0]] * (3 - len(r)) for r in refs])  # the same references, repeated
    assert varying == pytest.approx(padded) and 0 < varying["bleu"] < 100 and varying["n"] == 3
    lifted = bleu_chrf(hyps, [refs[0] + [hyps[0]], refs[1], refs[2]])  # item 1 gains an exact reference
    assert lifted["bleu"] > varying["bleu"] + 1
    with pytest.raises(ValueError, match="no items"):
        bleu_chrf([], [])


def test_fluency_metrics_by_hand():
    texts = ["a b a b a", "c d e"]
    # words a b a b a c d e: 5 distinct of 8; bigrams ab ba ab ba cd de: 4 of 6; trigrams aba bab aba cde: 3 of 4
    assert distinct_n(texts, 1) == pytest.approx(5 / 8)
    assert distinct_n(texts, 2) == pytest.approx(4 / 6)
    assert distinct_n(texts, 3) == pytest.approx(3 / 4)
    # bigrams per text: ab ba ab ba -> 1 - 2/4 = 0.5; cd de -> 0; mean 0.25
    assert repetition_rate(texts, 2) == pytest.approx(0.25)
    assert repetition_rate(["x y"], 4) == 0.0  # no 4-gram: nothing to repeat
    report = fluency_report(["go go go go go go"])
    assert report["repetition_rate_4gram"] == pytest.approx(1 - 1 / 3)
    assert report["distinct_1"] == pytest.approx(1 / 6) and report["mean_words"] == 6


def test_kv_cache_in_chunks_equals_one_full_pass(model):
    """Prefill, then several tokens at once, then one: the logits of every position equal those of
    one full forward pass (the chunk after a cache needs an offset causal mask)."""
    from lmforge.model.layers import KVCache

    tokens = _tokens(12)[None]
    with torch.no_grad():
        full = model(tokens)
        caches = [KVCache() for _ in range(model.cfg.n_layers)]
        parts = [model(tokens[:, a:b], caches) for a, b in ((0, 5), (5, 11), (11, 12))]
    assert (torch.cat(parts, 1) - full).abs().max() < 1e-5


def test_eval_command_scores_a_large_vocabulary_with_the_chunked_loss(tmp_path, monkeypatch):
    """`lmforge eval` on a run whose vocabulary is 8192 or more computes the perplexity with the chunked
    loss (4096 tokens at a time: no [batch, window, vocab] logits), with the plain logits' result."""
    from safetensors.torch import save_file

    import lmforge.cli.eval as cli_eval
    import lmforge.eval.perplexity as perplexity
    from lmforge.config import load_config, to_toml
    from lmforge.folders import CONFIG, WEIGHTS

    cfg = load_config("tiny", {"model.vocab_size": 8192, "model.dim": 32, "model.n_layers": 1, "model.n_heads": 4,
                               "model.max_seq_len": 64, "data.seq_len": 64, "model.tie_embeddings": False})
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG).write_text(to_toml(cfg))
    save_file(build_model(cfg.model, seed=0).state_dict(), str(run / WEIGHTS))
    tokens = torch.randint(0, 8192, (300,), generator=torch.Generator().manual_seed(0)).numpy()
    monkeypatch.setattr(cli_eval, "_stream_tokens", lambda opts, cfg, tok: ("given tokens", tokens))
    calls = []
    real = perplexity.sliding_window_nll
    monkeypatch.setattr(perplexity, "sliding_window_nll", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    res = cli_eval.run_eval(cli_eval.EvalOptions(ckpt=str(run), samples=0, window=64, stride=32))
    assert [kw["loss_chunk"] for kw in calls] == [4096]
    model = build_model(cfg.model, seed=0).eval()
    plain, count = real(model, tokens, 64, 32)
    assert res["perplexity"]["tokens"] == count == 299
    assert res["perplexity"]["loss"] == pytest.approx(plain / count, rel=1e-6)
