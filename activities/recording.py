"""What the fakes of the provider interfaces share (Karpenter's fake cloud provider: record every call, inject
failures): ``activities.providers.fake`` for the clouds, ``activities.capacity.fake`` for home capacity."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from dataclasses import field


@dataclass
class CallRecorder:
    calls: list[tuple[str, str]] = field(default_factory=list)
    # method -> exceptions raised by the next calls of that method, in order
    failures: dict[str, list[Exception]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail_next(self, method: str, *errors: Exception) -> None:
        self.failures.setdefault(method, []).extend(errors)

    def _record(self, method: str, arg: str) -> None:
        with self._lock:
            self.calls.append((method, arg))
            pending = self.failures.get(method)
            if pending:
                raise pending.pop(0)
