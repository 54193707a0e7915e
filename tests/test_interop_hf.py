"""Hugging Face interop: lmforge -> transformers and transformers -> lmforge give the same logits.

Tolerance: fp32 on CPU, max |logit difference| < 1e-4 (the two implementations compute RoPE,
attention and norms in different but mathematically equal orders; observed ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.config import ModelConfig  # noqa: E402
from lmforge.interop.hf import export_hf, import_hf, import_hf_run  # noqa: E402
from lmforge.model.transformer import build_model  # noqa: E402

TOL = 1e-4
# init_std 0.2 (not 0.02): attention far from uniform, so a q/k or RoPE mix-up shows in the logits
BASE = dict(vocab_size=128, dim=32, n_layers=2, n_heads=4, max_seq_len=32, init_std=0.2)
CONFIGS = {
    "llama_gqa": dict(BASE, n_kv_heads=2, ffn_hidden=48, tie_embeddings=False, rope_theta=500000.0),
    "llama_tied_bias": dict(BASE, bias=True, tie_embeddings=True, norm_eps=1e-6),
    "gpt2": dict(BASE, pos_emb="learned", norm="layernorm", activation="gelu", bias=True, tie_embeddings=True),
    "gpt2_nobias_untied": dict(BASE, pos_emb="learned", norm="layernorm", activation="gelu", bias=False,
                               tie_embeddings=False),
}


def _random_model(kw: dict):
    """A model whose every parameter (norm weights and biases too) is random, so a mapping
    mistake anywhere changes the logits."""
    model = build_model(ModelConfig(**kw), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _tokens(vocab: int, seq: int = 20) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(2))


def _hf_logits(path, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_logits_match_transformers(name, tmp_path):
    model = _random_model(CONFIGS[name])
    export_hf(model, tmp_path / "hf")
    tokens = _tokens(model.cfg.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
    theirs = _hf_logits(tmp_path / "hf", tokens)
    assert (ours - theirs).abs().max().item() < TOL
    # and back: the import reproduces the exported weights bit for bit (a GPT-2 without biases
    # comes back with zero biases, the same function)
    _, back = import_hf(tmp_path / "hf")
    theirs_state = back.state_dict()
    for key, value in theirs_state.items():
        if key.startswith("rope_"):
            continue
        mine = model.state_dict().get(key)
        assert torch.equal(value, mine if mine is not None else torch.zeros_like(value)), key


def test_export_writes_a_tokenizer_that_transformers_loads(tmp_path):
    from transformers import AutoTokenizer

    from lmforge.data.tokenizer import train_bpe

    tok = train_bpe(["the king and the queen walked to the castle"] * 20, vocab_size=300)
    model = _random_model(dict(CONFIGS["llama_gqa"], vocab_size=320))
    export_hf(model, tmp_path / "hf", tokenizer=tok)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "the queen walked"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eos_id
    assert hf_tok.decode(tok.encode(text)) == text


@torch.no_grad()
def _randomise_and_save(model, tmp_path):
    """transformers initialises norms to 1, biases to 0 and weights with std 0.02: make every
    vector random (so a mix-up shows) and weights 10x larger (attention far from uniform)."""
    for p in model.parameters():
        if p.dim() == 1:
            p.add_(0.1 * torch.randn_like(p))
        else:
            p.mul_(10.0)
    model.save_pretrained(str(tmp_path / "hf"))
    return model.eval()


def _hf_llama(tmp_path, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=48,
                      rope_theta=10000.0, tie_word_embeddings=tie)
    return _randomise_and_save(LlamaForCausalLM(cfg), tmp_path)


def _hf_gpt2(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=48, bos_token_id=0,
                     eos_token_id=0)
    return _randomise_and_save(GPT2LMHeadModel(cfg), tmp_path)


@pytest.mark.parametrize("kind", ["llama_mqa", "llama_tied", "gpt2"])
def test_import_reproduces_transformers_logits(kind, tmp_path):
    hf = _hf_gpt2(tmp_path) if kind == "gpt2" else _hf_llama(tmp_path, tie=kind == "llama_tied")
    cfg, model = import_hf(tmp_path / "hf")
    tokens = _tokens(100, 30)
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < TOL
    if kind == "llama_mqa":
        assert cfg.kv_heads == 1 and cfg.ffn_dim == 40 and not cfg.tie_embeddings


def test_import_cli_writes_a_run_folder_generate_can_use(tmp_path):
    from lmforge.ckpt.export import load_run
    from lmforge.cli import main

    hf = _hf_gpt2(tmp_path)
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    cfg, model = load_run(tmp_path / "run")
    tokens = _tokens(100, 10)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < TOL
    # and out again through the export command
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")]) == 0
    assert (_hf_logits(tmp_path / "hf2", tokens) - hf(tokens).logits).abs().max().item() < TOL


def test_an_imported_runs_config_fixes_the_model_and_leaves_training_to_the_layout(tmp_path):
    """The imported config.toml holds what the import knows (model, data); a fine-tuning run from it
    adapts the micro-batch to its own global batch as it would a preset's, instead of refusing the
    default micro_batch_size 16 as if the user had chosen it."""
    from lmforge.cli import main
    from lmforge.config import ConfigError, load_config
    from lmforge.folders import CONFIG

    _hf_llama(tmp_path, tie=False)
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    text = (tmp_path / "run" / CONFIG).read_text()
    assert "[model]" in text and "[data]" in text and "[train]" not in text and "[optim]" not in text
    cfg = load_config(str(tmp_path / "run" / CONFIG), {"train.global_batch_size": 12})
    assert cfg.train.micro_batch_size == 12 and cfg.model.n_layers == 2 and cfg.model.kv_heads == 1
    assert any("micro_batch_size 16 -> 12" in note for note in cfg.adjustments), cfg.adjustments
    with pytest.raises(ConfigError, match="micro_batch_size"):  # the user's own choice stays an error
        load_config(str(tmp_path / "run" / CONFIG), {"train.global_batch_size": 12, "train.micro_batch_size": 5})


def test_unrepresentable_configs_are_rejected_clearly(tmp_path):
    mixed = build_model(ModelConfig(**dict(BASE, norm="layernorm")), seed=0)
    with pytest.raises(ValueError, match="matches neither LlamaForCausalLM"):
        export_hf(mixed, tmp_path / "a")
    gqa_gpt2 = build_model(ModelConfig(**dict(CONFIGS["gpt2"], n_kv_heads=2)), seed=0)
    with pytest.raises(ValueError, match="grouped-query attention"):
        export_hf(gqa_gpt2, tmp_path / "b")
    with pytest.raises(ValueError, match="config.json is missing"):
        import_hf(tmp_path)


def test_import_rejects_weights_that_do_not_match_config(tmp_path):
    import json

    _hf_llama(tmp_path, tie=False)
    path = tmp_path / "hf" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["intermediate_size"] = 64
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp.gate.weight\) has shape"):
        import_hf(tmp_path / "hf")
    del cfg["intermediate_size"], cfg["num_hidden_layers"]
    cfg.update(intermediate_size=40, num_hidden_layers=3)
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layers.2.*is missing"):
        import_hf(tmp_path / "hf")


def test_import_sharded_safetensors_and_pytorch_bin(tmp_path):
    """Large checkpoints come sharded (model.safetensors.index.json) or as pytorch_model.bin
    (read with weights_only=True)."""
    import shutil

    hf = _hf_llama(tmp_path, tie=False)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", binary / "config.json")
    torch.save(hf.state_dict(), binary / "pytorch_model.bin")
    tokens = _tokens(100, 12)
    with torch.no_grad():
        want = hf(tokens).logits
        for folder in (sharded, binary):
            _, model = import_hf(folder)
            assert (model(tokens) - want).abs().max().item() < TOL, folder


def test_tokenizer_survives_export_and_import(tmp_path):
    from lmforge.data.tokenizer import Tokenizer
    from tests.tiny_lm import MODEL, tiny_tokenizer, write_run

    tok = tiny_tokenizer()
    run = write_run(tmp_path / "run", build_model(ModelConfig(**MODEL), seed=0), tok)
    export_hf(run, tmp_path / "hf")
    import_hf_run(tmp_path / "hf", tmp_path / "back")
    back = Tokenizer.load(tmp_path / "back" / "tokenizer.json")
    text = "the cat sat on the mat."
    assert back.encode(text) == tok.encode(text) and back.eos_id == tok.eos_id


def test_export_and_import_never_overwrite_what_they_should_not(tmp_path, capsys):
    """`lmforge export --out <the run folder>` used to replace the run's own model.safetensors and
    tokenizer.json with the transformers ones (the run no longer loaded). Now: a run folder is never
    an export target, a transformers folder never an import target, and existing files are
    replaced only with --force."""
    import hashlib

    from lmforge.cli.interop import export_main, import_main
    from tests.tiny_lm import MODEL, tiny_tokenizer, write_run

    run = write_run(tmp_path / "run", build_model(ModelConfig(**MODEL), seed=0), tiny_tokenizer())
    digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in run.iterdir() if f.is_file()}
    with pytest.raises(ValueError, match="is an lmforge run folder .*model.safetensors"):
        export_hf(run, run)
    assert export_main(["--run", str(run), "--out", str(run), "--force"]) == 2  # not even with --force
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in run.iterdir() if f.is_file()} == digest

    hf = tmp_path / "hf"
    assert export_main(["--run", str(run), "--out", str(hf)]) == 0
    with pytest.raises(ValueError, match="already holds config.json.*--force"):
        export_hf(run, hf)
    assert export_main(["--run", str(run), "--out", str(hf), "--force"]) == 0
    with pytest.raises(ValueError, match="is a transformers model folder"):
        import_hf_run(hf, hf)
    back = tmp_path / "back"
    assert import_main(["--hf", str(hf), "--out", str(back)]) == 0
    capsys.readouterr()
    assert import_main(["--hf", str(hf), "--out", str(back)]) == 2  # config.toml etc. exist
    err = capsys.readouterr().err  # the CLI's words: its flag, not the Python keyword behind it
    assert err.startswith(f"error: --out = {str(back)!r} already holds config.toml") and "or pass --force" in err
    assert "overwrite" not in err, err
    assert import_main(["--hf", str(hf), "--out", str(back), "--force"]) == 0


def test_export_of_an_unfinished_run_reads_its_newest_checkpoint(small_data, tmp_path):
    """A run that has checkpoints but no model.safetensors (stopped before its end) exports from its
    newest valid checkpoint, read tensor by tensor: the same file as from the finished run's weights."""
    from safetensors.torch import load_file

    from lmforge.config import load_config
    from lmforge.train.trainer import Trainer

    cfg = load_config("tiny", {"model.vocab_size": 320, "model.dim": 32, "model.n_layers": 2, "model.n_heads": 4,
                               "model.max_seq_len": 32, "data.seq_len": 32, "data.tokenizer_vocab_size": 320,
                               "train.global_batch_size": 4, "train.steps": 3, "train.eval_every": 0, "train.eval_sequences": 4,
                               "train.sample_tokens": 0, "train.precision": "fp32", "train.plot": False,
                               "train.tensorboard": False, "checkpoint.async_save": False})
    run = tmp_path / "run"
    Trainer(cfg, out_dir=run, data=small_data).fit()
    export_hf(run, tmp_path / "from_weights")
    (run / "model.safetensors").unlink()
    export_hf(run, tmp_path / "from_checkpoint")
    want, got = load_file(str(tmp_path / "from_weights" / "model.safetensors")), \
        load_file(str(tmp_path / "from_checkpoint" / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    for ckpt in (run / "checkpoints").iterdir():
        import shutil

        shutil.rmtree(ckpt)
    with pytest.raises(ValueError, match="has no model.safetensors"):
        export_hf(run, tmp_path / "nothing")


# ---- the Llama 3.x / Qwen2.5 / Qwen3 / Mistral families (issue 37) --------------------------------

FAMILY_TOL = 1e-5  # fp32 logits, max |difference|
SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {  # name: (transformers class, config keys, lmforge ModelConfig values the import must give)
    "qwen2_tied": ("Qwen2", dict(tie_word_embeddings=True, rope_theta=1e6),
                   dict(bias=False, qkv_bias=True, tie_embeddings=True, rope_theta=1e6)),
    "qwen2_window": ("Qwen2", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=7,
                                   max_window_layers=0), dict(qkv_bias=True, sliding_window=7)),
    "qwen3_untied": ("Qwen3", dict(tie_word_embeddings=False, head_dim=8), dict(qk_norm=True, bias=False)),
    "qwen3_tied": ("Qwen3", dict(tie_word_embeddings=True, head_dim=8), dict(qk_norm=True, tie_embeddings=True)),
    # Qwen3 0.6B-4B: heads x head_dim != hidden_size (here 4 x 16 on 32)
    "qwen3_wide_heads": ("Qwen3", dict(tie_word_embeddings=True, head_dim=16), dict(qk_norm=True, attn_head_dim=16)),
    "mistral_window": ("Mistral", dict(sliding_window=6, tie_word_embeddings=False), dict(sliding_window=6)),
    "llama3_rope": ("Llama", dict(rope_theta=5e5, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True),
                    dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=16)),
    "llama_linear_rope": ("Llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
                          dict(rope_scaling="linear", rope_factor=4.0)),
}


