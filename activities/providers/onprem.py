"""On-prem pools (``onprem/<pool>``): idle GPU servers registered in the hub under the pool's rate card.

The hub is the pool's "cloud API", called with the cluster token: ``price_offerings`` is the rate card (transfer:
the pool's own figure, 0 by default), ``launch`` claims an idle, online server that fits (idempotent by
operation: a retried launch gets the same server) and hands the node's user data (the gateway ticket) to the
server's agent through the hub; ``list``/``get`` read the cluster's claims; ``terminate`` releases the server
(idempotent). The agent then joins through the gateway like any burst node, and leaves when released.

A launch returns once the server's agent has picked the claim up. A server that goes offline before it does
(no heartbeat within the pool's timeout) has its claim withdrawn, and one whose agent declines it (a cluster it is
not configured to serve) loses it; the next idle server is tried, and with none left the launch fails with
``InsufficientCapacityError`` and the operation moves on to the policy's next location. The withdrawn server is
not claimed again until it heartbeats.

One user data (one ticket) serves every claim of a launch, and still reaches one server only: the hub hands the
ticket to a server's agent only once it has taken the claim up, and a claim taken up is never withdrawn (only
released, which makes the agent leave). A withdrawn or declining server never saw it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from activities.clients.hub import HubClient
from activities.clients.hub import HubError
from activities.clients.hub import HubRefused
from activities.clients.hub import HubUnauthorized
from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.locations import BurstConfig
from models.node import Instance
from models.node import LaunchRequest
from models.provisioning import Offering

from .base import check_allowed
from .errors import InstanceNotFoundError
from .errors import InsufficientCapacityError
from .errors import LocationNotAllowedError
from .errors import NotOwnedError
from .errors import ProviderError

log = logging.getLogger(__name__)

# The hub's server states as instance states (confirm_gone counts shutting-down and terminated as gone).
INSTANCE_STATES = {"claimed": "pending", "joining": "pending", "serving": "running", "releasing": "shutting-down",
                   "offline": "pending", "idle": "terminated", "retired": "terminated"}


def _beat(details: str) -> None:
    """Heartbeat when called from an activity (the launch waits for the agent)."""
    from temporalio import activity

    if activity.in_activity():
        activity.heartbeat(details)


class PoolClient(HubClient):
    """The hub's pool endpoints for the optimizer (``/v1/cluster/pools/...``), with the cluster token."""

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()


