"""The `dlaunch` command line: the only part of dlaunch that sees argv and exit codes.

One module per subcommand (run, lab, scale, plan, inspect, report, jobs), wired in `main`;
every option is declared once in `args` (what an option is: `option`), and each command reads
its resolved options as one frozen dataclass of `options`; `prepare` turns them into a
`launcher.request.RunRequest` and a run dir, `placement` says where the ranks run. Must never
import torch at module level (`dlaunch --help` stays fast); `launcher.runtime` is never imported.
"""
