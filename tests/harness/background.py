"""A daemon thread that runs while a ``with`` block does: the watchers and the booters of end-to-end tests."""

from __future__ import annotations

import threading
from typing import Self


class Background:
    """Runs ``_run`` in a daemon thread from entering the ``with`` block; leaving it sets ``_stop`` (which
    ``_run`` watches) and waits up to ``join_seconds`` for the thread."""

    join_seconds = 10.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_seconds)

    def _run(self) -> None:
        raise NotImplementedError
