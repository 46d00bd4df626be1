"""Experiment trackers (`dlaunch run --log-to tensorboard,mlflow,wandb`): the run's metrics, as
dlaunch records them, sent to the trackers people already read.

The launcher logs, not the ranks: a thread tails rank 0's records while the job runs (every
FEED_INTERVAL_S, so the curves move during training) and, once the run is over, logs the
summary result.json holds. So the ranks need no tracker package, local and SLURM runs take one
path (the run dir is on a file system the launcher reads), and a tracker shows exactly what
the rank files and result.json say.

Per step, rank 0's train/* metrics (`step_metrics`: its samples/s is rank 0's share); once, at
the last step, result.json's headline numbers under summary/; as params, `tracker_params`.

TensorBoard: event files in RUN_DIR/tensorboard (torch.utils.tensorboard; needs `tensorboard`).
MLflow: one run named after the run id, where MLFLOW_TRACKING_URI (and MLFLOW_EXPERIMENT_NAME)
say, mlflow's defaults otherwise; ended FINISHED or FAILED with the run. W&B: a run in project
WANDB_PROJECT or "dlaunch", offline unless WANDB_MODE or WANDB_API_KEY is set: a launcher must
never wait for a login prompt.

A tracker that cannot start or log (no server, a bad URI, a server that hangs or dies) costs one
warning line and is dropped: the run goes on, its files keep every metric, and result.json
lists it under `warnings`. Tracker calls run on the feed's thread only, each MLflow request
bounded (CALL_TIMEOUT_S, no retries unless the MLFLOW_HTTP_REQUEST_* variables ask), and at
the end the trackers get FINISH_WAIT_S: a tracker never delays the result, the exit or the next
job. With no MLFLOW_TRACKING_URI and an MLflow without its sqlite store (mlflow-skinny), the
run goes to RUN_DIR/mlruns (a file store), said in one line.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from launcher.errors import LaunchError
from launcher.results.types import RunResult
from launcher.rundir import RunPaths
from launcher.runspec import LaunchSpec

# the module each of TRACKERS needs, and what to install
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow-skinny"),
          "wandb": ("wandb", "wandb")}
FEED_INTERVAL_S = 5.0
FINISH_WAIT_S = 5.0  # at the end, the trackers' last calls get this long before they are dropped
CALL_TIMEOUT_S = 5  # an MLflow request's timeout, unless MLFLOW_HTTP_REQUEST_TIMEOUT says otherwise
TENSORBOARD_SUBDIR = "tensorboard"


def check_trackers(names: tuple[str, ...]) -> None:
    """LaunchError naming the first tracker whose package is not installed (before the run writes anything)."""
    for name in names:
        module, package = _NEEDS[name]
        if importlib.util.find_spec(module) is None:
            raise LaunchError(f"--log-to {name}: the {module} package is not installed in this "
                              f"Python; pip install {package}, or drop {name} from --log-to")


class Sink(Protocol):
    """One tracker's run."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, ok: bool) -> None: ...


class _TensorBoard:
    def __init__(self, run_dir: Path, params: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_SUBDIR))
        self.writer.add_text("dlaunch/params", json.dumps(dict(params), indent=1), 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self, ok: bool) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, run_dir: Path, params: Mapping[str, Any]) -> None:
        import mlflow
        import mlflow.environment_variables as mlflow_env
        from mlflow.entities import Metric, Param, RunTag

        # one bounded try per request unless the user's MLFLOW_HTTP_REQUEST_* say otherwise
        # (mlflow's defaults retry 7 times over minutes, a warning per retry)
        mlflow_env.MLFLOW_HTTP_REQUEST_MAX_RETRIES.default = 0
        mlflow_env.MLFLOW_HTTP_REQUEST_TIMEOUT.default = CALL_TIMEOUT_S
        mlflow_env.MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.default = True  # not into dlaunch's output
        if mlflow_env.MLFLOW_TRACKING_URI.get() is None and importlib.util.find_spec("sqlalchemy") is None:
            # mlflow's default store is sqlite, which mlflow-skinny cannot open: the run dir's own
            store = run_dir / "mlruns"
            mlflow_env.MLFLOW_ALLOW_FILE_STORE.default = True
            mlflow.set_tracking_uri(f"file:{store}")
            self.note = (f"no MLFLOW_TRACKING_URI, and this MLflow has no sqlite store: logging to {store} "
                         f"(mlflow ui --backend-store-uri file:{store})")
        self.metric = Metric
        # the client, by run id: mlflow's fluent API keeps its active run per thread, and the
        # summary is logged from another thread than the steps
        self.client = mlflow.MlflowClient()
        # the experiment as MLFLOW_EXPERIMENT_NAME / _ID say (mlflow's own resolution)
        self.run_id = mlflow.start_run(run_name=str(params["run_id"])).info.run_id
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()],
                              tags=[RunTag("dlaunch.run_dir", str(run_dir))])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, now_ms, step) for k, v in metrics.items()])

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


class _Wandb:
    def __init__(self, run_dir: Path, params: Mapping[str, Any]) -> None:
        import wandb

        # WANDB_MODE, when set, is read by wandb itself
        mode: Literal["online", "offline"] | None = (
            None if os.environ.get("WANDB_MODE") else "online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dlaunch"), name=str(params["run_id"]),
                              dir=str(run_dir), config=dict(params), mode=mode,
                              settings=wandb.Settings(silent=True, console="off"))  # not into dlaunch's output

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


