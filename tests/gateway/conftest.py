"""Fixtures the gateway's tests share: the gateway's own credentials, Nodes a test creates (deleted after it), and
node state directories. Helpers: tests/gateway/helpers.py; joins and CSRs: tests/harness/joining.py."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from node.join import NodeFiles
from tests.harness.joining import gateway_credentials
from tests.harness.kube import Cluster, wait_for
from tests.harness.netbed import Gateway, Joined, NetBed


@pytest.fixture(scope="module")
def gateway_api(cluster: Cluster) -> client.ApiClient:
    return gateway_credentials(cluster)


@pytest.fixture
def nodes(cluster: Cluster) -> Iterator[list[str]]:
    """Names of Nodes a test may create; deleted afterwards so no tainted GPU node is left for other tests."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            cluster.admin.core.delete_node(name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Callable[[], NodeFiles]]:
    """A fresh node state directory per call (a node's keys live there)."""
    count = iter(range(1000))
    yield lambda: NodeFiles(tmp_path / f"node-{next(count)}")


@pytest.fixture(scope="module")
def joined(cluster: Cluster, bed: NetBed, gateway: Gateway, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Joined]:
    """A node joined through the tunnel of the module's own ``bed`` and ``gateway`` fixtures, Ready; its Node
    deleted after the module."""
    from tests.gateway.test_tunnel_end import join_node, ready

    node = join_node(cluster, bed, gateway, tmp_path_factory.mktemp("nodes"))
    try:
        wait_for(lambda: ready(cluster, node.name), timeout=60, what=f"{node.name} Ready through the tunnel")
        yield node
    finally:
        with contextlib.suppress(client.ApiException):
            cluster.admin.core.delete_node(node.name)
