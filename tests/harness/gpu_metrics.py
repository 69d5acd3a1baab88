"""A burst stack whose GPUs a DCGM exporter serves and a real Prometheus scrapes: what the ScaleToZero and sharing
tests decide from."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tests.harness.burst import BurstStack
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.dcgm_exporter import openmetrics_history
from tests.harness.kube import Cluster
from tests.harness.prometheus import SCRAPE_JOB
from tests.harness.prometheus import Prometheus


@dataclass
class GpuMetricsStack:
    burst: BurstStack
    exporter: DcgmExporter
    prometheus: Prometheus

    @property
    def cluster(self) -> Cluster:
        return self.burst.cluster

    def give_gpus(self, namespace: str, pods: list[str], *, activity: float, minutes: int,
                  fb_used_mib: float = 2048) -> None:
        """The pods hold GPUs at ``activity`` now, with ``minutes`` of such history (0: none) in Prometheus."""
        for pod in pods:
            self.exporter.assign(namespace, pod, activity=activity, fb_used_mib=fb_used_mib)
        if minutes:
            now = time.time()
            held = [g for g in self.exporter.snapshot() if (g.namespace, g.pod) in {(namespace, p) for p in pods}]
            history = openmetrics_history([(now - ago, held) for ago in range(minutes * 60, 10, -30)],
                                          extra={"job": SCRAPE_JOB, "instance": self.exporter.address})
            self.prometheus.stop()
            self.prometheus.backfill(history)
            self.prometheus.start()
        self.prometheus.wait_scraped()
