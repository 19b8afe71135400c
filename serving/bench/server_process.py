"""One deployment's server as a child process: start it, wait until its gRPC health check
says SERVING, read its ServerInfo, stop it with SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTH_POLL_SECONDS = 0.5


@dataclasses.dataclass
class Deployment:
    """A server command line to benchmark. ``command`` may use ``{port}``, ``{http_port}``
    (free loopback ports chosen at start), ``{python}`` (this interpreter) and
    ``{shiftjax}`` (the ``shiftjax`` script beside it, so no activated venv is needed)."""

    name: str
    command: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    startup_timeout_s: float = 1800.0  # big models compile for minutes on the first start
    stop_timeout_s: float = 120.0

    @classmethod
    def from_dict(cls, item: dict) -> "Deployment":
        unknown = set(item) - {f.name for f in dataclasses.fields(cls)}
        if unknown or "name" not in item or "command" not in item:
            raise ValueError(f"a deployment needs name and command (and may have env, startup_timeout_s, "
                             f"stop_timeout_s); got keys {sorted(item)}")
        command = item["command"]
        command = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
        return cls(item["name"], command, {k: str(v) for k, v in item.get("env", {}).items()},
                   float(item.get("startup_timeout_s", 1800.0)), float(item.get("stop_timeout_s", 120.0)))


def read_deployments(path: str | Path) -> tuple[list[Deployment], dict]:
    """The deployments of a JSON file: a list of deployments, or an object with
    ``deployments`` and optionally ``device`` (what they run on)."""
    data = json.loads(Path(path).read_text())
    meta = {} if isinstance(data, list) else {k: v for k, v in data.items() if k != "deployments"}
    items = data if isinstance(data, list) else data.get("deployments")
    if not items:
        raise ValueError(f"--deployments {path}: no deployments (a list, or an object with 'deployments')")
    deployments = [Deployment.from_dict(item) for item in items]
    names = [d.name for d in deployments]
    if len(set(names)) != len(names):
        raise ValueError(f"--deployments {path}: names must be unique, got {names}")
    return deployments, meta


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shiftjax_script() -> str:
    """The ``shiftjax`` console script of this interpreter's environment, else the name."""
    beside = Path(sys.executable).parent / "shiftjax"
    return str(beside) if beside.is_file() else "shiftjax"


class ServerProcess:
    """A started deployment; ``grpc_address`` and ``http_address`` are on loopback."""

    def __init__(self, deployment: Deployment, log_path: Path):
        self.deployment = deployment
        self.port, self.http_port = free_port(), free_port()
        fields = {"port": self.port, "http_port": self.http_port, "python": sys.executable,
                  "shiftjax": shiftjax_script()}
        self.command = [part.format(**fields) for part in deployment.command]
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self.exit_code: int | None = None

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def start(self) -> None:
        """Starts the server and returns once it is SERVING; raises RuntimeError (with the
        log's tail) if it exits or does not become ready in time."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        print(f"[{self.deployment.name}] starting: {shlex.join(self.command)}", file=sys.stderr)
        began = time.monotonic()
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                        env=os.environ | self.deployment.env)
        log.close()
        deadline = began + self.deployment.startup_timeout_s
        with grpc.insecure_channel(self.grpc_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"[{self.deployment.name}] exited with {self.process.returncode} while "
                                       f"starting; the end of {self.log_path}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"[{self.deployment.name}] not SERVING after "
                                       f"{self.deployment.startup_timeout_s:.0f} s; see {self.log_path}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass  # not listening yet
                time.sleep(HEALTH_POLL_SECONDS)
        self.startup_seconds = time.monotonic() - began
        print(f"[{self.deployment.name}] SERVING after {self.startup_seconds:.1f} s", file=sys.stderr)

    def server_info(self, include_step_trace: bool = False) -> dict:
        """ServerInfo with ``info_json`` decoded (empty dict if the server cannot say);
        with ``include_step_trace``, its ``step_trace`` of the last steps."""
        from google.protobuf.json_format import MessageToDict

        from shiftjax.serving.proto.shiftjax.v1 import inference_pb2, inference_pb2_grpc

        try:
            with grpc.insecure_channel(self.grpc_address) as channel:
                reply = inference_pb2_grpc.InferenceServiceStub(channel).ServerInfo(
                    inference_pb2.ServerInfoRequest(include_step_trace=include_step_trace), timeout=30.0)
        except grpc.RpcError as error:
            return {"error": f"{error.code().name}: {error.details()}"}
        info = MessageToDict(reply, preserving_proto_field_name=True)
        try:
            info["info_json"] = json.loads(info.get("info_json") or "{}")
        except ValueError:
            pass
        return info

    def stop(self) -> int | None:
        """SIGTERM, then waits for the graceful drain; kills only a server that outlives
        ``stop_timeout_s`` (and says so)."""
        if self.process is None or self.process.poll() is not None:
            self.exit_code = None if self.process is None else self.process.returncode
            return self.exit_code
        self.process.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.process.wait(timeout=self.deployment.stop_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"[{self.deployment.name}] still running {self.deployment.stop_timeout_s:.0f} s after "
                  "SIGTERM; killing it", file=sys.stderr)
            self.process.kill()
            self.exit_code = self.process.wait()
        print(f"[{self.deployment.name}] stopped (exit {self.exit_code})", file=sys.stderr)
        return self.exit_code

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ServerInfoSampler:
    """Polls ServerInfo on a thread while a run goes on, keeping what changes with load:
    ``running``, ``waiting``, ``free_pages`` and the per-mode step and token counters. The
    differences between samples give the server's queue and its mode mix over time, with
    no step trace needed. ``time`` is Unix seconds (the client's clock)."""

    FIELDS = ("running", "waiting", "free_pages", "steps", "switches", "preemptions")

    def __init__(self, address: str, interval_s: float = 0.25):
        import threading

        self.address, self.interval_s = address, interval_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="server-info-sampler", daemon=True)

    def __enter__(self) -> "ServerInfoSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _poll(self) -> None:
        from shiftjax.serving.proto.shiftjax.v1 import inference_pb2, inference_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            while True:
                try:
                    reply = stub.ServerInfo(inference_pb2.ServerInfoRequest(), timeout=5.0)
                    sample = {name: int(getattr(reply, name)) for name in self.FIELDS}
                    sample |= {"time": time.time(), "steps_by_mode": dict(reply.steps_by_mode),
                               "tokens_by_mode": dict(reply.tokens_by_mode)}
                    self.samples.append(sample)
                except grpc.RpcError:
                    pass  # a busy or draining server: the next sample will tell
                if self._stop.wait(self.interval_s):
                    return
