"""Waiting for a launched node to join (registered through the gateway, Ready, its joining taint lifted), and
checking that the node that joined is the instance launched for the operation (its attested identity)."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.clients.gateway import GatewayRefused
from activities.clients.kube import NodeJoinTimeout
from activities.clients.kube import VerificationFailed
from activities.context import PhaseActivities
from activities.context import beat
from models.errors import JOIN_TIMEOUT
from models.errors import VERIFICATION_FAILED
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import bind_attested_instance
from models.node import NodeIdentityCheck
from models.node import NodeIdentityResult
from models.node import NodeWaitRequest


class JoinActivities(PhaseActivities):
    """wait_for_node, check_node_identity"""

    @activity.defn(name="wait_for_node", no_thread_cancel_exception=True)
    def wait_for_node(self, req: NodeWaitRequest) -> str:
        try:
            return self.kube.wait_node_ready(req.node_name, req.operation, req.timeout_seconds, beat)
        except NodeJoinTimeout as exc:
            raise ApplicationError(str(exc), type=JOIN_TIMEOUT, non_retryable=True) from None
        except VerificationFailed as exc:
            raise ApplicationError(str(exc), type=VERIFICATION_FAILED, non_retryable=True) from None

    @activity.defn(name="check_node_identity")
    def check_node_identity(self, req: NodeIdentityCheck) -> NodeIdentityResult:
        """The identity the gateway verified at the node's join must be the launched instance's: a ticket read from
        the instance's user data and redeemed by another machine of the same account and region passes the
        gateway's checks (signature, location, account) but not this one. A mismatch fails the node
        (non-retryable): the workflow terminates the instance, removes the Node and plans its pods again. Reads
        only: a retry asks again."""
        try:
            identity = self.gateway.identity(req.node_name, operation=req.operation)
        except (TicketError, JoinRefused, GatewayRefused) as exc:
            # The gateway holds the node for another operation, or has no redeemed ticket for it: whatever runs
            # under its name is not known to be the launched instance.
            raise ApplicationError(f"node {req.node_name} refused: the gateway cannot say what it joined as: {exc}",
                                   type=VERIFICATION_FAILED, non_retryable=True) from None
        inst = req.instance
        bound, problem = bind_attested_instance(identity, inst.provider, inst.instance_id, inst.attested_id)
        if problem:
            raise ApplicationError(f"node {req.node_name} refused: {problem}", type=VERIFICATION_FAILED,
                                   non_retryable=True)
        return NodeIdentityResult(identity=identity,
                                  detail=identity.describe() + (" (the launched instance)" if bound else ""))
