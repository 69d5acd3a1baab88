"""The activities of burst and drain operations. Each is idempotent: a retry after a crash finds what the
previous attempt did (instances by operation tag, nodes by name, audit records by key)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.audit import AuditLog
from activities.clients.gateway import GatewayClient
from activities.clients.kube import KubeOps, NodeJoinTimeout, VerificationFailed
from activities.clients.policies import hold_reason
from activities.providers.base import (
    InstanceNotFoundError,
    InsufficientCapacityError,
    LocationNotAllowedError,
    NotOwnedError,
    Provider,
    ProviderError,
)
from activities.telemetry.tracing import traced
from models.audit import AuditRecord
from models.drain import EvictionResult, GoneCheck, NodeRef, NodeRemoval
from models.errors import AddressesExhausted
from models.hub import REPORT_ACTIONS, ActionReport, GateRequest, GateState, report_detail
from models.join import JoinTicketRequest, UserDataTooLarge, render_user_data
from models.labels import JOIN_REFUSED_ANNOTATION
from models.locations import BurstConfig
from models.node import (
    CleanupRequest,
    CleanupResult,
    Instance,
    InstanceRef,
    LaunchRequest,
    NodeExpectation,
    NodeWaitRequest,
    ServeCheckRequest,
    ServeCheckResult,
    VerifyResult,
)
from models.provisioning import BatchPlan, BatchPlanRequest, LoadPolicyRequest, Offering, PolicySnapshot
from planning.burst import AddressSlots, Room, node_labels, plan_pods

# Error types the workflows branch on (ApplicationError.type).
INSUFFICIENT_CAPACITY = "InsufficientCapacity"
LOCATION_NOT_ALLOWED = "LocationNotAllowed"
JOIN_TIMEOUT = "JoinTimeout"
VERIFICATION_FAILED = "VerificationFailed"
POLICY_GONE = "PolicyGone"
NOT_OWNED = "NotOwned"
PROVIDER_REJECTED = "ProviderRejected"
HELD = "Held"
# The gateway has no free address slot for the node: no ticket, so nothing launched.
ADDRESSES_EXHAUSTED = "AddressesExhausted"

# Where audit records go for the hub (the worker signals the hub sync workflow); None without a hub.
ReportSink = Callable[[ActionReport], Awaitable[None]]


def beat(details: str) -> None:
    """Heartbeat, and stop if the activity was cancelled (threads get no injected CancelledError)."""
    activity.heartbeat(details)
    if activity.is_cancelled():
        raise asyncio.CancelledError(f"cancelled while {details}")


# Sync activities run in threads. They are never interrupted by an injected CancelledError (one raised inside a
# lock, e.g. logging's, would leave it held and hang the worker); the long ones poll for cancellation instead.
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
    ) -> None:
        self.kube = kube
        # The one seam where every provider, present or future, gets its cloud-call spans and metrics.
        self.providers = {name: traced(provider) for name, provider in providers.items()}
        self.gateway = gateway
        self.config = config
        self.audit_log = audit
        self.temporal = temporal
        self.task_queue = task_queue
        self.clock = clock
        self.report_sink = report_sink

    def _provider(self, location: str) -> Provider:
        name = location.split("/", 1)[0]
        provider = self.providers.get(name)
        if provider is None:
            raise ApplicationError(f"no provider for {name} locations is configured ({location})",
                                   type="ProviderMissing", non_retryable=True)
        return provider

    # -- policy and plan -------------------------------------------------------------------------------------
    @activity.defn(name="load_policy", no_thread_cancel_exception=True)
    def load_policy(self, req: LoadPolicyRequest) -> PolicySnapshot:
        from kubernetes.client import ApiException

        try:
            policy = self.kube.read_policy(req.policy)
        except ApiException as exc:
            if exc.status == 404:
                raise ApplicationError(f"policy {req.policy} no longer exists", type=POLICY_GONE,
                                       non_retryable=True) from None
            raise
        except ValueError as exc:
            raise ApplicationError(f"policy {req.policy} is invalid: {exc}", type=POLICY_GONE,
                                   non_retryable=True) from None
        spec = policy.spec
        return PolicySnapshot(
            name=policy.name, generation=policy.metadata.generation or 0, mode=spec.effective_mode(req.default_mode),
            tolerate=spec.workloads.tolerate, locations=list(spec.locations), max_nodes=spec.limits.max_nodes,
            max_gpu_hour=float(spec.limits.max_gpu_hour), return_home=spec.return_home,
        )

    def _offerings(self, locations: list[str]) -> tuple[list[Offering], list[str]]:
        offerings: list[Offering] = []
        unavailable: list[str] = []
        for location in locations:
            try:
                self.config.location(location)
                offerings += self._provider(location).price_offerings(location)
            except KeyError as exc:
                unavailable.append(f"{location}: {exc.args[0]}")
            except (ProviderError, ApplicationError) as exc:
                unavailable.append(f"{location}: {exc}")
        return offerings, unavailable

    @activity.defn(name="plan_batch", no_thread_cancel_exception=True)
    def plan_batch(self, req: BatchPlanRequest) -> BatchPlan:
        """Plan the batch: which of its pods still wait, the room on the policy's burst nodes, the offerings of
        its locations priced now; then the pure planner (planning.burst)."""
        still = self.kube.waiting_uids({p.uid for p in req.pods})
        waiting = [p for p in req.pods if p.uid in still]
        used = self.kube.gpus_on_nodes({n.node_name for n in req.nodes})
        rooms = [Room(name=n.node_name, labels=node_labels(n.offering, req.policy.name),
                      free=n.offering.gpus - used.get(n.node_name, 0)) for n in req.nodes]
        preferred = {pod: n.node_name for n in req.nodes for pod in n.pods}
        offerings, unavailable = self._offerings(req.policy.locations) if waiting else ([], [])
        slots = self._free_slots(req) if waiting else None
        p = req.policy
        plan = plan_pods(batch=req.batch, policy=p.name, taint_key=p.tolerate, pods=waiting,
                         rooms=[r for r in rooms if r.free > 0], offerings=offerings, locations=p.locations,
                         max_gpu_hour=p.max_gpu_hour, max_new_nodes=req.max_new_nodes, max_nodes=p.max_nodes,
                         preferred=preferred, address_slots=slots)
        plan.gone = [pod.uid for pod in req.pods if pod.uid not in still]
        plan.refused = unavailable + plan.refused
        plan.planned_at = self.clock()
        return plan

    def _free_slots(self, req: BatchPlanRequest) -> AddressSlots:
        """The gateway's address slots free for new nodes: every provider's node joins with a ticket, which
        reserves one. The provisioning's nodes still launching (no ticket yet) will take theirs."""
        room = self.gateway.capacity()
        holding = set(room.nodes)
        pending = sum(1 for n in req.nodes if n.node_name not in holding)
        return AddressSlots(total=room.total, held=room.held, free=max(0, room.free - pending))

    # -- launch ------------------------------------------------------------------------------------------------
    @activity.defn(name="launch_instance", no_thread_cancel_exception=True)
    def launch_instance(self, req: LaunchRequest) -> Instance:
        provider = self._provider(req.offering.location)
        gate = self._gate(req.policy)  # checked again here, as the allow-list is: nothing launches while held
        if gate.held:
            raise ApplicationError(gate.reason, type=HELD, non_retryable=True)
        try:  # the ticket reserves the node's address slot: none free, no instance (it could never join)
            grant = self.gateway.issue_ticket(JoinTicketRequest(
                operation=req.operation, policy=req.policy, location=req.offering.location,
                node_name=req.node_name, labels=req.labels, taints=req.taints, gpus=req.offering.gpus,
            ))
        except AddressesExhausted as exc:
            raise ApplicationError(str(exc), type=ADDRESSES_EXHAUSTED, non_retryable=True) from None
        try:
            # Where the node joins: the endpoint the gateway names (its public URL or LoadBalancer address) and
            # the name to verify its certificate as; a gateway naming none: the configured URL.
            user_data = render_user_data(gateway_url=grant.endpoint or self.config.gateway_url,
                                         server_name=grant.server_name if grant.endpoint else "",
                                         ticket=grant.ticket, node_name=req.node_name, labels=req.labels,
                                         taints=req.taints, ca_bundle=self.config.gateway_ca_bundle)
        except UserDataTooLarge as exc:  # configuration (labels, CA bundle): a retry would not shrink it
            raise ApplicationError(str(exc), type=PROVIDER_REJECTED, non_retryable=True) from None
        activity.heartbeat("launching")
        try:
            instance = provider.launch(req, user_data)
        except LocationNotAllowedError as exc:
            raise ApplicationError(str(exc), type=LOCATION_NOT_ALLOWED, non_retryable=True) from None
        except InsufficientCapacityError as exc:
            raise ApplicationError(str(exc), type=INSUFFICIENT_CAPACITY, non_retryable=True) from None
        except ProviderError as exc:
            if not exc.retryable:
                raise ApplicationError(str(exc), type=PROVIDER_REJECTED, non_retryable=True) from None
            raise
        return instance

    @activity.defn(name="wait_for_node", no_thread_cancel_exception=True)
    def wait_for_node(self, req: NodeWaitRequest) -> str:
        try:
            return self.kube.wait_node_ready(req.node_name, req.operation, req.timeout_seconds, beat)
        except NodeJoinTimeout as exc:
            raise ApplicationError(str(exc), type=JOIN_TIMEOUT, non_retryable=True) from None
        except VerificationFailed as exc:
            raise ApplicationError(str(exc), type=VERIFICATION_FAILED, non_retryable=True) from None

    @activity.defn(name="verify_node", no_thread_cancel_exception=True)
    def verify_node(self, req: NodeExpectation) -> VerifyResult:
        def checked(details: str) -> None:  # the gateway's join check (e.g. more GPUs than the offering) failed
            beat(details)
            node = self.kube.core.read_node(req.node_name)
            reason = (node.metadata.annotations or {}).get(JOIN_REFUSED_ANNOTATION)
            if reason:
                raise VerificationFailed(f"node {req.node_name} failed the gateway's join check: {reason} (cordoned)")

        try:
            return self.kube.verify_node(req, checked)
        except VerificationFailed as exc:
            raise ApplicationError(str(exc), type=VERIFICATION_FAILED, non_retryable=True) from None

    @activity.defn(name="serve_until_done")
    async def serve_until_done(self, req: ServeCheckRequest) -> ServeCheckResult:
        """Hold while the burst node serves; return once the node is idle or (returnHome) home has room.
        One long heartbeating activity instead of a workflow timer loop keeps the history short. It is async and
        runs on the serve task queue (see SERVE_QUEUE_SUFFIX): a serving operation holds no thread and no slot
        of the activities that do the work, so hundreds can serve at once."""
        while True:
            result = await asyncio.to_thread(self.kube.check_serving, req)
            activity.heartbeat(f"{result.pods_on_node} pod(s) on {req.node_name}")
            if result.done:
                return result
            await asyncio.sleep(req.check_seconds)  # cancellation arrives here as CancelledError

    # -- drain and removal -------------------------------------------------------------------------------------
    @activity.defn(name="cordon_node", no_thread_cancel_exception=True)
    def cordon_node(self, req: NodeRef) -> bool:
        return self.kube.cordon(req.node_name)

    @activity.defn(name="evict_pods", no_thread_cancel_exception=True)
    def evict_pods(self, req: NodeRef) -> EvictionResult:
        return self.kube.evict_pods(req.node_name)

    @activity.defn(name="terminate_instance", no_thread_cancel_exception=True)
    def terminate_instance(self, ref: InstanceRef) -> None:
        try:
            self._provider(ref.location).terminate(ref.location, ref.instance_id, policy=ref.policy)
        except NotOwnedError as exc:
            raise ApplicationError(str(exc), type=NOT_OWNED, non_retryable=True) from None

    @activity.defn(name="remove_node", no_thread_cancel_exception=True)
    def remove_node(self, req: NodeRemoval) -> bool:
        return self.gateway.remove_node(req.node_name, operation=req.operation)

    @activity.defn(name="confirm_gone", no_thread_cancel_exception=True)
    def confirm_gone(self, req: GoneCheck) -> bool:
        if self.kube.node_exists(req.node_name):
            return False
        if req.instance is None:
            return True
        try:
            inst = self._provider(req.instance.location).get(req.instance.location, req.instance.instance_id)
        except InstanceNotFoundError:
            return True
        return inst.state in ("shutting-down", "terminated")

    @activity.defn(name="cleanup_operation", no_thread_cancel_exception=True)
    def cleanup_operation(self, req: CleanupRequest) -> CleanupResult:
        """Terminate every instance tagged with the operation in any allowed location, and remove its Node.
        Used for compensation, where the workflow may not know what a crashed launch left running."""
        result = CleanupResult()
        for location in req.locations:
            try:
                provider = self._provider(location)
                self.config.location(location)
            except (ApplicationError, KeyError):
                continue
            for inst in provider.list(location, operation=req.operation):
                activity.heartbeat(f"terminating {inst.instance_id}")
                if inst.state not in ("shutting-down", "terminated"):
                    provider.terminate(location, inst.instance_id, policy=req.policy)
                    result.terminated.append(inst.instance_id)
        result.node_removed = self.gateway.remove_node(req.node_name, operation=req.operation)
        return result

    # -- audit -------------------------------------------------------------------------------------------------
    @activity.defn(name="record_audit")
    async def record_audit(self, record: AuditRecord) -> bool:
        """Append the audit record, and queue it for the hub when one is configured (R2.8). Both are keyed, so a
        retry after a crash between the two writes each once."""
        written = await asyncio.to_thread(self.audit_log.append, record)
        if self.report_sink is not None:
            await self.report_sink(ActionReport(
                idempotency_key=record.key, operation=record.operation, policy=record.policy,
                action=record.action if record.action in REPORT_ACTIONS else "failed",
                location=record.location, instance=record.instance_id, node=record.node_name,
                detail=report_detail(" ".join(p for p in (
                    record.detail, f"(approver {record.approver})" if record.approver else "") if p)),
                occurred_at=record.at))
        return written

    # -- the hub's hold (R2.3) ---------------------------------------------------------------------------------
    def _gate(self, policy: str) -> GateState:
        reason = hold_reason(self.kube.policy_status(policy))
        return GateState(held=reason is not None, reason=reason or "")

    @activity.defn(name="action_gate", no_thread_cancel_exception=True)
    def action_gate(self, req: GateRequest) -> GateState:
        """Whether an operation of this policy may act now: not while the hub rejects this cluster's token."""
        return self._gate(req.policy)

    @activity.defn(name="await_actions_allowed")
    async def await_actions_allowed(self, req: GateRequest) -> GateState:
        """Hold until the policy may act again (the hub sync marks it connected once a valid token is mounted).
        Async, on the serve queue: a held operation takes no activity slot."""
        while True:
            state = await asyncio.to_thread(self._gate, req.policy)
            activity.heartbeat(state.reason or "allowed")
            if not state.held:
                return state
            await asyncio.sleep(req.check_seconds)

    def all(self) -> list[Callable[..., Any]]:
        return [
            self.load_policy, self.plan_batch, self.launch_instance,
            self.wait_for_node, self.verify_node, self.cordon_node,
            self.evict_pods, self.terminate_instance, self.remove_node, self.confirm_gone, self.cleanup_operation,
            self.record_audit, self.action_gate,
        ]
