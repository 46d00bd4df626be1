"""The `dlaunch` command line: the only part of dlaunch that sees argv and exit codes.

One module per subcommand; `args` holds the argument types shared by every parser. Must never
import torch at module level (`dlaunch --help` stays fast); `launcher.runtime` is never imported.
"""
