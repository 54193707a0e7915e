"""The training objective's normalisation (lmforge.model.loss), in one process and in milliseconds.

The parity tests compare a layout with one process, so a normalisation that is wrong the same way on
both sides passes them; these pin the one-process step to torch's own mean cross-entropy instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge.config import load_config
from lmforge.model.loss import IGNORE_INDEX, count_targets, normalise, token_nll_sum


def test_count_and_normalise_score_only_the_targets_that_are_not_ignored():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    targets[0, :2] = targets[2, 4] = IGNORE_INDEX
    assert int(count_targets(targets)) == int(count_targets([targets[:1], targets[1:]])) == 12
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)  # mean over scored
    nll = token_nll_sum(logits, targets)
    torch.testing.assert_close(normalise(nll, count_targets(targets)), want, rtol=1e-6, atol=0)
    # x dp against DDP / FSDP's averaging of the gradients over dp ranks
    torch.testing.assert_close(normalise(nll, count_targets(targets), 4), 4 * want, rtol=1e-6, atol=0)


def test_a_steps_loss_and_gradient_are_one_big_batchs_mean_over_its_scored_targets():
    """Two micro-batches holding unequal numbers of scored targets (as document masking makes them):
    the one-process layout's step loss and accumulated gradients equal those of the mean token
    cross-entropy over the whole step's scored targets, not a mean of per-micro-batch means and not
    a division by every position."""
    from lmforge.model.transformer import Transformer
    from lmforge.parallel.layout import Layout
    from lmforge.parallel.mesh import DistInfo
    from lmforge.train.precision import make_precision

    cfg = load_config("tiny", {"model.vocab_size": 320, "model.dim": 32, "model.n_layers": 1, "model.n_heads": 2,
                               "model.max_seq_len": 16, "data.seq_len": 16, "data.tokenizer_vocab_size": 320,
                               "train.precision": "fp32"})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    x = torch.randint(0, 320, (4, 16))
    y = torch.randint(0, 320, (4, 16))
    y[0, :12] = y[1, 3:9] = y[3, -1] = IGNORE_INDEX  # micro-batch 1 (rows 0-1): 14 scored; 2 (rows 2-3): 31
    layout = Layout(model, cfg, DistInfo(), "fp32")
    loss = layout.forward_backward([(x[:2], y[:2]), (x[2:], y[2:])], make_precision("fp32", torch.device("cpu")))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-7, msg=n)
