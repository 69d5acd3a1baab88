"""A list of Kubernetes objects kept by one watch instead of a list on every read.

Listing every Node or Pod each time a question needs them cost more CPU than anything else done per node under load
(the gateway's reconciler listed 200 Nodes 4 times a second; every serving burst node's check read the cluster's
Nodes and Pods once a second; issue 26). A ``WatchedList`` lists once, then follows changes from that list's
resourceVersion as plain JSON, keeps of each object only what ``keep`` makes of it (a serving check needs a pod's
node and GPUs, not its whole spec: memory stays small in a cluster of many pods), and tells ``on_change`` of every
object added or modified. While it is not following (before its first list, after an error, after the API server
expired its resourceVersion: 410 Gone) it has no view, and ``current`` lists as before: a stale view is never
served."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import Generic
from typing import TypeVar

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from common.kube import RecentRead
from common.kube import raw_list

log = logging.getLogger("kubeon.watch")

Json = dict[str, Any]
T = TypeVar("T")
R = TypeVar("R")


class WatchExpired(Exception):
    """The API server no longer holds the watch's resourceVersion (410 Gone): list again."""


def object_key(obj: Json) -> str:
    """``namespace/name``, or ``name`` for a cluster-scoped object."""
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta["name"])


class WatchedList(Generic[T]):
    """``snapshot()``: what ``keep`` made of each object ``list_call`` lists (by ``object_key``), as the watch last
    saw them, or None while it is not following. ``selectors``: the list's and the watch's ``field_selector`` or
    ``label_selector`` (an object that leaves the selection arrives as DELETED)."""

    def __init__(self, list_call: Callable[..., Any], keep: Callable[[Json], T], *,
                 on_change: Callable[[Json], None] | None = None, name: str = "watch", window_seconds: int = 60,
                 retry_seconds: float = 1.0, fallback_seconds: float = 1.0, **selectors: str) -> None:
        self._list_call, self._keep, self._on_change, self._selectors = list_call, keep, on_change, selectors
        self._name, self._window, self._retry = name, window_seconds, retry_seconds
        # What ``current`` serves while the watch is not following: a list, at most fallback_seconds old.
        self._listed = RecentRead(lambda: {key: keep(o) for key, o in self._read()[0].items()}, fallback_seconds)
        self._lock = threading.Lock()
        self._objects: dict[str, T] = {}
        self._following = False
        # Counts changes of the view, so what is derived from it is computed again only when it changed.
        self._version = 0
        self._derived: dict[Callable[..., Any], tuple[int, Any]] = {}
        self._stop = threading.Event()
        self._response: Any = None
        self._thread: threading.Thread | None = None

    def snapshot(self) -> dict[str, T] | None:
        with self._lock:
            return dict(self._objects) if self._following else None

    @property
    def following(self) -> bool:
        with self._lock:
            return self._following

    def lookup(self, key: str) -> tuple[bool, T | None]:
        """(following, what is kept of the object at ``key`` or None if there is none); (False, None) while not
        following."""
        with self._lock:
            return (True, self._objects.get(key)) if self._following else (False, None)

    def derived(self, make: Callable[[Mapping[str, T]], R]) -> R | None:
        """``make`` of the view, computed once per change of it (``make`` must not keep or change the mapping);
        None while not following."""
        with self._lock:
            if not self._following:
                return None
            version, value = self._derived.get(make, (-1, None))
            if version != self._version:
                value = make(self._objects)
                self._derived[make] = (self._version, value)
            return value

    def current(self, make: Callable[[Mapping[str, T]], R]) -> R:
        """``make`` of the view (following starts on first use); while the watch is not following, of a list at
        most ``fallback_seconds`` old: a stale view is never served."""
        self.start()
        view = self.derived(make)
        return view if view is not None else make(self._listed.get())

    def start(self) -> None:
        """Start following, once (later calls do nothing)."""
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:  # unblocks the read the watch thread waits in
                response.shutdown()
            except Exception as exc:  # already closed: the thread is on its way out anyway
                log.debug("%s shutdown: %s", self._name, exc)
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
                log.warning("%s failed (%s: %s): listing again in %.0f s", self._name, type(exc).__name__, exc,
                            self._retry)
                version = None
                with self._lock:
                    self._following = False
                self._stop.wait(self._retry)

    def _read(self) -> tuple[dict[str, Json], str]:
        """The objects listed now, by ``object_key``, and the list's resourceVersion."""
        body = raw_list(self._list_call(_preload_content=False, **self._selectors))
        return {object_key(o): o for o in body["items"]}, str(body["metadata"]["resourceVersion"])

    def _list(self) -> str:
        listed, version = self._read()
        kept = {key: self._keep(o) for key, o in listed.items()}
        with self._lock:
            self._objects, self._following = kept, True
            self._version += 1
        if self._on_change is not None:
            for obj in listed.values():
                self._on_change(obj)
        return version

    def _follow(self, version: str) -> str:
        """Apply the watch's events from ``version`` until the server ends the window; the last version seen."""
        response: Any = self._list_call(watch=True, resource_version=version, allow_watch_bookmarks=True,
                                        timeout_seconds=self._window, _preload_content=False,
                                        _request_timeout=(10, self._window + 30), **self._selectors)
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
                key = object_key(obj)
                if kind == "DELETED":
                    with self._lock:
                        self._objects.pop(key, None)
                        self._version += 1
                else:
                    kept = self._keep(obj)
                    with self._lock:
                        self._objects[key] = kept
                        self._version += 1
                if kind != "DELETED" and self._on_change is not None:
                    self._on_change(obj)
        finally:
            self._response = None
            response.release_conn()
        return version
