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

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmforge.config import Config, ModelConfig, to_toml
from lmforge.folders import (CONFIG, HF_CONFIG, RUN_FILES, TOKENIZER, WEIGHTS, atomic_path, atomic_write,
                             check_target)
from lmforge.model.transformer import Transformer, build_model

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


def _to_gpt2(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    def get(name: str, shape_of: str) -> torch.Tensor:
        # lmforge without biases: zero biases give GPT-2 the same function
        return state[name] if name in state else torch.zeros(state[shape_of].shape[0])

    out = {"transformer.wte.weight": state["tok_emb.weight"], "transformer.wpe.weight": state["pos_emb.weight"],
           "transformer.ln_f.weight": state["norm.weight"], "transformer.ln_f.bias": get("norm.bias", "norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[h + theirs + ".weight"] = state[b + ours + ".weight"]
            out[h + theirs + ".bias"] = get(b + ours + ".bias", b + ours + ".weight")
        qkv = [b + f"attn.{w}" for w in ("wq", "wk", "wv")]
        out[h + "attn.c_attn.weight"] = torch.cat([state[n + ".weight"] for n in qkv]).t()
        out[h + "attn.c_attn.bias"] = torch.cat([get(n + ".bias", n + ".weight") for n in qkv])
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[h + theirs + ".weight"] = state[b + ours + ".weight"].t()
            out[h + theirs + ".bias"] = get(b + ours + ".bias", b + ours + ".weight")
    return out


def _from_gpt2(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    out = {"tok_emb.weight": hf["wte.weight"], "pos_emb.weight": hf["wpe.weight"],
           "norm.weight": hf["ln_f.weight"], "norm.bias": hf["ln_f.bias"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[b + ours + ".weight"], out[b + ours + ".bias"] = hf[h + theirs + ".weight"], hf[h + theirs + ".bias"]
        w, bias = hf[h + "attn.c_attn.weight"].t(), hf[h + "attn.c_attn.bias"]
        for name, wt, bt in zip(("wq", "wk", "wv"), w.chunk(3), bias.chunk(3)):
            out[b + f"attn.{name}.weight"], out[b + f"attn.{name}.bias"] = wt, bt
        for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[b + ours + ".weight"], out[b + ours + ".bias"] = hf[h + theirs + ".weight"].t(), hf[h + theirs + ".bias"]
    return out


def to_hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under transformers names and layouts (contiguous CPU tensors)."""
    from lmforge.ckpt.export import model_state

    cfg = model.cfg
    state = model_state(model)
    if hf_family(cfg) == "llama":
        out = {theirs: state[ours] for ours, theirs in _llama_names(cfg).items()}
    else:
        out = _to_gpt2(state, cfg)
    return {k: v.detach().to("cpu").contiguous() for k, v in out.items()}


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """transformers weights -> lmforge state dict for `cfg`; ValueError names missing tensors."""
    try:
        if hf_family(cfg) == "llama":
            if cfg.tie_embeddings:
                hf = {k: v for k, v in hf.items() if k != "lm_head.weight"}
            return {ours: hf[theirs] for ours, theirs in _llama_names(cfg).items()}
        return _from_gpt2(hf, cfg)
    except KeyError as exc:
        raise ValueError(f"{source}: weight {exc.args[0]!r} is missing; the weights do not match config.json "
                         f"(layers, biases or tied embeddings).") from exc


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
        model = run_or_model
    else:
        from lmforge.ckpt.export import load_run

        run_dir = Path(run_or_model)
        _, model = load_run(run_dir)
        if tokenizer is None and (run_dir / TOKENIZER).is_file():
            tokenizer = Tokenizer.load(run_dir / TOKENIZER)
    cfg = model.cfg
    ids = {}
    if tokenizer is not None:
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size = {cfg.vocab_size}.")
        ids = {"eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id, "pad_id": tokenizer.pad_id}
    hf_cfg = hf_config(cfg, **ids)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(out)
    with atomic_path(out / WEIGHTS) as tmp:
        save_file(to_hf_state(model), str(tmp), metadata={"format": "pt"})
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


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a transformers folder: model.safetensors, sharded safetensors (index), or
    pytorch_model.bin (loaded with weights_only=True: no code runs)."""
    from lmforge.ckpt.export import read_safetensors

    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / WEIGHTS).is_file():
        return read_safetensors(hf_dir / WEIGHTS)
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(read_safetensors(hf_dir / f))
        return state
    if (hf_dir / "pytorch_model.bin").is_file():
        return torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
                     f"save the model with `save_pretrained` first.")


def import_hf(hf_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """A local transformers Llama or GPT-2 folder -> (ModelConfig, lmforge Transformer in eval mode)."""
    hf_dir = Path(hf_dir)
    cfg_path = hf_dir / HF_CONFIG
    if not cfg_path.is_file():
        raise ValueError(f"{hf_dir} is not a transformers model folder: {cfg_path.name} is missing.")
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise ValueError(f"{cfg_path}: invalid JSON ({exc})") from exc
    cfg = model_config_from_hf(hf_cfg, str(cfg_path))
    model = build_model(cfg, device)
    load_hf_weights(model, hf_dir)
    model.eval()
    return cfg, model


@torch.no_grad()
def load_hf_weights(model: Transformer, hf_dir: str | Path) -> None:
    """Copy the weights of a transformers folder into `model` (whose config must match it);
    ValueError names the first tensor whose shape differs or that is missing."""
    hf_dir = Path(hf_dir)
    state = from_hf_state(read_hf_weights(hf_dir), model.cfg, str(hf_dir))
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{hf_dir}: {name} has shape {tuple(tensor.shape)}, config.json implies "
                             f"{tuple(expected[name].shape)}.")
    dtype = model.tok_emb.weight.dtype
    missing, _ = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not k.startswith("rope_") and not (k == "lm_head.weight" and model.cfg.tie_embeddings)]
    if missing:
        raise ValueError(f"{hf_dir}: no weights for {missing[:5]}.")
    model.tie_weights()


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
    from lmforge.ckpt.export import save_weights

    hf_dir, out = Path(hf_dir), Path(out_dir)
    check_target(out, "run", RUN_FILES, "--out", overwrite)
    cfg, model = import_hf(hf_dir)
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
    save_weights(model, out / WEIGHTS)
    return out
