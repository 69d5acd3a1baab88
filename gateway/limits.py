"""What keeps the internet-facing gateway serving under abuse (issue 21, finding 9).

- ``guarded_h11``: uvicorn's h11 protocol with a deadline for receiving each request (its headers and body
  within ``receipt_timeout`` seconds of its first byte, or of the connection being made: uvicorn alone has none,
  and ``limit_concurrency`` then lets 128 connections that trickle their headers turn every other request into a
  503), and a cap on concurrent connections per source address (refused at once: closed before any byte is read).
- ``FailureLimiter``: failed authentications per source address in a sliding window; over it, the gateway answers
  429 without asking the API server (each bogus bearer token would otherwise cost one TokenReview).
- ``RefusedTokens``: a small cache of token digests the API server refused lately (never the tokens themselves).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections import deque
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kubeon.gateway")


def guarded_h11(*, receipt_timeout: float, per_source: int) -> type[H11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)``, with its own table of connections per source."""
    open_by_source: dict[str, int] = {}

    class GuardedH11Protocol(H11Protocol):
        _receipt: asyncio.TimerHandle | None = None
        _source: str | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            source = self.client[0] if self.client else ""
            if open_by_source.get(source, 0) >= per_source:
                log.debug("refused a connection from %s: %d open already", source, per_source)
                transport.abort()
                return
            self._source = source
            open_by_source[source] = open_by_source.get(source, 0) + 1
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._source is not None:
                left = open_by_source.get(self._source, 1) - 1
                if left > 0:
                    open_by_source[self._source] = left
                else:
                    open_by_source.pop(self._source, None)
                self._source = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()  # the request is in: the application's time is not the client's
            elif self._receipt is None:
                self._arm()  # the first bytes of the next request on a kept-alive connection

        def _arm(self) -> None:
            self._disarm()
            self._receipt = self.loop.call_later(receipt_timeout, self._expired)

        def _disarm(self) -> None:
            if self._receipt is not None:
                self._receipt.cancel()
                self._receipt = None

        def _expired(self) -> None:
            self._receipt = None
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                return
            log.debug("closed a connection from %s: no complete request within %.0fs", self._source,
                      receipt_timeout)
            self.transport.abort()

    return GuardedH11Protocol


class FailureLimiter:
    """At most ``limit`` failures per source in ``window`` seconds; thread-safe (FastAPI runs sync dependencies in
    a thread pool). Bounded: at most ``max_sources`` sources are tracked (the oldest dropped)."""

    def __init__(self, limit: int, window: float = 60.0, max_sources: int = 4096) -> None:
        self.limit = limit
        self.window = window
        self._max = max_sources
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def _recent(self, source: str, now: float) -> deque[float] | None:
        times = self._failures.get(source)
        if times is not None:
            while times and times[0] <= now - self.window:
                times.popleft()
        return times

    def retry_after(self, source: str) -> float:
        """0 when ``source`` may try; else seconds until its oldest counted failure ages out."""
        now = time.monotonic()
        with self._lock:
            times = self._recent(source, now)
            if times is None or len(times) < self.limit:
                return 0.0
            return max(1.0, times[0] + self.window - now)

    def failed(self, source: str) -> None:
        now = time.monotonic()
        with self._lock:
            times = self._recent(source, now)
            if times is None:
                times = self._failures[source] = deque(maxlen=max(self.limit, 1))
            self._failures.move_to_end(source)
            times.append(now)
            while len(self._failures) > self._max:
                self._failures.popitem(last=False)


class RefusedTokens:
    """SHA-256 digests of tokens the API server refused, for ``ttl`` seconds (at most ``size``)."""

    def __init__(self, ttl: float = 60.0, size: int = 1024) -> None:
        self.ttl = ttl
        self._size = size
        self._seen: OrderedDict[bytes, tuple[float, Any]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _digest(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def get(self, token: str) -> Any | None:
        key = self._digest(token)
        with self._lock:
            hit = self._seen.get(key)
            if hit is None:
                return None
            if hit[0] < time.monotonic():
                del self._seen[key]
                return None
            return hit[1]

    def add(self, token: str, value: Any) -> None:
        with self._lock:
            self._seen[self._digest(token)] = (time.monotonic() + self.ttl, value)
            while len(self._seen) > self._size:
                self._seen.popitem(last=False)


__all__ = ["FailureLimiter", "RefusedTokens", "guarded_h11"]
