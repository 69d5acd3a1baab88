"""moto in server mode on a loopback port, as its own process (so a killed worker never takes it down)."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from tests.harness.children import wait_answering
from tests.harness.controlplane import free_port
from tests.harness.processes import stop_process


@dataclass
class MotoServer:
    logdir: Path
    endpoint: str = ""
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # How the process is started: `make dev` passes its registry's (children die with it, leftovers are reaped).
    popen: Callable[..., subprocess.Popen[bytes]] = field(default=subprocess.Popen, repr=False)

    def start(self, timeout: float = 30.0) -> MotoServer:
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        log = open(self.logdir / "moto.log", "wb")  # noqa: SIM115 - lives as long as the process
        self._proc = self.popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        wait_answering(self._proc, f"{self.endpoint}/moto-api/", name="moto_server", timeout=timeout,
                       log=(self.logdir / "moto.log").read_text)
        return self

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def stop(self) -> None:
        if self._proc:
            stop_process(self._proc, 10)
