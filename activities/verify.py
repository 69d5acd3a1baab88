"""Verifying a joined node before it serves: its taint and labels, the gateway's join check, its pods placed."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.clients.kube import VerificationFailed
from activities.context import PhaseActivities, beat
from models.errors import VERIFICATION_FAILED
from models.labels import JOIN_REFUSED_ANNOTATION, JOIN_REFUSED_TAINT
from models.node import NodeExpectation, VerifyResult


class VerifyActivities(PhaseActivities):
    """verify_node"""

    @activity.defn(name="verify_node", no_thread_cancel_exception=True)
    def verify_node(self, req: NodeExpectation) -> VerifyResult:
        def checked(details: str) -> None:  # the gateway's join check (e.g. more GPUs than the offering) failed
            beat(details)
            node = self.kube.core.read_node(req.node_name)
            reason = (node.metadata.annotations or {}).get(JOIN_REFUSED_ANNOTATION)
            if not reason and any(t.key == JOIN_REFUSED_TAINT.key for t in (node.spec.taints or [])):
                reason = "refused by the gateway (its refusal taint)"
            if reason:
                raise VerificationFailed(f"node {req.node_name} failed the gateway's join check: {reason} (cordoned)")

        try:
            return self.kube.verify_node(req, checked)
        except VerificationFailed as exc:
            raise ApplicationError(str(exc), type=VERIFICATION_FAILED, non_retryable=True) from None
