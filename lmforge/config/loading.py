"""Loading a Config: TOML presets (with `inherit`), dotted CLI overrides, type checking of every
value, the reference docs (`describe`) and TOML output (`to_toml`)."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from lmforge.config.base import ConfigError
from lmforge.config.sections import Config

PRESET_DIR = Path(__file__).parent.parent / "presets"


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _resolve_preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist.")
        return path
    preset = PRESET_DIR / f"{name_or_path}.toml"
    if not preset.is_file():
        raise ConfigError(
            f"unknown preset {name_or_path!r}; available presets: {', '.join(available_presets())} "
            f"(or give a path to a .toml file).")
    return preset


def _read_toml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a TOML file, following `inherit = "preset"` chains (nested tables merged)."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: `inherit` forms a cycle through {[str(p) for p in seen]}.")
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    parent = raw.pop("inherit", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: `inherit` must be a preset name or a path, got {parent!r}.")
    base = _read_toml(_resolve_preset_path(parent), seen + (path.resolve(),))
    return _deep_merge(base, raw)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return `value` converted to the annotated type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))}.")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        errors, wanted = [], []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(key, value, arg)
            except ConfigError as exc:
                errors.append(str(exc))
                wanted.append(_wanted(arg))
        if len(errors) > 1:  # e.g. `bool | Literal["auto"]`: name every allowed kind of value
            raise ConfigError(f"{key} = {value!r} must be {', or '.join(wanted)}.")
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}.")
    if origin is list:  # an array of values (model.layer_types)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} must be an array, e.g. [{_wanted(typing.get_args(tp)[0])}, ...].")
        return [_check_type(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value)]
    if origin is dict:  # a table of name = value pairs (data.stages[].weights)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} = {value!r} must be a table, e.g. {{name = 1.0}}.")
        key_type, value_type = typing.get_args(tp)
        return {_check_type(f"{key}.{k}", k, key_type): _check_type(f"{key}.{k}", v, value_type)
                for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} must be true or false.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} = {value!r} must be an integer.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} = {value!r} must be a number.")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} must be a string.")
    raise AssertionError(f"unsupported config type {tp} for {key}")


def _wanted(tp: Any) -> str:
    """What a value of the annotated type `tp` is, in words (an error's "must be ...")."""
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        return repr(choices[0]) if len(choices) == 1 else f"one of {', '.join(map(repr, choices))}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def build_dataclass(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """A config dataclass from a TOML table, every value type-checked; used for `lmforge train`'s
    config and `lmforge prepare`'s `[prepare]` table alike.

    `prefix` is the table's dotted path with a trailing dot ("" at the top level, "prepare."), so
    each ConfigError names the full key. Nested dataclass fields are sub-tables; `list[Dataclass]`
    fields are arrays of tables (`[[prepare.sources]]`); a field without a default is required.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.')} must be a table (section), got {raw!r}.")
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = _closest(key, names)
            raise ConfigError(
                f"unknown config key {full!r}" + (f"; did you mean '{prefix}{close}'?" if close else "")
                + f" Valid keys in [{prefix.rstrip('.') or 'top level'}]: {', '.join(names)}.")
        tp = hints[key]
        item = _list_item_dataclass(tp)
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value, f"{full}.")
        elif item is not None:
            if not isinstance(value, list):
                raise ConfigError(f"{full} must be an array of tables ([[{full}]]), got {value!r}.")
            kwargs[key] = [build_dataclass(item, v, f"{full}[{i}].") for i, v in enumerate(value)]
        else:
            kwargs[key] = _check_type(full, value, tp)
    missing = [n for n, f in names.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}: required key is missing.")
    return cls(**kwargs)


