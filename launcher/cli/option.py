"""One declared option (`Option`), where it sits in dlaunch.yaml (`Yaml`), and the argparse
types that name their flag when they refuse a value.

The declarations themselves are in launcher.cli.args. Imports nothing from launcher but errors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from launcher.errors import UsageError

COMMANDS = ("run", "lab", "plan", "scale", "tune", "report", "inspect", "status", "logs", "cancel",
            "doctor")
KINDS = ("value", "switch", "toggle", "list")  # --x V | --x | --x/--no-x | --x V (repeatable)

Parse = Callable[[str], Any]


def int_at_least(flag: str, minimum: int) -> Parse:
    """An argparse `type` accepting integers >= `minimum`, naming the flag when it refuses."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{flag} must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise UsageError(f"{flag} must be an integer >= {minimum}, got {value}")
        return value

    return parse


def minutes(flag: str) -> Parse:
    """An argparse `type` accepting a finite number of minutes > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{flag} must be a number of minutes > 0 (fractions allowed), got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{flag} must be a number of minutes > 0, got {text}")
        return value

    return parse


def at_least(minimum: int) -> Callable[[str], Parse]:
    """The `parse` of an integer option: `int_at_least` for whichever flag declares it."""
    return lambda flag: int_at_least(flag, minimum)


def real(_flag: str) -> Parse:
    """The `parse` of a float option (argparse's own message names the flag)."""
    return float


@dataclass(frozen=True, kw_only=True)
class Yaml:
    """Where an option lives in dlaunch.yaml: `section.name`, the types accepted there and
    how to describe a good value in an error line. `name` defaults to the option's dest."""

    section: str
    types: tuple[type[Any], ...]
    what: str
    name: str | None = None


@dataclass(frozen=True)
class Option:
    """One flag (or positional) of one or more commands.

    `parse` makes the argparse type from the flag (so its errors name it); `per` overrides any
    field for one command (`{"plan": {"default": None}}`); `slurm_in` lists the commands where
    the option sits in the SLURM group and needs --slurm; `merge(flag, yaml)` replaces "flag
    if given, else yaml" for options whose values combine; `aliases` are the field names that
    specs and the request use for it in their error messages.
    """

    flag: str
    _: KW_ONLY
    commands: tuple[str, ...]
    help: str = ""
    kind: str = "value"
    parse: Callable[[str], Parse] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    required: bool = False
    slurm_in: tuple[str, ...] = ()
    yaml: Yaml | None = None
    merge: Callable[[Any, Any], Any] | None = None
    aliases: tuple[str, ...] = ()
    per: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option {self.flag}: kind must be one of {KINDS}, got {self.kind!r}")
        unknown = (set(self.commands) | set(self.per) | set(self.slurm_in)) - set(COMMANDS)
        if unknown or not self.commands or not set(self.per) | set(self.slurm_in) <= set(self.commands):
            raise ValueError(f"option {self.flag}: bad command names {sorted(unknown) or self.per}")

    @property
    def dest(self) -> str:
        """The attribute argparse stores it under, and its key in `resolve`'s result."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def positional(self) -> bool:
        """A positional argument (no leading dash)."""
        return not self.flag.startswith("-")

    @property
    def yaml_key(self) -> str | None:
        """`section.name` in dlaunch.yaml, or None."""
        return f"{self.yaml.section}.{self.yaml.name or self.dest}" if self.yaml else None

    def for_command(self, command: str) -> Option:
        """This option as `command` declares it (its `per` overrides applied)."""
        return dataclasses.replace(self, **self.per.get(command, {}), per={})
