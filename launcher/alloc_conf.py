"""The caching-allocator setting dlaunch adds for CUDA ranks: expandable segments (fewer
fragmentation OOMs with changing shapes; the planner's memory model assumes it).

torch 2.9 renamed the variable: `PYTORCH_ALLOC_CONF` (every accelerator's allocator) replaces
`PYTORCH_CUDA_ALLOC_CONF`, which still works there but is deprecated; before 2.9 only the old
name exists. Which of the two torch reads first when both are set has changed between versions,
so a user who set either one gets nothing added: a second variable could override theirs. One
rule for the ranks' environment (backends.torchrun) and the plan's (plan.search); pure but for
`installed_torch_version`, which reads the package metadata once (never imports torch).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import metadata

ALLOC_CONF = "PYTORCH_ALLOC_CONF"
CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"  # the name before torch 2.9
EXPANDABLE_SEGMENTS = "expandable_segments:True"
RENAMED_IN = (2, 9)


@functools.cache
def installed_torch_version() -> str | None:
    """The version of the torch this interpreter (the ranks') would import; None without torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def alloc_conf_name(torch_version: str | None) -> str:
    """The variable torch `torch_version` reads: the new name from 2.9 on (local builds such as
    2.9.0+cu128 and release candidates included), the old one before, for 2.9's own nightlies
    and source builds (2.9.0.dev2025..., 2.9.0a0+git...: the earlier ones predate the rename)
    and when the version is unknown: every version reads the old name, at worst with a warning."""
    found = re.match(r"(\d+)\.(\d+)(?:\.\d+)?(\S*)", torch_version or "")
    if found is None:
        return CUDA_ALLOC_CONF
    minor = (int(found[1]), int(found[2]))
    unreleased = re.match(r"(a\d|\.?dev)", found[3]) is not None
    return ALLOC_CONF if minor > RENAMED_IN or (minor == RENAMED_IN and not unreleased) else CUDA_ALLOC_CONF


def alloc_conf_env(user_env: Mapping[str, str], torch_version: str | None) -> dict[str, str]:
    """Expandable segments under the name `torch_version` reads; nothing when `user_env` sets either name."""
    user_set = ALLOC_CONF in user_env or CUDA_ALLOC_CONF in user_env
    return {} if user_set else {alloc_conf_name(torch_version): EXPANDABLE_SEGMENTS}
