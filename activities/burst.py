"""Every activity of burst and drain operations, one object per phase of a node's life sharing one context.

Each is idempotent: a retry after a crash finds what the previous attempt did (instances by operation tag, nodes
by name, audit records by key). The activity names are what histories hold; they never change."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from temporalio.client import Client

from activities.audit import AuditActivities
from activities.capacity import CapacityProvider
from activities.clients.audit_log import AuditLog
from activities.clients.gateway import GatewayClient
from activities.clients.kube import KubeOps
from activities.context import BurstContext
from activities.context import HomeSettings
from activities.context import ReportSink
from activities.drain import DrainActivities
from activities.gate import GateActivities
from activities.join import JoinActivities
from activities.launch import LaunchActivities
from activities.providers.base import Provider
from activities.provisioning import ProvisioningActivities
from activities.serve import ServeActivities
from activities.telemetry.tracing import traced
from activities.verify import VerifyActivities
from models.locations import BurstConfig


class BurstActivities:
    def __init__(
        self,
        *,
        kube: KubeOps,
        providers: dict[str, Provider],
        gateway: GatewayClient,
        config: BurstConfig,
        audit: AuditLog,
        temporal: Client | None = None,
        task_queue: str = "kubeon-gpu",
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        report_sink: ReportSink | None = None,
        capacity: CapacityProvider | None = None,
        home: HomeSettings | None = None,
    ) -> None:
        # The one seam where every provider, present or future, gets its cloud-call spans and metrics.
        self.context = BurstContext(
            kube=kube, providers={name: traced(provider) for name, provider in providers.items()}, gateway=gateway,
            config=config, audit_log=audit, temporal=temporal, task_queue=task_queue, clock=clock,
            report_sink=report_sink, capacity=capacity, home=home or HomeSettings())
        self.provisioning = ProvisioningActivities(self.context)
        self.launch = LaunchActivities(self.context)
        self.join = JoinActivities(self.context)
        self.verify = VerifyActivities(self.context)
        self.serve = ServeActivities(self.context)
        self.drain = DrainActivities(self.context)
        self.audit = AuditActivities(self.context)
        self.gate = GateActivities(self.context)

    @property
    def providers(self) -> dict[str, Provider]:
        return self.context.providers

    def all(self) -> list[Callable[..., Any]]:
        """The activities of the main task queue."""
        return [
            self.provisioning.load_policy, self.provisioning.plan_batch, self.provisioning.scale_home_group,
            self.launch.launch_instance,
            self.join.wait_for_node, self.join.check_node_identity, self.verify.burn_in_node, self.verify.verify_node,
            self.drain.cordon_node,
            self.drain.evict_pods, self.drain.terminate_instance, self.drain.remove_node, self.drain.confirm_gone,
            self.drain.cleanup_operation, self.audit.record_audit, self.gate.action_gate,
            self.drain.read_transfer, self.drain.count_burst_cost,
        ]

    def held_long(self) -> list[Callable[..., Any]]:
        """The async activities that hold for a node's whole service or a hold: the serve task queue's."""
        return [self.serve.serve_until_done, self.gate.await_actions_allowed]
