"""Argument types shared by every command's parser: each bad value is one UsageError line."""

from __future__ import annotations

from collections.abc import Callable

from launcher.errors import UsageError


def int_at_least(flag: str, minimum: int) -> Callable[[str], int]:
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
