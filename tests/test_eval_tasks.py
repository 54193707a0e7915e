"""Multiple-choice scoring, and `lmforge eval` end to end, on a tiny model trained for a few
seconds on a repetitive text (so the right answers are known)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lmforge.eval.tasks import continuation_logprobs, encode_pair, evaluate_mc, load_mc_items
from tests.tiny_lm import TEXT, train_tiny, write_run

ITEMS = [
    {"context": "the cat sat on the", "choices": [" mat.", " park.", " tree."], "label": 0},
    {"context": "the dog ran to the", "choices": [" mat.", " park.", " tree."], "label": 1},
    {"query": "a bird sang in the", "choices": [" mat.", " park.", " tree."], "gold": 2},
    {"context": "the cat sat on the mat. the dog", "choices": [" sang in the tree.", " ran to the park."],
     "label": 1},
]


@pytest.fixture(scope="module")
def trained():
    return train_tiny()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_continuation_logprob_equals_hand_computation(trained):
    tok, model = trained
    ctx, cont = encode_pair(tok, "the cat sat on the", " mat.")
    (lp, greedy), = continuation_logprobs(model, [(ctx, cont)])
    with torch.no_grad():
        logp = model(torch.tensor([ctx + cont[:-1]]))[0].double().log_softmax(-1)
    by_hand = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert abs(lp - by_hand) < 1e-4
    # `greedy`: every continuation token is the argmax at its position, computed by hand (not what
    # the trained model happens to prefer, which depends on the machine)
    assert greedy == all(int(logp[len(ctx) - 1 + i].argmax()) == t for i, t in enumerate(cont))
    ctx2, cont2 = encode_pair(tok, "the cat sat on the", " tree.")
    (lp2, greedy2), = continuation_logprobs(model, [(ctx2, cont2)])
    with torch.no_grad():
        logp2 = model(torch.tensor([ctx2 + cont2[:-1]]))[0].double().log_softmax(-1)
    assert abs(lp2 - sum(float(logp2[len(ctx2) - 1 + i, t]) for i, t in enumerate(cont2))) < 1e-4
    assert greedy2 == all(int(logp2[len(ctx2) - 1 + i].argmax()) == t for i, t in enumerate(cont2))
    assert not (greedy and greedy2)  # two different continuations cannot both be the greedy one


def test_batching_and_padding_do_not_change_scores(trained):
    tok, model = trained
    reqs = [encode_pair(tok, it.get("context", it.get("query")), c) for it in ITEMS for c in it["choices"]]
    one = continuation_logprobs(model, reqs, batch_size=1)
    many = continuation_logprobs(model, reqs, batch_size=5)
    assert all(abs(a[0] - b[0]) < 1e-4 and a[1] == b[1] for a, b in zip(one, many))


def hand_scored(model, tok, rows) -> dict[str, float]:
    """acc / acc_norm of `rows` from log-probabilities summed by hand from the model's full-sequence
    logits (not through continuation_logprobs or score_mc): the expected value of evaluate_mc for
    whatever this model happens to prefer."""
    right = right_norm = 0
    for row in rows:
        context, label = row.get("context", row.get("query")), row.get("label", row.get("gold"))
        lps = []
        for choice in row["choices"]:
            ctx, cont = encode_pair(tok, context, choice)
            with torch.no_grad():
                logp = model(torch.tensor([ctx + cont[:-1]]))[0].double().log_softmax(-1)
            lps.append(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
        norm = [lp / len(c.encode("utf-8")) for lp, c in zip(lps, row["choices"])]
        right += int(int(np.argmax(lps)) == label)
        right_norm += int(int(np.argmax(norm)) == label)
    return {"acc": right / len(rows), "acc_norm": right_norm / len(rows), "n": len(rows)}


def test_multiple_choice_scores_what_the_model_prefers(trained, tmp_path):
    """evaluate_mc against a hand computation of the same model's choices, for the items and for
    every rotation of their labels (so each item is scored right under one labelling and wrong
    under the others: the three accuracies sum to the item count). Nothing here depends on what the
    model learned (it once asserted 1.0, which a machine's rounding could break)."""
    tok, model = trained
    items = load_mc_items(_write_jsonl(tmp_path / "mc.jsonl", ITEMS))
    assert items[2].label == 2 and items[2].context == "a bird sang in the"  # query/gold spelling
    three = [it for it in ITEMS if len(it["choices"]) == 3]
    accs = []
    for shift in range(3):
        rows = [dict(it, label=(it.get("label", it.get("gold")) + shift) % 3) for it in three]
        for r in rows:
            r.pop("gold", None)
            r.setdefault("context", r.pop("query", None))
        result = evaluate_mc(model, tok, load_mc_items(_write_jsonl(tmp_path / f"s{shift}.jsonl", rows)))
        want = hand_scored(model, tok, rows)
        assert result["n"] == want["n"] == 3
        assert result["acc"] == pytest.approx(want["acc"]) and result["acc_norm"] == pytest.approx(want["acc_norm"])
        accs.append(result["acc"])
    assert sum(accs) == pytest.approx(1.0)  # each item right under exactly one labelling
    assert evaluate_mc(model, tok, items) == pytest.approx(hand_scored(model, tok, ITEMS))


def test_multiple_choice_file_errors(tmp_path):
    with pytest.raises(ValueError, match=r"mc.jsonl:1: missing key 'label' or 'gold'"):
        load_mc_items(_write_jsonl(tmp_path / "mc.jsonl", [{"context": "a", "choices": ["b", "c"]}]))
    with pytest.raises(ValueError, match="'label' = 5 must be an index"):
        load_mc_items(_write_jsonl(tmp_path / "mc.jsonl", [{"context": "a", "choices": ["b", "c"], "label": 5}]))


def test_eval_command_end_to_end(trained, tmp_path, capsys):
    from lmforge.cli import main
    from lmforge.data.shards import write_token_shards
    from lmforge.eval.generate import generate_text

    tok, model = trained
    run = write_run(tmp_path / "run", model, tok)
    reference = generate_text(model, tok, "the dog", 20, stop=["\n"], temperature=0.0).strip()
    bleu = _write_jsonl(tmp_path / "bleu.jsonl", [{"prompt": "the dog", "reference": reference}])
    mc = _write_jsonl(tmp_path / "mc.jsonl", ITEMS)
    ids = np.asarray(tok.encode(TEXT[:300]), dtype=np.int64)
    write_token_shards([ids], tmp_path / "shards", 1000, 320, {})
    out = tmp_path / "res.json"
    argv = ["eval", "--ckpt", str(run), "--data", str(tmp_path / "shards"), "--window", "32", "--stride", "16",
            "--bleu", str(bleu), "--max-new-tokens", "20", "--mc", str(mc), "--samples", "2",
            "--sample-tokens", "30", "--json", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert "perplexity" in table and "BLEU" in table and "acc_norm" in table and "distinct_2" in table
    assert res["bleu"]["bleu"] == pytest.approx(100.0)
    assert res["multiple_choice"][str(mc)]["acc"] == pytest.approx(hand_scored(model, tok, ITEMS)["acc"])
    ppl = res["perplexity"]
    assert ppl["tokens"] == len(ids) - 1 and ppl["perplexity"] == pytest.approx(math.exp(ppl["loss"]))
    assert ppl["perplexity"] < 3.0  # the model learned this text (uniform would be 320)
    assert len(res["samples"]) == 2 and 0.0 <= res["fluency"]["distinct_1"] <= 1.0
    # text perplexity on a text that fits one window equals exp(mean NLL) of one full-context pass
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. a bird sang in the tree.")
    assert main(["eval", "--ckpt", str(run), "--text", str(text), "--samples", "0", "--json", str(out)]) == 0
    t_ids = torch.tensor(tok.encode(text.read_text()))
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(t_ids[None, :-1])[0].double(), t_ids[1:])
    assert json.loads(out.read_text())["perplexity"]["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    # a user error is one line naming the problem, exit status 2
    assert main(["eval", "--ckpt", str(run), "--text", str(tmp_path / "nope.txt")]) == 2
    assert f"--text '{tmp_path / 'nope.txt'}' does not exist." in capsys.readouterr().err


def test_eval_defaults_to_the_runs_validation_shards(trained, tmp_path, monkeypatch, small_data):
    """Without --text/--data, perplexity covers the validation split the run's data config names."""
    from lmforge.data.shards import TokenShards
    from lmforge.cli.eval import EvalOptions, run_eval
    from lmforge.train import components

    tok, model = trained
    run = write_run(tmp_path / "run", model, tok)
    monkeypatch.setattr(components, "prepare_data", lambda cfg: small_data)  # the run's (cached) prepared data
    res = run_eval(EvalOptions(ckpt=str(run), samples=0, max_tokens=500, window=64, stride=64))
    assert res["perplexity"]["source"] == str(small_data.val_dir)
    assert res["perplexity"]["tokens"] == min(500, len(TokenShards(small_data.val_dir))) - 1
    monkeypatch.setattr(components, "prepare_data", lambda cfg: (_ for _ in ()).throw(OSError("no network")))
    with pytest.raises(ValueError, match="could not open the run's validation data .*no network.*--data"):
        run_eval(EvalOptions(ckpt=str(run), samples=0))


def test_score_mc_normalises_by_bytes():
    """acc takes the highest summed log-probability, acc_norm the highest per byte of the choice."""
    from lmforge.eval.tasks import MCItem, score_mc

    items = [MCItem(context="x", choices=[" a", " a much longer answer"], label=1)]
    # raw: -2 (2 bytes) beats -8 (21 bytes); per byte: -8/21 = -0.38 beats -2/2 = -1
    assert score_mc(items, [-2.0, -8.0]) == {"acc": 0.0, "acc_norm": 1.0, "n": 1}
    assert score_mc(items, [-9.0, -8.0]) == {"acc": 1.0, "acc_norm": 1.0, "n": 1}
