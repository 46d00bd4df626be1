"""Masking of secret-looking environment variables wherever dlaunch prints or stores them.

A variable is secret when its name contains TOKEN, KEY, SECRET, PASSWORD, PASSWD or
CREDENTIAL (any case): `HF_TOKEN`, `WANDB_API_KEY`, `AWS_SECRET_ACCESS_KEY`, `DB_PASSWORD`.
The rule errs on the side of masking (`KEYBOARD_LAYOUT` is masked too): a masked harmless value
costs nothing, a printed token in a shared run dir or a CI log cannot be taken back. Only what
is printed or written is masked; the processes themselves still get the real values.

Never imports any other part of dlaunch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """True when an environment variable's name looks like it holds a secret."""
    return bool(_SECRET_NAME.search(name))


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with every secret-looking variable's value replaced by `MASK`."""
    return {k: (MASK if is_secret_name(k) and v else v) for k, v in env.items()}


def masked_spec_dict(spec: Any) -> dict[str, Any]:
    """`spec.to_dict()` with its `env` masked: what goes into `launch.json`. Safe because the ranks
    get their environment from the process: launch.json's `env` records what dlaunch added."""
    data = spec.to_dict()
    if isinstance(data.get("env"), Mapping):
        data["env"] = mask_env(data["env"])
    return data