def _hf_family_model(tmp_path, name: str):
    import transformers

    cls, keys, _ = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{cls}Config")(**SMALL, **keys)
    return _randomise_and_save(getattr(transformers, f"{cls}ForCausalLM")(cfg), tmp_path)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_imports_with_transformers_logits_and_exports_bit_equal(name, tmp_path):
    """A transformers-made model of each family (random norm weights and biases) imports with fp32
    logits within 1e-5 of transformers' (over 40 tokens: past every sliding window), and exports
    back to the same class with bit-equal weights."""
    from safetensors.torch import load_file

    hf = _hf_family_model(tmp_path, name)
    cfg, model = import_hf(tmp_path / "hf")
    for key, value in FAMILIES[name][2].items():
        assert getattr(cfg, key) == value, (key, getattr(cfg, key))
    tokens = _tokens(100, 40)
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < FAMILY_TOL, diff
    export_hf(model, tmp_path / "back")
    theirs = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ours = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    import json

    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == [f"{FAMILIES[name][0]}ForCausalLM"]
    assert (_hf_logits(tmp_path / "back", tokens) - hf(tokens).logits).abs().max().item() < FAMILY_TOL


def test_sliding_window_changes_attention_and_a_wide_window_is_full_attention():
    """A window shorter than the sequence changes the logits from the window on (and only there);
    one at least the sequence length gives exactly the full causal model."""
    kw = dict(BASE, n_kv_heads=2)
    full = _random_model(kw)
    tokens = _tokens(128, 20)
    with torch.no_grad():
        want = full(tokens)
        for window, same in ((20, True), (64, True), (5, False)):
            windowed = Transformer_like(full, dict(kw, sliding_window=window))
            got = windowed(tokens)
            assert torch.equal(got[:, :5], want[:, :5])  # the first `window` tokens see the same keys
            assert torch.equal(got, want) == same, window


