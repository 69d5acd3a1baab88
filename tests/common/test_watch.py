"""A list kept by one watch (common/watch.py) against the real control plane: the view follows adds, changes and
deletes past the server's window; an object that leaves the selection leaves the view; only what ``keep`` makes of
an object is kept; what is derived from the view is computed once per change; a watch that cannot list has no view
(its reader lists instead)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from kubernetes import client

from common.watch import WatchedList
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster


def test_the_view_follows_objects_added_changed_and_deleted(cluster: Cluster) -> None:
    seen: list[str] = []
    watch = WatchedList(cluster.admin.core.list_node, lambda node: node, window_seconds=5,
                        on_change=lambda node: seen.append(node["metadata"]["name"]))
    assert watch.snapshot() is None, "no view before the first list"
    watch.start()
    name = f"watched-{uuid.uuid4().hex[:8]}"
    try:
        wait_for(lambda: watch.snapshot() is not None, timeout=30, what="the watch's first list")
        cluster.admin.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels={"x": "1"})))
        wait_for(lambda: name in (watch.snapshot() or {}), timeout=30, what=f"{name} in the watch's view")
        assert name in seen, "each node added is handed to on_change"
        # Past a window (the server ends the watch after window_seconds), the view still follows.
        cluster.admin.core.patch_node(name, {"metadata": {"labels": {"x": "2"}}})
        wait_for(lambda: (watch.snapshot() or {}).get(name, {}).get("metadata", {}).get("labels", {}).get("x") == "2",
                 timeout=30, what=f"{name}'s new label in the view")
        cluster.admin.core.delete_node(name)
        wait_for(lambda: (view := watch.snapshot()) is not None and name not in view, timeout=30,
                 what=f"{name} gone from the watch's view")
    finally:
        watch.stop()
        if name in (watch.snapshot() or {}):
            cluster.admin.core.delete_node(name)
    assert watch.snapshot() is not None  # the last view stays readable; its reader is stopped with it


def _pod(name: str, size: str, namespace: str) -> client.V1Pod:
    """A pod only this test's watch selects (labelled with the test's namespace)."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"watched": "yes", "size": size, "run": namespace}),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="registry.invalid/c:1")]))


def test_only_what_keep_makes_is_kept_and_an_object_leaving_the_selection_leaves_the_view(
        cluster: Cluster, namespace: str) -> None:
    watch = WatchedList(cluster.admin.core.list_pod_for_all_namespaces,
                        lambda pod: pod["metadata"]["labels"]["size"], label_selector=f"watched=yes,run={namespace}")
    watch.start()
    try:
        cluster.admin.core.create_namespaced_pod(namespace, _pod("small", "1", namespace))
        cluster.admin.core.create_namespaced_pod(namespace, _pod("large", "4", namespace))
        wait_for(lambda: watch.snapshot() == {f"{namespace}/small": "1", f"{namespace}/large": "4"}, timeout=30,
                 what="both pods in the view, by namespace/name, as what keep made of them")
        cluster.admin.core.patch_namespaced_pod("large", namespace, {"metadata": {"labels": {"watched": "no"}}})
        wait_for(lambda: watch.snapshot() == {f"{namespace}/small": "1"}, timeout=30,
                 what="the pod no longer selected gone from the view")
    finally:
        watch.stop()


def test_what_is_derived_from_the_view_is_computed_once_per_change(cluster: Cluster, namespace: str) -> None:
    made: list[int] = []

    def count(view: Mapping[str, Any]) -> int:
        made.append(len(view))
        return len(view)

    watch = WatchedList(cluster.admin.core.list_pod_for_all_namespaces, lambda pod: pod["metadata"]["name"],
                        label_selector=f"watched=yes,run={namespace}")
    assert watch.derived(count) is None, "nothing derived before the first list"
    watch.start()
    try:
        wait_for(lambda: watch.derived(count) == 0, timeout=30, what="the first list")
        calls = len(made)
        assert [watch.derived(count) for _ in range(5)] == [0] * 5
        assert len(made) == calls, "an unchanged view is not derived again"
        cluster.admin.core.create_namespaced_pod(namespace, _pod("counted", "1", namespace))
        wait_for(lambda: watch.derived(count) == 1, timeout=30, what="the pod counted")
        assert len(made) >= calls + 1
    finally:
        watch.stop()


def test_a_watch_that_cannot_list_has_no_view_and_keeps_trying() -> None:
    tried = threading.Event()
    attempts: list[int] = []

    def refused(**_: Any) -> Any:
        attempts.append(1)
        if len(attempts) >= 2:
            tried.set()
        raise client.ApiException(status=403, reason="Forbidden")

    watch = WatchedList(refused, lambda obj: obj, retry_seconds=0.05)
    watch.start()
    try:
        assert tried.wait(10), "the list is tried again after a refusal"
        assert watch.snapshot() is None and watch.derived(len) is None
    finally:
        watch.stop()
