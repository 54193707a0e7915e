"""Hugging Face `transformers` interop: export an lmforge model as a transformers folder, and
import a transformers Llama / GPT-2 folder as an lmforge model. Local files only, no hub.

Layouts (lmforge name -> transformers name):

* Llama (`LlamaForCausalLM`): RMSNorm + SwiGLU + RoPE. `blocks.i.attn.wq` -> `model.layers.i.
  self_attn.q_proj`, `mlp.gate/up/down` -> `mlp.gate_proj/up_proj/down_proj`, norms ->
  `input_layernorm` / `post_attention_layernorm`. RoPE: lmforge's `apply_rope` uses the
  half-split convention (dimension i pairs with i + head_dim/2), which is exactly Hugging Face's
  `rotate_half`, so q/k weights are copied as they are, with no permutation. (Meta's original
  checkpoints use interleaved pairs; they would need the permutation that HF's own conversion
  script applies, which is not needed here.)
* GPT-2 (`GPT2LMHeadModel`): LayerNorm + GELU(tanh) + learned positions. GPT-2's `Conv1D`
  stores weights as (in, out), the transpose of `nn.Linear`, and fuses q/k/v into `c_attn`;
  an lmforge GPT-2 without biases exports zero biases (the same function).

Anything else (e.g. RoPE with LayerNorm, GQA in GPT-2, exact-erf GELU, scaled RoPE) is
rejected with a ValueError that says which setting neither class can represent.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from lmforge.config import Config, ModelConfig, to_toml
from lmforge.folders import (CONFIG, HF_CONFIG, RUN_FILES, TOKENIZER, WEIGHTS, atomic_path, atomic_write,
                             check_target)
from lmforge.ckpt.export import WeightReader, run_weights, save_streaming
from lmforge.ckpt.streaming import TensorRef, safetensors_writer
from lmforge.model.materialise import materialise
from lmforge.model.transformer import Transformer

# activations of transformers' GPT-2 that are the tanh approximation lmforge's GeluMLP computes
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


# --------------------------------------------------------------------------------------------
# layout detection and configs
# --------------------------------------------------------------------------------------------


def hf_family(cfg: ModelConfig) -> str:
    """'llama' or 'gpt2': the transformers class that represents `cfg` exactly, or ValueError."""
    llama = (cfg.norm, cfg.activation, cfg.pos_emb) == ("rmsnorm", "swiglu", "rope")
    gpt2 = (cfg.norm, cfg.activation, cfg.pos_emb) == ("layernorm", "gelu", "learned")
    if gpt2 and cfg.kv_heads != cfg.n_heads:
        raise ValueError(
            f"model.n_kv_heads = {cfg.n_kv_heads} (grouped-query attention) cannot be represented by "
            f"GPT2LMHeadModel; export a GPT-2 style model with n_kv_heads unset, or use a Llama-style "
            f"model (rmsnorm, swiglu, rope).")
    if llama:
        return "llama"
    if gpt2:
        return "gpt2"
    raise ValueError(
        f"model (norm={cfg.norm!r}, activation={cfg.activation!r}, pos_emb={cfg.pos_emb!r}) matches neither "
        f"LlamaForCausalLM (rmsnorm, swiglu, rope) nor GPT2LMHeadModel (layernorm, gelu, learned); "
        f"change model.norm / model.activation / model.pos_emb to one of these combinations to export.")


def require_transformers(command: str) -> None:
    """ValueError with the install command when the `transformers` package cannot be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ValueError(f'{command} needs the transformers package, which is not installed ({exc}); '
                         f'install it with: pip install "lmforge[eval]"') from None


def hf_config(cfg: ModelConfig, eos_id: int | None = None, bos_id: int | None = None,
              pad_id: int | None = None):
    """The transformers config object (LlamaConfig or GPT2Config) equivalent to `cfg`."""
    from transformers import GPT2Config, LlamaConfig

    special = {"eos_token_id": eos_id, "bos_token_id": bos_id, "pad_token_id": pad_id}
    if hf_family(cfg) == "llama":
        return LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta, hidden_act="silu", attention_bias=cfg.bias, mlp_bias=cfg.bias,
            attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings,
            architectures=["LlamaForCausalLM"], **special)
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_embd=cfg.dim, n_layer=cfg.n_layers, n_head=cfg.n_heads,
        n_inner=cfg.ffn_dim, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
        activation_function="gelu_pytorch_tanh", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, architectures=["GPT2LMHeadModel"],
        **special)


