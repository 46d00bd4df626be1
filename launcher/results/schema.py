"""Checking that data read back from a file has the shape dlaunch wrote: a value against a type
hint, a dict against a dataclass's fields. Every check returns why the data is wrong (one short
phrase) or None, so each reader decides whether a bad piece is skipped or refused.

Pure (no I/O). Never imports report, jobs, backends, cli or runtime.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from launcher.files import shown


def kind_of(value: Any) -> str:
    """What a JSON value is, for a message: `a string 'slow'`, `a list`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, str):
        return f"the string {shown(value, 24)}"
    return f"{type(value).__name__} {shown(value, 24)}"


def is_number(value: Any) -> bool:
    """A finite int or float (a bool is not a number here, nor NaN or an infinity)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


# the scalar hints and the test of a value for each
_SCALARS: dict[Any, Callable[[Any], bool]] = {
    type(None): lambda v: v is None, bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool), float: is_number}


def type_problem(value: Any, hint: Any) -> str | None:
    """Why `value` does not fit the type hint `hint`; None when it does (unknown hints fit)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        if any(type_problem(value, a) is None for a in args):
            return None
        return f"expected {' or '.join(_hint_name(a) for a in args)}, got {kind_of(value)}"
    ok = True  # unknown hints fit
    if hint in _SCALARS:
        ok = _SCALARS[hint](value)
    elif dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, dict):
            return dataclass_problem(hint, value)
        ok = False
    elif origin in (tuple, list) or hint in (tuple, list):
        if isinstance(value, list | tuple):
            item = args[0] if args else Any
            return next((f"item {i}: {p}" for i, v in enumerate(value)
                         if (p := type_problem(v, item)) is not None), None)
        ok = False
    elif origin in (dict, Mapping) or hint in (dict, Mapping):
        if isinstance(value, dict) and len(args) == 2:
            return next((f"key {shown(k, 24)}: {p}" for k, v in value.items()
                         if (p := type_problem(v, args[1])) is not None), None)
        ok = isinstance(value, dict)
    return None if ok else f"expected {_hint_name(hint)}, got {kind_of(value)}"


def dataclass_problem(cls: type, data: Any, *, unknown_ok: bool = False) -> str | None:
    """Why the dict `data` cannot be the fields of dataclass `cls` (a key it does not have,
    a required one missing, a value of the wrong type); None when it can."""
    if not isinstance(data, dict):
        return f"expected an object, got {kind_of(data)}"
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not unknown_ok and (extra := sorted(str(k) for k in data if k not in fields)):
        return f"unknown key {shown(extra[0], 40)}"
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                return f"missing key {name!r}"
            continue
        if (problem := type_problem(data[name], hints[name])) is not None:
            return f"{name!r}: {problem}"
    return None


def _hint_name(hint: Any) -> str:
    if dataclasses.is_dataclass(hint) or hint in (dict, Mapping) or typing.get_origin(hint) in (dict, Mapping):
        return "an object"
    if hint in (tuple, list) or typing.get_origin(hint) in (tuple, list):
        return "a list"
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))
