"""One source for every layout rule (issue 53, item 2): `lmforge.config.layout_rules` is read by the
config check (`lmforge train`), by the planner's typed `--layout` and by the search; each rule's
message is written once; the planner and the config accept exactly the same layouts, and refuse the
others with the same reasons; a typed layout lmforge refuses is planned, with the reasons at the top.
Torch-free and fast (no processes)."""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import string
from pathlib import Path

import pytest

from lmforge.config import Config, ConfigError, load_config
from lmforge.config.layout_rules import LAYOUT_RULES, LayoutRefused
from lmforge.config.rules import adapt_defaults
from lmforge.spec.parallel import PP_SCHEDULES
from lmforge.cli.plan import plan_main
from lmforge.plan.layout import Layout, layout_for_config, lmforge_refusals

LMFORGE = Path(__file__).resolve().parents[1] / "lmforge"
PRESETS = ("gpt2-124m", "llama2-70b", "gpt3-175b", "tiny-moe", "mixtral-8x7b")
DRAWS = 3000
GPT3 = ["--model", "gpt3-175b", "--gpus", "64x8xH100", "--weights", "lmforge", "--layout",
        "dp=16,zero=1,tp=4,pp=8,mb=1,ga=96,ac=selective,sp=1,sched=interleaved,v=2"]


