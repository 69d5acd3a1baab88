"""`make dev`'s GPU metrics: the example workload's pods get DCGM series on the simulated A100 node, with enough
backfilled idle history for the example ScaleToZero policy to find it idle at once; its annotation makes it busy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from activities.clients.prometheus import PrometheusClient, PrometheusUnavailable
from planning.idle import PodActivity, judge_idle
from tests.harness.dev_metrics import ACTIVITY, NAMESPACE, NODE, DevMetrics
from tests.harness.kube import Cluster, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dev_metrics(cluster: Cluster, tmp_path: Path) -> Iterator[DevMetrics]:
    metrics = DevMetrics(cluster, tmp_path).start()
    try:
        yield metrics
    finally:
        metrics.stop()
        cluster.admin.core.delete_namespace(NAMESPACE)
        cluster.admin.core.delete_node(NODE)


def test_example_workload_is_measured_and_can_be_made_idle(cluster: Cluster, dev_metrics: DevMetrics) -> None:
    workload = yaml.safe_load((ROOT / "examples/scale-to-zero-workload.yaml").read_text())
    cluster.admin.apps.create_namespaced_deployment(NAMESPACE, workload)
    client = PrometheusClient(dev_metrics.url)
    try:
        def pods_measured() -> dict[tuple[str, str], PodActivity] | None:
            dev_metrics.sync()
            try:
                got = client.pod_activity([NAMESPACE], 60)
            except PrometheusUnavailable:  # the background syncer restarts Prometheus to backfill a new pod
                return None
            return got if len(got) == 2 else None

        wait_for(pods_measured, what="both llm pods in Prometheus", timeout=90, interval=1)
        activity = client.pod_activity([NAMESPACE], 1800)
        pods = sorted(activity)
        assert all(activity[k].coverage >= 0.9 for k in pods)  # the backfilled 40 minutes
        verdict = judge_idle(pods, activity, threshold=0.05, idle_for_s=1800, min_coverage=0.9)
        assert verdict.idle, verdict.reason
        # Made busy by its annotation: the next scrapes say so.
        cluster.admin.apps.patch_namespaced_deployment("llm", NAMESPACE, {"metadata": {"annotations": {
            ACTIVITY: "0.6"}}})

        def busy() -> bool:
            dev_metrics.sync()
            try:
                got = client.pod_activity([NAMESPACE], 1800)
            except PrometheusUnavailable:
                return False
            return not judge_idle(pods, got, threshold=0.05, idle_for_s=1800, min_coverage=0.9).idle

        wait_for(busy, what="the pods busy after the annotation", timeout=60, interval=1)
    finally:
        client.close()
