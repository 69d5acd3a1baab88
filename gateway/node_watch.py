"""The cluster's Nodes for the gateway's reconciler, kept by one watch instead of a list on every pass.

A pass needs every Node; listing them 4 times a second while nodes join cost the gateway more CPU than anything it
does for a node (a list of 200 Nodes decoded into client objects, issue 26). The watch lists once, then follows
changes from that list's resourceVersion as plain JSON, and tells ``on_change`` of every Node added or modified, so
the reconciler acts on a registration when it happens instead of at its next timed pass. While the watch is not
following (before its first list, after an error, after the API server expired its resourceVersion: 410 Gone) it
has no view and the reconciler lists as before: a stale view is never served."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger("kubeon.gateway")

NodeJson = dict[str, Any]


class WatchExpired(Exception):
    """The API server no longer holds the watch's resourceVersion (410 Gone): list again."""


class NodeWatch:
    """``snapshot()``: the Nodes by name as the watch last saw them, or None while it is not following."""

    def __init__(self, core: client.CoreV1Api, on_change: Callable[[NodeJson], None], *,
                 window_seconds: int = 60, retry_seconds: float = 1.0) -> None:
        self._core = core
        self._on_change = on_change
        self._window = window_seconds
        self._retry = retry_seconds
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeJson] = {}
        self._following = False
        self._stop = threading.Event()
        self._response: Any = None
        self._thread: threading.Thread | None = None

    def snapshot(self) -> dict[str, NodeJson] | None:
        with self._lock:
            return dict(self._nodes) if self._following else None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gateway-node-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:  # unblocks the read the watch thread waits in
                response.shutdown()
            except Exception as exc:  # already closed: the thread is on its way out anyway
                log.debug("node watch shutdown: %s", exc)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._follow(version)
            except WatchExpired:
                version = None
            except Exception as exc:  # the API server away or the connection cut: no view until listed again
                if self._stop.is_set():
                    break
                log.warning("gateway node watch failed (%s: %s): listing again in %.0f s", type(exc).__name__, exc,
                            self._retry)
                version = None
                with self._lock:
                    self._following = False
                self._stop.wait(self._retry)

    def _list(self) -> str:
        body = json.loads(self._core.list_node(_preload_content=False).data)  # type: ignore[attr-defined]
        nodes = {n["metadata"]["name"]: n for n in body["items"]}
        with self._lock:
            self._nodes, self._following = nodes, True
        for node in nodes.values():
            self._on_change(node)
        return str(body["metadata"]["resourceVersion"])

    def _follow(self, version: str) -> str:
        """Apply the watch's events from ``version`` until the server ends the window; the last version seen."""
        response: Any = self._core.list_node(watch=True, resource_version=version, allow_watch_bookmarks=True,
                                        timeout_seconds=self._window, _preload_content=False,
                                        _request_timeout=(10, self._window + 30))
        self._response = response
        try:
            for line in iter_resp_lines(response):
                if self._stop.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise WatchExpired(obj.get("message", ""))
                    raise client.ApiException(status=obj.get("code", 0), reason=obj.get("message", ""))
                version = str(obj["metadata"]["resourceVersion"])
                if kind == "BOOKMARK":
                    continue
                name = obj["metadata"]["name"]
                with self._lock:
                    if kind == "DELETED":
                        self._nodes.pop(name, None)
                    else:
                        self._nodes[name] = obj
                if kind != "DELETED":
                    self._on_change(obj)
        finally:
            self._response = None
            response.release_conn()
        return version
