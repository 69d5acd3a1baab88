"""The chart's admission policy for burst nodes (issue 21, findings 4 and 5), on the real API server: what a burst
node may do to its own Node with its own kubelet credentials (Node authorizer + NodeRestriction + the policy).
Every control plane of the test bed installs it from the chart's file, as a cluster with the chart has it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import yaml
from kubernetes import client, config

from tests.charts.helm import BURST_VALUES, template
from tests.harness.controlplane import NODE_ADMISSION_POLICY
from tests.harness.kube import Cluster

pytestmark = pytest.mark.cluster

JOINING = client.V1Taint(key="gpu.kubeon.io/joining", value="true", effect="NoSchedule")
TRUST = {"gpu.kubeon.io/location": "aws-eu-central-1", "gpu.kubeon.io/operation": "op-0123456789ab",
         "gpu.kubeon.io/policy": "inference-burst"}


def as_node(cluster: Cluster, name: str) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(cluster.plane.node_kubeconfig(name))))


def register(api: client.CoreV1Api, name: str, *, taints: list[client.V1Taint] | None,
             labels: dict[str, str] | None = None) -> client.V1Node:
    return api.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=labels),
                                         spec=client.V1NodeSpec(taints=taints)))


@contextlib.contextmanager
def registered_burst_node(cluster: Cluster, name: str) -> Iterator[client.CoreV1Api]:
    """A burst node registered as it may (joining-tainted, with the labels that carry trust) by its own kubelet
    credentials, which are yielded; its Node deleted after."""
    api = as_node(cluster, name)
    register(api, name, taints=[JOINING], labels=TRUST)
    try:
        yield api
    finally:
        cluster.admin.core.delete_node(name)


def refused(call: Callable[[], object]) -> client.ApiException:
    with pytest.raises(client.ApiException) as err:
        call()
    assert err.value.status == 403, err.value.body
    return err.value


def test_chart_ships_the_file_the_test_bed_installs() -> None:
    rendered = template(values=[BURST_VALUES])
    text = NODE_ADMISSION_POLICY.read_text().replace("kubeon-burst-node-self-registration",
                                                     "kubeon-gpu-optimizer-burst-nodes")
    shipped = [d for d in yaml.safe_load_all(text) if d]
    assert [d for d in rendered.docs if d["kind"].startswith("ValidatingAdmissionPolicy")] == shipped
    assert not [d for d in template().docs if d["kind"].startswith("ValidatingAdmissionPolicy")]


def test_a_burst_node_cannot_register_without_the_joining_taint(cluster: Cluster) -> None:
    name = "burst-op-taintless01"
    api = as_node(cluster, name)
    err = refused(lambda: register(api, name, taints=None, labels=TRUST))
    assert "gpu.kubeon.io/joining:NoSchedule" in str(err.body)
    other = client.V1Taint(key="gpu.kubeon.io/burst", value="true", effect="NoSchedule")
    refused(lambda: register(api, name, taints=[other]))
    with pytest.raises(client.ApiException) as gone:
        cluster.admin.core.read_node(name)
    assert gone.value.status == 404
    created = register(api, name, taints=[JOINING], labels=TRUST)
    assert JOINING.key in [t.key for t in created.spec.taints]
    cluster.admin.core.delete_node(name)


def test_a_home_node_is_not_bound_by_the_policy(cluster: Cluster) -> None:
    """Only the optimizer's burst names: a home kubelet registers as it always did."""
    name = "home-gpu-node-07"
    register(as_node(cluster, name), name, taints=None)
    cluster.admin.core.delete_node(name)


def test_a_burst_node_cannot_rewrite_the_labels_that_carry_trust(cluster: Cluster) -> None:
    name = "burst-op-relabel0001"
    with registered_burst_node(cluster, name) as api:
        patches: list[dict[str, str | None]] = [
            {"gpu.kubeon.io/location": "onprem-dc1"},  # claim another location (data residency)
            {"gpu.kubeon.io/operation": "op-ffffffffffff"},  # make removal refuse it
            {"gpu.kubeon.io/location": None},  # be counted as home capacity
            {"gpu.kubeon.io/team": "ml"},  # a label a team's selector trusts
            {"node.kubernetes.io/instance-type": "p5.48xlarge"},
        ]
        for patch in patches:
            refused(lambda: api.patch_node(name, {"metadata": {"labels": patch}}))  # noqa: B023 - called at once
        api.patch_node(name, {"metadata": {"labels": {"example.com/rack": "r12"}}})  # anything else stays its own
        labels = cluster.admin.core.read_node(name).metadata.labels
        assert {k: labels.get(k) for k in TRUST} == TRUST and labels["example.com/rack"] == "r12"
        # The gateway (any identity but the node's own) still sets them.
        cluster.admin.core.patch_node(name, {"metadata": {"labels": {"gpu.kubeon.io/verified": "true"}}})


def test_a_refused_burst_node_cannot_uncordon_itself(cluster: Cluster) -> None:
    name = "burst-op-refused0001"
    with registered_burst_node(cluster, name) as api:
        cluster.admin.core.patch_node(name, {"metadata": {"annotations": {"gpu.kubeon.io/join-refused": "8 GPUs"}},
                                             "spec": {"unschedulable": True}})
        refused(lambda: api.patch_node(name, {"spec": {"unschedulable": False}}))
        refused(lambda: api.patch_node(name, {"metadata": {"annotations": {"gpu.kubeon.io/join-refused": None}}}))
        assert cluster.admin.core.read_node(name).spec.unschedulable is True
