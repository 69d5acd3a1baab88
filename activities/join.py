"""Waiting for a launched node to join: registered through the gateway, Ready, its joining taint lifted."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.clients.kube import NodeJoinTimeout, VerificationFailed
from activities.context import PhaseActivities, beat
from models.errors import JOIN_TIMEOUT, VERIFICATION_FAILED
from models.node import NodeWaitRequest


class JoinActivities(PhaseActivities):
    """wait_for_node"""

    @activity.defn(name="wait_for_node", no_thread_cancel_exception=True)
    def wait_for_node(self, req: NodeWaitRequest) -> str:
        try:
            return self.kube.wait_node_ready(req.node_name, req.operation, req.timeout_seconds, beat)
        except NodeJoinTimeout as exc:
            raise ApplicationError(str(exc), type=JOIN_TIMEOUT, non_retryable=True) from None
        except VerificationFailed as exc:
            raise ApplicationError(str(exc), type=VERIFICATION_FAILED, non_retryable=True) from None
