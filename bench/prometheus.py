"""What the decision-cost benches (scale_bench, sharing_bench) share: a real Prometheus scraping the DCGM exporter
fixture, with history backfilled from what the exporter shows now."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from activities.clients.prometheus import PrometheusClient
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.dcgm_exporter import openmetrics_history
from tests.harness.prometheus import SCRAPE_JOB
from tests.harness.prometheus import Prometheus


@contextlib.contextmanager
def backfilled(exporter: DcgmExporter, history_minutes: int) -> Iterator[tuple[PrometheusClient, float]]:
    """A Prometheus with ``history_minutes`` of the exporter's present series (one sample a minute) backfilled,
    started and scraped; a client that detected its series, and how long the backfill took (seconds). Stopped on
    leaving."""
    with tempfile.TemporaryDirectory(prefix="bench-prometheus-") as tmp:
        prom = Prometheus(Path(tmp) / "prom", targets=[exporter.address], scrape_interval="15s")
        try:
            now = time.time()
            gpus = exporter.snapshot()
            t0 = time.monotonic()
            history = openmetrics_history([(now - ago, gpus) for ago in range(history_minutes * 60, 10, -60)],
                                          extra={"job": SCRAPE_JOB, "instance": exporter.address})
            prom.backfill(history)
            backfill_s = time.monotonic() - t0
            prom.start()
            prom.wait_scraped(timeout=60)
            client = PrometheusClient(prom.url, timeout=60)
            try:
                client.detect()
                yield client, backfill_s
            finally:
                client.close()
        finally:
            prom.stop()