_SINKS: dict[str, Callable[[Path, Mapping[str, Any]], Sink]] = {
    "tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb}


def tracker_params(spec: LaunchSpec) -> dict[str, Any]:
    """What each tracker's run is labelled with."""
    return {"run_id": spec.run_id, "workload": Path(spec.workload).name, "world_size": spec.world_size,
            "num_nodes": spec.nodes, "device": spec.device, "strategy": "script" if spec.is_script else spec.strategy,
            "precision": spec.precision, "micro_batch": spec.micro_batch,
            "grad_accum": spec.grad_accum, "steps": spec.steps}


def step_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The per-step metrics of one step record (a loss written as null, NaN, is left out)."""
    out: dict[str, float] = {}
    if isinstance(record.get("loss"), (int, float)):
        out["train/loss"] = float(record["loss"])
    if isinstance(step_s := record.get("step_time_s"), (int, float)):
        out["train/step_time_s"] = float(step_s)
        if step_s > 0 and isinstance(record.get("samples"), (int, float)):
            out["train/samples_per_s"] = float(record["samples"]) / float(step_s)
    if isinstance(record.get("data_wait_s"), (int, float)):
        out["train/data_wait_s"] = float(record["data_wait_s"])
    return out


def summary_metrics(result: RunResult) -> dict[str, float]:
    """result.json's headline numbers, under summary/."""
    out = {"summary/samples_per_s": result.samples_per_s, "summary/units_per_s": result.units_per_s,
           "summary/step_time_median_s": result.step_time_median_s, "summary/data_wait_share": result.data_wait_share}
    if result.exposed_comm_s is not None:
        out["summary/exposed_comm_s"] = result.exposed_comm_s
    return out


class TrackerFeed:
    """Tails rank 0's records into the trackers named while the run goes, on its own thread (see
    the module docstring); `finish` has the summary logged and the trackers closed. A dropped
    tracker is one warning line, kept in `dropped` (the caller records it in result.json)."""

    def __init__(self, names: tuple[str, ...], run_dir: str | Path, params: Mapping[str, Any], *,
                 interval_s: float = FEED_INTERVAL_S, warn: Callable[[str], None] | None = None) -> None:
        self.names, self.run_dir, self.params, self.interval_s = names, Path(run_dir), dict(params), interval_s
        self.warn = warn or (lambda text: print(f"dlaunch: {text}", file=sys.stderr, flush=True))
        self.sinks: dict[str, Sink] = {}
        self.dropped: dict[str, str] = {}  # tracker -> why, as warned
        self.closed: set[str] = set()
        self.last_step = 0
        self._result: RunResult | None = None
        self._offset, self._inode = 0, -1
        self._stop = threading.Event()
        # set when the thread is through: finish waits on it, not on join (Python before 3.13
        # takes a thread whose join Ctrl-C interrupted for finished)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlaunch-trackers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            # mlflow logs every retry as a warning through a handler of its own (urllib3's reach
            # dlaunch's, which passes other libraries' errors only); dlaunch says a tracker's trouble once
            logging.getLogger("mlflow").setLevel(logging.ERROR)
            self._open()  # here, not in start: mlflow's import alone takes a second
            self._drain()
            while not self._stop.wait(self.interval_s):
                self._drain()
            self._end()
        finally:
            self._done.set()

    def _end(self) -> None:
        """What is left of rank 0's records, the summary, and every tracker closed."""
        self._drain()
        if self._result is not None:
            self._log(summary_metrics(self._result), self.last_step)
        ok = self._result is not None and self._result.status == "ok"
        for name, sink in list(self.sinks.items()):
            try:
                sink.close(ok)
                self.closed.add(name)
            except Exception as e:  # noqa: BLE001
                self._drop(name, f"closing failed ({_first_line(e)})")

    def _drop(self, name: str, why: str) -> None:
        self.sinks.pop(name, None)
        if name not in self.dropped:
            self.dropped[name] = why
            self.warn(f"--log-to {name}: {why}; not logging to it (the run dir keeps every metric)")

    def _open(self) -> None:
        for name in self.names:
            try:
                self.sinks[name] = sink = _SINKS[name](self.run_dir, self.params)
            except Exception as e:  # noqa: BLE001 - any tracker failure costs a line, never the run
                self._drop(name, f"could not start ({_first_line(e)})")
                continue
            if note := getattr(sink, "note", None):
                self.warn(f"--log-to {name}: {note}")

    def _drain(self) -> None:
        """Log the step records rank 0 appended since the last call."""
        path = RunPaths(root=self.run_dir).records(0)
        try:
            st = path.stat()
            if st.st_ino != self._inode or st.st_size < self._offset:  # a restart's new file
                self._offset, self._inode = 0, st.st_ino
            with open(path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return  # not written yet
        whole = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
        self._offset += len(whole)
        for line in whole.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") == "step" and isinstance(record.get("step"), int):
                self.last_step = max(self.last_step, record["step"])
                self._log(step_metrics(record), record["step"])

    def _log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(metrics, step)
            except Exception as e:  # noqa: BLE001
                self._drop(name, f"logging failed ({_first_line(e)})")

    def finish(self, result: RunResult | None, *, wait_s: float = FINISH_WAIT_S) -> dict[str, str]:
        """Have what is left and the summary logged and every tracker closed, waiting at most
        `wait_s` (Ctrl-C: not at all); a tracker not done by then is dropped. Returns `dropped`."""
        self._result = result
        self._stop.set()
        if self._thread.ident is None:  # never started: nothing runs beside this thread
            self._end()
            return self.dropped
        try:
            self._done.wait(wait_s)
        except KeyboardInterrupt:  # the result is written: stop waiting, exit
            wait_s = 0.0
        if not self._done.is_set():
            for name in (n for n in self.names if n not in self.closed):
                self._drop(name, f"no answer within {wait_s:g} s of the run's end, its last metrics not logged")
        return self.dropped


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".strip()
