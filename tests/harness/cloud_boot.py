"""Boots the instances of the local Google Cloud and Azure servers, as the sim provider boots its own: each
running instance reads its user data (GCE metadata ``user-data``, Azure ``customData``: what the machine itself
sees) and joins through the gateway with the ticket in it; kwok then runs the Node."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from activities.gateway import parse_user_data_ticket
from activities.providers.sim import KWOK_ANNOTATIONS
from tests.harness.azure_server import SIZES
from tests.harness.cloud_fake import FakeServer
from tests.harness.gcp_server import MACHINE_TYPES

# (instance id, user data, capacity, provider id) -> the node's name; raises when the join fails.
Join = Callable[[str, str, dict[str, str], str], str]


def gateway_join(gateway: Any) -> Join:
    """Join through an in-process gateway (KubeGateway.admit), else through the gateway's HTTP API."""

    def join(_iid: str, user_data: str, capacity: dict[str, str], provider_id: str) -> str:
        if hasattr(gateway, "admit"):
            doc = parse_user_data_ticket(user_data)
            node = gateway.admit(doc["ticket"], capacity=capacity, annotations=KWOK_ANNOTATIONS,
                                 provider_id=provider_id)
            return str(node.metadata.name)
        from activities.gateway_http import join_with_user_data

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


class Booter:
    """A thread that joins every newly running instance of one local cloud, once."""

    def __init__(self, server: FakeServer, join: Join, *, interval: float = 0.3) -> None:
        self.server, self.join, self.interval = server, join, interval
        self.kind = _azure if "azure" in server.module else _gcp
        self.joined: dict[str, str] = {}  # instance id -> node name
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Booter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

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
