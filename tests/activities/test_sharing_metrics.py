"""The sharing decision from a real Prometheus with backfilled DCGM history (the exporter fixture), through the
metrics client's queries over every namespace: quiet pods get time-slicing, a busy node nothing, pods whose peak
was 9 GiB an hour ago get all-1g.10gb and pods that once peaked at 12 GiB never do."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from activities.clients.prometheus import PrometheusClient
from planning.sharing import GpuPod
from planning.sharing import NodeFacts
from planning.sharing import Rule
from planning.sharing import decide
from tests.activities.test_metrics import start_prometheus
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.dcgm_exporter import openmetrics_history
from tests.harness.prometheus import SCRAPE_JOB

pytestmark = pytest.mark.prometheus
WINDOW = 3600
RULE = Rule(threshold=0.4, min_coverage=0.9, window="1h", max_replicas=4,
            mig_allowed=("all-1g.10gb", "all-3g.40gb"), usd_per_gpu_hour=4.1)


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusClient]:
    exporter = DcgmExporter().start()
    for host, count in (("quiet", 4), ("busy", 1), ("small", 2), ("large", 2)):
        exporter.add_node(host, gpus=count)
    for i in range(4):
        exporter.assign("ml", f"quiet-{i}", activity=0.05, fb_used_mib=4096)
    exporter.assign("ml", "busy-0", activity=0.6, fb_used_mib=30000)
    for i in range(2):
        exporter.assign("infer", f"small-{i}", activity=0.03, fb_used_mib=4096)
        exporter.assign("infer", f"large-{i}", activity=0.03, fb_used_mib=4096)
    now = time.time()
    samples = []
    for ago in range(70 * 60, 15, -30):
        gpus = exporter.snapshot()
        for g in gpus:
            if g.pod.startswith(("small-", "large-")) and abs(ago - 40 * 60) < 30:
                g.fb_used_mib = 9 * 1024 if g.pod.startswith("small-") else 12 * 1024  # their peaks
            if g.pod.startswith("quiet-") and ago % 600 == 0:
                g.activity = 0.08  # an occasional burst stays under the p95
        samples.append((now - ago, gpus))
    history = openmetrics_history(samples, extra={"job": SCRAPE_JOB, "instance": exporter.address})
    server = start_prometheus(tmp_path_factory.mktemp("prom-sharing"), exporter, [history])
    client = PrometheusClient(server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()
        exporter.stop()


def node(name: str, ns: str, count: int, gpus: int, waiting: int = 0) -> NodeFacts:
    return NodeFacts(name=name, product="NVIDIA-A100-SXM4-80GB", gpus=gpus,
                     pods=tuple(GpuPod(ns, f"{name}-{i}", 1) for i in range(count)),
                     waiting=tuple(GpuPod(ns, f"wait-{i}", 1) for i in range(waiting)))


def test_decisions_from_backfilled_dcgm_history(prom: PrometheusClient) -> None:
    before = prom.queries
    usage = prom.pod_memory([], WINDOW)
    assert prom.queries - before <= 6  # detect (cached after the first) and four queries for every pod at once
    assert {k for k in usage} >= {("ml", f"quiet-{i}") for i in range(4)} | {("ml", "busy-0")}
    assert usage[("ml", "quiet-0")].p95_activity == pytest.approx(0.05, abs=0.01)
    assert usage[("infer", "small-0")].peak_used_mib == 9 * 1024
    assert usage[("infer", "large-1")].peak_used_mib == 12 * 1024
    assert min(u.coverage for u in usage.values()) >= 0.9

    quiet = decide(node("quiet", "ml", 4, 4, waiting=4), usage, RULE)
    ts = [p for p in quiet.proposals if p.kind == "time-slicing"]
    assert ts and ts[0].replicas == 2 and ts[0].saving_usd_per_hour == pytest.approx(16.4)

    busy = decide(node("busy", "ml", 1, 1, waiting=3), usage, RULE)
    assert busy.proposals == () and busy.reason.startswith("busy: its pods' summed p95 is 60%")

    small = decide(node("small", "infer", 2, 2), usage, RULE)
    assert [p.geometry for p in small.proposals] == ["all-1g.10gb"]
    large = decide(node("large", "infer", 2, 2), usage, RULE)
    assert [p.geometry for p in large.proposals] == ["all-3g.40gb"]
