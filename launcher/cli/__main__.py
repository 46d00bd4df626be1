"""`python -m launcher.cli`: the same as the `dlaunch` console script."""

from launcher.cli.main import entry

entry()
