"""The GPU Operator stand-in on the real control plane: the config-manager's label-driven time-slicing (with the
ConfigMap's propagation delay, refusals of missing keys and invalid configs, no reaction to an edited key in use)
and the MIG manager's state machine, resources and pod deletion. Each pass is driven by ``step(now)`` on a
virtual clock, so nothing waits."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client

from tests.harness.gpu_operator import CONFIG_LABEL
from tests.harness.gpu_operator import MIG_CONFIG_LABEL
from tests.harness.gpu_operator import MIG_STATE_LABEL
from tests.harness.gpu_operator import ConfigRefused
from tests.harness.gpu_operator import GpuOperator
from tests.harness.gpu_operator import base_product
from tests.harness.gpu_operator import geometries
from tests.harness.gpu_operator import parse_config
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.workloads import gpu_pod

pytestmark = pytest.mark.cluster

OWNER_LABEL = "test.kubeon.io/gpu-operator"


def ts_config(replicas: int, *, fail_gt_one: bool = True) -> str:
    return yaml.safe_dump({"version": "v1", "flags": {"migStrategy": "none"}, "sharing": {"timeSlicing": {
        "failRequestsGreaterThanOne": fail_gt_one, "resources": [{"name": "nvidia.com/gpu", "replicas": replicas}]}}})


@pytest.fixture
def operator(cluster: Cluster, namespace: str) -> GpuOperator:
    cluster.admin.core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="time-slicing-config"), data={}))
    # Keeps to this test's nodes, as the DaemonSet's nodeSelector would: on the control plane the tests share, a
    # pass over every GPU node (other modules' too) was slow enough to time the running-thread test out in CI.
    return GpuOperator(cluster.admin.api, namespace=namespace, propagation_delay=0.0, mig_seconds=1.0,
                       node_selector=f"{OWNER_LABEL}={namespace}")


@pytest.fixture
def gpu_node(cluster: Cluster, namespace: str) -> Iterator[Any]:
    made: list[str] = []

    def make(product: str = "NVIDIA-A100-SXM4-80GB", gpus: int = 4) -> str:
        name = f"gpuop-{uuid.uuid4().hex[:6]}"
        cluster.create_kwok_node(name, labels={**GpuOperator.gfd_labels(product, gpus), OWNER_LABEL: namespace},
                                 gpus=gpus)
        made.append(name)
        return name

    yield make
    for name in made:
        cluster.admin.core.delete_node(name)


def node(cluster: Cluster, name: str) -> tuple[dict[str, str], dict[str, str]]:
    n: Any = cluster.admin.core.read_node(name)
    return dict(n.metadata.labels or {}), {k: v for k, v in (n.status.allocatable or {}).items()
                                           if k.startswith("nvidia.com/")}


def write_key(cluster: Cluster, namespace: str, key: str, body: str | None) -> None:
    cluster.admin.core.patch_namespaced_config_map("time-slicing-config", namespace, {"data": {key: body}})


def label(cluster: Cluster, name: str, key: str, value: str | None) -> None:
    cluster.admin.core.patch_node(name, {"metadata": {"labels": {key: value}}})


def relabel(cluster: Cluster, operator: GpuOperator, name: str, key: str, value: str | None, *passes: float) -> None:
    """Set the node's label, then let the operator pass over its nodes at each of ``passes`` (its clock)."""
    label(cluster, name, key, value)
    for now in passes:
        operator.step(now)


def test_time_slicing_follows_the_node_label(cluster: Cluster, namespace: str, operator: GpuOperator,
                                             gpu_node: Any) -> None:
    name = gpu_node()
    operator.step(0)
    labels, alloc = node(cluster, name)
    assert alloc == {"nvidia.com/gpu": "4"}
    assert (labels["nvidia.com/gpu.replicas"], labels["nvidia.com/gpu.sharing-strategy"]) == ("1", "none")

    write_key(cluster, namespace, "ts-2", ts_config(2))
    relabel(cluster, operator, name, CONFIG_LABEL, "ts-2", 1)
    labels, alloc = node(cluster, name)
    assert alloc == {"nvidia.com/gpu": "8"}
    assert cluster.admin.core.read_node(name).status.capacity["nvidia.com/gpu"] == "8"
    assert labels["nvidia.com/gpu.replicas"] == "2"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-SHARED"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.count"] == "4"

    # The body of a key in use changes: nothing happens until the label does (the Operator does not watch it).
    write_key(cluster, namespace, "ts-2", ts_config(4))
    operator.step(2)
    assert node(cluster, name)[1] == {"nvidia.com/gpu": "8"}

    relabel(cluster, operator, name, CONFIG_LABEL, None, 3)  # no label, no default: the empty fallback
    labels, alloc = node(cluster, name)
    assert alloc == {"nvidia.com/gpu": "4"}
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.replicas"]) == ("NVIDIA-A100-SXM4-80GB", "1")


