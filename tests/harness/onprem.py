"""On-prem pieces for end-to-end tests and `make dev`: a server agent as its own process (`kubeon-gpu
onprem-agent --simulated`: kwok runs its node, as for sim instances) and the gateway's HTTP app on loopback (the
real `gateway.app` app with its own credentials, checking the pools' join tokens)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import TokenReviewer, create_app
from gateway.pool_tokens import token_file
from gateway.service import KubeGateway
from tests.harness.controlplane import free_port
from worker.runtime import kube_api

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class AgentProcess:
    hub_url: str
    join_token_file: Path
    pool: str
    server: str
    state_dir: Path
    gpu_product: str = "NVIDIA-L4"
    gpus: int = 1
    heartbeat_seconds: float = 0.5
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # How the process is started: `make dev` passes its registry's (children die with it, leftovers are reaped).
    popen: Callable[..., subprocess.Popen[bytes]] = field(default=subprocess.Popen, repr=False)

    @property
    def log_file(self) -> Path:
        return self.state_dir.parent / f"agent-{self.server}.log"

    @property
    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    @property
    def credentials_dir(self) -> Path:
        return self.state_dir / "credentials"

    def state(self) -> dict[str, Any]:
        path = self.state_dir / "state.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}

    def start(self) -> AgentProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child
        self._proc = self.popen(
            [sys.executable, "-m", "worker.cli", "onprem-agent", "--hub-url", self.hub_url,
             "--join-token-file", str(self.join_token_file), "--pool", self.pool, "--server", self.server,
             "--gpu-product", self.gpu_product, "--gpus", str(self.gpus), "--state-dir", str(self.state_dir),
             "--heartbeat-seconds", str(self.heartbeat_seconds), "--simulated", "--label", "rack=r1"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        out.close()
        return self

    def signal(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        self._proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: what a power cut does."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class GatewayThread:
    """The gateway's HTTP app (`POST /v1/join`) on a loopback port, in a thread; start and stop at will."""

    kubeconfig: Path
    ticket_key: bytes
    tokens_dir: Path
    port: int = field(default_factory=free_port)
    _server: uvicorn.Server | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mount_join_token(self, location: str, token: str) -> None:
        """What the chart does with the location's existingSecret."""
        path = token_file(self.tokens_dir, location)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)

    def start(self) -> GatewayThread:
        api = kube_api(self.kubeconfig)
        app = create_app(KubeGateway(api, self.ticket_key), TokenReviewer(api), frozenset(),
                         pool_tokens_dir=self.tokens_dir)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway on {self.url} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
        self._server = self._thread = None
