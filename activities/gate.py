"""The hub's hold (R2.3): whether an operation may act now, and waiting until it may."""

from __future__ import annotations

import asyncio

from temporalio import activity

from activities.context import PhaseActivities
from models.hub import GateRequest
from models.hub import GateState


class GateActivities(PhaseActivities):
    """action_gate, await_actions_allowed"""

    @activity.defn(name="action_gate", no_thread_cancel_exception=True)
    def action_gate(self, req: GateRequest) -> GateState:
        """Whether an operation of this policy may act now: not while the hub rejects this cluster's token."""
        return self.context.gate(req.policy)

    @activity.defn(name="await_actions_allowed")
    async def await_actions_allowed(self, req: GateRequest) -> GateState:
        """Hold until the policy may act again (the hub sync marks it connected once a valid token is mounted).
        Async, on the serve queue: a held operation takes no activity slot."""
        while True:
            state = await asyncio.to_thread(self.context.gate, req.policy)
            activity.heartbeat(state.reason or "allowed")
            if not state.held:
                return state
            await asyncio.sleep(req.check_seconds)