def test_missing_key_is_refused_until_the_mounted_copy_has_it(cluster: Cluster, namespace: str,
                                                              operator: GpuOperator, gpu_node: Any) -> None:
    operator.propagation_delay = 60.0
    name = gpu_node(gpus=2)
    operator.step(0)
    write_key(cluster, namespace, "ts-3", ts_config(3))
    relabel(cluster, operator, name, CONFIG_LABEL, "ts-3", 10)  # written through the API, not yet in the pod's volume
    assert node(cluster, name)[1] == {"nvidia.com/gpu": "2"}
    assert operator.events_for(name)[-1].endswith("specified config ts-3 does not exist (config-manager exits; "
                                                  "retried)")
    operator.step(69)
    assert node(cluster, name)[1] == {"nvidia.com/gpu": "2"}
    operator.step(71)  # the restarted sidecar finds it once the volume caught up
    assert node(cluster, name)[1] == {"nvidia.com/gpu": "6"}

    relabel(cluster, operator, name, CONFIG_LABEL, "never-written", 100, 200, 300)
    assert node(cluster, name)[1] == {"nvidia.com/gpu": "6"}, "a missing key keeps the previous config"
    assert operator.events_for(name).count(
        f"{name}: specified config never-written does not exist (config-manager exits; retried)") == 1

    operator.propagation_delay = 0.0
    write_key(cluster, namespace, "bad", yaml.safe_dump({"version": "v1", "sharing": {"timeSlicing": {
        "resources": [{"name": "nvidia.com/gpu", "replicas": 1}]}}}))
    relabel(cluster, operator, name, CONFIG_LABEL, "bad", 400)
    assert node(cluster, name)[1] == {"nvidia.com/gpu": "6"}
    assert operator.events_for(name)[-1] == f"{name}: config bad refused: number of replicas must be >= 2"


def test_disconnected_config_manager_ignores_labels(cluster: Cluster, namespace: str, operator: GpuOperator,
                                                    gpu_node: Any) -> None:
    name = gpu_node(gpus=1)
    operator.disconnect()
    write_key(cluster, namespace, "ts-2", ts_config(2))
    relabel(cluster, operator, name, CONFIG_LABEL, "ts-2", 0)
    assert node(cluster, name)[1] == {"nvidia.com/gpu": "1"}


def test_mig_reconfiguration_deletes_gpu_pods_and_advertises_slices(cluster: Cluster, namespace: str,
                                                                    operator: GpuOperator, gpu_node: Any) -> None:
    operator.with_reboot = True
    name = gpu_node(gpus=2)
    cluster.admin.core.create_namespaced_pod(namespace, gpu_pod("train-0", node_name=name))
    cluster.admin.core.create_namespaced_pod(namespace, gpu_pod("train-1", node_name=name))
    cluster.admin.core.create_namespaced_pod(namespace, client.V1Pod(
        metadata=client.V1ObjectMeta(name="cpu-only"),
        spec=client.V1PodSpec(node_name=name, containers=[client.V1Container(name="main", image="busybox")])))
    operator.step(0)
    relabel(cluster, operator, name, MIG_CONFIG_LABEL, "all-1g.10gb", 1)
    assert node(cluster, name)[0][MIG_STATE_LABEL] == "pending"
    wait_for(lambda: {p.metadata.name for p in cluster.admin.core.list_namespaced_pod(namespace).items
                      if p.metadata.deletion_timestamp is None} == {"cpu-only"},
             what="the MIG manager deleted the GPU pods, not the CPU one", timeout=30)
    operator.step(2.5)
    assert node(cluster, name)[0][MIG_STATE_LABEL] == "rebooting"
    operator.step(4)
    labels, alloc = node(cluster, name)
    assert labels[MIG_STATE_LABEL] == "success"
    assert alloc == {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "14"}
    assert labels["nvidia.com/mig-1g.10gb.count"] == "14"

    operator.fail_next_mig(name)
    relabel(cluster, operator, name, MIG_CONFIG_LABEL, "all-3g.40gb", 5, 7, 9)
    labels, alloc = node(cluster, name)
    assert labels[MIG_STATE_LABEL] == "failed"
    assert alloc == {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "14"}, "failed leaves the old slices"
    for now in (20, 30):
        operator.step(now)
    assert node(cluster, name)[0][MIG_STATE_LABEL] == "failed", "a failed geometry is not retried"

    relabel(cluster, operator, name, MIG_CONFIG_LABEL, "all-disabled", 40, 42, 44)
    labels, alloc = node(cluster, name)
    assert labels[MIG_STATE_LABEL] == "success"
    assert alloc == {"nvidia.com/gpu": "2"}
    assert "nvidia.com/mig-1g.10gb.count" not in labels


