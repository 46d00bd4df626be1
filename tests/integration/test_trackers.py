"""`dlaunch run --log-to`: a real 2-rank CPU run logged to TensorBoard, MLflow (a file store in
the test's folder) and W&B (offline); what each tracker holds is read back (W&B's offline log by
a reader of its format here) and set against the rank files and result.json. Then MLflow
against a server that hangs, refuses or dies mid-run (a stand-in here), and with no MLflow
variables set at all."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, rank_records, run_result

pytestmark = [pytest.mark.distributed, pytest.mark.alone]

STEPS = 12


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("trackers")
    uri = f"file:{root / 'mlruns'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(root), "MLFLOW_TRACKING_URI": uri,
           "MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_MODE": "offline"}
    run = root / "run"
    done = subprocess.run([sys.executable, "-m", "launcher.cli.main", "run", str(REPO / "workloads" / "mlp.py"),
                           "--gpus", "2", "--steps", str(STEPS), "--no-calibrate", "--log-every", "1",
                           "--log-to", "tensorboard,mlflow,wandb", "--run-dir", str(run)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "--log-to" not in done.stderr, done.stderr  # no tracker warned
    assert "wandb:" not in done.stdout + done.stderr  # W&B kept its own chatter to itself
    return run, root, uri


def _expected(run: Path) -> tuple[list[int], list[float], dict[str, float]]:
    steps = [r for r in rank_records(run, 0) if r["kind"] == "step"]
    result = run_result(run)
    summary = {"summary/samples_per_s": result["samples_per_s"],
               "summary/step_time_median_s": result["step_time_median_s"],
               "summary/data_wait_share": result["data_wait_share"]}
    return [r["step"] for r in steps], [r["loss"] for r in steps], summary


def test_tensorboard_holds_every_step_and_the_summary(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, _ = logged
    steps, losses, summary = _expected(run)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == steps == list(range(1, STEPS + 1))
    assert all(math.isclose(e.value, v, rel_tol=1e-6) for e, v in zip(loss, losses))
    for key, value in summary.items():
        [event] = events.Scalars(key)
        assert event.step == STEPS and math.isclose(event.value, value, rel_tol=1e-6), key


def test_mlflow_holds_a_finished_run_matching_result_json(logged, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run, _, uri = logged
    steps, losses, summary = _expected(run)
    client = MlflowClient(uri)
    [found] = client.search_runs(experiment_ids=["0"])
    assert found.info.run_name == run_result(run)["run_id"] and found.info.status == "FINISHED"
    assert found.data.params["world_size"] == "2" and found.data.params["strategy"] == run_result(run)["strategy"]
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == list(zip(steps, losses))
    for key, value in summary.items():
        assert math.isclose(found.data.metrics[key], value, rel_tol=1e-12), key


def test_wandb_keeps_an_offline_run_matching_result_json(logged):
    run, _, _ = logged
    steps, losses, summary = _expected(run)
    [log] = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(log.read_bytes())
    logged_losses = {row["_step"]: row["train/loss"] for row in history if "train/loss" in row}
    assert logged_losses == dict(zip(steps, losses))
    [last] = [row for row in history if "summary/samples_per_s" in row]
    assert last["_step"] == STEPS
    for key, value in summary.items():
        assert math.isclose(last[key], value, rel_tol=1e-12), key


def _wandb_history(data: bytes) -> list[dict[str, object]]:
    """The history rows of a W&B offline log (wandb has no public reader of it): a 7-byte file
    header, then LevelDB's log format (32 KiB blocks of records, each a 7-byte header of CRC,
    length and type: full, or first / middle / last of a record split over blocks), each record
    a wandb `Record` protobuf."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    block, pos, records, pending = 32768, 7, [], b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
    rows = []
    for payload in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


# --- a tracking server that misbehaves: a stand-in speaking just enough of MLflow's REST API ---

_RUN = {"info": {"run_id": "r1", "run_uuid": "r1", "experiment_id": "0", "run_name": "r", "status": "RUNNING",
                 "start_time": 1, "artifact_uri": "file:/nowhere", "lifecycle_stage": "active", "user_id": "u"},
        "data": {}, "inputs": {}}
_BODY = json.dumps({"run": _RUN, "experiment_id": "0"}).encode()


