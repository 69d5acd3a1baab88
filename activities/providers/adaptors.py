"""Cloud SDKs imported on first use (after SkyPilot's ``sky/adaptors``): a provider module names the SDK modules it
needs once, at its top, and a cluster without that cloud's locations never loads them (boto3, google-cloud-compute
and azure-mgmt-compute each add seconds and tens of MiB to the worker's start)."""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any


class LazyImport:
    """A module imported when one of its attributes is first read (``compute_v1.Instance``, ``except
    exceptions.NotFound``); the import runs once, under a lock, whichever activity thread gets there first."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None
        self._lock = threading.Lock()

    def load(self) -> ModuleType:
        if self._module is None:
            with self._lock:
                if self._module is None:
                    self._module = importlib.import_module(self._name)
        return self._module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"LazyImport({self._name!r}, loaded={self._module is not None})"
