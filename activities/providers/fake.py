"""An in-memory provider that records every call and injects failures: for workflow tests."""

from __future__ import annotations

import builtins
import itertools
from dataclasses import dataclass
from dataclasses import field

from activities.recording import CallRecorder
from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.node import Instance
from models.node import LaunchRequest
from models.provisioning import Offering

from .base import check_allowed
from .errors import InstanceNotFoundError
from .errors import NotOwnedError


@dataclass
class FakeProvider(CallRecorder):
    name: str = "fake"
    offerings: dict[str, list[Offering]] = field(default_factory=dict)
    instances: dict[str, Instance] = field(default_factory=dict)
    user_data: dict[str, str] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def price_offerings(self, location: str) -> list[Offering]:
        self._record("price_offerings", location)
        return list(self.offerings.get(location, []))

    def launch(self, request: LaunchRequest, user_data: str) -> Instance:
        self._record("launch", request.offering.location)
        check_allowed(request)
        with self._lock:
            for inst in self.instances.values():
                if inst.tags.get(TAG_OPERATION) == request.operation and inst.state == "running":
                    return inst
            iid = f"i-fake{next(self._ids):04d}"
            inst = Instance(provider=self.name, location=request.offering.location, instance_id=iid,
                            instance_type=request.offering.instance_type, state="running",
                            tags={TAG_BURST: request.policy, TAG_OPERATION: request.operation},
                            node_name=request.node_name)
            self.instances[iid] = inst
            self.user_data[iid] = user_data
            return inst

    def get(self, location: str, instance_id: str) -> Instance:
        self._record("get", instance_id)
        inst = self.instances.get(instance_id)
        if inst is None:
            raise InstanceNotFoundError(f"{location}: {instance_id} not found")
        return inst

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]:
        self._record("list", location)
        return [i for i in self.instances.values() if i.location == location
                and (policy is None or i.tags.get(TAG_BURST) == policy)
                and (operation is None or i.tags.get(TAG_OPERATION) == operation)]

    def terminate(self, location: str, instance_id: str, *, policy: str) -> None:
        self._record("terminate", instance_id)
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        if inst.tags.get(TAG_BURST) != policy:
            raise NotOwnedError(f"{instance_id} is not {policy}'s")
        inst.state = "terminated"

    def live(self) -> builtins.list[Instance]:
        return [i for i in self.instances.values() if i.state == "running"]
