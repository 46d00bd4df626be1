"""A plain-text progress bar for long multi-step commands (sweeps).

Never imports any other part of dlaunch.
"""

from __future__ import annotations

from typing import IO


class ProgressBar:
    """`[#####.....] 2/4 points  ws2-r0 running`: redrawn in place on a terminal, one line
    per update otherwise (CI logs)."""

    def __init__(self, total: int, out: IO[str] | None, width: int = 24) -> None:
        self.total, self.out, self.width = total, out, width
        self.tty = bool(out is not None and getattr(out, "isatty", lambda: False)())
        self._drawn = False

    def update(self, done: int, label: str) -> None:
        """Redraw the bar with `done` points finished."""
        if self.out is None:
            return
        filled = self.width * done // max(1, self.total)
        bar = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} points  {label}"
        if self.tty:
            self.out.write("\r\x1b[2K" + bar)
            self._drawn = True
        else:
            self.out.write(bar + "\n")
        self.out.flush()

    def note(self, text: str) -> None:
        """Print a line that stays (above the bar on a terminal)."""
        if self.out is None:
            return
        self.out.write(("\r\x1b[2K" if self._drawn else "") + text + "\n")
        self._drawn = False
        self.out.flush()
