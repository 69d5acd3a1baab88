"""One `helm install` into a namespace other than `kubeon-gpu` (issue 21, lows), on the real control plane: the
gateway is told to allow that namespace's optimizer, and the chart's ServiceAccounts there hold their rules
(the optimizer's R5.1 read, the gateway's Role on its own and the embedded Temporal's Service). Its own module:
the chart's cluster-scoped names are fixed, so it cannot run while test_install.py's release exists."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client

from tests.charts.helm import BURST_VALUES
from tests.charts.helm import CHART
from tests.charts.helm import MINIMAL_VALUES
from tests.charts.helm import RELEASE
from tests.charts.helm import run_helm
from tests.charts.test_install import GATEWAY
from tests.charts.test_install import GPU_OPERATOR
from tests.charts.test_install import OPTIMIZER
from tests.charts.test_install import _exists
from tests.charts.test_install import can
from tests.charts.test_install import namespace_settled
from tests.charts.test_install import refused
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def release_ns(cluster: Cluster) -> Iterator[str]:
    admin = cluster.admin
    ns = f"ml-platform-{uuid.uuid4().hex[:6]}"
    operator_existed = namespace_settled(cluster, GPU_OPERATOR)
    if not operator_existed:  # the GPU Operator's namespace, where the chart's time-slicing Role goes
        admin.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=GPU_OPERATOR)))
    adopt = any(_exists(read) for read in (lambda: admin.rbac.read_cluster_role(OPTIMIZER),
                                           lambda: admin.rbac.read_cluster_role(GATEWAY)))
    try:
        run_helm(["install", RELEASE, CHART, "--namespace", ns, "--create-namespace",
                  "--kubeconfig", cluster.plane.admin_kubeconfig, "--wait=false",
                  *(["--take-ownership"] if adopt else []), "-f", MINIMAL_VALUES, "-f", BURST_VALUES,
                  "--set", "cluster=test", "--set", "temporal.mode=embedded",
                  "--set", f"scaleToZero.namespaces={{{ns}}}"])
        yield ns
    finally:
        run_helm(["uninstall", RELEASE, "--namespace", ns, "--wait", "--timeout", "120s",
                  "--kubeconfig", cluster.plane.admin_kubeconfig], check=False)
        for gone in (ns, *([] if operator_existed else [GPU_OPERATOR])):
            try:
                admin.core.delete_namespace(gone)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise


def test_a_release_in_another_namespace_allows_its_own_optimizer(cluster: Cluster, release_ns: str) -> None:
    admin = cluster.admin
    gateway = admin.apps.read_namespaced_deployment(GATEWAY, release_ns).spec.template.spec.containers[0]
    settings = {e.name: e.value for e in gateway.env}
    assert settings["KUBEON_GATEWAY_ALLOWED_CLIENTS"] == f"system:serviceaccount:{release_ns}:{OPTIMIZER}"
    assert settings["KUBEON_GATEWAY_SERVICE_NAMESPACE"] == release_ns
    # The chart's ServiceAccounts in that namespace, with their own credentials.
    for name in (OPTIMIZER, GATEWAY):
        wait_for(lambda name=name: admin.core.read_namespaced_service_account(name, release_ns),  # type: ignore[misc]
                 what=f"the ServiceAccount {name}")
    optimizer = cluster.service_account_client(release_ns, OPTIMIZER, create=False)
    gw = cluster.service_account_client(release_ns, GATEWAY, create=False)
    wait_for(lambda: can(optimizer, "list", "nodes"), what="the optimizer's ClusterRole bound in that namespace")
    assert not can(optimizer, "get", "secrets", namespace=release_ns)
    wait_for(lambda: gw.core.read_namespaced_service(GATEWAY, release_ns), what="the gateway's own Service")
    assert gw.core.read_namespaced_service(f"{OPTIMIZER}-temporal", release_ns).spec.cluster_ip
    refused(lambda: gw.core.list_namespaced_service(release_ns))
    refused(lambda: gw.core.read_namespaced_service(GATEWAY, "kubeon-gpu"))
