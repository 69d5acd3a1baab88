"""A burst node serving: held until it is idle or (returnHome) home has room again; its tunnel transfer read from
the gateway meanwhile (issue 27)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time

from temporalio import activity

from activities.context import BurstContext
from activities.context import PhaseActivities
from models.cost import TransferReading
from models.cost import actual_cost
from models.locations import transfer_usd_per_gb
from models.node import ServeCheckRequest
from models.node import ServeCheckResult
from models.node import TransferRequest

log = logging.getLogger("kubeon.serve")


def read_transfer(context: BurstContext, req: TransferRequest) -> TransferReading:
    """The node's counters from the gateway, with its location's egress rate (the estimate's table). Raises what
    the gateway client raises (``GatewayUnavailable``, ``GatewayRefused``, ``TicketError``)."""
    got = context.gateway.transfer(req.node_name, operation=req.operation)
    try:
        rate = transfer_usd_per_gb(context.config.home, context.config.location(req.location))
    except KeyError:
        rate = 0.0  # a location no longer configured: its bytes are shown, not priced
    return TransferReading(rx_bytes=got.rx_bytes, tx_bytes=got.tx_bytes, measured_at=got.measured_at,
                           usd_per_gb=rate)


HEARTBEAT_EVERY = 1.0


class ServeActivities(PhaseActivities):
    """serve_until_done"""

    @activity.defn(name="serve_until_done")
    async def serve_until_done(self, req: ServeCheckRequest) -> ServeCheckResult:
        """Hold while the burst node serves; return once the node is idle or (returnHome) home has room.
        One long heartbeating activity instead of a workflow timer loop keeps the history short. It is async and
        runs on the serve task queue (see SERVE_QUEUE_SUFFIX): a serving operation holds no thread and no slot
        of the activities that do the work, so hundreds can serve at once.

        Every ``transfer_check_seconds`` it also reads the node's transfer from the gateway (cumulative counters:
        reading again is harmless); the last good reading travels in the heartbeat, so an attempt retried on
        another worker starts from it, and comes back with the result. A gateway error never ends the serve: it is
        logged, carried in the reading's ``error`` and the read is tried again at the next interval."""
        reading = _last_reading()
        next_read = 0.0
        while True:
            if req.transfer_check_seconds > 0 and req.operation and time.monotonic() >= next_read:
                reading = await self._read(req, reading)
                next_read = time.monotonic() + req.transfer_check_seconds
                over = over_budget(req, reading)
                if over:
                    log.warning("%s: %s", req.node_name, over)
                    drain = req.on_over_budget == "Drain"
                    return ServeCheckResult(done=drain, reason=over if drain else "", over_budget=over,
                                            transfer=reading)
            result = await asyncio.to_thread(self.kube.check_serving, req)
            beat = (f"{result.pods_on_node} pod(s) on {req.node_name}", reading.model_dump(mode="json") if reading
                    else None)
            activity.heartbeat(*beat)
            if result.done:
                result.transfer = reading
                return result
            # Between checks, a heartbeat every second (the SDK throttles what it sends to the heartbeat timeout):
            # the serve's heartbeat timeout is short whatever check_seconds is, so a dead worker's serve is retried
            # within seconds. Cancellation arrives in the sleep as CancelledError.
            until = time.monotonic() + req.check_seconds
            while (left := until - time.monotonic()) > 0:
                await asyncio.sleep(min(left, HEARTBEAT_EVERY))
                activity.heartbeat(*beat)

    async def _read(self, req: ServeCheckRequest, last: TransferReading | None) -> TransferReading | None:
        try:
            return await asyncio.to_thread(read_transfer, self.context, TransferRequest(
                node_name=req.node_name, operation=req.operation, location=req.location))
        except Exception as exc:  # the gateway's trouble is reported, never the serve's end
            log.warning("transfer of %s not read (tried again in %gs): %s", req.node_name,
                        req.transfer_check_seconds, exc)
            return (last or TransferReading()).model_copy(update={"error": str(exc)[:300]})


def over_budget(req: ServeCheckRequest, reading: TransferReading | None) -> str:
    """Why the node's cost on actuals so far is over the policy's maxGpuHour, or "" (not measured, not over, or a
    Report already made)."""
    if (reading is None or not reading.measured or req.offering is None or req.launched_at is None
            or req.max_gpu_hour <= 0 or (req.over_budget_reported and req.on_over_budget != "Drain")):
        return ""
    cost = actual_cost(req.offering, req.launched_at, dt.datetime.now(dt.UTC), reading)
    if cost.usd_per_gpu_hour <= req.max_gpu_hour:
        return ""
    return (f"over budget on actuals: ${cost.usd_per_gpu_hour:.4f}/GPU-h > maxGpuHour ${req.max_gpu_hour:.4f} "
            f"(measured transfer ${cost.transfer_usd:.4f} over {cost.compute_hours:.3f} h; "
            f"onOverBudget {req.on_over_budget})")


def _last_reading() -> TransferReading | None:
    details = activity.info().heartbeat_details
    if details:
        try:
            return TransferReading.model_validate(details[-1])
        except ValueError:
            return None
    return None
