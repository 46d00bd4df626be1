"""`dlaunch.yaml`: per-project defaults, read from the current directory.

Only what a user would otherwise repeat on every command line lives here; a flag given on the
command line always wins. The file is read with `yaml.safe_load` (never `yaml.load`: a config
file must not be able to run code), and every key is checked, so a typo is a one-line
`ConfigError` instead of a silently ignored setting. Layout:

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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_NAME = "dlaunch.yaml"

# key -> (python types accepted, description for error messages)
_SLURM_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "partition": ((str,), "a partition name"),
    "account": ((str,), "an account name"),
    "qos": ((str,), "a QOS name"),
    "constraint": ((str,), "a node feature expression"),
    "time_min": ((int, float), "minutes (a number > 0)"),
    "cpus_per_node": ((int,), "an integer >= 1"),
    "queue_timeout_min": ((int, float), "minutes (a number > 0)"),
    "opts": ((dict,), "a mapping of sbatch option -> value"),
    "topology": ((str,), "a topology file describing the partition's nodes"),
}
_TOP_KEYS = ("slurm",)


@dataclass(frozen=True, kw_only=True)
class SlurmDefaults:
    """SLURM defaults from dlaunch.yaml; None means "not set there"."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time_min: float | None = None
    cpus_per_node: int | None = None
    queue_timeout_min: float | None = None
    opts: Mapping[str, str] = field(default_factory=dict)
    topology: str | None = None


@dataclass(frozen=True, kw_only=True)
class Config:
    """Everything dlaunch.yaml can set."""

    path: str | None = None  # where it was read from; None when there is no file
    slurm: SlurmDefaults = field(default_factory=SlurmDefaults)


def _check_slurm(section: Any, where: str) -> SlurmDefaults:
    if section is None:
        return SlurmDefaults()
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: 'slurm' must be a mapping of settings, got {type(section).__name__}")
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key not in _SLURM_KEYS:
            raise ConfigError(f"{where}: unknown key 'slurm.{key}'; known keys: "
                              f"{', '.join(sorted(_SLURM_KEYS))}")
        types, what = _SLURM_KEYS[key]
        # bool is an int subclass: `time_min: yes` must not read as 1 minute
        if isinstance(value, bool) or not isinstance(value, types):
            raise ConfigError(f"{where}: 'slurm.{key}' must be {what}, got {value!r}")
        if key in ("time_min", "queue_timeout_min") and value <= 0:
            raise ConfigError(f"{where}: 'slurm.{key}' must be {what}, got {value!r}")
        if key == "cpus_per_node" and value < 1:
            raise ConfigError(f"{where}: 'slurm.{key}' must be {what}, got {value!r}")
        if key in ("partition", "account", "qos", "constraint", "topology") and not value.strip():
            raise ConfigError(f"{where}: 'slurm.{key}' must be {what}, got an empty string")
        if key == "opts":
            opts = {}
            for k, v in value.items():
                if not isinstance(k, str) or isinstance(v, (dict, list)) or v is None:
                    raise ConfigError(f"{where}: 'slurm.opts' entries must be option: value, "
                                      f"got {k!r}: {v!r}")
                opts[k] = str(v).lower() if isinstance(v, bool) else str(v)
            value = opts
        values[key] = value
    return SlurmDefaults(**values)


def load_config(directory: str | Path | None = None) -> Config:
    """Read `dlaunch.yaml` from `directory` (default: the current directory), if it exists."""
    import yaml

    path = Path(directory or ".") / CONFIG_NAME
    if not path.is_file():
        return Config()
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read: {e.strerror}") from None
    if data is None:
        return Config(path=where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping with a 'slurm' section, got {type(data).__name__}")
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(_TOP_KEYS)}")
    log.debug("read %s", where)
    return Config(path=where, slurm=_check_slurm(data.get("slurm"), where))
