"""Model families on a device: two-layer Llama-3.1 (RoPE scaling), Qwen2.5 (q/k/v biases) and Qwen3
(QK-norm) shapes, and the 2026 families (issue 57): Qwen3-Next's hybrid (four layers: three Gated DeltaNet,
one gated full attention with partial RoPE), Gemma 3 (sandwich norms, scaled embeddings, a sliding and a
global layer) and OLMo 3 (norms after attention and MLP, a sliding and a full layer) train N steps and
validate with the chunked loss at a vocabulary of 8192, which is checked against the plain loss over the
same validation batches.

    python benchmarks/family_shapes.py --device cuda --precision bf16 [--steps 20] [--json out.json]
    python benchmarks/family_shapes.py --device cpu --precision fp32 --steps 4 --small    # CPU smoke
    python benchmarks/family_shapes.py --prepare-only   # prepare the data it trains on (into LMFORGE_CACHE)

Each family is its preset (llama3.1-8b, qwen2.5-7b, qwen3-8b, tiny-hybrid, gemma3-1b, olmo3-7b) with its own
options kept and the size cut: 2 layers (the hybrid 4: its 3:1 pattern), width 256, 4 query heads over 2
key/value heads, MLP 512, vocabulary 8192 (a byte-level BPE of that size trained on the default corpus);
the sliding layers' window is 32 tokens, so it masks at every sequence length the script uses. They train with the real `Trainer` (compile off),
20 steps by default, with `train.loss_chunk = auto` (4096-token chunks at this vocabulary on CUDA, so a
16 x 512-token micro-batch is two chunks). A family passes when the option it stands for is in the
built model, the validation loss fell, and the chunked validation loss (the trainer's own) equals the
plain logits' loss to the stated tolerance. Exit status 1 when any family fails.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from lmforge.config import load_config  # noqa: E402
from lmforge.train.trainer import Trainer  # noqa: E402

VOCAB = 8192  # the vocabulary at which train.loss_chunk = auto turns the chunked loss on
DATA = {"data.corpus": "default", "data.tokenizer": "bpe", "data.tokenizer_vocab_size": VOCAB,
        "data.val_fraction": 0.02, "model.vocab_size": VOCAB}
SHAPE = {"model.n_layers": 2, "model.dim": 256, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_hidden": 512}
# |chunked - plain| validation loss, nats: the same logits, cast and reduced in another order
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


def has_rope_scaling(trainer: Trainer) -> bool:
    return trainer.cfg.model.rope_scaling == "llama3"


def has_qkv_bias(trainer: Trainer) -> bool:
    return any(n.endswith(("wqkv.bias", "wq.bias")) for n, _ in trainer.model.named_parameters())


def has_qk_norm(trainer: Trainer) -> bool:
    return any("q_norm" in n for n, _ in trainer.model.named_parameters())


def has_deltanet_and_gate(trainer: Trainer) -> bool:
    from lmforge.model.gated_deltanet import GatedDeltaNet

    m = trainer.cfg.model
    return any(isinstance(mod, GatedDeltaNet) for mod in trainer.model.modules()) and m.attn_gate and m.rope_fraction < 1


def has_sandwich_norms_and_sliding(trainer: Trainer) -> bool:
    m = trainer.cfg.model
    return m.norm_placement == "sandwich" and m.embed_scale and "sliding_attention" in m.layer_types


def has_post_norms_and_sliding(trainer: Trainer) -> bool:
    m = trainer.cfg.model
    return m.norm_placement == "post" and m.qk_norm and "sliding_attention" in m.layer_types


LOCAL_GLOBAL = {"model.layer_types": ["sliding_attention", "full_attention"], "model.sliding_window": 32}
FAMILIES = {  # name -> (preset, the option it stands for, how to see it in the built model, the family's own cut)
    "llama3.1": ("llama3.1-8b", "RoPE scaling (llama3)", has_rope_scaling, {}),
    "qwen2.5": ("qwen2.5-7b", "q/k/v biases", has_qkv_bias, {}),
    "qwen3": ("qwen3-8b", "QK-norm", has_qk_norm, {}),
    "qwen3-next": ("tiny-hybrid", "Gated DeltaNet + gated attention", has_deltanet_and_gate, {"model.n_layers": 4}),
    "gemma3": ("gemma3-1b", "sandwich norms, local/global", has_sandwich_norms_and_sliding,
               {**LOCAL_GLOBAL, "model.attn_head_dim": 64}),
    "olmo3": ("olmo3-7b", "post-norms, local/global", has_post_norms_and_sliding, LOCAL_GLOBAL),
}


def overrides(args: argparse.Namespace, own: dict | None = None) -> dict:
    run = {"train.steps": args.steps, "train.device": args.device, "train.precision": args.precision,
           "train.compile": False, "train.loss_chunk": "auto", "train.eval_every": 0, "train.sample_tokens": 0,
           "train.log_every": max(args.steps // 4, 1), "train.plot": False, "train.progress": "none",
           "train.tensorboard": False, "train.activation_checkpoint": "none", "checkpoint.every_steps": 0,
           "checkpoint.every_minutes": 0.0, "checkpoint.save_final": False, "schedule.warmup_steps": 2,
           "optim.lr": 3e-3, "data.seq_len": 512, "train.micro_batch_size": 16, "train.global_batch_size": 32,
           "train.eval_sequences": 64}
    if args.small:  # (the CPU smoke: 4 x 64-token micro-batches; 128-token chunks, so still two a micro-batch)
        run.update({"data.seq_len": 64, "train.micro_batch_size": 4, "train.global_batch_size": 8,
                    "train.eval_sequences": 8, "train.loss_chunk": 128})
    return {**DATA, **SHAPE, **(own or {}), **run}


def one_family(name: str, args: argparse.Namespace, out: Path) -> dict:
    preset, option, present, own = FAMILIES[name]
    trainer = Trainer(load_config(preset, overrides(args, own)), out_dir=out)
    result = trainer.fit()
    chunk = trainer.layout.loss_chunk(trainer.precision)
    plain = trainer.validation.evaluate(trainer.layout.inference_model(), trainer.precision.autocast, trainer.device,
                                       loss_chunk=0)["loss"]
    diff = abs(result.val_loss - plain)
    tol = TOLERANCE.get(args.precision, TOLERANCE["bf16"])
    problems = []
    if not present(trainer):
        problems.append(f"{option} is not in the built model")
    if chunk <= 0:
        problems.append(f"validation did not chunk (train.loss_chunk resolved to {chunk})")
    if not diff <= tol:
        problems.append(f"chunked val loss {result.val_loss:.5f} vs plain {plain:.5f}: |diff| {diff:.2e} > {tol:g}")
    if not (math.isfinite(result.val_loss) and result.val_loss < result.initial_val_loss):
        problems.append(f"val loss did not fall ({result.initial_val_loss:.4f} -> {result.val_loss:.4f})")
    kernel = None  # (the Gated DeltaNet families: which chunked form ran, model.deltanet.kernel)
    if trainer.cfg.model.has_linear_layers:
        from lmforge.model.gated_deltanet import fla_chunked

        kernel = "fla" if (trainer.device.type == "cuda" and trainer.cfg.model.deltanet.kernel != "torch"
                           and fla_chunked() is not None) else "torch"
    return {"family": name, "preset": preset, "option": option, "params": trainer.n_params, "loss_chunk": chunk,
            "deltanet_kernel": kernel,
            "initial_val_loss": result.initial_val_loss, "val_loss": result.val_loss, "plain_val_loss": plain,
            "chunked_vs_plain": diff, "tolerance": tol, "tokens_per_second": result.tokens_per_second,
            "ok": not problems, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small batches, 128-token loss chunks (the CPU smoke)")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--prepare-only", action="store_true", help="prepare the training data (the cache) and exit")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.prepare_only:
        from lmforge.train.components import prepare_data

        print("prepared", prepare_data(load_config("tiny", DATA)))
        return 0
    root = Path(tempfile.mkdtemp(prefix="lmforge-families-"))
    rows = [one_family(name.strip(), args, root / name.strip()) for name in args.families.split(",") if name.strip()]
    shutil.rmtree(root, ignore_errors=True)
    for r in rows:
        print(f"{r['family']:<10} {r['option']:<32} {r['params']:>11,} params; val loss {r['initial_val_loss']:.3f} -> "
              f"{r['val_loss']:.3f} (chunk {r['loss_chunk']}; plain {r['plain_val_loss']:.4f}, |diff| "
              f"{r['chunked_vs_plain']:.1e}); {r['tokens_per_second']:,.0f} tok/s; "
              + ("ok" if r["ok"] else "FAILED: " + "; ".join(r["problems"])))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "precision": args.precision, "steps": args.steps,
                                               "families": rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
