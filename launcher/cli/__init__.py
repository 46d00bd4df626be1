"""The `dlaunch` command line: the only part of dlaunch that sees argv and exit codes.

One module per subcommand (run, lab, scale, tune, plan, inspect, report, runs, doctor), wired in
`main`; every option is declared once in `args` (what an option is: `option`), and each command
reads its resolved options as one frozen dataclass of `options`; `prepare` turns them into a
`launcher.request.RunRequest`, its placement and a run dir. Must never import torch at module
level (`dlaunch --help` stays fast); `launcher.runtime` is never imported.
"""
