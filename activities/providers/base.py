"""The provider interface (after Karpenter's CloudProvider): launch, get, list, terminate, price offerings.

Implementations are synchronous (they run in the activity thread pool) and idempotent: ``launch`` finds the
instance it already started for an operation before starting another, ``terminate`` of a gone instance is
a no-op.
"""

from __future__ import annotations

from typing import Final
from typing import Protocol

from models.labels import TAG_BURST
from models.node import Instance
from models.node import LaunchRequest
from models.provisioning import Offering

from .errors import InstanceNotFoundError
from .errors import LocationNotAllowedError
from .errors import NotOwnedError


class Provider(Protocol):
    name: str

    def price_offerings(self, location: str) -> list[Offering]: ...

    def launch(self, request: LaunchRequest, user_data: str) -> Instance: ...

    def get(self, location: str, instance_id: str) -> Instance: ...

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]: ...

    def terminate(self, location: str, instance_id: str, *, policy: str) -> None: ...


# An instance in one of these states is on its way out: terminating it again is a no-op.
GONE_STATES: Final = frozenset({"shutting-down", "terminated"})


class CloudProvider:
    """What the cloud providers (aws, gcp, azure) do alike. ``terminate`` touches only an instance carrying the
    policy's burst tag and is idempotent; each cloud supplies ``get`` and the delete call itself."""

    name: str

    def get(self, location: str, instance_id: str) -> Instance:
        raise NotImplementedError

    def owner_tag(self, policy: str) -> str:
        """The tag (or label) that marks an instance as this policy's, as the cloud spells it."""
        return f"{TAG_BURST}={policy}"

    def terminate(self, location: str, instance_id: str, *, policy: str) -> None:
        """Terminate the policy's instance: gone already, or on its way out, is a no-op; an instance without the
        policy's burst tag is refused (``NotOwnedError``). The delete is not waited for: confirm_gone checks."""
        try:
            instance = self.get(location, instance_id)
        except InstanceNotFoundError:
            return
        if instance.tags.get(TAG_BURST) != policy:
            raise NotOwnedError(f"{location}: instance {instance_id} does not carry {self.owner_tag(policy)}")
        if instance.state in GONE_STATES:
            return
        self.delete_instance(location, instance)

    def delete_instance(self, location: str, instance: Instance) -> None:
        """Ask the cloud to delete the instance; one already gone is not an error."""
        raise NotImplementedError


def check_allowed(request: LaunchRequest) -> None:
    """Second check of the allow-list, inside the launch itself (the plan already checked once)."""
    if request.offering.location not in request.allowed_locations:
        raise LocationNotAllowedError(
            f"location {request.offering.location} is not in policy {request.policy}'s locations "
            f"({', '.join(request.allowed_locations)}); refusing to launch"
        )


def report_progress(details: str) -> None:
    """Heartbeat from inside a provider call that waits on the cloud (an operation, a long-running poll), so the
    activity's heartbeat timeout measures a stuck call, not a slow cloud. Outside an activity: nothing."""
    from temporalio import activity

    if activity.in_activity():
        activity.heartbeat(details)
