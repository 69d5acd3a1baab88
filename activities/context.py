"""What the activities of burst and drain operations share: the clients, the providers, the configuration, the
audit log; and the helpers every phase uses (the provider of a location, the hub's hold, a cancellable heartbeat).

Sync activities run in threads. They are never interrupted by an injected CancelledError (one raised inside a
lock, e.g. logging's, would leave it held and hang the worker); the long ones poll for cancellation instead
(``beat``)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.capacity import CapacityProvider
from activities.clients.audit_log import AuditLog
from activities.clients.gateway import GatewayClient
from activities.clients.kube import KubeOps
from activities.clients.policies import hold_reason
from activities.providers.base import Provider
from models.hub import ActionReport
from models.hub import GateState
from models.locations import BurstConfig

T = TypeVar("T")

# Where audit records go for the hub (the worker signals the hub sync workflow); None without a hub.
ReportSink = Callable[[ActionReport], Awaitable[None]]


def beat(details: str) -> None:
    """Heartbeat, and stop if the activity was cancelled (threads get no injected CancelledError)."""
    activity.heartbeat(details)
    if activity.is_cancelled():
        raise asyncio.CancelledError(f"cancelled while {details}")


async def poll(read: Callable[[], T], done: Callable[[T], bool], *, timeout_seconds: float,
               describe: Callable[[T], str]) -> tuple[T, bool]:
    """``read`` (in a thread) once a second until ``done`` of what it read, or ``timeout_seconds`` have passed;
    every read heartbeats ``describe`` of it (a killed worker's wait moves on). What was read last, and whether it
    was done."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        got = await asyncio.to_thread(read)
        activity.heartbeat(describe(got))
        if done(got):
            return got, True
        if time.monotonic() > deadline:
            return got, False
        await asyncio.sleep(1)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class HomeSettings:
    # A pod Karpenter could serve is not burst for this long after it became Unschedulable (Karpenter batches pods
    # before it creates a NodeClaim); past it with no NodeClaim, it is burst.
    launch_grace_seconds: float = 60.0
    # A home NodeClaim still unregistered after this long no longer holds a pod back from burst.
    register_seconds: float = 300.0


@dataclass
class BurstContext:
    kube: KubeOps
    # Wrapped by the composition (activities.burst) in the tracing seam: every cloud call gets its span and metrics.
    providers: dict[str, Provider]
    gateway: GatewayClient
    config: BurstConfig
    audit_log: AuditLog
    temporal: Client | None = None
    task_queue: str = "kubeon-gpu"
    clock: Callable[[], dt.datetime] = field(default=_now)
    report_sink: ReportSink | None = None
    # capacity.provider (karpenter): home capacity a waiting pod is served by before it is burst; None: none.
    capacity: CapacityProvider | None = None
    home: HomeSettings = field(default_factory=lambda: HomeSettings())

    def provider(self, location: str) -> Provider:
        name = location.split("/", 1)[0]
        provider = self.providers.get(name)
        if provider is None:
            raise ApplicationError(f"no provider for {name} locations is configured ({location})",
                                   type="ProviderMissing", non_retryable=True)
        return provider

    def gate(self, policy: str) -> GateState:
        """The hub's hold (R2.3): no operation of the policy acts while the hub rejects this cluster's token."""
        reason = hold_reason(self.kube.policy_status(policy))
        return GateState(held=reason is not None, reason=reason or "")


class PhaseActivities:
    """The base of each phase's activities: one shared context."""

    def __init__(self, context: BurstContext) -> None:
        self.context = context
        self.kube = context.kube
        self.gateway = context.gateway
        self.config = context.config
        self.clock = context.clock