def _list_item_dataclass(tp: Any) -> type | None:
    """`X` for an annotation `list[X]` where X is a dataclass, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _closest(key: str, names: typing.Iterable[str]) -> str | None:
    import difflib

    match = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    return match[0] if match else None


def parse_override_value(text: str) -> Any:
    """Parse a CLI value as a TOML value (numbers, booleans, quoted strings); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (`optim.lr`) in a nested raw dict."""
    raw = _deep_merge({}, raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {dotted!r}: {part!r} is not a section.")
            node = child
        node[parts[-1]] = value
    return raw


def load_config(preset: str | None = "tiny", overrides: dict[str, Any] | None = None, validate: bool = True,
                launch: tuple[int, str] | None = None) -> Config:
    """Build a Config from a preset name or TOML path plus dotted overrides, adapt the preset's
    defaults to the layout (`rules.adapt_defaults`: what the user set explicitly, on the command
    line or in their own TOML file, is never adapted) and validate it. `launch` = (processes
    started, who started them) for a run about to train: with expert parallelism and no dp_shard
    chosen, dp_shard is inferred from it (`rules.infer_dp_shard`); the process count is then checked
    first, before any rule that derives from the layout (`rules.check_process_count`)."""
    raw: dict[str, Any] = {}
    name = "custom"
    explicit = set(overrides or {})
    if preset is not None:
        path = _resolve_preset_path(preset)
        raw = _read_toml(path)
        name = path.stem
        if path.resolve().parent != PRESET_DIR.resolve():  # the user's own file: its keys are choices
            with open(path, "rb") as fh:
                explicit |= set(_dotted_keys(tomllib.load(fh)))
    raw.setdefault("preset", name)
    raw = apply_overrides(raw, overrides or {})
    _upgrade(raw)
    cfg = build_dataclass(Config, raw, "")
    cfg.explicit_keys = frozenset(explicit)
    if validate:
        from lmforge.config.rules import adapt_defaults, check_process_count, infer_dp_shard

        inferred = infer_dp_shard(cfg, launch[0], explicit) if launch is not None else None
        cfg.check_sections()  # what was set, before adapt_defaults derives anything from it
        if launch is not None:
            check_process_count(cfg, *launch)
        cfg.adjustments = ([inferred] if inferred else []) + adapt_defaults(cfg, explicit)
        cfg.validate()
    return cfg


def _upgrade(raw: dict[str, Any]) -> None:
    """Keys an older lmforge wrote (a run folder's config.toml), translated in place: train.eval_batches
    (micro-batches of validation data) became train.eval_sequences."""
    train = raw.get("train")
    if isinstance(train, dict) and "eval_batches" in train and "eval_sequences" not in train:
        batches = train.pop("eval_batches")
        if isinstance(batches, int) and isinstance(train.get("micro_batch_size", 16), int):
            train["eval_sequences"] = batches * train.get("micro_batch_size", 16)


def _dotted_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _dotted_keys(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def parse_cli_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `["--optim.lr", "3e-4", "--train.compile=true"]` into `{"optim.lr": 3e-4, ...}`."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.key value.")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} needs a value.")
            i += 1
            text = args[i]
        out[key.replace("-", "_")] = parse_override_value(text)
        i += 1
    return out


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every field, recursively: the reference documentation of the config.
    Fields of an array of tables are listed as `key[].field`."""
    rows = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        item = _list_item_dataclass(tp)
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
        elif item is not None:
            rows.extend(describe(item, f"{prefix}{f.name}[]."))
        else:
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
            rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("doc", "")))
    return rows


def to_toml(cfg: Config, sections: tuple[str, ...] | None = None) -> str:
    """Serialise a config back to TOML (written next to every run for reproducibility). With
    `sections`, only those tables are written (plus the top-level keys): a file read back with
    `load_config` takes the rest from the defaults, which it may still adapt to the layout."""
    lines: list[str] = []
    tree = cfg.to_dict()
    for key, value in tree.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value)}")
    def table(name: str, value: dict[str, Any]) -> None:
        lines.append(f"\n[{name}]")
        for k, v in value.items():
            if v is not None and not isinstance(v, dict):
                lines.append(f"{k} = {_toml_value(v)}")
        for k, v in value.items():  # nested sections (model.moe) as sub-tables
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    for key, value in tree.items():
        if isinstance(value, dict) and (sections is None or key in sections):
            table(key, value)
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):  # an inline table (data.stages[].weights, a stage itself)
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)
