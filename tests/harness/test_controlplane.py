"""The real control plane behaves as the product relies on: kwok nodes, the scheduler and taints,
the Eviction API with PodDisruptionBudgets, and RBAC."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster

BURST_TAINT = client.V1Taint(key="gpu.kubeon.io/burst", value="true", effect="NoSchedule")


def _gpu_pod(name: str, *, tolerate: bool, labels: dict[str, str] | None = None,
             node_selector: dict[str, str] | None = None) -> client.V1Pod:
    tolerations = [client.V1Toleration(key="gpu.kubeon.io/burst", operator="Exists", effect="NoSchedule")]
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(
            containers=[client.V1Container(
                name="infer", image="registry.invalid/infer:1",
                resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}))],
            tolerations=tolerations if tolerate else None,
            node_selector=node_selector,
        ),
    )


def test_control_plane_started_on_loopback(cluster: Cluster) -> None:
    assert cluster.plane.server.startswith("https://127.0.0.1:")
    version = client.VersionApi(cluster.admin.api).get_code()
    assert version.git_version.startswith("v1.")  # set by -ldflags, not v0.0.0


def test_kwok_node_becomes_ready(cluster: Cluster) -> None:
    name = f"kwok-{uuid.uuid4().hex[:6]}"
    cluster.create_kwok_node(name)
    wait_for(lambda: cluster.node_ready(name), what=f"node {name} Ready", timeout=60)


def test_scheduler_places_only_tolerating_pod_on_tainted_node(cluster: Cluster, namespace: str) -> None:
    node = f"burst-{uuid.uuid4().hex[:6]}"
    selector = {"test.kubeon.io/node": node}
    cluster.create_kwok_node(node, labels=selector, taints=[BURST_TAINT])
    wait_for(lambda: cluster.node_ready(node), what=f"node {node} Ready")
    core = cluster.admin.core
    core.create_namespaced_pod(namespace, _gpu_pod("opted-in", tolerate=True, node_selector=selector))
    core.create_namespaced_pod(namespace, _gpu_pod("not-opted-in", tolerate=False, node_selector=selector))

    placed = wait_for(lambda: core.read_namespaced_pod("opted-in", namespace).spec.node_name,
                      what="tolerating pod scheduled")
    assert placed == node
    wait_for(lambda: core.read_namespaced_pod("opted-in", namespace).status.phase == "Running",
             what="kwok runs the pod")

    def unschedulable() -> client.V1PodCondition | None:
        pod = core.read_namespaced_pod("not-opted-in", namespace)
        return next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"
                     and c.status == "False" and c.reason == "Unschedulable"), None)

    cond = wait_for(unschedulable, what="non-tolerating pod Unschedulable")
    assert "untolerated taint" in cond.message
    pod = core.read_namespaced_pod("not-opted-in", namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


def test_eviction_blocked_by_pdb_returns_429(cluster: Cluster, namespace: str) -> None:
    node = f"pdb-{uuid.uuid4().hex[:6]}"
    selector = {"test.kubeon.io/node": node}
    cluster.create_kwok_node(node, labels=selector)
    core = cluster.admin.core
    core.create_namespaced_pod(namespace, _gpu_pod("guarded", tolerate=False, labels={"app": "guarded"},
                                                   node_selector=selector))
    wait_for(lambda: core.read_namespaced_pod("guarded", namespace).status.phase == "Running",
             what="guarded pod Running")
    cluster.admin.policy.create_namespaced_pod_disruption_budget(namespace, client.V1PodDisruptionBudget(
        metadata=client.V1ObjectMeta(name="guard"),
        spec=client.V1PodDisruptionBudgetSpec(
            min_available=1, selector=client.V1LabelSelector(match_labels={"app": "guarded"})),
    ))
    # The disruption controller computes the budget asynchronously; wait until it has observed the pod.
    wait_for(lambda: (s := cluster.admin.policy.read_namespaced_pod_disruption_budget(
        "guard", namespace).status) and s.observed_generation and s.current_healthy == 1,
        what="PDB status observed")

    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="guarded", namespace=namespace))
    with pytest.raises(client.ApiException) as err:
        core.create_namespaced_pod_eviction("guarded", namespace, eviction)
    assert err.value.status == 429
    assert "disruption budget guard" in err.value.body
    assert core.read_namespaced_pod("guarded", namespace).metadata.deletion_timestamp is None


def test_service_account_without_secret_rules_cannot_read_secrets(cluster: Cluster, namespace: str) -> None:
    cluster.admin.core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(name="hidden"), string_data={"token": "s3cret"}))
    # Grant it something (pods) so a denial of secrets is about secrets, not about being unknown.
    cluster.admin.rbac.create_namespaced_role(namespace, client.V1Role(
        metadata=client.V1ObjectMeta(name="pod-reader"),
        rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list"])]))
    cluster.admin.rbac.create_namespaced_role_binding(namespace, client.V1RoleBinding(
        metadata=client.V1ObjectMeta(name="pod-reader"),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="pod-reader"),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)]))
    sa = cluster.service_account_client(namespace, "reader")

    assert sa.core.list_namespaced_pod(namespace).items == []
    with pytest.raises(client.ApiException) as err:
        sa.core.read_namespaced_secret("hidden", namespace)
    assert err.value.status == 403
    assert f"system:serviceaccount:{namespace}:reader" in err.value.body
