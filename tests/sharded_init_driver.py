"""Each rank materialises only its part of the model; put together, the parts are one process's model.

    [torchrun --nproc-per-node N] tests/sharded_init_driver.py CORPUS CASES_JSON

CASES_JSON maps a case name to config overrides (on the "tiny" preset with data.corpus = CORPUS).
For each case every rank builds the model on the meta device and parallelizes it, which
materialises its own part (lmforge.parallel.parallelize); then rank 0 receives the whole weights
tensor by tensor (`layout.full_weights()`) and compares them bitwise with the model one process
builds (`build_model`, or with finetune.init_from the same model given the pre-trained weights
through `load_pretrained`, LoRA adapters included). Every rank also checks that the bytes of its
local parameters are its share: at most the whole model's / the number of ranks that split it,
plus what the layout keeps whole (norm weights under TP without sequence parallelism). Prints one
"<case>: ok" line per case on rank 0; any difference raises.
"""

from __future__ import annotations

import json
import sys

import torch

from lmforge.cli import exit_now


def main(corpus: str, cases: dict) -> int:
    from lmforge.config import load_config
    from lmforge.model.lora import apply_lora
    from lmforge.model.transformer import build_model
    from lmforge.parallel.mesh import destroy_distributed, init_distributed
    from lmforge.parallel.parallelize import parallelize
    from lmforge.train.components import build_training_model
    from lmforge.train.finetune import load_pretrained

    for case, overrides in cases.items():
        cfg = load_config("tiny", {"data.corpus": corpus, **overrides})
        info = init_distributed(cfg)
        model, source = build_training_model(cfg, info.device)
        whole = sum(p.numel() for p in model.parameters())
        layout = parallelize(model, cfg, info, "fp32", source)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in layout.model.parameters())
        p = cfg.parallel  # ranks that split the parameters: TP x PP x FSDP2's shard degree (ZeRO-1, DDP: whole)
        fsdp = p.fsdp or ((p.tp > 1 or p.pp > 1) and p.dp * p.cp > 1)
        split = p.tp * p.pp * (p.dp_shard * p.cp if fsdp else 1)
        assert local <= whole / split * 1.1 + 4 * cfg.model.dim * cfg.model.n_layers, \
            (case, info.rank, local, whole, split)
        got = dict(layout.full_weights())
        if info.rank == 0:
            want = build_model(cfg.model, seed=cfg.train.seed)
            if cfg.finetune.init_from:
                load_pretrained(want, cfg.finetune.init_from)
            if cfg.finetune.lora_rank:
                apply_lora(want, cfg.finetune.lora_targets, cfg.finetune.lora_rank, cfg.finetune.lora_alpha,
                           seed=cfg.train.seed)
            expected = {n: p.detach() for n, p in want.named_parameters()}
            assert got.keys() == expected.keys(), (case, sorted(got.keys() ^ expected.keys()))
            for name, tensor in expected.items():
                assert torch.equal(got[name], tensor), f"{case}: {name} differs from one process's"
            print(f"{case}: ok ({len(got)} tensors, rank 0 holds {local:,} of {whole:,} parameters)", flush=True)
        if info.distributed:
            torch.distributed.barrier()
    if torch.distributed.is_initialized():
        destroy_distributed()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1], json.loads(sys.argv[2])))