def model_config_from_hf(hf: dict, source: str = HF_CONFIG) -> ModelConfig:
    """ModelConfig equivalent to a transformers config.json dict (Llama or GPT-2), or ValueError."""
    kind = hf.get("model_type")
    if kind == "llama":
        dim, heads = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or dim // heads
        if head_dim * heads != dim:
            raise ValueError(f"{source}: head_dim = {head_dim} x num_attention_heads = {heads} != hidden_size = "
                             f"{dim}; lmforge needs head_dim = hidden_size / num_attention_heads.")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act = {hf['hidden_act']!r}; lmforge's SwiGLU uses 'silu'.")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source}: rope type {rope_type!r} (scaled RoPE) is not supported by lmforge; "
                             f"only the default (unscaled) RoPE is.")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            raise ValueError(f"{source}: attention_bias and mlp_bias differ; lmforge has one model.bias for all "
                             f"linear layers.")
        return ModelConfig(
            vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_hidden_layers"], n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048), pos_emb="rope", rope_theta=float(theta),
            norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
            bias=bool(hf.get("attention_bias", False)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dropout=0.0)
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in _TANH_GELUS:
            raise ValueError(f"{source}: activation_function = {act!r}; lmforge's GPT-2 MLP computes the tanh "
                             f"GELU approximation ({', '.join(_TANH_GELUS)}).")
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise ValueError(f"{source}: non-standard attention scaling (scale_attn_by_inverse_layer_idx / "
                             f"scale_attn_weights) is not supported.")
        dim = hf["n_embd"]
        return ModelConfig(
            vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"], n_heads=hf["n_head"],
            ffn_hidden=hf.get("n_inner") or 4 * dim, max_seq_len=hf["n_positions"], pos_emb="learned",
            norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), activation="gelu", bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dropout=0.0)
    raise ValueError(f"{source}: model_type = {kind!r} is not supported; lmforge imports 'llama' and 'gpt2'.")


