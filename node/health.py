"""The burn-in's GPU health check (issue 27) on the burst node: the node program runs DCGM's diagnostic level 1
(``dcgmi diag -r 1``, the deployment and software checks, about a minute) and posts its result as the condition
``gpu.kubeon.io/GpuHealthy`` of its own Node; the optimizer's burn-in waits for it before the node serves.

Why on the node and not as a pod tolerating the joining taint: the optimizer's ClusterRole (R5.1) creates no
pods (its one pod write is evictions), and a pod would first pull a DCGM image through the tunnel. The node
program already runs as root on an image that carries DCGM, and the node's own credential may update its own
Node's status (the Node authorizer and NodeRestriction: a kubelet posts its conditions the same way). A pod's
result would be reported by that same node (its kubelet posts pod status), so trusting the node's condition gives
away nothing a pod would have kept; what the node can forge either way is its own health, which only gets it
terminated sooner or lets it serve as it would have without the check.

The diagnostic needs the driver, not the kubelet: it starts before the kubelet and runs while the kubelet
registers; its result is posted once the Node exists.
"""

from __future__ import annotations

import datetime as dt
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from models.join import GpuHealth
from models.labels import GPU_HEALTH_CONDITION

if TYPE_CHECKING:
    from kubernetes import client

DEFAULT_GPU_HEALTH_COMMAND = "dcgmi diag -r 1"
# Level 1 takes about a minute; one that has not finished in five is a failed node, not one to wait for.
GPU_HEALTH_TIMEOUT_SECONDS = 300.0
# How long the result waits for the kubelet to register the Node it is posted on.
NODE_WAIT_SECONDS = 300.0
MESSAGE_CHARS = 1000
# A result row of dcgmi's table: "| Memory                    | Fail - GPU: 0   |".
_ROW = re.compile(r"^\|\s*(?P<test>[^|]+?)\s*\|\s*(?P<result>[^|]*?)\s*\|$")


class HealthNotPosted(RuntimeError):
    """The result could not be posted on the node's Node (it never registered, or the API server refused)."""


def verdict(command: str, returncode: int, output: str) -> GpuHealth:
    """Healthy when the diagnostic exits 0 and no result row says Fail (dcgmi exits non-zero when a test fails;
    a row is checked too, so a wrapper that loses the exit status cannot pass a failed GPU). The message names the
    failed tests, or the passed ones."""
    rows = [(m["test"], m["result"]) for m in map(_ROW.match, output.splitlines()) if m]
    failed = [f"{test}: {result}" for test, result in rows if result.startswith("Fail")]
    if returncode == 0 and not failed:
        passed = [test for test, result in rows if result == "Pass"]
        detail = f"{len(passed)} test(s) passed" if passed else "passed"
        return GpuHealth(healthy=True, reason="DcgmDiagPassed", message=f"`{command}`: {detail}")
    detail = "; ".join(failed) or " | ".join(line.strip() for line in output.strip().splitlines()[-3:])
    return GpuHealth(healthy=False, reason="DcgmDiagFailed",
                     message=f"`{command}` failed (exit {returncode}): {detail}"[:MESSAGE_CHARS])


class GpuHealthRun:
    """The diagnostic, started at once; ``result`` waits for it."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.proc: subprocess.Popen[str] | None = None
        self.unavailable: GpuHealth | None = None
        try:
            self.proc = subprocess.Popen(shlex.split(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)
        except (OSError, ValueError) as exc:  # not installed, not executable, unbalanced quotes
            self.unavailable = GpuHealth(
                healthy=False, reason="DcgmDiagUnavailable",
                message=(f"`{command}` could not start: {exc} (install DCGM on the node image, or leave GpuHealth "
                         "out of the policy's spec.burnIn.checks)")[:MESSAGE_CHARS])

    def result(self, timeout: float = GPU_HEALTH_TIMEOUT_SECONDS) -> GpuHealth:
        if self.proc is None:
            assert self.unavailable is not None
            return self.unavailable
        try:
            output, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return GpuHealth(healthy=False, reason="DcgmDiagTimedOut",
                             message=f"`{self.command}` did not finish in {timeout:.0f}s")
        return verdict(self.command, self.proc.returncode, output)


def condition(health: GpuHealth, now: dt.datetime) -> dict[str, str]:
    stamp = now.isoformat().replace("+00:00", "Z")
    return {"type": GPU_HEALTH_CONDITION, "status": "True" if health.healthy else "False", "reason": health.reason,
            "message": health.message, "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}


def post_gpu_health(api: client.ApiClient, node_name: str, health: GpuHealth, *,
                    wait_seconds: float = NODE_WAIT_SECONDS, sleep: Callable[[float], None] = time.sleep) -> None:
    """Post ``health`` as a condition of the node's own Node (a strategic merge by condition type: the kubelet's
    conditions stay as they are), once the kubelet has registered it."""
    from kubernetes import client

    core = client.CoreV1Api(api)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            core.read_node(node_name)
            break
        except client.ApiException as exc:
            if exc.status != 404:
                raise HealthNotPosted(f"reading Node {node_name}: {exc.status} {exc.reason}") from None
        if time.monotonic() > deadline:
            raise HealthNotPosted(f"Node {node_name} was not registered within {wait_seconds:.0f}s")
        sleep(0.5)
    try:
        core.patch_node_status(node_name, {"status": {"conditions": [condition(health, dt.datetime.now(dt.UTC))]}})
    except client.ApiException as exc:
        raise HealthNotPosted(f"posting {GPU_HEALTH_CONDITION} on Node {node_name}: {exc.status} {exc.reason}"
                              ) from None
