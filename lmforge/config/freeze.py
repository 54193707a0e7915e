"""A config frozen once its run has resolved it (lmforge.train.auto): assigning to any of its keys
afterwards raises, naming the key.

    freeze(cfg)            # cfg and every section in it (model.moe too)
    cfg.train.steps = 5    # FrozenConfigError: train.steps: ...

A copy (`copy.deepcopy`, `dataclasses.replace`) is a new config and may be changed; the trainer
resolves and freezes its own copy, so a test or script that builds a config keeps it editable.
The frozen object keeps its class's behaviour: each frozen section is an instance of a subclass
(`Frozen<Section>`, defined here once per section class, so a frozen config still pickles).
"""

from __future__ import annotations

import dataclasses
import sys

from lmforge.config.base import ConfigError

_FLAG = "_lmforge_frozen_as"


class FrozenConfigError(ConfigError):
    """A key of a frozen config was assigned."""


def _frozen_setattr(self, name: str, value) -> None:
    where = self.__dict__.get(_FLAG)
    if where is not None:
        key = f"{where}.{name}" if where else name
        raise FrozenConfigError(
            f"{key}: the run's config is frozen once its 'auto' values are resolved (lmforge.train.auto); "
            f"set {key} before the run starts (a copy, copy.deepcopy(cfg), may be changed).")
    object.__setattr__(self, name, value)


def _base(cls: type) -> type:
    return cls.__mro__[1] if getattr(cls, "_lmforge_frozen_class", False) else cls


def _frozen_eq(self, other):
    """Equal to the same section, frozen or not (dataclasses compare only objects of one class)."""
    base = _base(type(self))
    if _base(type(other)) is not base:
        return NotImplemented
    return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(base))


def _frozen_repr(self) -> str:
    """The section's own repr (its class's name, not the frozen subclass's)."""
    return _base(type(self)).__qualname__ + _base(type(self)).__repr__(self)[len(type(self).__qualname__):]


def _frozen_class(cls: type) -> type:
    if getattr(cls, "_lmforge_frozen_class", False):
        return cls
    name = f"Frozen{cls.__name__}"
    module = sys.modules[__name__]
    frozen = getattr(module, name, None)
    if frozen is None:
        frozen = type(name, (cls,), {"__setattr__": _frozen_setattr, "__eq__": _frozen_eq, "__hash__": None,
                                     "__repr__": _frozen_repr, "_lmforge_frozen_class": True,
                                     "__module__": __name__, "__qualname__": name})
        setattr(module, name, frozen)
    return frozen


def freeze(cfg, where: str = "") -> None:
    """Freeze `cfg` and every dataclass section it holds, in place."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            freeze(value, f"{where}.{f.name}" if where else f.name)
    object.__setattr__(cfg, "__class__", _frozen_class(type(cfg)))
    object.__setattr__(cfg, _FLAG, where)


def is_frozen(cfg) -> bool:
    return cfg.__dict__.get(_FLAG) is not None