def _source_strings() -> list[str]:
    """Every string literal in lmforge/ (the literal parts of f-strings included; implicitly joined
    literals are one)."""
    out = []
    for path in sorted(LMFORGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def test_each_layout_rule_message_is_written_once():
    """Each rule's message template: its longest literal stretch (between its fields), and every
    stretch of at least 40 characters, occurs in exactly one string literal of lmforge/, the template
    itself. A second copy of a rule (a check re-written in the planner, the search or a config
    section) fails this."""
    strings = _source_strings()
    assert len({r.name for r in LAYOUT_RULES}) == len(LAYOUT_RULES) >= 25
    for rule in LAYOUT_RULES:
        pieces = sorted((lit for lit, *_ in string.Formatter().parse(rule.message)), key=len, reverse=True)
        assert len(pieces[0]) >= 30, f"{rule.name}: no literal stretch of >= 30 characters to find it by"
        for piece in [pieces[0]] + [p for p in pieces[1:] if len(p) >= 40]:
            where = [s for s in strings if piece in s]
            assert len(where) == 1, f"{rule.name}: {piece!r} is written {len(where)} times in lmforge/"


def _draw(rng: random.Random, seq: int) -> tuple[str, dict, int]:
    """A random layout: the `lmforge plan --layout` text, the `lmforge train` overrides a user
    would type for it (written here, independently of lmforge's converter), and its sequence length.
    Each key keeps its plain value most of the time, so that every outcome is drawn often."""
    def pick(plain, *others, plainly=0.6):
        return plain if rng.random() < plainly else rng.choice(others)

    dp, zero, tp, pp, cp = pick(4, 1, 2, 8, 3), pick(3, 0, 1, 2), pick(1, 2, 4, 8, 3), pick(1, 2, 4, 3), pick(1, 2, 4, 3)
    sp, sched, ep = pick(0, 1, plainly=0.8), pick("1f1b", *PP_SCHEDULES), pick(1, 2, 4, 3, plainly=0.8)
    v = pick(2 if sched == "interleaved" else 1, 1, 2, 3, plainly=0.8)
    mb, ga, ac = pick(1, 2, 4), pick(8, 1, 2, 4, 16, 6), pick("full", "none", "selective", "every_k")
    reduce_every, offload, loss_chunk = pick(0, 1, plainly=0.8), pick(0, 1, plainly=0.8), pick(0, 4096, plainly=0.8)
    precision, seq_len = pick("bf16", "fp16", "fp32"), pick(seq, seq // 2, seq - 6)
    cpm = pick("allgather", "ulysses", plainly=0.7)
    text = (f"dp={dp},zero={zero},tp={tp},pp={pp},cp={cp},cpm={cpm},sp={sp},sched={sched},v={v},mb={mb},ga={ga},"
            f"ac={ac},reduce_every={reduce_every},offload={offload},ep={ep},loss_chunk={loss_chunk},precision={precision}")
    sharded = zero >= 1 and dp * cp > 1  # (ZeRO over more than one rank: the shard dimension)
    overrides = {
        "parallel.dp_replicate": 1 if sharded else dp, "parallel.dp_shard": dp if sharded else 1,
        "parallel.zero_stage": zero if sharded else 0, "parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp,
        "parallel.cp_mode": cpm, "parallel.sequence_parallel": bool(sp), "parallel.pp_schedule": sched,
        "parallel.pp_virtual_stages": v,
        "parallel.ep": ep, "parallel.cpu_offload": bool(offload),
        "parallel.fsdp_reduce_every_micro_batch": bool(reduce_every),
        "train.micro_batch_size": mb, "train.global_batch_size": mb * ga * dp, "train.activation_checkpoint": ac,
        "train.loss_chunk": loss_chunk, "train.precision": precision, "data.seq_len": seq_len,
        "schedule.batch_rampup_start": 0, "schedule.batch_rampup_tokens": 0, "schedule.batch_rampup_increment": 0}
    return text, overrides, seq_len


def _train_config(preset: Config, overrides: dict) -> None:
    """What `load_config(preset, overrides)` does for `lmforge train` after parsing: the overrides set
    (each section copied), each section checked, the preset's defaults adapted around the explicit
    keys, the whole validated. (The loader's TOML parse and type hints cost ~5 ms a config; every
    tenth draw also goes through `load_config` itself, which must agree.)"""
    sections: dict[str, dict] = {}
    for key, value in overrides.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    cfg = dataclasses.replace(preset, **{s: dataclasses.replace(getattr(preset, s), **kw) for s, kw in sections.items()})
    cfg.check_sections()
    adapt_defaults(cfg, set(overrides))
    cfg.validate()


def test_planner_and_config_accept_the_same_random_layouts():
    """3,000 seeded random layouts over 5 presets (GPT-2, Llama-2-70B, GPT-3, a tiny MoE, Mixtral):
    the planner (`Layout.parse` + `validate` against the model, then `lmforge_refusals`: what
    `lmforge plan --layout` runs) and the config (`load_config` with the overrides a user types on
    `lmforge train`) accept exactly the same ones. A layout the planner cannot plan (a structural
    rule) the config refuses by that rule too; one the planner plans with refusals, the config refuses
    with the first of them, and where that is a layout rule, with all of them, in the same words."""
    rng = random.Random(53)
    configs = {p: load_config(p) for p in PRESETS}
    tally = {"accepted": 0, "structural": 0, "refused": 0}
    rules_seen: set[str] = set()
    for i in range(DRAWS):
        preset = PRESETS[i % len(PRESETS)]
        cfg = configs[preset]
        text, overrides, seq_len = _draw(rng, cfg.data.seq_len)
        try:
            _train_config(cfg, overrides)
            config_error = None
        except ConfigError as exc:
            config_error = exc
        if i % 10 == 0:
            try:
                load_config(preset, overrides)
                assert config_error is None, f"{preset} {overrides}: the loader accepts, {config_error}"
            except ConfigError as exc:
                assert str(exc) == str(config_error), f"{preset} {overrides}"
        where = f"{preset} --layout {text} (seq_len {seq_len}): config says {config_error}"
        try:
            layout = Layout.parse(text).validate(cfg.model, seq_len)
        except LayoutRefused as exc:  # the planner cannot plan it: a structural rule
            tally["structural"] += 1
            rule = exc.refusals[0].rule
            rules_seen.add(rule)
            assert config_error is not None, f"planner: {exc}; {where}"
            if isinstance(config_error, LayoutRefused):
                assert rule in [r.rule for r in config_error.refusals], f"planner: {exc}; {where}"
            continue
        refusals = lmforge_refusals(cfg, layout, seq_len)
        rules_seen.update(r.rule for r in refusals)
        if not refusals:
            tally["accepted"] += 1
            assert config_error is None, where
            continue
        tally["refused"] += 1
        assert config_error is not None, f"planner refuses: {refusals}; {where}"
        assert refusals[0].message == str(config_error), where
        if isinstance(config_error, LayoutRefused):
            assert config_error.refusals == [r for r in refusals if r.rule in {x.name for x in LAYOUT_RULES}], where
    # the draws reach every outcome, and most rules
    assert min(tally.values()) >= 200, tally
    assert len(rules_seen & {r.name for r in LAYOUT_RULES}) >= 20, sorted(rules_seen)


def test_a_typed_layout_lmforge_refuses_is_planned_with_every_reason_at_the_top(capsys):
    """Megatron's GPT-3 layout without its distributed optimizer (plain data parallelism next to TP,
    which lmforge runs through FSDP2 only): planned (125.1 GB per GPU in bf16-pure), with lmforge's refusal at the
    top and in --json's `refused`; with the distributed optimizer (ZeRO-1 under TP and PP, issue 59)
    the same layout is lmforge's and says nothing of the kind."""
    plain = GPT3[:-1] + [GPT3[-1].replace("zero=1", "zero=0")]
    assert plan_main(plain) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].strip().startswith("lmforge refuses this layout")
    assert out[2].strip().startswith("- parallel.tp = 4 with parallel.dp_replicate = 16: data parallelism next to")
    text = "\n".join(out)
    # (the preset trains in bf16-pure, as Megatron does: bf16 weights beside fp32 masters and gradients)
    assert "precision=bf16-pure" in out[0] and "adamw, bf16-pure, seq 2048" in text
    assert re.search(r"TOTAL per GPU\s+125.08 GB", text) and re.search(r"MFU \(model FLOPs, PaLM\)\s+47.2%", text)
    assert plan_main(plain + ["--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["rule"] for r in rep["refused"]] == ["tp-needs-fsdp"]
    assert rep["refused"][0]["message"] == out[2].strip()[2:]
    # layouts lmforge runs say nothing of the kind: ZeRO-1 (Megatron's distributed optimizer), ZeRO-3
    assert plan_main(GPT3 + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["refused"] == []
    assert plan_main(GPT3[:-1] + ["dp=16,zero=3,tp=4,pp=8,mb=1,ga=96,ac=full", "--set", "model.tie_embeddings=false",
                                  "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["refused"] == []


def test_config_check_and_planner_read_the_same_rule():
    """`lmforge train` stops with the first broken rule and carries them all; the planner's structural
    error is the same rule in the layout's words."""
    megatron = {"parallel.tp": 4, "parallel.pp": 8, "parallel.sequence_parallel": True, "parallel.pp_schedule": "interleaved",
                "parallel.pp_virtual_stages": 2, "train.micro_batch_size": 1, "schedule.batch_rampup_start": 0}
    with pytest.raises(LayoutRefused) as exc:
        load_config("gpt3-175b", {**megatron, "parallel.dp_replicate": 2})
    assert [r.rule for r in exc.value.refusals] == ["tp-needs-fsdp"]
    assert str(exc.value) == exc.value.refusals[0].message
    # the Megatron layout with its distributed optimizer: ZeRO-1 under TP and PP runs through FSDP2
    cfg = load_config("gpt3-175b", {**megatron, "parallel.dp_shard": 16, "parallel.zero_stage": 1})
    assert cfg.parallel.fsdp and layout_for_config(cfg, "bf16", "cuda", 1).fsdp
    with pytest.raises(LayoutRefused, match=r"^parallel.sequence_parallel = true needs parallel.tp >= 2") as exc:
        load_config("tiny", {"parallel.sequence_parallel": True})
    with pytest.raises(LayoutRefused, match=r"^layout sp = 1 needs tp >= 2") as planned:
        Layout.parse("sp=1")
    assert exc.value.refusals[0].rule == planned.value.refusals[0].rule == "sp-needs-tp"
