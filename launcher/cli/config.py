"""`dlaunch.yaml`: per-project defaults, read from the current directory.

Only what a user would otherwise repeat on every command line lives here; a flag given on the
command line always wins. The keys are not listed here: each is declared with its flag in the
option table (`launcher.cli.args.OPTIONS`, `yaml=`), so a key exists exactly when a flag does.
The file is read with `files.read_yaml_capped` (`yaml.safe_load` with size, nesting and aliases
capped: a config file must neither run code nor be a memory bomb), and every key is checked,
so a typo is a one-line `ConfigError` instead of a silently ignored setting. Layout:

    slurm:
      partition: gpu
      account: my-project
      qos: normal
      time_min: 120            # job time limit in minutes
      constraint: a100
      cpus_per_node: 32        # default: the partition's CPUs per node (sinfo)
      queue_timeout_min: 30    # give up (and cancel) when still pending after this long
      topology: topologies/h100-sxm-8x4node-ib.yaml  # the partition's nodes, for the plan
      opts:                    # extra sbatch options, as with --slurm-opt KEY=VALUE
        mem: 200G

Part of the CLI (only the CLI reads it); imports the option table and never anything that runs a job.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.cli.args import yaml_keys
from launcher.cli.option import Parse, Yaml
from launcher.errors import ConfigError, DlaunchError
from launcher.files import read_yaml_capped

log = logging.getLogger(__name__)

CONFIG_NAME = "dlaunch.yaml"


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything dlaunch.yaml set: `values` by key (`slurm.partition`), only keys it names."""

    path: str | None = None  # where it was read from; None when there is no file
    values: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str) -> object:
        """The value of one dotted key (`slurm.partition`); None when the file does not set it."""
        if key not in yaml_keys():
            raise KeyError(f"{key!r} is not a dlaunch.yaml key")
        return self.values.get(key)


def _checked(key: str, value: Any, declared: Yaml, parse: Parse | None, where: str) -> Any:
    bad = ConfigError(f"{where}: '{key}' must be {declared.what}, got {value!r}")
    # bool is an int subclass: `time_min: yes` must not read as 1 minute
    if isinstance(value, bool) or not isinstance(value, declared.types):
        raise bad
    if isinstance(value, str) and not value.strip():
        raise ConfigError(f"{where}: '{key}' must be {declared.what}, got an empty string")
    if isinstance(value, dict):
        opts = {}
        for k, v in value.items():
            if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
                raise ConfigError(f"{where}: '{key}' entries must be option: value, got {k!r}: {v!r}")
            opts[k] = str(v).lower() if isinstance(v, bool) else str(v)
        return opts
    if parse is not None:
        try:
            parse(str(value))  # the flag's own range check
        except DlaunchError:
            raise bad from None
    return value


def _section(name: str, section: Any, where: str) -> dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: '{name}' must be a mapping of settings, got {type(section).__name__}")
    keys = yaml_keys()
    known = sorted(k for k in keys if k.startswith(f"{name}."))
    values = {}
    for sub, value in section.items():
        key = f"{name}.{sub}"
        if key not in keys:
            raise ConfigError(f"{where}: unknown key '{key}'; known keys: "
                              f"{', '.join(k.partition('.')[2] for k in known)}")
        values[key] = _checked(key, value, *keys[key], where)
    return values


def load_config(directory: str | Path | None = None) -> Config:
    """Read `dlaunch.yaml` from `directory` (default: the current directory), if it exists."""
    path = Path(directory or ".") / CONFIG_NAME
    if not path.is_file():
        return Config()
    where = str(path)
    data = read_yaml_capped(path, error=ConfigError)  # size, nesting and aliases capped
    if data is None:
        return Config(path=where)
    sections = sorted({k.partition(".")[0] for k in yaml_keys()})
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping with a 'slurm' section, got {type(data).__name__}")
    for key in data:
        if key not in sections:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(sections)}")
    log.debug("read %s", where)
    values = {k: v for name in sections for k, v in _section(name, data.get(name), where).items()}
    return Config(path=where, values=values)
