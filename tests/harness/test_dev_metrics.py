"""`make dev`'s GPU metrics: the example workload's pods get DCGM series on the simulated A100 node, with enough
backfilled idle history for the example ScaleToZero policy to find it idle at once; its annotation makes it busy;
the example Sharing policy proposes a geometry for it that the GPU Operator stand-in applies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from activities.clients.prometheus import PrometheusClient
from activities.clients.prometheus import PrometheusUnavailable
from activities.sharing import SharingOps
from models.policy import SharingPolicy
from planning.idle import PodActivity
from planning.idle import judge_idle
from planning.sharing import Proposal
from planning.sharing import decide
from tests.harness.dev_metrics import ACTIVITY
from tests.harness.dev_metrics import GPU_OPERATOR_NAMESPACE
from tests.harness.dev_metrics import NAMESPACE
from tests.harness.dev_metrics import NODE
from tests.harness.dev_metrics import DevMetrics
from tests.harness.gpu_operator import MIG_CONFIG_LABEL
from tests.harness.gpu_operator import MIG_STATE_LABEL
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from worker.sharing_watcher import rule_of

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dev_metrics(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevMetrics]:
    metrics = DevMetrics(cluster, tmp_path_factory.mktemp("dev-metrics")).start()
    try:
        yield metrics
    finally:
        metrics.stop()
        cluster.admin.core.delete_namespace(NAMESPACE)
        cluster.admin.core.delete_namespace(GPU_OPERATOR_NAMESPACE)
        cluster.admin.core.delete_node(NODE)


@pytest.fixture
def workload(cluster: Cluster, dev_metrics: DevMetrics) -> Iterator[str]:
    """examples/scale-to-zero-workload.yaml's Deployment, removed with its pods afterwards."""
    doc = yaml.safe_load((ROOT / "examples/scale-to-zero-workload.yaml").read_text())
    cluster.admin.apps.create_namespaced_deployment(NAMESPACE, doc)
    name = str(doc["metadata"]["name"])
    try:
        yield name
    finally:
        cluster.admin.apps.delete_namespaced_deployment(name, NAMESPACE, propagation_policy="Foreground")
        wait_for(lambda: not cluster.admin.apps.list_namespaced_deployment(
            NAMESPACE, field_selector=f"metadata.name={name}").items and not cluster.admin.core.list_namespaced_pod(
            NAMESPACE, label_selector="app=llm").items, what="the example workload gone", timeout=60)


def test_example_workload_is_measured_and_can_be_made_idle(cluster: Cluster, dev_metrics: DevMetrics,
                                                            workload: str) -> None:
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
        assert all(activity[k].coverage >= 0.9 for k in pods)  # the backfilled history
        verdict = judge_idle(pods, activity, threshold=0.05, idle_for_s=1800, min_coverage=0.9)
        assert verdict.idle, verdict.reason
        # Made busy by its annotation: the next scrapes say so.
        cluster.admin.apps.patch_namespaced_deployment(workload, NAMESPACE, {"metadata": {"annotations": {
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


def test_example_sharing_policy_proposes_mig_for_the_example_workload_and_the_stand_in_applies_it(
        cluster: Cluster, dev_metrics: DevMetrics, workload: str) -> None:
    """make dev's Sharing walk-through (README): the example workload's two idle 1-GPU pods (9 GiB peak each) on the
    A100-80GB node -> the example policy proposes MIG all-1g.10gb with its saving; the GPU Operator stand-in running
    on that node applies the geometry (what the approved MigWorkflow does: tests/workflows/test_sharing.py)."""
    policy = SharingPolicy.model_validate(
        yaml.safe_load((ROOT / "examples/policies/sharing-a100.yaml").read_text()))
    metrics = PrometheusClient(dev_metrics.url)
    ops = SharingOps(cluster.admin.api, metrics)
    why: list[str] = ["not evaluated"]
    try:
        def proposed() -> Proposal | None:
            dev_metrics.sync()
            nodes = ops.node_facts(policy.spec.nodes.match_labels)
            if [n.name for n in nodes] != [NODE] or len(nodes[0].pods) != 2:
                why[:] = [f"nodes {[(n.name, n.pods) for n in nodes]}"]
                return None
            try:
                usage = metrics.pod_memory([], policy.spec.idle.window_seconds)
            except PrometheusUnavailable:  # the background syncer restarts Prometheus to backfill a new pod
                return None
            verdict = decide(nodes[0], usage, rule_of(policy))
            why[:] = [verdict.reason]
            return verdict.proposals[0] if verdict.proposals else None

        try:
            proposal = wait_for(proposed, what="a sharing proposal for the example workload", timeout=90, interval=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the last verdict: {why[0]}") from None
        assert (proposal.kind, proposal.geometry) == ("mig", "all-1g.10gb"), proposal
        assert proposal.saving_usd_per_hour > 0
    finally:
        metrics.close()

    def applied(geometry: str) -> dict[str, str]:
        # The state label cleared with the change, as the MigWorkflow writes it: "success" is then this change's.
        cluster.admin.core.patch_node(NODE, {"metadata": {"labels": {MIG_CONFIG_LABEL: geometry,
                                                                      MIG_STATE_LABEL: None}}})

        def done() -> dict[str, str] | None:
            node = cluster.admin.core.read_node(NODE)
            state = (node.metadata.labels or {}).get(MIG_STATE_LABEL)
            assert state != "failed", dev_metrics.gpu_operator.events_for(NODE) if dev_metrics.gpu_operator else state
            return {str(k): str(v) for k, v in node.status.allocatable.items()} if state == "success" else None

        found: dict[str, str] = wait_for(done, what=f"the stand-in applying {geometry} on the dev node", timeout=30)
        return found

    try:
        assert applied("all-1g.10gb")["nvidia.com/mig-1g.10gb"] == "28"  # 4 GPUs x 7 slices
    finally:
        assert applied("all-disabled")["nvidia.com/gpu"] == "4"
