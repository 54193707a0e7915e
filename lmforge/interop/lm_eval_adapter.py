"""An lmforge run as a model of EleutherAI's lm-evaluation-harness (`lm_eval`).

:class:`LMForgeLM` implements the harness's ``LM`` interface -- ``loglikelihood``,
``loglikelihood_rolling`` and ``generate_until`` -- over an lmforge run folder. It does not need
``lm_eval`` itself: each request may be a harness ``Instance`` (its ``.args``) or a plain tuple,
so the scoring is usable and tested without the harness. ``harness_model(ckpt)`` imports
``lm_eval`` (lazily; it is an optional dependency) and returns an instance of a subclass of the
harness's ``LM``, registered under the name ``lmforge``, e.g.::

    import lm_eval
    from lmforge.interop.lm_eval_adapter import harness_model
    lm_eval.simple_evaluate(model=harness_model("runs/tiny"), tasks=["hellaswag"])

Log-likelihoods use the same code as ``lmforge eval``: continuations are scored after their
context (cut from the left to the model's context), rolling log-likelihoods over disjoint windows
of ``max_seq_len`` tokens after an end-of-text token, generation is greedy unless the request
asks for sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.folders import TOKENIZER


def _args(request: Any) -> tuple:
    """The arguments of a harness request: `Instance.args`, or the request itself as a tuple."""
    return tuple(request.args) if hasattr(request, "args") else tuple(request)


class LMForgeLM:
    """lm-evaluation-harness's LM interface over an lmforge run folder (or a loaded model + tokenizer)."""

    def __init__(self, ckpt: str | Path | None = None, device: str = "cpu", batch_size: int | str = 8,
                 max_gen_toks: int = 256, model=None, tokenizer=None, seed: int = 1234) -> None:
        super().__init__()  # the harness's LM.__init__ when mixed in by `harness_model`
        if model is None:
            from lmforge.ckpt.export import load_run
            from lmforge.data.tokenizer import Tokenizer

            if ckpt is None:
                raise ValueError("LMForgeLM needs ckpt= (a run folder) or model= and tokenizer=.")
            _, model = load_run(ckpt, device)
            tokenizer = Tokenizer.load(Path(ckpt) / TOKENIZER)
        if tokenizer is None:
            raise ValueError("LMForgeLM needs the run's tokenizer (tokenizer.json in the run folder).")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" -> 8
        self.max_gen_toks, self.seed = max_gen_toks, seed

    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is greedy) per (context, continuation) request."""
        from lmforge.eval.tasks import continuation_logprobs, encode_pair

        pairs = [encode_pair(self.tokenizer, *_args(r)[:2]) for r in requests]
        return continuation_logprobs(self.model, pairs, self.batch_size)

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        """log p(text) per (text,) request: every token of the text is scored, the first after an
        end-of-text token, over disjoint windows of max_seq_len tokens."""
        from lmforge.eval.perplexity import sliding_window_nll

        window = self.model.cfg.max_seq_len
        device = next(self.model.parameters()).device
        out = []
        for r in requests:
            ids = [self.tokenizer.eos_id] + self.tokenizer.encode(_args(r)[0])
            if len(ids) < 2:
                out.append(0.0)  # the empty text has probability 1
                continue
            nll, _ = sliding_window_nll(self.model, ids, window, window, self.batch_size, device)
            out.append(-nll)
        return out

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        """The continuation of each (context, gen_kwargs) request, cut before the first `until`
        string; gen_kwargs: until (str or list), max_gen_toks, do_sample, temperature, top_k, top_p."""
        from lmforge.eval.generate import generate_text

        outs = []
        for i, r in enumerate(requests):
            args = _args(r)
            context, kwargs = args[0], dict(args[1]) if len(args) > 1 and args[1] else {}
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sample = bool(kwargs.get("do_sample", False))
            temperature = float(kwargs.get("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            outs.append(generate_text(
                self.model, self.tokenizer, context, int(kwargs.get("max_gen_toks", self.max_gen_toks)), stop=until,
                temperature=temperature, top_k=int(kwargs.get("top_k", 0)), top_p=float(kwargs.get("top_p", 1.0)),
                seed=self.seed + i))
        return outs


def harness_model(ckpt: str | Path, **kwargs) -> Any:
    """An LMForgeLM that is also an `lm_eval.api.model.LM` (registered as "lmforge"), for
    `lm_eval.simple_evaluate(model=...)`. Needs `pip install lm-eval`."""
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError as exc:
        raise ValueError("the lm-evaluation-harness is not installed: pip install lm-eval "
                         "(LMForgeLM's methods work without it on plain request tuples).") from exc

    class HarnessLM(LMForgeLM, LM):
        """LMForgeLM's methods under the harness's base class."""

    try:
        register_model("lmforge")(HarnessLM)
    except (AssertionError, ValueError):  # already registered by an earlier call
        pass
    return HarnessLM(ckpt, **kwargs)
