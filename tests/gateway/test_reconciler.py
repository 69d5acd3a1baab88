"""The reconciler against the real control plane: the joining check (capacity against the ticket's offering)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kubernetes import client

from models.labels import JOIN_REFUSED_ANNOTATION
from models.labels import JOINING_TAINT
from node.join import NodeFiles
from tests.gateway.helpers import gateway
from tests.gateway.helpers import join_and_register
from tests.gateway.helpers import ticket_request
from tests.harness.kube import Cluster

pytestmark = pytest.mark.cluster


def test_a_node_reporting_more_gpus_than_its_offering_is_cordoned(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes).model_copy(update={"gpus": 1})
    join_and_register(gw, req, files(), gpus=100000)
    assert req.node_name in gw.reconcile()["cordoned"]
    got = cluster.admin.core.read_node(req.node_name)
    assert got.spec.unschedulable is True
    assert "100000 GPUs" in got.metadata.annotations[JOIN_REFUSED_ANNOTATION]
    assert JOINING_TAINT.key in {t.key for t in got.spec.taints}  # never lifted: no pod lands
