"""Config loading, overrides and up-front validation: every bad input names its key and the fix."""

import dataclasses
import subprocess
import sys

import pytest

from lmforge.config import (Config, ConfigError, available_presets, describe, load_config, parse_cli_overrides,
                            to_toml)
from lmforge.model.transformer import count_params


def test_every_preset_loads_and_validates():
    names = available_presets()
    for required in ("tiny", "gpt2-124m", "llama-1b", "gpt3-175b", "llama2-70b", "chinchilla-70b", "mistral-7b"):
        assert required in names
    for name in names:
        cfg = load_config(name)
        assert cfg.preset == name
        assert cfg.description


def test_presets_of_more_than_10b_parameters_train_in_bf16_pure_and_the_plan_says_why(capsys):
    """Issue 55 item 5: every preset over BF16_PURE_PRESETS_ABOVE parameters trains in bf16-pure (bf16
    weights and activations over fp32 masters, Megatron's scheme), the smaller ones as they were; `lmforge
    plan` names where its bf16-pure came from, and --precision bf16 plans autocast without the note."""
    from lmforge.cli.plan import plan_main
    from lmforge.config.rules import BF16_PURE_PRESETS_ABOVE

    large = sorted(n for n in available_presets() if count_params(load_config(n).model)["total"] > BF16_PURE_PRESETS_ABOVE)
    assert large == ["chinchilla-70b", "deepseek-v3-671b", "gpt3-175b", "llama2-70b", "mixtral-8x7b", "qwen3-30b-a3b",
                     "qwen3-next-80b-a3b"]
    assert {n: load_config(n).train.precision for n in available_presets()} == {
        n: "bf16-pure" if n in large else "auto" if n.startswith("tiny") else "bf16" for n in available_presets()}
    assert plan_main(["--model", "llama2-70b", "--gpus", "8xH100", "--layout", "dp=8,zero=3,mb=1,ac=full"]) == 0
    out = capsys.readouterr().out
    assert "precision=bf16-pure" in out.splitlines()[0]
    assert "note: precision bf16-pure: llama2-70b's train.precision (presets of more than 10B parameters" in out
    assert plan_main(["--model", "llama2-70b", "--gpus", "8xH100", "--layout", "dp=8,zero=3,mb=1,ac=full",
                      "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "precision=" not in out.splitlines()[0] and "note: precision" not in out  # (bf16: the layout default)


@pytest.mark.parametrize("preset, billions, tol", [
    ("gpt2-124m", 0.124, 0.01), ("llama-1b", 1.08, 0.05), ("gpt3-175b", 175.0, 1.0),
    ("llama2-70b", 68.98, 0.2), ("mistral-7b", 7.24, 0.05), ("olmo2-7b", 7.30, 0.01),
    ("olmo3-7b", 7.30, 0.01)])
def test_presets_have_published_parameter_counts(preset, billions, tol):
    total = count_params(load_config(preset).model)["total"] - (
        # GPT-2's published 124M counts the real 50257-row vocabulary, not the padded 50304
        (50304 - 50257) * 768 if preset == "gpt2-124m" else 0)
    assert abs(total / 1e9 - billions) < tol, total


FAMILY_PRESETS = {  # published parameter counts (model cards / config.json of the released weights)
    "llama3.1-8b": 8_030_261_248, "llama3.2-1b": 1_235_814_400, "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360, "mistral-7b": 7_241_732_096,
    "gemma3-1b": 999_885_952,
}


@pytest.mark.parametrize("preset", list(FAMILY_PRESETS))
def test_family_presets_have_exactly_the_published_parameter_counts(preset):
    """Counted from the model itself, built on the meta device (no memory), and by the formula."""
    import torch

    from lmforge.model.transformer import Transformer

    cfg = load_config(preset).model
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_params() == count_params(cfg)["total"] == FAMILY_PRESETS[preset]


def test_family_presets_carry_their_families_options():
    llama31, llama32 = load_config("llama3.1-8b").model, load_config("llama3.2-1b").model
    assert (llama31.rope_scaling, llama31.rope_factor, llama31.rope_theta, llama31.tie_embeddings) == \
        ("llama3", 8.0, 500000.0, False)
    assert (llama32.rope_factor, llama32.tie_embeddings) == (32.0, True)
    for name in ("qwen2.5-0.5b", "qwen2.5-7b"):
        qwen = load_config(name).model
        assert qwen.attn_qkv_bias and not qwen.bias and qwen.rope_theta == 1e6
    qwen3 = load_config("qwen3-8b").model
    assert qwen3.qk_norm and not qwen3.attn_qkv_bias and qwen3.head_dim == 128
    assert load_config("mistral-7b").model.sliding_window == 4096
    gemma = load_config("gemma3-1b").model  # 5 local : 1 global, each with its RoPE base; four norms a block
    assert [gemma.layer_window(i) for i in range(6)] == [512] * 5 + [0]
    assert (gemma.local_rope_theta, gemma.rope_theta, gemma.norm_placement, gemma.embed_scale, gemma.activation) == \
        (1e4, 1e6, "sandwich", True, "geglu")
    olmo = load_config("olmo2-7b").model
    assert (olmo.norm_placement, olmo.qk_norm_scope, olmo.qk_norm_widths) == ("post", "projection", (4096, 4096))
    olmo3 = load_config("olmo3-7b").model  # OLMo 2's block, 3 sliding (4,096 tokens) : 1 full, the last full
    assert [olmo3.layer_window(i) for i in range(32)] == ([4096] * 3 + [0]) * 8
    assert (olmo3.norm_placement, olmo3.qk_norm_scope, olmo3.vocab_size, olmo3.local_rope_theta) == \
        ("post", "projection", 100278, olmo3.rope_theta)


def test_recipe_presets_carry_published_hyperparameters():
    gpt3 = load_config("gpt3-175b")
    assert (gpt3.optim.lr, gpt3.optim.beta2, gpt3.optim.weight_decay, gpt3.optim.grad_clip) == (6e-5, 0.95, 0.1, 1.0)
    assert gpt3.tokens_per_step == 1536 * 2048
    llama = load_config("llama2-70b")
    assert (llama.optim.lr, llama.optim.eps, llama.schedule.warmup_steps, llama.model.n_kv_heads) == (1.5e-4, 1e-5, 2000, 8)
    assert llama.tokens_per_step == 4 * 1024 * 1024
    chin = load_config("chinchilla-70b")
    assert chin.optim.lr == 1e-4 and chin.schedule.min_lr_ratio == 0.1
    mistral = load_config("mistral-7b")
    assert (mistral.model.ffn_hidden, mistral.model.n_kv_heads) == (14336, 8)


def test_overrides_are_typed_and_applied():
    cfg = load_config("tiny", parse_cli_overrides(["--optim.lr", "3e-4", "--model.n_layers=2",
                                                   "--train.compile", "true", "--model.n_kv_heads", "none"]))
    assert cfg.optim.lr == 3e-4 and cfg.model.n_layers == 2 and cfg.train.compile is True
    assert cfg.model.n_kv_heads is None
    # ints are accepted where floats are expected
    assert load_config("tiny", {"optim.lr": 1}).optim.lr == 1.0


@pytest.mark.parametrize("overrides, needle", [
    ({"optim.lrr": 1e-3}, "unknown config key 'optim.lrr'; did you mean 'optim.lr'"),
    ({"modle.dim": 64}, "unknown config key 'modle'"),
    ({"model.dim": "big"}, "model.dim = 'big' must be an integer"),
    ({"train.compile": 1}, "train.compile = 1 must be true or false"),
    ({"train.precision": "fp8"}, "train.precision = 'fp8' is not one of"),
    ({"model.n_heads": 7}, "model.n_heads = 7 does not divide model.dim = 192"),
    ({"model.n_kv_heads": 4}, "model.n_kv_heads = 4 must divide model.n_heads = 6"),
    ({"train.global_batch_size": 30, "train.micro_batch_size": 32},
     "train.global_batch_size = 30 is not divisible by train.micro_batch_size (32)"),
    ({"parallel.dp_shard": 4, "train.global_batch_size": 32, "train.micro_batch_size": 16}, "data-parallel degree (4"),
    ({"parallel.dp_shard": 3}, "train.global_batch_size = 32 is not divisible"),  # the preset's batch stays
    ({"data.seq_len": 512}, "data.seq_len = 512 exceeds model.max_seq_len = 256"),
    ({"schedule.warmup_steps": 1000}, "schedule.warmup_steps = 1000 must be < train.steps"),
    ({"optim.lr": -1.0}, "optim.lr = -1.0 must be > 0"),
    ({"optim.name": "adamax"}, "optim.name = 'adamax' is not one of"),
    ({"parallel.tp": 4}, "parallel.tp = 4 must divide model.n_heads"),
    ({"parallel.pp": 3}, "parallel.pp = 3 must divide model.n_layers"),
    ({"data.tokenizer_vocab_size": 8192}, "data.tokenizer_vocab_size = 8192 exceeds model.vocab_size = 4096"),
    ({"model.dim": 0}, "model.dim = 0 must be >= 1"),
    ({"model.rope_scaling": "dynamic"}, "model.rope_scaling = 'dynamic' is not one of"),
    ({"model.rope_scaling": "linear", "model.rope_factor": 0.5}, "model.rope_factor = 0.5 must be >= 1"),
    ({"model.rope_scaling": "llama3", "model.rope_low_freq_factor": 4.0}, "must satisfy 0 < low < high"),
    ({"model.rope_scaling": "linear", "model.pos_emb": "learned"}, "model.rope_scaling = 'linear' needs model.pos_emb"),
    ({"model.qk_norm": True, "model.norm": "layernorm"}, "model.qk_norm = true needs model.norm = 'rmsnorm'"),
    ({"model.sliding_window": -1}, "model.sliding_window = -1 must be >= 0"),
])
def test_bad_configs_are_rejected_with_the_key_named(overrides, needle):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny", overrides)
    assert needle in str(exc.value), str(exc.value)


def test_batch_error_suggests_valid_values():
    with pytest.raises(ConfigError, match="use global_batch_size = 16 or 32"):
        load_config("tiny", {"train.global_batch_size": 20, "train.micro_batch_size": 16})
    with pytest.raises(ConfigError, match="use global_batch_size = 64 or 128"):
        load_config("tiny", {"train.global_batch_size": 100, "parallel.dp_shard": 2, "train.micro_batch_size": 32})


def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset 'nope'; available presets: .*tiny"):
        load_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ndim = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(str(bad))


def test_inherit_and_round_trip(tmp_path):
    child = tmp_path / "child.toml"
    child.write_text('inherit = "tiny"\n[model]\nn_layers = 2\n')
    cfg = load_config(str(child))
    assert cfg.model.n_layers == 2 and cfg.model.dim == load_config("tiny").model.dim
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(str(again)).to_dict() == {**cfg.to_dict(), "preset": "child"}


def test_every_field_is_documented():
    rows = describe(Config)
    assert len(rows) > 50
    undocumented = [key for key, _, doc in rows if len(doc) < 10]
    assert not undocumented, undocumented
    for section in dataclasses.fields(Config):
        assert section.metadata.get("doc"), section.name


def test_cli_reports_config_errors_with_exit_code_2():
    proc = subprocess.run([sys.executable, "-m", "lmforge", "train", "--model.n_heads", "7"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "model.n_heads = 7 does not divide model.dim" in proc.stderr


def test_the_presets_micro_batch_and_warmup_adapt_to_the_layout_but_explicit_choices_do_not():
    """The presets fix the global batch; their micro-batch shrinks to fit dp and the pipeline depth
    (largest divisor that fits) and their warmup to short runs, each with a line for the log. What
    the user sets stays as set, and an impossible explicit choice is an error."""
    cfg = load_config("tiny", {"parallel.dp_replicate": 2})
    assert cfg.train.micro_batch_size == 16 and cfg.train.global_batch_size == 32
    assert list(cfg.adjustments) == ["train.micro_batch_size 32 -> 16: the global batch of 32 sequences is 16 per "
                                     "data-parallel rank (dp 2)"]
    cfg = load_config("tiny", {"parallel.pp": 2, "model.tie_embeddings": False, "parallel.pp_schedule": "interleaved",
                               "parallel.pp_virtual_stages": 2})
    assert cfg.grad_accum_steps % 2 == 0 and cfg.grad_accum_steps >= 2
    cfg = load_config("tiny", {"train.steps": 20})
    assert cfg.schedule.warmup_steps == 2 and any("warmup_steps 20 -> 2" in a for a in cfg.adjustments)
    assert load_config("tiny").adjustments == []
    with pytest.raises(ConfigError, match="not divisible by train.micro_batch_size \\(32\\)"):
        load_config("tiny", {"parallel.dp_replicate": 2, "train.micro_batch_size": 32})
    with pytest.raises(ConfigError, match="warmup_steps = 20 must be < train.steps = 20"):
        load_config("tiny", {"train.steps": 20, "schedule.warmup_steps": 20})


def test_a_user_toml_file_is_explicit_and_an_old_run_config_still_loads(tmp_path):
    own = tmp_path / "my_run.toml"
    own.write_text('inherit = "tiny"\n[train]\nmicro_batch_size = 32\n[parallel]\ndp_replicate = 2\n')
    with pytest.raises(ConfigError, match="not divisible"):  # the file's micro-batch is a choice
        load_config(str(own))
    old = tmp_path / "config.toml"  # written by an lmforge that had train.eval_batches
    old.write_text(to_toml(load_config("tiny")).replace("eval_sequences = 512", "eval_batches = 16"))
    assert load_config(str(old)).train.eval_sequences == 16 * 32