class OnPremProvider:
    name = "onprem"

    def __init__(self, config: BurstConfig, hub: PoolClient, *, claim_ack_seconds: float = 120.0,
                 poll_seconds: float = 0.5, beat: Callable[[str], None] = _beat) -> None:
        self._config = config
        self._hub = hub
        self._ack_seconds = claim_ack_seconds
        self._poll = poll_seconds
        self._beat = beat

    @staticmethod
    def _pool(location: str) -> str:
        provider, _, pool = location.partition("/")
        if provider != "onprem" or not pool:
            raise ProviderError(f"{location} is not an onprem/<pool> location", retryable=False)
        return pool

    def _call(self, location: str, method: str, path: str, **kwargs: Any) -> Any:
        try:
            return self._hub.call(method, f"/v1/cluster/pools/{self._pool(location)}{path}", **kwargs)
        except HubUnauthorized as exc:
            raise ProviderError(f"{location}: {exc}", retryable=False) from None
        except HubRefused as exc:
            if exc.status == 403:
                raise LocationNotAllowedError(f"{location}: {exc}", retryable=False) from None
            if exc.status == 404:
                raise InstanceNotFoundError(f"{location}: {exc}") from None
            if exc.status == 409 and "not_owned" in str(exc):
                raise NotOwnedError(f"{location}: {exc}", retryable=False) from None
            if exc.status == 409:
                raise  # no idle server: the launch turns it into InsufficientCapacityError
            raise ProviderError(f"{location}: {exc}", retryable=False) from None
        except HubError as exc:  # unreachable or 5xx: retry (a release waits until the hub is back)
            raise ProviderError(f"{location}: {exc}") from None

    @staticmethod
    def _instance(location: str, claim: dict[str, Any]) -> Instance:
        return Instance(
            provider="onprem", location=location, instance_id=claim["server"],
            instance_type=f"onprem.{claim['gpus']}x{claim['gpu_product']}",
            state=INSTANCE_STATES.get(claim["state"], "pending"),
            tags={TAG_BURST: claim["policy"], TAG_OPERATION: claim["operation"]}, node_name=claim["node_name"],
            launched_at=datetime.fromisoformat(claim["claimed_at"]),
        )

    # -- Provider ----------------------------------------------------------------------------------------
    def price_offerings(self, location: str) -> list[Offering]:
        """The rate card's offerings with at least one idle, online server."""
        body = self._call(location, "GET", "/offerings")
        transfer = float(body["transfer_usd_per_gpu_hour"])
        return [Offering(location=location, instance_type=o["instance_type"], gpus=int(o["gpus"]),
                         gpu_product=o["gpu_product"], instance_usd_per_hour=float(o["usd_per_hour"]),
                         transfer_usd_per_gpu_hour=transfer)
                for o in body["offerings"] if int(o["idle"]) > 0]

    def launch(self, request: LaunchRequest, user_data: str) -> Instance:
        check_allowed(request)
        location = request.offering.location
        body = {"operation": request.operation, "policy": request.policy,
                "gpu_product": request.offering.gpu_product, "gpus": request.offering.gpus,
                "node_name": request.node_name, "user_data": user_data}
        withdrawn: list[str] = []
        for _ in range(100):  # bounded: every round withdraws one server, which is then offline or gone
            try:
                claim = self._call(location, "POST", "/claims", json={**body, "exclude": withdrawn})["claim"]
            except HubRefused as exc:  # 409: no idle, online server that fits (or the policy's maxNodes)
                gone = f" (withdrawn from or declined by {', '.join(withdrawn)})" if withdrawn else ""
                raise InsufficientCapacityError(f"{location}: {exc}{gone}") from None
            picked = self._await_agent(location, claim)
            if picked is not None:
                return picked
            withdrawn.append(claim["server"])
        raise InsufficientCapacityError(f"{location}: no server picked up the claim ({', '.join(withdrawn)})")

    def _await_agent(self, location: str, claim: dict[str, Any]) -> Instance | None:
        """Wait until the server's agent picks the claim up; withdraw it (None) if the server goes offline or
        does not answer within the claim acknowledgement time."""
        server = claim["server"]
        deadline = time.monotonic() + self._ack_seconds
        while True:
            if claim["state"] in ("joining", "serving"):
                return self._instance(location, claim)
            if claim["state"] == "offline" or time.monotonic() > deadline:
                log.warning("%s: server %s did not pick up the claim of operation %s (%s): withdrawing it",
                            location, server, claim["operation"], claim["state"])
                result = self._call(location, "POST", f"/servers/{server}/release",
                                    json={"operation": claim["operation"], "policy": claim["policy"],
                                          "withdraw": True})
                if not result["released"] and result["state"] in ("joining", "serving"):
                    # taken up at the last moment: the server has the ticket, so it is this launch's
                    return self._instance(location, self._call(location, "GET", f"/servers/{server}"))
                return None
            self._beat(f"waiting for server {server} of {location} to pick up the claim")
            time.sleep(self._poll)
            try:
                claim = self._call(location, "GET", f"/servers/{server}")
            except InstanceNotFoundError:  # its agent declined the claim: the server is not ours
                log.warning("%s: server %s declined the claim of operation %s", location, server,
                            claim["operation"])
                return None

    def get(self, location: str, instance_id: str) -> Instance:
        return self._instance(location, self._call(location, "GET", f"/servers/{instance_id}"))

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]:
        params = {k: v for k, v in (("policy", policy), ("operation", operation)) if v is not None}
        return [self._instance(location, c) for c in self._call(location, "GET", "/claims", params=params)]

    def terminate(self, location: str, instance_id: str, *, policy: str) -> None:
        """Release the server back to its pool; a server this cluster no longer holds is a no-op."""
        try:
            claim = self._call(location, "GET", f"/servers/{instance_id}")
        except InstanceNotFoundError:
            return
        if claim["policy"] != policy:
            raise NotOwnedError(f"{location}: server {instance_id} is held for policy {claim['policy']}, not {policy}",
                                retryable=False)
        self._call(location, "POST", f"/servers/{instance_id}/release",
                   json={"operation": claim["operation"], "policy": policy})