def Transformer_like(model, kw: dict):  # noqa: N802
    """A model of config `kw` holding `model`'s weights."""
    other = build_model(ModelConfig(**kw), seed=0)
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.mark.parametrize("edit, message", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope' is not supported"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
     "sliding window on some layers only"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
])
def test_family_settings_lmforge_cannot_represent_are_named(tmp_path, edit, message):
    import json

    _hf_family_model(tmp_path, "qwen2_tied")
    path = tmp_path / "hf" / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("rope_parameters", None) if "rope_scaling" in edit else None
    cfg.update(edit)
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        import_hf(tmp_path / "hf")


def test_family_options_neither_side_can_represent_are_rejected_on_export(tmp_path):
    for kw, message in ((dict(qk_norm=True, qkv_bias=True), "qk_norm = true with biases"),
                        (dict(bias=True, qkv_bias=False), "biases on o and the MLP but not on q/k/v"),
                        (dict(bias=True, sliding_window=8), "MistralForCausalLM has no biases")):
        with pytest.raises(ValueError, match=message):
            export_hf(build_model(ModelConfig(**dict(BASE, **kw)), seed=0), tmp_path / "x")


def test_import_keeps_the_folders_tokenizer_and_its_bos_eos_ids(tmp_path):
    """The run's tokenizer.json and its tokenizer_config.json: BOS/EOS are the folder's own tokens
    (names lmforge would not guess), also when the run's tokenizer is loaded again later."""
    from transformers import AutoTokenizer

    from lmforge.data.tokenizer import Tokenizer, load_tokenizer
    from tests.qwen_standin import BOS, EOS, make_qwen_standin

    hf_dir = make_qwen_standin(tmp_path / "hf")
    hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
    run = import_hf_run(hf_dir, tmp_path / "run")
    for tok in (Tokenizer.load(run / "tokenizer.json"), load_tokenizer(run), load_tokenizer(hf_dir)):
        assert (tok.bos_id, tok.eos_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)
        assert tok.backend.id_to_token(tok.eos_id) == EOS and tok.backend.id_to_token(tok.bos_id) == BOS
        assert tok.encode("the river runs") == hf_tok("the river runs", add_special_tokens=False)["input_ids"]
