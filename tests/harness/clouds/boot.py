"""Boots the instances of the local Google Cloud and Azure servers, as the sim provider boots its own: each
running instance reads its user data (GCE metadata ``user-data``, Azure ``customData``: what the machine itself
sees) and joins through the gateway with the ticket in it; kwok then runs the Node."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from activities.providers.sim import KWOK_ANNOTATIONS
from tests.harness.background import Background
from tests.harness.clouds.azure_server import SIZES
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.gcp_server import MACHINE_TYPES

# (instance id, user data, capacity, provider id) -> the node's name; raises when the join fails.
Join = Callable[[str, str, dict[str, str], str], str]


def gateway_join(gateway: Any) -> Join:
    """Join with the product's node code: redeemed at an in-process gateway (``KubeGateway.join``), else at the
    gateway's HTTP API the user data names; the node then registers itself with its own certificate."""

    def join(iid: str, user_data: str, capacity: dict[str, str], provider_id: str) -> str:
        from models.join import parse_user_data
        from node.register import join_simulated
        from tests.harness.joining import join_with_user_data

        if hasattr(gateway, "join"):
            doc = parse_user_data(user_data)
            state = Path(tempfile.gettempdir()) / "kubeon-test-nodes" / f"cloud-{iid}"
            node = join_simulated(doc, state, gateway.join, provider_id=provider_id, capacity=capacity,
                                  annotations=KWOK_ANNOTATIONS)
            return str(node.metadata.name)
        return join_with_user_data(user_data, capacity, KWOK_ANNOTATIONS, provider_id)

    return join


def _gcp(state: dict[str, Any]) -> list[tuple[str, str, dict[str, str], str]]:
    out = []
    for inst in state["instances"]:
        if inst["status"] != "RUNNING":
            continue
        machine = inst["machineType"].rsplit("/", 1)[-1]
        cpus, mem, _, gpus = MACHINE_TYPES[machine]
        parts = inst["selfLink"].split("/projects/", 1)[1].split("/")  # p, zones, z, instances, name
        out.append((inst["id"], inst["userData"], {"cpu": str(cpus), "memory": f"{mem}Mi", "pods": "110",
                                                   "nvidia.com/gpu": str(gpus)},
                    f"gce://{parts[0]}/{parts[2]}/{parts[4]}"))
    return out


def _azure(state: dict[str, Any]) -> list[tuple[str, str, dict[str, str], str]]:
    out = []
    for vm in state["vms"]:
        if vm["properties"]["provisioningState"] != "Succeeded":
            continue
        _, cpus, mem, gpus = SIZES[vm["properties"]["hardwareProfile"]["vmSize"]]
        out.append((vm["properties"]["vmId"], vm["customDataDecoded"],
                    {"cpu": str(cpus), "memory": f"{mem}Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
                    f"azure://{vm['id']}"))
    return out


class Booter(Background):
    """A thread that joins every newly running instance of one local cloud, once."""

    def __init__(self, server: FakeServer, join: Join, *, interval: float = 0.3) -> None:
        super().__init__()
        self.server, self.join, self.interval = server, join, interval
        self.kind = _azure if "azure" in server.module else _gcp
        self.joined: dict[str, str] = {}  # instance id -> node name
        self.errors: list[str] = []

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                booting = self.kind(self.server.state())
            except OSError:
                continue  # the server is restarting
            for iid, user_data, capacity, provider_id in booting:
                if iid in self.joined or not user_data:
                    continue
                try:
                    self.joined[iid] = self.join(iid, user_data, capacity, provider_id)
                except Exception as exc:  # a node that fails to join stays unjoined, as a real one would
                    self.errors.append(f"{iid}: {exc}")
                    self.joined[iid] = ""
