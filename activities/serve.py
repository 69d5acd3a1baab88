"""A burst node serving: held until it is idle or (returnHome) home has room again."""

from __future__ import annotations

import asyncio

from temporalio import activity

from activities.context import PhaseActivities
from models.node import ServeCheckRequest, ServeCheckResult


class ServeActivities(PhaseActivities):
    """serve_until_done"""

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
