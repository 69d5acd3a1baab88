"""The metrics client against a real Prometheus scraping the DCGM exporter fixture, with backfilled history."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from activities.clients.prometheus import GR_ENGINE_ACTIVE
from activities.clients.prometheus import LabelForm
from activities.clients.prometheus import NoGpuMetrics
from activities.clients.prometheus import PrometheusClient
from activities.clients.prometheus import PrometheusUnavailable
from planning.idle import PodActivity
from planning.idle import judge_idle
from tests.harness.controlplane import free_port
from tests.harness.dcgm_exporter import DcgmExporter
from tests.harness.dcgm_exporter import Gpu
from tests.harness.dcgm_exporter import openmetrics_history
from tests.harness.prometheus import SCRAPE_JOB
from tests.harness.prometheus import Prometheus

pytestmark = pytest.mark.prometheus
IDLE_FOR = 30 * 60


def history(exporter: DcgmExporter, *, minutes: int, step: int = 30,
            change: dict[tuple[str, int], dict[str, float]] | None = None, profiling: bool = True) -> str:
    """The exporter's current GPUs at every ``step`` seconds of the last ``minutes`` (the newest 15 s left to
    the live scrape); ``change`` overrides (pod, minutes ago) -> values, e.g. a busy burst five minutes ago."""
    now = time.time()
    samples = []
    for ago in range(minutes * 60, 15, -step):
        gpus = exporter.snapshot()
        for g in gpus:
            for (pod, minute), values in (change or {}).items():
                if g.pod == pod and abs(ago - minute * 60) < step:
                    g.activity = values.get("activity", g.activity)
                    g.fb_used_mib = values.get("fb_used_mib", g.fb_used_mib)
        samples.append((now - ago, gpus))
    return openmetrics_history(samples, profiling=profiling,
                               extra={"job": SCRAPE_JOB, "instance": exporter.address})


def start_prometheus(workdir: Path, exporter: DcgmExporter, backfill: list[str], **kwargs: object) -> Prometheus:
    prom = Prometheus(workdir, targets=[exporter.address], **kwargs)  # type: ignore[arg-type]
    for text in backfill:
        prom.backfill(text)
    prom.start()
    prom.wait_scraped()
    return prom


@pytest.fixture(scope="module")
def dcgm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DcgmExporter, PrometheusClient]]:
    """Pods: ``idle`` (40 min at 1%), ``spiked`` (idle but 60% five minutes ago), ``young`` (5 min of data),
    ``busy`` (70% now), and a free GPU."""
    exporter = DcgmExporter().start()
    exporter.add_node("gpu-node-a", gpus=4)
    exporter.add_node("gpu-node-b", gpus=2)
    exporter.assign("ml", "idle-0", activity=0.01, fb_used_mib=9 * 1024)
    exporter.assign("ml", "spiked-0", activity=0.01, fb_used_mib=2048)
    exporter.assign("ml", "busy-0", activity=0.7, fb_used_mib=70 * 1024)
    exporter.assign("other", "idle-0", activity=0.0)
    old = history(exporter, minutes=40, change={("spiked-0", 5): {"activity": 0.6}})
    exporter.assign("ml", "young-0", activity=0.0)
    young = openmetrics_history(
        [(time.time() - ago, [g for g in exporter.snapshot() if g.pod == "young-0"]) for ago in range(300, 15, -30)],
        extra={"job": SCRAPE_JOB, "instance": exporter.address})
    prom = start_prometheus(tmp_path_factory.mktemp("prom"), exporter, [old, young])
    client = PrometheusClient(prom.url)
    try:
        yield exporter, client
    finally:
        client.close()
        prom.stop()
        exporter.stop()


def _judge(activity: dict[tuple[str, str], PodActivity], *pods: str) -> tuple[bool, str]:
    verdict = judge_idle([("ml", p) for p in pods], activity, threshold=0.05, idle_for_s=IDLE_FOR, min_coverage=0.9)
    return verdict.idle, verdict.reason


def test_detects_pod_labels(dcgm: tuple[DcgmExporter, PrometheusClient]) -> None:
    assert dcgm[1].detect() == LabelForm(pod="pod", namespace="namespace")


def test_idle_pod_with_thirty_minutes_of_history_is_idle(dcgm: tuple[DcgmExporter, PrometheusClient]) -> None:
    activity = dcgm[1].pod_activity(["ml"], IDLE_FOR)
    assert activity[("ml", "idle-0")].peak == pytest.approx(0.01)
    assert activity[("ml", "idle-0")].coverage >= 0.95
    idle, reason = _judge(activity, "idle-0")
    assert idle, reason
    assert ("other", "idle-0") not in activity  # only the namespaces asked for


@pytest.mark.parametrize(("pods", "why"), [
    pytest.param(["spiked-0"], "busy: pod spiked-0 peaked at 60%", id="pod_busy_five_minutes_ago"),
    pytest.param(["idle-0", "busy-0"], "busy-0 peaked at 70%", id="busy_pod"),
    pytest.param(["idle-0", "cpu-only-0"], "no DCGM data for pod cpu-only-0", id="pod_without_series"),
])
def test_is_not_idle_saying_why(dcgm: tuple[DcgmExporter, PrometheusClient], pods: list[str], why: str) -> None:
    idle, reason = _judge(dcgm[1].pod_activity(["ml"], IDLE_FOR), *pods)
    assert not idle
    assert why in reason


def test_five_minutes_of_data_is_not_idle_for_thirty(dcgm: tuple[DcgmExporter, PrometheusClient]) -> None:
    activity = dcgm[1].pod_activity(["ml"], IDLE_FOR)
    assert activity[("ml", "young-0")].peak == 0.0
    idle, reason = _judge(activity, "young-0")
    assert not idle
    assert "too little history for pod young-0" in reason


def test_a_later_busy_scrape_ends_idleness(dcgm: tuple[DcgmExporter, PrometheusClient]) -> None:
    exporter, client = dcgm
    exporter.assign("other", "idle-0", activity=0.0)
    assert client.pod_activity(["other"], IDLE_FOR)[("other", "idle-0")].peak == 0.0
    exporter.set_pod("other", "idle-0", activity=0.5)
    deadline = time.monotonic() + 15
    while client.pod_activity(["other"], IDLE_FOR)[("other", "idle-0")].peak < 0.5:
        assert time.monotonic() < deadline, "the busy scrape never showed"
        time.sleep(0.5)


def test_peak_framebuffer_and_reported_memory(dcgm: tuple[DcgmExporter, PrometheusClient]) -> None:
    memory = dcgm[1].pod_memory(["ml"], IDLE_FOR)
    idle = memory[("ml", "idle-0")]
    assert idle.peak_used_mib == 9 * 1024
    assert idle.total_mib == 81920
    assert idle.p95_activity == pytest.approx(0.01)
    assert memory[("ml", "busy-0")].peak_used_mib == 70 * 1024


def test_one_round_of_queries_whatever_the_pod_count(dcgm: tuple[DcgmExporter, PrometheusClient]) -> None:
    client = dcgm[1]
    client.detect()
    before = client.queries
    client.pod_activity(["ml", "other"], IDLE_FOR)
    assert client.queries - before == 2


def test_unreachable_prometheus_is_a_named_error() -> None:
    client = PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(PrometheusUnavailable, match="unreachable"):
        client.pod_activity(["ml"], IDLE_FOR)


def test_prometheus_without_dcgm_series_is_a_named_error(tmp_path: Path) -> None:
    exporter = DcgmExporter().start()  # no GPUs: an exporter answering with no series
    prom = start_prometheus(tmp_path, exporter, [])
    client = PrometheusClient(prom.url)
    try:
        with pytest.raises(NoGpuMetrics, match="no DCGM exporter series"):
            client.pod_activity(["ml"], IDLE_FOR)
    finally:
        client.close()
        prom.stop()
        exporter.stop()


def test_exported_labels_and_utilisation_fallback(tmp_path: Path) -> None:
    """A ServiceMonitor-style scrape (honor_labels false, the exporter pod's own pod/namespace labels) of GPUs
    without profiling metrics: pods are found under exported_*, activity from DCGM_FI_DEV_GPU_UTIL / 100."""
    exporter = DcgmExporter(profiling=False).start()
    exporter.add_node("gpu-node-c", gpus=2)
    exporter.assign("ml", "llm-0", activity=0.03)
    exporter.assign("ml", "llm-1", activity=0.4)
    prom = start_prometheus(tmp_path, exporter, [], honor_labels=False,
                            target_labels={"pod": "dcgm-exporter-x1", "namespace": "gpu-operator"})
    client = PrometheusClient(prom.url)
    try:
        form = client.detect()
        assert form.exported and form.namespace == "exported_namespace"
        assert not client.query(f"count({GR_ENGINE_ACTIVE})")
        activity = client.pod_activity(["ml"], 60)
        assert activity[("ml", "llm-0")].peak == pytest.approx(0.03)
        assert activity[("ml", "llm-1")].peak == pytest.approx(0.4)
        assert ("gpu-operator", "dcgm-exporter-x1") not in activity
    finally:
        client.close()
        prom.stop()
        exporter.stop()


def test_judge_without_pods_is_not_idle() -> None:
    verdict = judge_idle([], {}, threshold=0.05, idle_for_s=IDLE_FOR, min_coverage=0.9)
    assert not verdict.idle and "no running pods" in verdict.reason


def test_gpu_labels_have_dcgm_names() -> None:
    gpu = Gpu(index=0, hostname="n1", namespace="ml", pod="p", container="c")
    labels = gpu.labels()
    for name in ("gpu=", "UUID=", "modelName=", "Hostname=", 'namespace="ml"', 'pod="p"', 'container="c"'):
        assert name in labels