# --------------------------------------------------------------------------------------------
# weight name mapping
# --------------------------------------------------------------------------------------------


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    """lmforge parameter name -> transformers Llama name (same tensors, no transposition)."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    parts = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
             "attn.wo": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
             "mlp.down": "mlp.down_proj"}
    for i in range(cfg.n_layers):
        for ours, theirs in parts.items():
            kinds = ("weight", "bias") if cfg.bias and "norm" not in ours else ("weight",)
            for kind in kinds:
                names[f"blocks.{i}.{ours}.{kind}"] = f"model.layers.{i}.{theirs}.{kind}"
    return names


def _hf_tensors(cfg: ModelConfig, get: Callable[[str], torch.Tensor],
                has: Callable[[str], bool]) -> dict[str, Callable[[], torch.Tensor]]:
    """transformers name -> a function making that tensor from lmforge's (`get(name)`; `has(name)`:
    whether the model has it). Nothing is read until a function is called, so an export holds one
    output tensor at a time (called on meta tensors: the shapes and dtypes, for free)."""
    if hf_family(cfg) == "llama":
        return {theirs: functools.partial(get, ours) for ours, theirs in _llama_names(cfg).items()}

    def bias(name: str, shape_of: str) -> torch.Tensor:
        # lmforge without biases: zero biases give GPT-2 the same function
        if has(name):
            return get(name)
        like = get(shape_of)
        return torch.zeros(like.shape[0], dtype=like.dtype, device=like.device)

    def qkv(b: str, kind: str) -> torch.Tensor:
        names = [b + f"attn.{w}" for w in ("wq", "wk", "wv")]
        if kind == "weight":
            return torch.cat([get(n + ".weight") for n in names]).t()
        return torch.cat([bias(n + ".bias", n + ".weight") for n in names])

    part = functools.partial
    out = {"transformer.wte.weight": part(get, "tok_emb.weight"), "transformer.wpe.weight": part(get, "pos_emb.weight"),
           "transformer.ln_f.weight": part(get, "norm.weight"),
           "transformer.ln_f.bias": part(bias, "norm.bias", "norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = part(get, "lm_head.weight")
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[h + theirs + ".weight"] = part(get, b + ours + ".weight")
            out[h + theirs + ".bias"] = part(bias, b + ours + ".bias", b + ours + ".weight")
        out[h + "attn.c_attn.weight"] = part(qkv, b, "weight")
        out[h + "attn.c_attn.bias"] = part(qkv, b, "bias")
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[h + theirs + ".weight"] = lambda n=b + ours + ".weight": get(n).t()
            out[h + theirs + ".bias"] = part(bias, b + ours + ".bias", b + ours + ".weight")
    return out


def hf_weight_refs(cfg: ModelConfig, hf_dir: str | Path) -> dict[str, TensorRef]:
    """Where each lmforge weight of a `cfg` model lies in the transformers folder `hf_dir`
    (model.safetensors, a sharded index, or pytorch_model.bin memory-mapped): read slice by slice,
    a rank of a sharded run reads only its own parts (lmforge.ckpt.streaming.TensorRef). ValueError
    names a missing weight."""
    hf_dir = Path(hf_dir)
    where = _hf_weight_files(hf_dir)

    def ref(key: str, transpose: bool = False, offset: tuple[int, ...] = ()) -> TensorRef:
        for k in (key, f"transformer.{key}"):
            if k in where:
                file, tensors = where[k]
                return TensorRef(file, k, transpose, offset, tensors)
        raise ValueError(f"{hf_dir}: weight {key!r} is missing; the weights do not match config.json (layers, "
                         f"biases or tied embeddings).")

    if hf_family(cfg) == "llama":
        return {ours: ref(theirs) for ours, theirs in _llama_names(cfg).items()}
    out = {"tok_emb.weight": ref("wte.weight"), "pos_emb.weight": ref("wpe.weight"),
           "norm.weight": ref("ln_f.weight"), "norm.bias": ref("ln_f.bias")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = ref("lm_head.weight")
    d = cfg.dim
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[b + ours + ".weight"], out[b + ours + ".bias"] = ref(h + theirs + ".weight"), ref(h + theirs + ".bias")
        for j, name in enumerate(("wq", "wk", "wv")):  # c_attn (in, 3 out): q, k, v side by side, transposed
            out[b + f"attn.{name}.weight"] = ref(h + "attn.c_attn.weight", transpose=True, offset=(0, j * d))
            out[b + f"attn.{name}.bias"] = ref(h + "attn.c_attn.bias", offset=(j * d,))
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[b + ours + ".weight"], out[b + ours + ".bias"] = ref(h + theirs + ".weight", transpose=True), \
                ref(h + theirs + ".bias")
    return out


def _hf_weight_files(hf_dir: Path) -> dict[str, tuple[Path, dict | None]]:
    """Stored tensor name -> (its file, the memory-mapped tensors of a pytorch_model.bin or None)."""
    from safetensors import SafetensorError, safe_open

    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / WEIGHTS).is_file():
        files = [hf_dir / WEIGHTS]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc}); save the model again.") from None
        return {key: (hf_dir / name, None) for key, name in weight_map.items()}
    elif (hf_dir / "pytorch_model.bin").is_file():  # (loaded with weights_only=True: no code runs; mmap: no copy)
        path = hf_dir / "pytorch_model.bin"
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return {key: (path, tensors) for key in tensors}
    else:
        raise ValueError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
                         f"save the model with `save_pretrained` first.")
    where = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                where.update({key: (file, None) for key in f.keys()})
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{file} is not a complete safetensors file ({exc}): it was truncated or is "
                             f"corrupt. Fix: copy or write it again from its source.") from None
    return where


def write_hf_weights(cfg: ModelConfig, weights: WeightReader, path: Path) -> None:
    """model.safetensors of a transformers folder, written one tensor at a time from an lmforge weight
    reader (lmforge.ckpt.export): the peak is one output tensor (GPT-2's fused c_attn: three)."""
    meta = lambda name: torch.empty(weights.shapes[name], dtype=weights.dtypes[name], device="meta")  # noqa: E731
    has = weights.shapes.__contains__
    specs = [(name, t.dtype, tuple(t.shape)) for name, make in _hf_tensors(cfg, meta, has).items() for t in [make()]]
    with safetensors_writer(path, specs, metadata={"format": "pt"}) as write:
        for name, make in _hf_tensors(cfg, weights.read, has).items():
            write(name, make().contiguous())


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


HF_FILES = (HF_CONFIG, "generation_config.json", WEIGHTS, TOKENIZER, "tokenizer_config.json")


def export_hf(run_or_model: str | Path | Transformer, out_dir: str | Path, tokenizer=None,
              overwrite: bool = False) -> Path:
    """Write a transformers folder (config.json, generation_config.json, model.safetensors, and
    tokenizer.json + tokenizer_config.json when a tokenizer is known) for an lmforge run folder or
    model. `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained`
    then load it offline. `tokenizer`: an lmforge Tokenizer (default: the run's tokenizer.json).
    Existing files are replaced only with `overwrite`; a run folder is never written into."""
    from lmforge.data.tokenizer import Tokenizer

    # every check before the first write: a refused export creates nothing (no empty --out folder)
    require_transformers("lmforge export")
    check_target(out_dir, "transformers", HF_FILES, "--out", overwrite)
    if isinstance(run_or_model, Transformer):
        cfg, weights = run_or_model.cfg, WeightReader.of_model(run_or_model)
    else:
        run_dir = Path(run_or_model)
        cfg, weights = run_weights(run_dir)
        if tokenizer is None and (run_dir / TOKENIZER).is_file():
            tokenizer = Tokenizer.load(run_dir / TOKENIZER)
    ids = {}
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size = {cfg.vocab_size}.")
        ids = {"eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "pad_id": tokenizer.pad_id}
    hf_cfg = hf_config(cfg, **ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(out)
    write_hf_weights(cfg, weights, out / WEIGHTS)
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, out, cfg.max_seq_len)
    return out


def save_hf_tokenizer(tokenizer, out_dir: Path, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json loadable by `PreTrainedTokenizerFast`/`AutoTokenizer`."""
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend
    name = backend.id_to_token
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=name(tokenizer.eos_id),
        bos_token=name(tokenizer.bos_id) if tokenizer.bos_id is not None else None,
        pad_token=name(tokenizer.pad_id) if tokenizer.pad_id is not None else None, model_max_length=max_len)
    fast.save_pretrained(str(out_dir))


# --------------------------------------------------------------------------------------------
# import
# --------------------------------------------------------------------------------------------


def _read_hf_config(hf_dir: Path) -> dict:
    cfg_path = hf_dir / HF_CONFIG
    if not cfg_path.is_file():
        raise ValueError(f"{hf_dir} is not a transformers model folder: {cfg_path.name} is missing.")
    try:
        return json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{cfg_path}: invalid JSON ({exc})") from exc


def import_hf(hf_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A local transformers Llama or GPT-2 folder -> (ModelConfig, lmforge Transformer in eval mode),
    built on the meta device and filled one weight at a time."""
    hf_dir = Path(hf_dir)
    cfg = model_config_from_hf(_read_hf_config(hf_dir), str(hf_dir / HF_CONFIG))
    refs = hf_weight_refs(cfg, hf_dir)

    def values(name, module, module_name, param_name, shape, index, dtype):
        if name not in refs:
            raise ValueError(f"{hf_dir}: no weights for {name}.")
        return refs[name].read(shape, index, name).to(dtype)

    with torch.device("meta"):
        model = Transformer(cfg)
    materialise(model, device, values)
    model.eval()
    return cfg, model


def import_hf_tokenizer(hf_dir: Path):
    """The lmforge Tokenizer of a transformers folder (tokenizer.json, or GPT-2 vocab/merges
    files), or None when the folder has none."""
    from lmforge.data.tokenizer import find_gpt2_files, load_gpt2_files, Tokenizer

    if (hf_dir / TOKENIZER).is_file():
        eos = None
        tc = hf_dir / "tokenizer_config.json"
        if tc.is_file():
            eos = json.loads(tc.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
        return Tokenizer.load(hf_dir / TOKENIZER, eos_token=eos)
    files = find_gpt2_files(hf_dir)
    return load_gpt2_files(*files) if files else None


def import_hf_run(hf_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write an lmforge run folder (config.toml, model.safetensors, tokenizer.json if the source
    has a tokenizer) from a transformers folder, usable by `lmforge generate/eval` and fine-tuning.
    Existing files are replaced only with `overwrite`; a transformers folder is never written into."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    check_target(out, "run", RUN_FILES, "--out", overwrite)
    cfg = model_config_from_hf(_read_hf_config(hf_dir), str(hf_dir / HF_CONFIG))
    refs = hf_weight_refs(cfg, hf_dir)
    with torch.device("meta"):
        specs = [(name, p.dtype, tuple(p.shape)) for name, p in Transformer(cfg).named_parameters()]
    tokenizer = import_hf_tokenizer(hf_dir)  # read everything before the first write
    out.mkdir(parents=True, exist_ok=True)
    run_cfg = Config(preset="imported", description=f"imported from {hf_dir}", model=cfg)
    # data.tokenizer names the run's own tokenizer file ("none" when the source had none), so the
    # BPE-training checks of the config do not apply to an imported vocabulary
    run_cfg.data = replace(run_cfg.data, seq_len=min(run_cfg.data.seq_len, cfg.max_seq_len),
                           tokenizer=str((out / TOKENIZER).resolve()) if tokenizer else "none")
    if tokenizer is not None:
        tokenizer.save(out / TOKENIZER)  # atomic: Tokenizer.save writes through folders.atomic_write
    # Only what the import knows: the model and its data settings. The training keys stay
    # defaults rather than choices, so a fine-tuning run from this file adapts them to its layout
    # as it would a preset's (a file's own keys are never adapted).
    atomic_write(out / CONFIG, to_toml(run_cfg.validate(), sections=("model", "data")))
    with save_streaming(out / WEIGHTS, specs) as write:  # one tensor at a time, in fp32
        for name, dtype, shape in specs:
            write(name, refs[name].read(shape, (None,) * len(shape), name).to(dtype))
    return out
