"""moto in server mode on a loopback port, as its own process (so a killed worker never takes it down)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.children import terminate
from tests.harness.controlplane import free_port


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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log_text = (self.logdir / "moto.log").read_text()
                raise RuntimeError(f"moto_server exited {self._proc.returncode}: {log_text}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                return self
            time.sleep(0.1)
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {timeout}s")

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def stop(self) -> None:
        terminate(self._proc)
