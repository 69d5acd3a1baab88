"""What the metrics loops (worker/scale_watcher.py, worker/sharing_watcher.py) share: the resync loop, evaluating
each policy apart, the conditions they write into a policy's status, and starting one operation per subject
(a running one is left as it is)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from collections.abc import Iterable
from datetime import UTC
from datetime import datetime
from typing import Any
from typing import ClassVar
from typing import TypeVar

from kubernetes.client import ApiException
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.common import WorkflowIDReusePolicy

P = TypeVar("P")
C = TypeVar("C")


class ResyncLoop:
    """Every ``resync_seconds`` one round (:meth:`_round`, by default :meth:`resync`) until :meth:`stop`; a failed
    round is logged and the next one comes on time."""

    NAME: ClassVar[str]  # the loop's name in its log lines
    log: ClassVar[logging.Logger]

    def __init__(self, temporal: Client, *, cluster: str, task_queue: str, resync_seconds: float) -> None:
        self.temporal = temporal
        self.cluster = cluster
        self.task_queue = task_queue
        self.resync_seconds = resync_seconds
        self.started: list[str] = []  # workflow IDs started, for tests and logs
        self._stop = asyncio.Event()

    async def resync(self) -> list[str]:
        """Evaluate every policy and make sure each candidate has its operation; their workflow IDs."""
        raise NotImplementedError

    async def _round(self) -> None:
        await self.resync()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await self._round()
            except Exception:
                self.log.exception("%s resync failed; retrying in %gs", self.NAME, self.resync_seconds)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.resync_seconds):
                    await self._stop.wait()

    def stop(self) -> None:
        self._stop.set()

    async def _start_operation(self, workflow: str, arg: Any, *, id: str, summary: str) -> str:
        """The operation's workflow under ``id``, started unless one runs (then that one is left as it is); its
        ID."""
        handle = await self.temporal.start_workflow(
            workflow, arg, id=id, task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE, static_summary=summary)
        return handle.id


def each_policy(policies: Callable[[], Iterable[P]], evaluate: Callable[[P], list[C]], *, what: str,
                log: logging.Logger) -> list[C]:
    """``evaluate`` of every policy listed (none while the GpuPolicy CRD is not installed); one policy's failure
    is logged and never stops the others."""
    try:
        listed = policies()
    except ApiException as exc:
        if exc.status != 404:
            raise
        log.debug("no GpuPolicy CRD yet: nothing to measure")
        return []
    out: list[C] = []
    for policy in listed:
        try:
            out += evaluate(policy)
        except Exception:
            log.exception("%s %s: evaluation failed", what, getattr(policy, "name", policy))
    return out


def condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def prometheus_condition(configured: bool, unconfigured: str) -> dict[str, str]:
    """R1.3: whether prometheus.url is set (``unconfigured`` says what its absence disables)."""
    return condition("PrometheusConfigured", configured, "Configured" if configured else "NoPrometheusUrl",
                     "prometheus.url is set" if configured else unconfigured)


def metrics_condition(problem: str) -> dict[str, str]:
    """Whether the DCGM series could be read (``problem``: why not)."""
    return condition("GpuMetrics", not problem, "Measured" if not problem else "NotMeasured",
                     problem or "DCGM series found")


def evaluated_at() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
