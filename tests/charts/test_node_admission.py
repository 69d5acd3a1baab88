"""The chart's admission policy for burst nodes (issue 21, findings 4 and 5), on the real API server: what a burst
node may do to its own Node with its own kubelet credentials (Node authorizer + NodeRestriction + the policy).
Every control plane of the test bed installs it from the chart's file, as a cluster with the chart has it."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes import config

from tests.charts.helm import BURST_VALUES
from tests.charts.helm import template
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
    def key(doc: dict[str, Any]) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    policies = [d for d in rendered.docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
    assert sorted(policies, key=key) == sorted(shipped, key=key)
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


def test_a_burst_node_cannot_mark_itself_burned_in(cluster: Cluster) -> None:
    name = "burst-op-burnin0001"
    with registered_burst_node(cluster, name) as api:
        refused(lambda: api.patch_node(name, {"metadata": {"annotations": {"gpu.kubeon.io/burned-in": "Gpus"}}}))
        cluster.admin.core.patch_node(name, {"metadata": {"annotations": {"gpu.kubeon.io/burned-in": "Gpus: 1"}}})
        refused(lambda: api.patch_node(name, {"metadata": {"annotations": {"gpu.kubeon.io/burned-in": "all"}}}))
        api.patch_node(name, {"metadata": {"labels": {"example.com/rack": "r12"}}})  # anything else stays its own
        annotations = cluster.admin.core.read_node(name).metadata.annotations
        assert annotations["gpu.kubeon.io/burned-in"] == "Gpus: 1"


def _kubelet_csr(name: str, node: str) -> client.V1CertificateSigningRequest:
    """What the kubelet's client certificate rotation sends for ``node``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}"),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes")])
    pem = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(
        ec.generate_private_key(ec.SECP256R1()), hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    return client.V1CertificateSigningRequest(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1CertificateSigningRequestSpec(request=base64.b64encode(pem).decode(),
                                                    signer_name="kubernetes.io/kube-apiserver-client-kubelet",
                                                    usages=["digital signature", "client auth"]))


def test_a_burst_node_cannot_renew_its_own_certificate(cluster: Cluster) -> None:
    """The kubelet's self-renewal (auto-approved for system:nodes) is closed to burst nodes: a removed node's
    certificate ends with its lifetime; only the gateway re-issues, while the node holds its slot."""
    name = "burst-op-renewal0001"
    certs = client.CertificatesV1Api(config.new_client_from_config(
        config_file=str(cluster.plane.node_kubeconfig(name))))
    err = refused(lambda: certs.create_certificate_signing_request(_kubelet_csr(f"{name}-renew", name)))
    assert "burst gateway" in str(err.body)
    with pytest.raises(client.ApiException) as gone:
        client.CertificatesV1Api(cluster.admin.api).read_certificate_signing_request(f"{name}-renew")
    assert gone.value.status == 404


def test_a_home_node_still_renews_its_certificate(cluster: Cluster) -> None:
    home = "home-gpu-node-08"
    certs = client.CertificatesV1Api(config.new_client_from_config(
        config_file=str(cluster.plane.node_kubeconfig(home))))
    created = certs.create_certificate_signing_request(_kubelet_csr(f"{home}-renew", home), dry_run="All")
    assert created.spec.username == f"system:node:{home}"
