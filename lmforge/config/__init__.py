"""Typed configuration: dataclasses loaded from TOML presets plus dotted CLI overrides.

One `Config` describes a whole run. It is built in three layers, later ones winning:

1. the dataclass defaults (`sections.py`; they are the `tiny` preset's model, so a bare config works),
2. a TOML file (a preset name from `lmforge/presets/` or a path); a file may say
   `inherit = "other-preset"` to start from another preset,
3. dotted overrides from the command line: `--optim.lr 3e-4 --model.n_layers 6`.

Every field carries its documentation in `metadata["doc"]` (see `describe()`; `lmforge config
--docs` prints it). Every value is type-checked on load (`loading.py`); `Config.validate()` runs
each section's own `check()` and then the rules that span sections (`rules.py`), up front, with a
`ConfigError` naming the key and the fix, before any data is touched or any process group forms.
"""

from lmforge.config.base import ConfigError
from lmforge.config.loading import (PRESET_DIR, apply_overrides, available_presets, build_dataclass, describe,
                                    load_config, parse_cli_overrides, parse_override_value, to_toml)
from lmforge.config.sections import (CheckpointConfig, Config, DataConfig, FinetuneConfig, GuardConfig,
                                     ModelConfig, OptimConfig, ParallelConfig, ScheduleConfig, TrainConfig)

__all__ = [
    "PRESET_DIR", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "FinetuneConfig", "GuardConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "ScheduleConfig", "TrainConfig", "apply_overrides",
    "available_presets", "build_dataclass", "describe", "load_config", "parse_cli_overrides", "parse_override_value",
    "to_toml",
]