class _Answers(BaseHTTPRequestHandler):
    """Every request answered with a run; the server stops after `server.answers_left` answers."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server: Any = self.server
        if getattr(server, "hang_on", None) and server.hang_on in self.path:
            server.holding.set()
            time.sleep(60)  # stops answering at the end: the run's closing call hangs
            return
        if server.answers_left <= 0:
            threading.Thread(target=server.shutdown).start()  # the server dies mid-run
            self.close_connection = True
            return
        server.answers_left -= 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(_BODY)))
        self.end_headers()
        self.wfile.write(_BODY)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Any, float, Path]]]:
    root = tmp_path_factory.mktemp("servers")
    hangs = socket.socket()  # listens, never accepts: every request waits for an answer
    hangs.bind(("127.0.0.1", 0))
    hangs.listen(16)
    refuses = socket.socket()  # bound and closed: nothing there
    refuses.bind(("127.0.0.1", 0))
    refused_port = refuses.getsockname()[1]
    refuses.close()
    dies = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    dies.answers_left = 3  # type: ignore[attr-defined]  # the run's creation, its params, one batch
    threading.Thread(target=dies.serve_forever, daemon=True).start()
    uris = {"hang": f"http://127.0.0.1:{hangs.getsockname()[1]}", "refuse": f"http://127.0.0.1:{refused_port}",
            "die": f"http://127.0.0.1:{dies.server_address[1]}", "defaults": None}
    base = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    procs = {}
    for name, uri in uris.items():
        env = {**base, "OMP_NUM_THREADS": "1", "TMPDIR": str(root), **({"MLFLOW_TRACKING_URI": uri} if uri else {})}
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli.main", "run", str(REPO / "workloads" / "mlp.py"), "--gpus", "1",
             "--steps", "60", "--no-calibrate", "--log-every", "1", "--log-to", "mlflow",
             "--run-dir", str(root / name)], cwd=root, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
    done = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        done[name] = (subprocess.CompletedProcess(p.args, p.returncode, out, err), time.time(), root / name)
    yield done
    hangs.close()
    dies.server_close()


def _job_end(run: Path) -> float:
    return max(json.loads(p.read_text())["time"] for p in run.glob("rank-*.summary.json"))


@pytest.mark.parametrize("server", ["hang", "refuse", "die"])
def test_a_tracking_server_that_fails_costs_one_line_and_never_the_result(misbehaving, server):
    done, ended, run = misbehaving[server]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]  # the job's own status
    # the job ran 4 at once on the 2-core AMD EPYC VM: dlaunch left within 10 s of the ranks'
    # end (the tracker's bounded request, 5 s, and the summary)
    assert ended - _job_end(run) <= 10.0, ended - _job_end(run)
    said = [line for line in done.stderr.splitlines() if "--log-to mlflow" in line]
    assert len(said) == 1 and "not logging to it" in said[0], done.stderr
    quiet = [line for line in (done.stdout + done.stderr).splitlines()
             if not line.startswith(("dlaunch:", "[rank")) and any(w in line for w in (
                 "Retry", "urllib3", "Traceback", "mlflow", "View run", "Connection"))]
    assert quiet == [], quiet  # nothing printed by the tracker library
    assert any(w.startswith("--log-to mlflow: ") for w in run_result(run)["warnings"])  # kept in result.json


def test_mlflow_with_no_variables_set_logs_a_run_in_the_run_dir(misbehaving, monkeypatch):
    from mlflow.tracking import MlflowClient

    done, _, run = misbehaving["defaults"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--log-to mlflow: no MLFLOW_TRACKING_URI" in done.stderr and str(run / "mlruns") in done.stderr
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    [found] = MlflowClient(f"file:{run / 'mlruns'}").search_runs(experiment_ids=["0"])
    assert found.info.status == "FINISHED" and found.info.run_name == run_result(run)["run_id"]


def test_ctrl_c_while_a_tracker_holds_the_final_flush_exits_at_once(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    server.answers_left, server.hang_on = 10**6, "runs/update"  # type: ignore[attr-defined]
    server.holding = threading.Event()  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}, "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path), "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{server.server_address[1]}"}
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli.main", "run", str(REPO / "workloads" / "mlp.py"),
                             "--gpus", "1", "--steps", "20", "--no-calibrate", "--log-to", "mlflow",
                             "--run-dir", str(tmp_path / "run")], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the result is written and printed, then the trackers close
            if line.startswith("result: "):
                break
        # inside the final flush: the server holds the closing call
        assert server.holding.wait(30)  # type: ignore[attr-defined]
        time.sleep(0.2)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        code = proc.wait(timeout=30)
        assert time.monotonic() - sent < 3.0  # at once: not the 5 s the flush may take, nor more
    finally:
        proc.kill()
        server.shutdown()
        server.server_close()
    err = proc.stderr.read() if proc.stderr else ""
    assert code == 0 and "Traceback" not in err, err[-3000:]  # the job's own status
    assert "--log-to mlflow: no answer within 0 s of the run's end" in err
    assert run_result(tmp_path / "run")["status"] == "ok"
