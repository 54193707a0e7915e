"""FP8 under FSDP2 with its FP8 all-gather (train.fp8_all_gather; the conversion itself: lmforge.model.fp8):
each weight's scale precomputed after every optimizer step, a concern joined to the loop by its event."""

from __future__ import annotations

from lmforge.config import Config
from lmforge.config.rules import fp8_all_gather
from lmforge.train.events import Handler


def fp8_handlers(cfg: Config) -> list[Handler]:
    """The FP8 handlers `cfg` asks for (the trainer's built-in ones: lmforge.train.trainer)."""
    return [Fp8ScalesForFsdp()] if fp8_all_gather(cfg) else []


class Fp8ScalesForFsdp(Handler):
    """After each optimizer step, every FSDP2-sharded FP8 weight's scale in one all-reduce (torchao's
    precompute_float8_dynamic_scale_for_fsdp), so the next forward's FP8 all-gathers need none; every
    rank calls it at the same event (lmforge.train.events' contract)."""

    def update_end(self, trainer, step: int) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(trainer.model)
