"""A real Prometheus on loopback (Debian's ``prometheus`` package: ``/usr/bin/prometheus`` and ``promtool``, which
`make system-deps` installs when missing), scraping the DCGM exporter fixture (and any further jobs, e.g. the
worker's and the gateway's ``/metrics``), with history backfilled by ``promtool tsdb create-blocks-from
openmetrics`` before it starts."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import yaml

from tests.harness.children import wait_answering
from tests.harness.controlplane import free_port
from tests.harness.processes import stop_process

SCRAPE_JOB = "dcgm"


class PrometheusMissing(RuntimeError):
    pass


def binary(name: str) -> Path:
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if not found:
        raise PrometheusMissing(f"{name} not found: install Debian's prometheus package (`make system-deps`)")
    return Path(found)


@dataclass
class Prometheus:
    workdir: Path
    targets: list[str] = field(default_factory=list)
    scrape_interval: str = "1s"
    # Labels added to the scraped series as a Kubernetes ServiceMonitor adds the exporter pod's own: with
    # honor_labels false, the exporter's pod/namespace labels become exported_pod/exported_namespace.
    target_labels: dict[str, str] = field(default_factory=dict)
    honor_labels: bool = True
    # More scrape jobs: job name -> targets (host:port, path /metrics), labels as the targets give them.
    jobs: dict[str, list[str]] = field(default_factory=dict)
    port: int = 0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    # How the process is started: `make dev` passes its registry's (children die with it, leftovers are reaped).
    popen: Callable[..., subprocess.Popen[bytes]] = field(default=subprocess.Popen, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def backfill(self, openmetrics: str) -> None:
        """Write history into the data directory (before ``start``, or between ``stop`` and ``start``)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        source = self.workdir / f"backfill-{time.monotonic_ns()}.om"
        source.write_text(openmetrics)
        done = subprocess.run([str(binary("promtool")), "tsdb", "create-blocks-from", "openmetrics", str(source),
                               str(self.data_dir)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"promtool create-blocks-from failed: {done.stdout}{done.stderr}")

    def start(self, timeout: float = 60.0) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        config = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": "15s"},
            "scrape_configs": [{
                "job_name": SCRAPE_JOB, "honor_labels": self.honor_labels,
                "static_configs": [{"targets": self.targets, "labels": self.target_labels}],
            }, *({"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in self.jobs.items())],
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 - lives as long as the process
        self._proc = self.popen(
            [str(binary("prometheus")), f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.data_dir}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=30d", "--web.enable-lifecycle"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_answering(self._proc, f"{self.url}/-/ready", name="prometheus", log=self.log_tail, timeout=timeout,
                       interval=0.2)
        return self

    def wait_scraped(self, timeout: float = 30.0, jobs: tuple[str, ...] | None = None) -> None:
        """Until every target (of ``jobs``: default all) has been scraped successfully once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5) as answer:
                active = [t for t in json.load(answer)["data"]["activeTargets"]
                          if jobs is None or t["labels"].get("job") in jobs]
            if active and all(t["health"] == "up" for t in active):
                return
            time.sleep(0.3)
        raise RuntimeError(f"prometheus did not scrape {jobs or 'its targets'} within {timeout}s")

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "prometheus.log").read_text()[-chars:]
        return ""

    def stop(self) -> None:
        if self._proc:
            stop_process(self._proc, 20)
        self._proc = None
