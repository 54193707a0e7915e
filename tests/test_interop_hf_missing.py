"""Every family's import refuses a folder whose weights are not exactly the model's config.json
describes (lmforge.interop.hf_common.check_tensor_names): a missing layer, a missing expert and an
extra tensor each end in one line naming the tensor, before anything is built (a missing layer
used to import with exit 0 at transformers' random initialisation; a missing expert, in a traceback
calling it a size mismatch). Tiny random models made by transformers itself, saved with
save_pretrained, then the safetensors file rewritten without / with a tensor."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from lmforge.interop.hf import import_hf  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=32, tie_word_embeddings=False)
MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=24, num_local_experts=3, num_experts_per_tok=2)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=24, moe_intermediate_size=8, num_experts=3, num_experts_per_tok=2, head_dim=8)),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **COMMON, intermediate_size=24, moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=0)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, intermediate_size=24)),
}
# one tensor of one expert of layer 1, in the layout save_pretrained writes
EXPERT = {"mixtral": "model.layers.1.block_sparse_moe.experts.2.w3.weight",
          "qwen3_moe": "model.layers.1.mlp.experts.2.up_proj.weight",
          "deepseek_v3": "model.layers.1.mlp.experts.3.down_proj.weight"}


def _saved(tmp_path, family: str):
    torch.manual_seed(0)
    folder = tmp_path / family
    MODELS[family]().save_pretrained(str(folder))
    return folder, folder / "model.safetensors"


def _rewrite(path, drop=lambda name: False, add: dict | None = None) -> None:
    tensors = {name: t for name, t in load_file(str(path)).items() if not drop(name)}
    save_file({**tensors, **(add or {})}, str(path), metadata={"format": "pt"})


def _refused(folder, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        import_hf(folder)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("family", list(MODELS))
def test_a_folder_missing_a_whole_layer_is_refused_naming_its_first_tensor(tmp_path, family):
    folder, path = _saved(tmp_path, family)
    _rewrite(path, drop=lambda name: name.startswith("model.layers.1."))
    message = _refused(folder, r"weight 'model\.layers\.1\..*' is missing \(and \d+ more\)")
    assert "config.json" in message and str(folder) in message


@pytest.mark.parametrize("family", list(EXPERT))
def test_a_folder_missing_one_expert_tensor_is_refused_naming_it(tmp_path, family):
    folder, path = _saved(tmp_path, family)
    _rewrite(path, drop=lambda name: name == EXPERT[family])
    _refused(folder, rf"weight '{EXPERT[family]}' is missing;")


@pytest.mark.parametrize("family", list(MODELS))
def test_a_folder_with_an_extra_tensor_is_refused_naming_it(tmp_path, family):
    folder, path = _saved(tmp_path, family)
    _rewrite(path, add={"model.layers.2.mlp.gate.weight": torch.zeros(3, 16)})  # (a third layer config.json lacks)
    _refused(folder, r"weight 'model\.layers\.2\.mlp\.gate\.weight' is not part of the model config\.json describes;")


def test_the_fused_expert_layout_is_checked_too(tmp_path):
    """A Mixtral folder in transformers 5's fused layout (one gate_up_proj / down_proj per layer, as
    lmforge's own export writes it) imports; without one layer's down_proj it is refused."""
    from lmforge.config import ModelConfig
    from lmforge.config.sections import MoEConfig
    from lmforge.interop.hf_moe import export_moe, to_moe_state_dict
    from lmforge.model.transformer import build_model

    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=24, max_seq_len=32,
                      tie_embeddings=False, moe=MoEConfig(num_experts=3, top_k=2))
    model = build_model(cfg, seed=0)
    export_moe(model, tmp_path / "out")
    path = tmp_path / "out" / "model.safetensors"
    weights = {n: p.detach() for n, p in model.named_parameters()}
    save_file(to_moe_state_dict(cfg, weights), str(path), metadata={"format": "pt"})  # (the fused names)
    _, again = import_hf(tmp_path / "out")
    for (n, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n
    _rewrite(path, drop=lambda name: name == "model.layers.0.mlp.experts.down_proj")
    _refused(tmp_path / "out", r"weight 'model\.layers\.0\.mlp\.experts\.down_proj' is missing;")


def test_the_import_command_prints_the_one_line_and_exits_2(tmp_path, capsys):
    from lmforge.cli import main

    folder, path = _saved(tmp_path, "mixtral")
    _rewrite(path, drop=lambda name: name.startswith("model.layers.1."))
    capsys.readouterr()  # (save_pretrained's progress bars)
    assert main(["import", "--hf", str(folder), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weight 'model.layers.1." in err[0] and "is missing" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["import", "export"])
def test_the_help_of_import_and_export_names_every_family(command, capsys):
    from lmforge.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for family in ("Llama", "Qwen2", "Qwen3", "Mistral", "Mixtral", "Qwen3-MoE", "DeepSeek-V3", "GPT-2"):
        assert family in text, (command, family)
