"""A simulated location for local runs and tests, like Karpenter's kwok provider.

Instances live in a JSON state file (so they survive a worker restart, as a cloud's would). After the
location's boot delay an instance "boots" (the worker's boot hook): it reads its user data and joins through the
gateway with the same protocol as a real node (its own keys and kubelet CSR, the ticket redeemed, its own
certificate), then registers its own Node, which kwok runs as a simulated kubelet. Without a tunnel: it reaches
the API server over loopback (the tunnel tests boot instances into network namespaces instead).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any

from models.join import SIMULATED_GPU_HEALTH
from models.join import GpuHealth
from models.labels import GPU_RESOURCE
from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.locations import BurstConfig
from models.locations import transfer_usd_per_gpu_hour
from models.node import Instance
from models.node import LaunchRequest
from models.provisioning import Offering

from .base import check_allowed
from .errors import InstanceNotFoundError
from .errors import InsufficientCapacityError
from .errors import NotOwnedError
from .errors import ProviderError

LIVE_STATES = ("pending", "running")
KWOK_ANNOTATIONS = {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}

# Called when a simulated instance has booted: (instance, user_data, capacity) -> None; it joins the cluster.
# (the instance, its user data, the capacity its kubelet reports, the result its GPU health check posts).
BootHook = Callable[[Instance, str, dict[str, str], GpuHealth], None]
# A failing diagnostic as DCGM reports one (a GPU's memory test), for the sim's fault injection.
SIMULATED_GPU_HEALTH_FAILURE = GpuHealth(healthy=False, reason="DcgmDiagFailed",
                                         message="simulated `dcgmi diag -r 1` failed (exit 226): Memory: Fail - GPU: 0")


class _StateLock:
    """The state file's lock: a thread lock, and ``flock`` on a file beside it, so that the worker replicas sharing
    one simulated cloud (bench.temporal_production) read-modify-write it one at a time."""

    def __init__(self, path: Path) -> None:
        self._path, self._thread, self._fd = path, threading.Lock(), -1

    def __enter__(self) -> None:
        self._thread.acquire()
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._thread.release()


class SimProvider:
    name = "sim"

    def __init__(self, config: BurstConfig, state_file: Path, on_boot: BootHook | None = None) -> None:
        self._config = config
        self._file = state_file
        self._file.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _StateLock(self._file.with_suffix(".lock"))
        self._on_boot = on_boot
        self._timers: dict[str, threading.Timer] = {}
        self.calls: list[tuple[str, str]] = []
        # A restarted worker finds its simulated cloud as it left it: pending instances go on booting.
        for iid, rec in self._load().items():
            if rec["state"] == "pending":
                self._schedule_boot(iid, rec)

    # -- state -------------------------------------------------------------------------------------------
    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data: dict[str, dict[str, Any]] = json.loads(self._file.read_text())
            return data
        except FileNotFoundError:
            return {}

    def _save(self, data: dict[str, dict[str, Any]]) -> None:
        tmp = self._file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self._file)

    @staticmethod
    def _instance(iid: str, rec: dict[str, Any]) -> Instance:
        return Instance(
            provider="sim", location=rec["location"], instance_id=iid, instance_type=rec["instance_type"],
            state=rec["state"], tags=rec["tags"], node_name=rec.get("node_name", ""),
            launched_at=datetime.fromisoformat(rec["launched_at"]),
        )

    # -- Provider ----------------------------------------------------------------------------------------
    def price_offerings(self, location: str) -> list[Offering]:
        self.calls.append(("price_offerings", location))
        loc = self._config.location(location)
        transfer = transfer_usd_per_gpu_hour(self._config.home, loc)
        return [
            Offering(location=location, instance_type=o.instance_type, gpus=o.gpus, gpu_product=o.gpu_product,
                     instance_usd_per_hour=o.usd_per_hour, transfer_usd_per_gpu_hour=transfer)
            for o in loc.offerings
        ]

    def launch(self, request: LaunchRequest, user_data: str) -> Instance:
        self.calls.append(("launch", request.operation))
        check_allowed(request)
        location = request.offering.location
        loc = self._config.location(location)
        with self._lock:
            data = self._load()
            for iid, rec in data.items():
                if rec["tags"].get(TAG_OPERATION) == request.operation and rec["state"] in LIVE_STATES:
                    return self._instance(iid, rec)  # a retried launch finds what it started
            live = sum(1 for r in data.values() if r["location"] == location and r["state"] in LIVE_STATES)
            if live >= loc.sim.capacity:
                raise InsufficientCapacityError(
                    f"{location}: no capacity for {request.offering.instance_type} ({live} of {loc.sim.capacity} "
                    "simulated instances running)")
            iid = f"sim-{uuid.uuid4().hex[:12]}"
            earlier = sum(1 for r in data.values() if r["location"] == location)
            short = 1 if earlier < loc.sim.short_gpus_first else 0
            rec = {
                "location": location, "instance_type": request.offering.instance_type, "state": "pending",
                "tags": {TAG_BURST: request.policy, TAG_OPERATION: request.operation},
                "node_name": request.node_name, "user_data": user_data, "gpus": request.offering.gpus,
                "gpus_allocatable": max(0, request.offering.gpus - short),
                "gpu_health_fails": earlier < loc.sim.failing_gpu_health_first,
                "launched_at": datetime.now(UTC).isoformat(), "boot_at": time.time() + loc.sim.boot_seconds,
            }
            data[iid] = rec
            self._save(data)
        if loc.sim.kill_worker_after_launch:
            os.kill(os.getpid(), signal.SIGKILL)  # the instance exists; the launch call never returns
        self._schedule_boot(iid, rec)
        return self._instance(iid, rec)

    def get(self, location: str, instance_id: str) -> Instance:
        rec = self._load().get(instance_id)
        if rec is None or rec["location"] != location:
            raise InstanceNotFoundError(f"{location}: instance {instance_id} not found")
        return self._instance(instance_id, rec)

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]:
        out = []
        for iid, rec in self._load().items():
            if rec["location"] != location:
                continue
            if policy is not None and rec["tags"].get(TAG_BURST) != policy:
                continue
            if operation is not None and rec["tags"].get(TAG_OPERATION) != operation:
                continue
            out.append(self._instance(iid, rec))
        return out

    def terminate(self, location: str, instance_id: str, *, policy: str) -> None:
        self.calls.append(("terminate", instance_id))
        with self._lock:
            data = self._load()
            rec = data.get(instance_id)
            if rec is None or rec["state"] == "terminated":
                return
            if rec["tags"].get(TAG_BURST) != policy:
                raise NotOwnedError(f"{location}: instance {instance_id} does not carry {TAG_BURST}={policy}")
            rec["state"] = "terminated"
            self._save(data)
        timer = self._timers.pop(instance_id, None)
        if timer:
            timer.cancel()

    # -- booting -----------------------------------------------------------------------------------------
    def _schedule_boot(self, iid: str, rec: dict[str, Any]) -> None:
        delay = max(0.0, float(rec.get("boot_at", 0)) - time.time())
        timer = threading.Timer(delay, self._boot, args=(iid,))
        timer.daemon = True
        self._timers[iid] = timer
        timer.start()

    def _boot(self, iid: str) -> None:
        with self._lock:
            data = self._load()
            rec = data.get(iid)
            if rec is None or rec["state"] != "pending":
                return
            rec["state"] = "running"
            self._save(data)
        self._timers.pop(iid, None)
        if self._on_boot is not None:
            gpus = rec.get("gpus_allocatable", rec["gpus"])  # fewer: the burn-in tests' fault (short_gpus_first)
            capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", GPU_RESOURCE: str(gpus)}
            health = SIMULATED_GPU_HEALTH_FAILURE if rec.get("gpu_health_fails") else SIMULATED_GPU_HEALTH
            try:
                self._on_boot(self._instance(iid, rec), rec["user_data"], capacity, health)
            except Exception as exc:  # a node that fails to join stays unjoined, as a real one would
                raise ProviderError(f"simulated instance {iid} failed to join: {exc}") from exc

    def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
