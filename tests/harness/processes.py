"""One process a test starts (a gateway, a hub, a worker, a local cloud, Prometheus): is it up, and stopping it
so that nothing of it is left. ``make dev``'s many children have their own, ordered handling in ``children.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

import httpx


def stop_process(proc: subprocess.Popen[Any], timeout: float, *, group: bool = False) -> bool:
    """SIGTERM ``proc`` and wait up to ``timeout`` seconds for it to exit, SIGKILL it when it has not. With
    ``group`` (it was started with ``start_new_session``), SIGKILL whatever is left of its process group after.
    True when it exited of itself (or had already), False when it had to be killed."""
    exited = True
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            exited = False
            proc.kill()
            proc.wait()
    if group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return exited


def answers_ok(proc: subprocess.Popen[Any], url: str, *, name: str, log: Callable[[], str]) -> bool:
    """Whether a GET of ``url`` answers 200 (False while nothing listens yet); an AssertionError with ``log()`` when
    ``proc`` (``name``) has exited instead: a condition for ``wait_for``."""
    if proc.poll() is not None:
        raise AssertionError(f"{name} exited {proc.returncode} before it was ready:\n{log()}")
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def killed_once(code: str, args: list[str], sent: Callable[[], bool], *, what: str, timeout: float = 30) -> None:
    """Run ``code`` (a Python snippet printing ``returned`` when its call returns) with ``args`` in a process of
    its own and SIGKILL it as soon as ``sent`` is true (its request reached the cloud, the answer not yet back):
    a worker killed mid-call. Fails unless it was killed before the call returned."""
    import sys

    from tests.harness.kube import wait_for

    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ})
    try:
        wait_for(sent, timeout=timeout, what=what)
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL and b"returned" not in out, out  # killed before the answer
