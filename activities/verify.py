"""Verifying a joined node before it serves: the burn-in gate (issue 27), its taint and labels, the gateway's join
check, its pods placed."""

from __future__ import annotations

import time
from collections.abc import Callable

from kubernetes import client
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.clients.kube import VerificationFailed
from activities.context import PhaseActivities
from activities.context import beat
from models.errors import VERIFICATION_FAILED
from models.labels import BURNED_IN_ANNOTATION
from models.labels import GPU_HEALTH_CONDITION
from models.labels import GPU_RESOURCE
from models.labels import JOIN_REFUSED_ANNOTATION
from models.labels import JOIN_REFUSED_TAINT
from models.node import BurnInRequest
from models.node import BurnInResult
from models.node import NodeExpectation
from models.node import VerifyResult


class VerifyActivities(PhaseActivities):
    """burn_in_node, verify_node"""

    @activity.defn(name="burn_in_node", no_thread_cancel_exception=True)
    def burn_in_node(self, req: BurnInRequest) -> BurnInResult:
        """The burn-in gate: each check the policy chose, on the registered node that still carries its taint (so
        no workload has landed). Reads only: a retry checks again. A check that does not pass within the timeout
        fails the node (non-retryable): the workflow terminates it and its pods are planned again."""
        passed = []
        for check in req.checks:
            if check == "Gpus":
                passed.append(self._allocatable_gpus(req))
            elif check == "Tunnel":
                passed.append(self._tunnel_mtu(req))
            elif check == "GpuHealth":
                passed.append(self._gpu_health(req))
            else:
                raise ApplicationError(f"unknown burn-in check {check!r}", type=VERIFICATION_FAILED,
                                       non_retryable=True)
        # Passed: the gateway lifts the joining taint of a node annotated so (workloads may land from then on).
        self.kube.core.patch_node(req.node_name, {"metadata": {"annotations": {
            BURNED_IN_ANNOTATION: "; ".join(passed)}}})
        return BurnInResult(node_name=req.node_name, passed=passed)

    def _watch_node(self, req: BurnInRequest, look: Callable[[client.V1Node], tuple[str | None, str]]) -> str:
        """Read the node each second until ``look`` says it passed (what it saw) or the timeout; ``look`` answers
        (passed, what it is waiting for) and raises when the node has failed for good."""
        deadline = time.monotonic() + req.timeout_seconds
        while True:
            passed, waiting = look(self.kube.core.read_node(req.node_name))
            if passed is not None:
                return passed
            beat(f"burn-in of {req.node_name}: {waiting}")
            if time.monotonic() > deadline:
                raise ApplicationError(f"burn-in failed on {req.node_name}: {waiting} (after {req.timeout_seconds}s)",
                                       type=VERIFICATION_FAILED, non_retryable=True)
            time.sleep(1.0)

    def _allocatable_gpus(self, req: BurnInRequest) -> str:
        """Allocatable nvidia.com/gpu equals the offering's GPUs (waiting up to the timeout for the device plugin)."""
        def look(node: client.V1Node) -> tuple[str | None, str]:
            have = int((node.status.allocatable or {}).get(GPU_RESOURCE, "0"))
            return (f"Gpus: allocatable {GPU_RESOURCE} {have}" if have == req.gpus else None,
                    f"allocatable {GPU_RESOURCE} is {have}, the offering has {req.gpus}")

        return self._watch_node(req, look)

    def _gpu_health(self, req: BurnInRequest) -> str:
        """The node's GPU health check passed: the condition its node program posts on its own Node once DCGM's
        diagnostic has run (node/health.py), waited for up to the timeout (the diagnostic takes about a minute)."""
        def look(node: client.V1Node) -> tuple[str | None, str]:
            posted = [c for c in node.status.conditions or [] if c.type == GPU_HEALTH_CONDITION]
            if posted and posted[0].status != "True":
                raise ApplicationError(f"burn-in failed on {req.node_name}: its GPU health check failed "
                                       f"({posted[0].reason}): {posted[0].message}", type=VERIFICATION_FAILED,
                                       non_retryable=True)
            return (f"GpuHealth: {posted[0].message}" if posted else None,
                    f"no GPU health result ({GPU_HEALTH_CONDITION}) posted by the node (its node program runs the "
                    "DCGM diagnostic and posts it)")

        return self._watch_node(req, look)

    def _tunnel_mtu(self, req: BurnInRequest) -> str:
        """The node's tunnel carries a packet of its full MTU: the gateway's DF probe (gateway/probe.py). Not
        waited for: the node registered through the tunnel, so it is up; a path that drops big packets stays so."""
        beat(f"burn-in of {req.node_name}: probing its tunnel at full MTU")
        probe = self.gateway.probe(req.node_name, operation=req.operation)
        if not probe.tunnel:
            return f"Tunnel: none to probe ({probe.detail})"
        if not probe.answered:
            raise ApplicationError(f"burn-in failed on {req.node_name}: its tunnel does not carry a full-MTU packet: "
                                   f"{probe.detail}", type=VERIFICATION_FAILED, non_retryable=True)
        return f"Tunnel: {probe.mtu}-byte DF probe answered in {probe.rtt_ms} ms"

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
