"""What every cloud's burst provider (activities/providers) does alike, as tests a cloud's test module runs against
its local server: a ``Test...(ProviderContract)`` class there names the cloud's locations, instance type and what its
server records, beside the module's ``provider`` and ``server`` fixtures."""

from __future__ import annotations

from typing import ClassVar

import pytest

from activities.providers.base import Provider
from activities.providers.errors import LocationNotAllowedError
from activities.providers.errors import NotOwnedError
from models.node import LaunchRequest
from tests.harness.clouds.fake import FakeServer


class ProviderContract:
    location: ClassVar[str]  # where the tests launch
    other_location: ClassVar[str]  # a location of the provider's config that the requests' policy does not allow
    instance_type: ClassVar[str]  # what they launch
    instances: ClassVar[str]  # the key of the server's state() that holds its instances
    gone_instance_id: ClassVar[str]  # an instance ID of the cloud's shape that the server never had

    @classmethod
    def request(cls, provider: Provider, *, op: str = "op-0123456789ab", policy: str = "team.a") -> LaunchRequest:
        offering = next(o for o in provider.price_offerings(cls.location) if o.instance_type == cls.instance_type)
        return LaunchRequest(operation=op, cluster="prod", policy=policy, allowed_locations=[cls.location],
                             offering=offering, node_name=f"burst-{op}", labels={}, taints=[])

    @staticmethod
    def creates(server: FakeServer) -> list[str]:
        """A word for each create call the server was sent (what a test of the module compares)."""
        raise NotImplementedError

    def list_in_pages(self, server: FakeServer) -> None:
        """Have the server answer listings a page at a time, where it can."""

    def test_a_retried_launch_finds_the_instance(self, provider: Provider, server: FakeServer) -> None:
        req = self.request(provider)
        first = provider.launch(req, "x")
        assert provider.launch(req, "x").instance_id == first.instance_id
        assert len(server.state()[self.instances]) == 1 and len(self.creates(server)) == 1

    def test_location_outside_the_policy_is_never_called(self, provider: Provider, server: FakeServer) -> None:
        req = self.request(provider).model_copy(update={"allowed_locations": [self.other_location]})
        server.reset()
        with pytest.raises(LocationNotAllowedError):
            provider.launch(req, "x")
        assert server.requests() == []

    def test_list_by_tag_get_terminate(self, provider: Provider, server: FakeServer) -> None:
        self.list_in_pages(server)
        inst = provider.launch(self.request(provider), "x")
        other = provider.launch(self.request(provider, op="op-other0000000", policy="team-b"), "x")
        assert [i.instance_id for i in provider.list(self.location, policy="team.a")] == [inst.instance_id]
        assert [i.instance_id for i in provider.list(self.location, operation="op-other0000000")] == [
            other.instance_id]
        assert provider.list(self.other_location) == []
        with pytest.raises(NotOwnedError):
            provider.terminate(self.location, other.instance_id, policy="team.a")
        server.fault(operation_seconds=30)  # the delete takes a while, as a cloud's does
        provider.terminate(self.location, inst.instance_id, policy="team.a")
        assert provider.get(self.location, inst.instance_id).state == "shutting-down"
        provider.terminate(self.location, inst.instance_id, policy="team.a")  # deleting already: no second delete
        assert sum(r["method"] == "DELETE" for r in server.requests()) == 1

    def test_terminate_of_a_gone_instance_is_done(self, provider: Provider) -> None:
        provider.terminate(self.location, self.gone_instance_id, policy="team.a")
