"""Talk to SLURM about jobs that exist: state, pending reason, cancel, partitions, logs.

Every call is an argv list (never a shell), with a timeout, and a SLURM command that is missing or
fails becomes a `LaunchError` with one line. Job state comes from `scontrol show job` (fast, from
slurmctld's memory, has the pending reason and restart count) and falls back to `sacct` once
slurmctld has forgotten the job (MinJobAge, 300 s by default). Never imports launcher.runtime,
drivers, cli or report, nor submitit (only SLURM's own commands).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.backends.monitor import read_json_object
from launcher.errors import LaunchError, UsageError
from launcher.rundir import SLURM_FILE, RunPaths

TIMEOUT_S = 30.0
# states after which a job does not run again (a requeued job shows PENDING, not these)
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED"})
# pending reasons that will not go away by waiting, in words
REASONS = {
    "PartitionNodeLimit": "the job asks for more nodes than the partition allows or has",
    "PartitionTimeLimit": "the time limit is above the partition's maximum",
    "PartitionConfig": "the request does not fit the partition's configuration",
    "ReqNodeNotAvail": "a required node is down, drained or reserved",
    "Resources": "waiting for free nodes",
    "Priority": "other jobs are ahead in the queue",
    "QOSMaxNodePerJobLimit": "the QOS allows fewer nodes per job",
    "AssocMaxNodesPerJobLimit": "the account allows fewer nodes per job",
    "BeginTime": "waiting for its start time (e.g. after a requeue)",
    "Dependency": "waiting for a dependency",
    "JobHeldUser": "held by the user (scontrol release to start)",
    "JobHeldAdmin": "held by an administrator",
}


def slurm_cmd(argv: Sequence[str], *, check: bool = True,
              timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run a SLURM client command; a missing binary or a hang is one LaunchError line."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found on PATH; run on a machine with the SLURM client commands") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{' '.join(argv)}` did not answer in {timeout:.0f} s; "
                          "is slurmctld up (`scontrol ping`)?") from None
    if check and proc.returncode != 0:
        msg = " ".join(proc.stderr.split()) or f"exit {proc.returncode}"
        raise LaunchError(f"`{' '.join(argv)}` failed: {msg}")
    return proc


@dataclass(frozen=True, kw_only=True)
class JobInfo:
    """One job as SLURM sees it now."""

    job_id: str
    state: str  # base state: PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, ...
    reason: str = ""  # pending/failure reason ("None" when there is none)
    nodes: str = ""  # NodeList, e.g. n[1-2]
    exit_code: str = ""  # "rc:signal"
    restarts: int = 0
    submit_time: str = ""
    start_time: str = ""
    end_time: str = ""
    source: str = "scontrol"  # scontrol | sacct

    @property
    def final(self) -> bool:
        """True once the job will not run again."""
        return self.state in FINAL_STATES

    @property
    def exit_status(self) -> int:
        """The batch script's exit code (0 when unknown)."""
        head = self.exit_code.split(":", 1)[0]
        return int(head) if head.isdigit() else 0

    def reason_text(self) -> str:
        """`Reason (what it means)`, or '' when SLURM gives none."""
        if not self.reason or self.reason == "None":
            return ""
        words = REASONS.get(self.reason)
        return f"{self.reason} ({words})" if words else self.reason