def test_mig_stuck_pending_and_unknown_geometry(cluster: Cluster, namespace: str, operator: GpuOperator,
                                                gpu_node: Any) -> None:
    name = gpu_node(product="NVIDIA-A100-SXM4-40GB", gpus=1)
    operator.step(0)
    operator.stick_pending(name)
    relabel(cluster, operator, name, MIG_CONFIG_LABEL, "all-1g.5gb", 1, 10, 100)
    labels, alloc = node(cluster, name)
    assert labels[MIG_STATE_LABEL] == "pending"
    assert alloc == {"nvidia.com/gpu": "1"}
    relabel(cluster, operator, name, MIG_CONFIG_LABEL, "all-1g.10gb", 101, 102, 104)  # an 80GB profile on a 40GB card
    assert node(cluster, name)[0][MIG_STATE_LABEL] == "failed"
    relabel(cluster, operator, name, MIG_CONFIG_LABEL, "all-balanced", 105, 106, 108)
    labels, alloc = node(cluster, name)
    assert labels[MIG_STATE_LABEL] == "success"
    assert alloc == {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.5gb": "2", "nvidia.com/mig-2g.10gb": "1",
                     "nvidia.com/mig-3g.20gb": "1"}


def test_holds_keep_a_node_at_its_step_until_released(cluster: Cluster, namespace: str, operator: GpuOperator,
                                                      gpu_node: Any) -> None:
    """What the crash tests hold a node at: the config-manager not acting on a new label; a MIG reconfiguration
    pending; one reported ``success`` whose resources the device plugin does not advertise yet."""
    shared, mig = gpu_node(gpus=2), gpu_node(gpus=2)
    write_key(cluster, namespace, "ts-2", ts_config(2))
    operator.step(0)
    operator.hold_config(shared)
    relabel(cluster, operator, shared, CONFIG_LABEL, "ts-2", 1, 10)
    assert node(cluster, shared)[1] == {"nvidia.com/gpu": "2"}
    operator.release(shared)
    operator.step(11)
    assert node(cluster, shared)[1] == {"nvidia.com/gpu": "4"}

    operator.hold_mig(mig, "all-3g.40gb")
    relabel(cluster, operator, mig, MIG_CONFIG_LABEL, "all-3g.40gb", 12, 20, 100)
    assert node(cluster, mig)[0][MIG_STATE_LABEL] == "pending"
    operator.release(mig)
    operator.step(101)
    labels, alloc = node(cluster, mig)
    assert (labels[MIG_STATE_LABEL], alloc) == ("success", {"nvidia.com/gpu": "0", "nvidia.com/mig-3g.40gb": "4"})

    operator.hold_mig_resources(mig, "all-1g.10gb")
    relabel(cluster, operator, mig, MIG_CONFIG_LABEL, "all-1g.10gb", 102, 104, 110)
    labels, alloc = node(cluster, mig)
    assert (labels[MIG_STATE_LABEL], alloc) == ("success", {"nvidia.com/gpu": "0", "nvidia.com/mig-3g.40gb": "4"})
    operator.release(mig)
    operator.step(111)
    assert node(cluster, mig)[1] == {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb": "14"}


def test_running_thread_applies_a_label(cluster: Cluster, namespace: str, operator: GpuOperator,
                                        gpu_node: Any) -> None:
    name = gpu_node(product="NVIDIA-H100-80GB-HBM3", gpus=8)
    write_key(cluster, namespace, "ts-4", ts_config(4))
    with operator:
        label(cluster, name, CONFIG_LABEL, "ts-4")
        wait_for(lambda: node(cluster, name)[1] == {"nvidia.com/gpu": "32"}, what="32 time-sliced GPUs",
                 timeout=30)


def test_the_loop_outlives_a_pass_the_api_server_failed() -> None:
    """A dropped connection (urllib3's ProtocolError, not an OSError) fails one pass; the next ones run."""
    operator = GpuOperator(client.ApiClient(), interval=0.01)
    passes: list[float | None] = []

    def step(now: float | None = None) -> None:
        passes.append(now)
        if len(passes) == 1:
            raise urllib3.exceptions.ProtocolError("Connection aborted.")

    operator.step = step  # type: ignore[method-assign]
    with operator:
        wait_for(lambda: len(passes) >= 3, what="passes after the failed one", timeout=10)
    assert operator.last_error.startswith("ProtocolError")


def test_geometries_and_config_validation() -> None:
    assert geometries("NVIDIA-A100-SXM4-40GB")["all-1g.5gb"] == {"1g.5gb": 7}
    assert geometries("NVIDIA-A100-SXM4-80GB")["all-balanced"] == {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    assert geometries("NVIDIA-H100-80GB-HBM3")["all-1g.10gb"] == {"1g.10gb": 7}
    assert geometries("NVIDIA-L4") == {}
    assert base_product("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED") == "NVIDIA-A100-SXM4-40GB"
    assert parse_config(ts_config(2)).replicas == 2
    assert parse_config("version: v1\nflags: {migStrategy: none}\n").replicas == 1
    for body, why in [("version: v2", "unknown version"), ("sharing: {timeSlicing: {resources: []}}",
                                                           "no resources specified"),
                      ("sharing: {timeSlicing: {resources: [{replicas: 2}]}}", "resource name is required")]:
        with pytest.raises(ConfigRefused, match=why):
            parse_config(body)
