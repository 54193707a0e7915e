"""The training loop (`Trainer`) and what it is built from; `trainer_for(cfg)` picks the loop."""

from __future__ import annotations


def trainer_for(cfg, **kwargs):
    """The trainer that runs `cfg`: the synchronous `Trainer`, or `AsyncSGDTrainer` for
    parallel.async_sgd (a loop of its own around a parameter server)."""
    if cfg.parallel.async_sgd:
        from lmforge.train.async_sgd import AsyncSGDTrainer

        return AsyncSGDTrainer(cfg, **kwargs)
    from lmforge.train.trainer import Trainer

    return Trainer(cfg, **kwargs)
