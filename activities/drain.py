"""Draining a burst node and sending it home: cordon, evict (PDBs honoured), terminate, remove, confirm; and the
compensation that finds what an operation made by its tag."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.clients.gateway import GatewayRefused
from activities.context import PhaseActivities
from activities.providers.errors import InstanceNotFoundError
from activities.providers.errors import NotOwnedError
from activities.serve import read_transfer
from activities.telemetry import metrics as pm
from models.cost import CostCount
from models.cost import TransferReading
from models.drain import EvictionResult
from models.drain import GoneCheck
from models.drain import NodeRef
from models.drain import NodeRemoval
from models.errors import NOT_OWNED
from models.errors import JoinRefused
from models.errors import TicketError
from models.node import CleanupRequest
from models.node import CleanupResult
from models.node import InstanceRef
from models.node import TransferRequest

_COUNTED: dict[str, None] = {}  # operations whose cost this process counted (bounded, oldest dropped)


class DrainActivities(PhaseActivities):
    """cordon_node, evict_pods, read_transfer, terminate_instance, remove_node, confirm_gone, cleanup_operation,
    count_burst_cost"""

    @activity.defn(name="read_transfer", no_thread_cancel_exception=True)
    def read_transfer(self, req: TransferRequest) -> TransferReading:
        """The node's last transfer reading before its removal. An unreachable gateway fails the attempt (retried);
        one that holds nothing of this node's operation (404, another operation's node) is not asked again."""
        try:
            return read_transfer(self.context, req)
        except (TicketError, JoinRefused, GatewayRefused) as exc:
            raise ApplicationError(f"transfer of {req.node_name}: {exc}", type="TransferUnknown",
                                   non_retryable=True) from None

    @activity.defn(name="count_burst_cost", no_thread_cancel_exception=True)
    def count_burst_cost(self, cost: CostCount) -> None:
        """Add a finished node's actual cost to ``kubeon_burst_cost_usd_total`` (once per operation in this
        process: a retry of a counted one adds nothing)."""
        if cost.operation in _COUNTED:
            return
        _COUNTED[cost.operation] = None
        while len(_COUNTED) > 10000:
            _COUNTED.pop(next(iter(_COUNTED)))
        pm.BURST_COST_USD.labels(location=cost.location, kind="compute").inc(cost.compute_usd)
        pm.BURST_COST_USD.labels(location=cost.location, kind="transfer").inc(cost.transfer_usd)

    @activity.defn(name="cordon_node", no_thread_cancel_exception=True)
    def cordon_node(self, req: NodeRef) -> bool:
        return self.kube.cordon(req.node_name)

    @activity.defn(name="evict_pods", no_thread_cancel_exception=True)
    def evict_pods(self, req: NodeRef) -> EvictionResult:
        return self.kube.evict_pods(req.node_name, gpu_only=req.gpu_only)

    @activity.defn(name="terminate_instance", no_thread_cancel_exception=True)
    def terminate_instance(self, ref: InstanceRef) -> None:
        try:
            self.context.provider(ref.location).terminate(ref.location, ref.instance_id, policy=ref.policy)
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
            inst = self.context.provider(req.instance.location).get(req.instance.location, req.instance.instance_id)
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
                provider = self.context.provider(location)
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