_KV = re.compile(r"(\S+?)=(.*?)(?=\s+\S+?=|\s*$)")


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job -o` output (one line of Key=Value pairs) -> dict."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return {m.group(1): m.group(2) for m in _KV.finditer(line)}


def _base_state(state: str) -> str:
    # sacct: "CANCELLED by 0"; scontrol may carry flags after '+'
    return state.split()[0].split("+")[0] if state else "UNKNOWN"


def query_job(job_id: str) -> JobInfo | None:
    """The job's state from slurmctld, else from accounting; None if SLURM does not know it."""
    proc = slurm_cmd(["scontrol", "show", "job", "-o", str(job_id)], check=False)
    if proc.returncode == 0 and proc.stdout.strip():
        d = parse_scontrol(proc.stdout)
        restarts = d.get("Restarts", "0")
        return JobInfo(job_id=str(job_id), state=_base_state(d.get("JobState", "")), reason=d.get("Reason", ""),
                       nodes=d.get("NodeList", "") or "", exit_code=d.get("ExitCode", ""),
                       restarts=int(restarts) if restarts.isdigit() else 0, submit_time=d.get("SubmitTime", ""),
                       start_time=d.get("StartTime", ""), end_time=d.get("EndTime", ""))
    if "invalid job id" not in proc.stderr.lower() and proc.returncode != 0:
        raise LaunchError(f"`scontrol show job {job_id}` failed: {' '.join(proc.stderr.split())}")
    acct = slurm_cmd(["sacct", "-X", "-n", "-P", "-j", str(job_id), "-o",
                      "JobID,State,Reason,NodeList,ExitCode,Submit,Start,End"], check=False)
    for line in acct.stdout.splitlines():
        f = line.split("|")
        if len(f) >= 8 and f[0] == str(job_id):
            return JobInfo(job_id=str(job_id), state=_base_state(f[1]), reason=f[2], nodes=f[3], exit_code=f[4],
                           submit_time=f[5], start_time=f[6], end_time=f[7], source="sacct")
    return None


def in_queue(job_id: str) -> bool:
    """True while the job is pending, running or completing (squeue lists it)."""
    proc = slurm_cmd(["squeue", "-h", "-j", str(job_id), "-o", "%T"], check=False)
    return proc.returncode == 0 and bool(proc.stdout.strip())


def cancel_job(job_id: str) -> None:
    """scancel the job (its ranks get SIGTERM; the step is killed after KillWait)."""
    slurm_cmd(["scancel", str(job_id)])


def list_partitions() -> list[str]:
    """Partition names (the default one first), or [] when sinfo cannot tell."""
    try:
        proc = slurm_cmd(["sinfo", "-h", "-o", "%P"], check=False, timeout=10)
    except LaunchError:
        return []
    names = [p.strip() for p in proc.stdout.split() if p.strip()]
    return sorted({n.rstrip("*") for n in names}, key=lambda n: (n + "*" not in names, n))


def partition_shape(partition: str | None) -> tuple[int | None, int]:
    """(CPUs per node, GPUs per node): the smallest in the partition; GPUs from GRES such as
    `gpu:8` or `gpu:h100:8(S:0-1)`, 0 when its nodes have none."""
    argv = ["sinfo", "-h", "-o", "%P|%c|%G"] + (["-p", partition] if partition else [])
    try:
        proc = slurm_cmd(argv, check=False, timeout=10)
    except LaunchError:
        return None, 0
    rows = [ln.split("|") for ln in proc.stdout.splitlines() if ln.count("|") == 2]
    if not partition:  # the default partition is marked with '*'
        rows = [r for r in rows if r[0].endswith("*")] or rows
    cpus = [int(m.group()) for r in rows if (m := re.match(r"\d+", r[1]))]
    gpus = [int(m.group(1)) for r in rows if (m := re.search(r"gpu(?::[^:,(]+)?:(\d+)", r[2].lower()))]
    return (min(cpus) if cpus else None), (min(gpus) if gpus else 0)


def read_slurm_file(run_dir: Path) -> dict:
    """RUN_DIR/slurm.json (what `run --slurm` wrote at submission)."""
    path = RunPaths(root=run_dir).slurm
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{str(run_dir)!r} is not a SLURM run (no {SLURM_FILE}); "
                         "give the run dir of a `dlaunch run --slurm` or a job id") from None
    except (OSError, ValueError) as e:
        raise LaunchError(f"cannot read {path}: {e}") from None


def resolve(ref: str, *, roots: Sequence[str | Path] = ("runs",)) -> tuple[Path | None, str]:
    """RUN_DIR_OR_JOB -> (run dir or None, job id). A job id is asked of slurmctld first (the job's
    log path lies inside its run dir): job ids restart at 1 on a cluster whose state was wiped, so
    an old runs/*/slurm.json may name the same id. Only for a job slurmctld has forgotten are
    `<root>/*/slurm.json` (and one level deeper, for sweeps) searched, newest submission first."""
    path = Path(ref).expanduser()
    if path.is_dir():
        info = read_slurm_file(path)
        return path.resolve(), str(info["job_id"])
    if not ref.isdigit():
        raise UsageError(f"{ref!r} is neither a run directory nor a SLURM job id")
    proc = slurm_cmd(["scontrol", "show", "job", "-o", ref], check=False)
    out = parse_scontrol(proc.stdout).get("StdOut", "") if proc.returncode == 0 else ""
    for parent in Path(out).parents if out else ():
        if RunPaths(root=parent).slurm.is_file():
            return parent, ref
    if proc.returncode == 0 and proc.stdout.strip():
        return None, ref  # a live job not started by `dlaunch run --slurm`
    found: list[tuple[float, Path]] = []
    for root in roots:
        for pattern in (f"*/{SLURM_FILE}", f"*/*/{SLURM_FILE}"):
            for f in Path(root).glob(pattern):
                if str((data := read_json_object(f)).get("job_id")) == ref:
                    found.append((float(data.get("submitted_at", 0.0)), f.parent.resolve()))
    return (max(found)[1] if found else None), ref


def task_logs(folder: Path, job_id: str) -> list[Path]:
    """submitit's per-node task logs (<job>_<task>_log.out/.err), in task order."""
    files = list(folder.glob(f"{job_id}_*_log.out")) + list(folder.glob(f"{job_id}_*_log.err"))

    def key(p: Path) -> tuple[int, str]:
        task = p.name[len(job_id) + 1:].split("_", 1)[0]
        return (int(task) if task.isdigit() else 1 << 30, p.suffix)

    return sorted(files, key=key)
