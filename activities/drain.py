"""Draining a burst node and sending it home: cordon, evict (PDBs honoured), terminate, remove, confirm; and the
compensation that finds what an operation made by its tag."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.context import PhaseActivities
from activities.providers.errors import InstanceNotFoundError, NotOwnedError
from models.drain import EvictionResult, GoneCheck, NodeRef, NodeRemoval
from models.errors import NOT_OWNED
from models.node import CleanupRequest, CleanupResult, InstanceRef


class DrainActivities(PhaseActivities):
    """cordon_node, evict_pods, terminate_instance, remove_node, confirm_gone, cleanup_operation"""

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
