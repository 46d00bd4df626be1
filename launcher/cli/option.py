"""One declared option (`Option`) and where it sits in dlaunch.yaml (`Yaml`); a run's knob
becomes an option through `knob_option`, which takes its flag, help, kind, check and default from
the knob's declaration (launcher.runspec.RunSettings) instead of repeating them.

The table itself is in launcher.cli.args. Imports only the foundation (errors, knobs, runspec).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from launcher.knobs import Check
from launcher.runspec import RunSettings

COMMANDS = ("run", "lab", "plan", "scale", "tune", "report", "inspect", "status", "logs", "cancel", "doctor")
KINDS = ("value", "switch", "toggle", "list")  # --x V | --x | --x/--no-x | --x V (repeatable)

Parse = Callable[[str], Any]


@dataclass(frozen=True, kw_only=True)
class Yaml:
    """Where an option lives in dlaunch.yaml (`section.name`) and which values it takes there."""

    section: str
    types: tuple[type[Any], ...]
    what: str  # how an error line describes a good value
    name: str | None = None  # None: the option's dest


@dataclass(frozen=True)
class Option:
    """One flag (or positional) of one or more commands."""

    flag: str
    _: KW_ONLY
    commands: tuple[str, ...]
    help: str = ""
    kind: str = "value"
    check: Check | None = None  # converts and checks a value (its errors name the flag)
    parse: Callable[[str], Parse] | None = None  # makes the argparse type of an option that is no number
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    required: bool = False
    slurm_in: tuple[str, ...] = ()  # the commands where it sits in the SLURM group and needs --slurm
    yaml: Yaml | None = None
    # `merge(flag, yaml)` replaces "flag if given, else yaml" for options whose values combine
    merge: Callable[[Any, Any], Any] | None = None
    knob: str | None = None  # the run knob it is (launcher.runspec)
    per: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # any field for one command: {"plan": {...}}

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
    def argparse_type(self) -> Parse | None:
        """What argparse converts a given value with (None: the text itself)."""
        if self.check is not None:
            return self.check.parser(self.flag)
        return self.parse(self.flag) if self.parse else None

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


def knob_option(name: str, *, commands: tuple[str, ...], slurm_in: tuple[str, ...] = (),
                per: Mapping[str, Mapping[str, Any]] | None = None) -> Option:
    """The option of the run knob `name`, as its declaration says (launcher.runspec.RunSettings):
    the table only adds which commands take it and what one command says differently."""
    declared = {f.name: f for f in dataclasses.fields(RunSettings)}[name]
    k = declared.metadata["knob"]
    unit = {"s": "seconds"}.get(k.unit, k.unit)  # the value's unit names it in --help
    return Option(k.flag, commands=commands, help=k.help, kind=k.kind, check=k.check,
                  default=declared.default, choices=k.choices, slurm_in=slurm_in, knob=name,
                  metavar=unit.upper().replace("-", "_") or None, per=per or {})
