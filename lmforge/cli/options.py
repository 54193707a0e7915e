"""Numeric command-line options checked like config keys: one helper, one parser class.

    p = OptionParser(prog="lmforge x")
    p.add_argument("--max-tokens", type=int_in(1), default=200)
    p.add_argument("--top-p", type=float_in(0, 1, lo_open=True), default=1.0)

A bad value (`--max-tokens -5`, `--top-p 2`, `--top-k abc`) raises OptionError, a ValueError that
every command already prints as its one `error: ...` line with exit status 2:
`--max-tokens -5 must be an integer >= 1`. argparse alone prints its usage and then
`argument --max-tokens: invalid int value`, and a plain `type=int` accepts -5. The check runs while
the command line is parsed, so before anything is imported or loaded.
"""

from __future__ import annotations

import argparse
import math


class OptionError(ValueError):
    """A command-line option's value out of its range (message: option, value, range)."""


class Bad(argparse.ArgumentTypeError):
    """Raised by a Number while argparse converts a value; OptionParser adds the option's name."""


class Number:
    """argparse `type=`: an int or a finite float in [lo, hi] (either end open, or absent)."""

    def __init__(self, kind: type, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
                 hi_open: bool = False, note: str = ""):
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open, self.note = kind, lo, hi, lo_open, hi_open, note
        self.__name__ = kind.__name__  # (argparse names the type by it in some messages)

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            span = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
            return f"an integer {span}" if self.kind is int else span
        bound = (f"{'>' if self.lo_open else '>='} {self.lo:g}" if self.lo is not None
                 else f"{'<' if self.hi_open else '<='} {self.hi:g}")
        return f"{'an integer' if self.kind is int else 'a finite number'} {bound}"

    def ok(self, value: float) -> bool:
        return (math.isfinite(value)
                and (self.lo is None or (value > self.lo if self.lo_open else value >= self.lo))
                and (self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)))

    def outside(self) -> str:
        """A value this option refuses (for the tests)."""
        value = self.kind((self.lo if self.lo_open else self.lo - 1) if self.lo is not None
                          else (self.hi if self.hi_open else self.hi + 1))
        return f"{value:g}"

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            value = None
        if value is None or not self.ok(value):
            shown = f"{value:g}" if isinstance(value, float) else text  # (nan, inf, -1e+09 as Python writes them)
            raise Bad(f"{shown} must be {self.describe()}{f' ({self.note})' if self.note else ''}")
        return value


def int_in(lo: int | None = None, hi: int | None = None, note: str = "") -> Number:
    """An integer >= lo (and <= hi)."""
    return Number(int, lo, hi, note=note)


def float_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
             note: str = "") -> Number:
    """A finite float in [lo, hi]; lo_open / hi_open exclude that end."""
    return Number(float, lo, hi, lo_open=lo_open, hi_open=hi_open, note=note)


class ListOf:
    """argparse `type=`: comma-separated Numbers (`--weights 1,1,2`)."""

    def __init__(self, number: Number):
        self.number = number
        self.__name__ = f"list of {number.kind.__name__}"

    def outside(self) -> str:
        return f"1,{self.number.outside()}"

    def __call__(self, text: str) -> list:
        try:
            return [self.number(v) for v in text.split(",") if v.strip()]
        except Bad:
            raise Bad(f"{text} must be a comma-separated list, each {self.number.describe()}") from None


def list_of(number: Number) -> ListOf:
    return ListOf(number)


positive_int = int_in(1)
count = int_in(0)  # (0 meaning "none" or "the default", as each option's help says)
seed = int_in(0)
prob = float_in(0, 1)
fraction = float_in(0, 1, lo_open=True)  # (0, 1]


class OptionParser(argparse.ArgumentParser):
    """argparse whose Number options fail with OptionError (`--max-tokens -5 must be an integer
    >= 1`, one line) instead of argparse's usage and `invalid int value`; every other usage error
    is argparse's own. Sub-command parsers made by add_subparsers are OptionParsers too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # (so the ArgumentError reaches parse_known_args below)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as exc:
            if isinstance(exc.__context__, Bad):  # argparse re-raises a type's error as ArgumentError
                raise OptionError(f"{(exc.argument_name or '').split('/')[0]} {exc.__context__}") from None
            self.error(str(exc))
