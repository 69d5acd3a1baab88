"""The reconciler's Nodes from one watch (common/watch.py) against the real control plane: a registration is acted
on when it happens, not at the next timed pass; a patch made from a view the Node has since moved past is refused,
never written over what changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from models.labels import JOINING_TAINT
from node.join import NodeFiles
from tests.gateway.helpers import gateway
from tests.gateway.helpers import join_and_register
from tests.gateway.helpers import ticket_request
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster

DRAIN_TAINT = {"key": "example.com/draining", "value": "true", "effect": "NoSchedule"}


def _taint_keys(cluster: Cluster, name: str) -> set[str]:
    return {t.key for t in cluster.admin.core.read_node(name).spec.taints or []}


def test_a_registered_node_is_untainted_by_its_watch_event_not_a_timed_pass(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    gw.start_reconciler(interval=3600)  # no timed pass within the test: only the watch can wake it
    try:
        req = ticket_request(nodes)
        join_and_register(gw, req, files())
        wait_for(lambda: JOINING_TAINT.key not in _taint_keys(cluster, req.node_name), timeout=30,
                 what=f"the joining taint lifted from {req.node_name} after its registration")
        got = cluster.admin.core.read_node(req.node_name)
        assert got.spec.pod_cidr, "the pass that lifted the taint also gave the node its pod CIDR"
    finally:
        gw.stop()


def test_a_pass_from_a_view_the_node_moved_past_patches_it_as_it_is_now_keeping_the_change(
        cluster: Cluster, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    join_and_register(gw, req, files())
    stale: dict[str, Any] = gateway_api.sanitize_for_serialization(cluster.admin.core.read_node(req.node_name))
    # Someone taints the node after the view was taken (a drain): the whole taint list the pass would write from
    # the view would drop it.
    taints = [{"key": t.key, "value": t.value, "effect": t.effect}
              for t in cluster.admin.core.read_node(req.node_name).spec.taints or []]
    cluster.admin.core.patch_node(req.node_name, {"spec": {"taints": [*taints, DRAIN_TAINT]}})
    # The conditional patch from the view is refused (409); the node is read again and patched as it is now:
    # the joining taint lifted in this same pass, the drain's kept.
    assert req.node_name in gw._reconciler._pass({req.node_name: stale})["labelled"]
    keys = _taint_keys(cluster, req.node_name)
    assert JOINING_TAINT.key not in keys and DRAIN_TAINT["key"] in keys
