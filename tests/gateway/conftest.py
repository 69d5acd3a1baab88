"""Fixtures the gateway's tests share: the gateway's own credentials, Nodes a test creates (deleted after it),
node state directories; for the tunnel modules, the bed, its tunnel gateway (``gateway``, its extra environment
``gateway_env``, which a module overrides) and a node joined through it. Helpers: tests/gateway/helpers.py; joins
and CSRs: tests/harness/joining.py."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from kubernetes import client

from node.join import NodeFiles
from tests.gateway.helpers import delete_nodes
from tests.harness.joining import gateway_credentials
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.netbed import POD_CIDR
from tests.harness.netbed import SERVICE_CIDR
from tests.harness.netbed import TUNNEL_CIDR
from tests.harness.netbed import Gateway
from tests.harness.netbed import Joined
from tests.harness.netbed import NetBed
from tests.harness.netbed import start_tunnel_gateway


@pytest.fixture(scope="module")
def gateway_api(cluster: Cluster) -> client.ApiClient:
    return gateway_credentials(cluster)


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[list[str]]:
    """Names of Nodes a test may create; deleted afterwards so no tainted GPU node is left for other tests."""
    names: list[str] = []
    yield names
    delete_nodes(cluster, names)


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Callable[[], NodeFiles]]:
    """A fresh node state directory per call (a node's keys live there)."""
    count = iter(range(1000))
    yield lambda: NodeFiles(tmp_path / f"node-{next(count)}")


@pytest.fixture(scope="module")
def bed(cluster: Cluster) -> Iterator[NetBed]:
    """Network namespaces for the gateway and its burst nodes, routed to the cluster (tests/harness/netbed.py); one
    per module, as each module starts its own tunnel gateway in it."""
    bed = NetBed().create(api_port=int(urlsplit(cluster.plane.server).port or 443))
    try:
        bed.route_cluster(service_cidr=SERVICE_CIDR, pod_cidr=POD_CIDR, tunnel_cidr=TUNNEL_CIDR)
        yield bed
    finally:
        bed.close()


@pytest.fixture(scope="module")
def gateway_env() -> dict[str, str]:
    """The tunnel gateway's environment beyond what ``start_tunnel_gateway`` sets (a module overrides this)."""
    return {}


@pytest.fixture(scope="module")
def gateway(cluster: Cluster, bed: NetBed, gateway_env: dict[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The gateway process with its tunnel in the module's ``bed`` (stopped after the module)."""
    gw = start_tunnel_gateway(cluster, bed, tmp_path_factory.mktemp("tunnel"), service_cidr=SERVICE_CIDR,
                              pod_cidr=POD_CIDR, tunnel_cidr=TUNNEL_CIDR, extra_env=gateway_env)
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def joined(cluster: Cluster, bed: NetBed, gateway: Gateway, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Joined]:
    """A node joined through the tunnel of the module's own ``bed`` and ``gateway`` fixtures, Ready; its Node
    deleted after the module."""
    from tests.gateway.test_tunnel_end import join_node
    from tests.gateway.test_tunnel_end import ready

    node = join_node(cluster, bed, gateway, tmp_path_factory.mktemp("nodes"))
    try:
        wait_for(lambda: ready(cluster, node.name), timeout=60, what=f"{node.name} Ready through the tunnel")
        yield node
    finally:
        with contextlib.suppress(client.ApiException):
            cluster.admin.core.delete_node(node.name)
