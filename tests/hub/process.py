"""The hub as a real process (``python -m hub.server``) on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import TypeVar

import httpx

from tests.harness.controlplane import free_port
from tests.harness.kube import wait_for
from tests.harness.processes import answers_ok
from tests.harness.processes import stop_process

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class HubProcess:
    args: list[str]
    logdir: Path
    # `hub.server` for the real thing; `tests.hub.clocked_server <clock file>` to move time from a test
    module: list[str] = field(default_factory=lambda: ["hub.server"])
    url: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def log(self) -> str:
        return (self.logdir / "hub.log").read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self, timeout: float = 30.0) -> HubProcess:
        # A restart keeps the address: the optimizer under test knows the hub by its URL.
        port = int(self.url.rsplit(":", 1)[1]) if self.url else free_port()
        self.url = f"http://127.0.0.1:{port}"
        with open(self.logdir / "hub.log", "wb") as log:
            self._proc = proc = subprocess.Popen(
                [sys.executable, "-m", *self.module, "--listen", f"127.0.0.1:{port}", *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            wait_for(lambda: answers_ok(proc, f"{self.url}/healthz", name="hub", log=lambda: self.log),
                     timeout=timeout, what=f"hub on {self.url} to answer /healthz", interval=0.05)
        except AssertionError:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM and wait; True when the hub shut down cleanly (uvicorn finishes, then re-raises SIGTERM, so the
        exit status is -SIGTERM). Nothing of the process group is left."""
        proc, self._proc = self._proc, None
        if proc is None:
            return True
        if not stop_process(proc, timeout, group=True):
            raise AssertionError(f"hub did not exit within {timeout}s of SIGTERM: {self.log}")
        return proc.returncode in (0, -signal.SIGTERM) and "Finished server process" in self.log


@dataclass
class SeededHub:
    """A hub process on SQLite with one cluster, its token in ``token_file``, and an admin client."""

    process: HubProcess
    admin: httpx.Client
    cluster: str
    token_file: Path


H = TypeVar("H", bound=SeededHub)


@contextlib.contextmanager
def seeded_hub(workdir: Path, cluster: str, kind: type[H]) -> Iterator[H]:
    """``kind`` (SeededHub or a subclass with helpers of its own) over a fresh hub; stopped afterwards."""
    from tests.hub.conftest import BOOTSTRAP_KEY

    key_file = workdir / "bootstrap.key"
    key_file.write_text(BOOTSTRAP_KEY + "\n")
    process = HubProcess(["--database-url", f"sqlite:///{workdir / 'hub.db'}", "--bootstrap-admin-key-file",
                          str(key_file)], logdir=workdir).start()
    admin = httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {BOOTSTRAP_KEY}"}, timeout=10)
    try:
        created = admin.post("/v1/clusters", json={"name": cluster})
        assert created.status_code == 201, created.text
        token_file = workdir / "token"
        token_file.write_text(created.json()["token"]["token"])
        yield kind(process=process, admin=admin, cluster=cluster, token_file=token_file)
    finally:
        admin.close()
        process.stop()
