"""On-prem pieces for end-to-end tests and `make dev`: a server agent as its own process (`kubeon-gpu
onprem-agent --simulated`: kwok runs its node, as for sim instances), registered by an operator and enrolling
with the pool's enrolment token, pinned to the clusters' gateways (``write_gateways``), and the gateway's HTTP app
on loopback (the real `gateway.app` app with its own credentials, checking the hub's signed claims with
the hub's public claim keys)."""

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
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml

from common.kube import kube_api
from gateway.app import TokenReviewer
from gateway.app import create_app
from gateway.service import KubeGateway
from tests.harness.controlplane import free_port
from tests.harness.processes import stop_process

ROOT = Path(__file__).resolve().parent.parent.parent
# What a test or dev cluster's gateway may route to a server: its tunnel, pod and service CIDRs (the default
# address plan), and loopback, where a simulated node reaches the local API server.
TEST_ROUTES = ("10.250.0.0/16", "10.245.0.0/16", "10.96.0.0/12", "127.0.0.0/8")


def write_gateways(path: Path, gateways: dict[str, str], *, routes: tuple[str, ...] = TEST_ROUTES,
                   ca_file: Path | None = None) -> Path:
    """The agent's ``--gateways-file``: the clusters it may serve, each with its gateway and routes."""
    clusters = {name: {"gateway": url, "allowedRoutes": list(routes), **({"caFile": str(ca_file)} if ca_file else {})}
                for name, url in gateways.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"clusters": clusters}))
    return path


def register_server(hub_url: str, admin_key: str, pool: str, server: str, *, gpu_product: str = "NVIDIA-L4",
                    gpus: int = 1, labels: dict[str, str] | None = None) -> None:
    """What the pool's operator does before a server's agent may enrol: the inventory entry."""
    r = httpx.put(f"{hub_url}/v1/pools/{pool}/servers/{server}", headers={"Authorization": f"Bearer {admin_key}"},
                  json={"gpu_product": gpu_product, "gpus": gpus, "labels": labels or {"rack": "r1"}}, timeout=10)
    assert r.status_code in (200, 201), r.text


def claim_keys(hub_url: str) -> str:
    """The hub's public claim keys (PEM): what the chart's hub.claimPublicKeys holds for the gateway."""
    r = httpx.get(f"{hub_url}/v1/pool-claims/keys", timeout=10)
    r.raise_for_status()
    pem: str = r.json()["pem"]
    return pem


@dataclass
class AgentProcess:
    hub_url: str
    join_token_file: Path
    pool: str
    server: str
    state_dir: Path
    gateways_file: Path
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
             "--enrolment-token-file", str(self.join_token_file), "--pool", self.pool, "--server", self.server,
             "--gateways-file", str(self.gateways_file),
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
            os.killpg(proc.pid, signal.SIGCONT)  # a stopped (SIGSTOP) agent would not act on SIGTERM
        stop_process(proc, timeout)


@dataclass
class GatewayThread:
    """The gateway's HTTP app (`POST /v1/join`) on a loopback port, in a thread; start and stop at will."""

    kubeconfig: Path
    ticket_key: bytes
    claim_keys_file: Path
    port: int = field(default_factory=free_port)
    _server: uvicorn.Server | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mount_claim_keys(self, pem: str) -> None:
        """What the chart does with hub.claimPublicKeys."""
        self.claim_keys_file.parent.mkdir(parents=True, exist_ok=True)
        self.claim_keys_file.write_text(pem)

    def start(self) -> GatewayThread:
        api = kube_api(self.kubeconfig)
        app = create_app(KubeGateway(api, self.ticket_key), TokenReviewer(api), frozenset(),
                         hub_claim_keys=self.claim_keys_file)
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
