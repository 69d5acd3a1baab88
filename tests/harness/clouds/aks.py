"""AKS agent pools and their machines on the local Azure Resource Manager (azure_server.py: HTTPS with its per-run
certificate, bearer tokens from its identity endpoint), in the REST shapes azure-mgmt-containerservice sends and
parses (shared notes capacity.md §8).

Under ``/subscriptions/{s}/resourceGroups/{rg}/providers/Microsoft.ContainerService/managedClusters/{c}``:

* ``GET agentPools``, ``GET agentPools/{p}``: ``properties.count``, ``mode`` System|User, ``vmSize``,
  ``nodeLabels``, ``provisioningState``; ``properties.eTag`` and the ``ETag`` header, new on every change.
* ``PUT agentPools/{p}`` (``begin_create_or_update``): the whole properties; ``If-Match`` with a stale ETag is a
  412 ``PreconditionFailed``; a count change is a long-running operation (200 + ``Azure-AsyncOperation``, polled
  at ``.../Microsoft.ContainerService/locations/{loc}/operations/{id}``, then the final GET of the pool); a shrink
  removes the newest machines (the cloud chooses), recorded with ``via: "scale"``.
* ``POST agentPools/{p}/deleteMachines {"machineNames": [...]}``: 202 with ``Azure-AsyncOperation`` and
  ``Location``; exactly those machines go (recorded ``via: "deleteMachines"``) and ``count`` drops by their number
  when the operation succeeds. An unknown machine name is a 400 ``InvalidParameter``.
* ``GET agentPools/{p}/machines``, ``GET agentPools/{p}/machines/{m}``: ``properties.resourceId`` is the VMSS VM.
* A System pool never goes below 1 node (a PUT with count 0, or deleteMachines of its last machines: 400
  ``InvalidParameter``, as AKS refuses it); User pools may be 0.
* One operation per managed cluster at a time: another mutation while one runs is a 409 ``OperationNotAllowed``
  (AKS: "another operation is in progress").

Faults: ``slow_remove_seconds`` (deleteMachines has started; its answer waits: a caller killed meanwhile),
``aks_operation_error`` ({"code", "message"}: the next AKS operation ends Failed with that error and
changes nothing), ``aks_429`` (N: the next N AKS requests answer 429 with ``Retry-After``), ``aks_concurrent``
(true: the next AKS mutation finds another operation running: 409), plus ``operation_seconds``/``retry_after``.

Seeding (``FakeServer.seed``): ``{"aks": {"subscription", "resourceGroup", "cluster", "location", "agentPools":
[{"name", "vmSize", "count", "mode", "nodeLabels", "nodeTaints": ["k=v:NoSchedule"], "enableAutoScaling",
"minCount", "maxCount"}]}}``.

Not here: managed cluster CRUD, autoscaler, upgrades, surge, Deallocate scale-down mode, the Node objects (the
harness's reconciler plays the cloud controller manager: clouds/nodes.py).
"""

from __future__ import annotations

import re
import time
import uuid
import zlib
from typing import Any

from werkzeug.wrappers import Request
from werkzeug.wrappers import Response

from tests.harness.clouds.fake import ApiError
from tests.harness.clouds.fake import json_response

AKS = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.ContainerService/"
                 r"managedClusters/(?P<c>[^/]+)/agentPools(/(?P<p>[^/]+)(/(?P<verb>deleteMachines|machines)"
                 r"(/(?P<m>[^/]+))?)?)?$", re.I)


def arm_error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> ApiError:
    return ApiError(status, {"error": {"code": code, "message": message}}, headers)


class AgentPools:
    """Mixed into ResourceManager: it owns ``operations``, ``faults`` and the lock."""

    operations: dict[str, dict[str, Any]]
    faults: dict[str, Any]

    def reset_aks(self) -> None:
        self.aks_clusters: dict[tuple[str, str, str], dict[str, Any]] = {}  # (sub, rg, cluster) lowercased
        self.agent_pools: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.machines: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = {}  # pool -> name -> machine
        self.machine_deleted: list[dict[str, Any]] = []  # {pool, machine, via}
        self._vm_index: dict[tuple[str, str, str, str], int] = {}

    # -- seeding -------------------------------------------------------------------------------------------
    def seed_aks(self, spec: dict[str, Any]) -> dict[str, Any]:
        sub, rg, cluster, location = spec["subscription"], spec["resourceGroup"], spec["cluster"], spec["location"]
        ckey = (sub.lower(), rg.lower(), cluster.lower())
        self.aks_clusters[ckey] = {"name": cluster, "location": location, "rg": rg, "sub": sub,
                                   "nodeResourceGroup": f"MC_{rg}_{cluster}_{location}"}
        for ap in spec.get("agentPools", []):
            key = (*ckey, ap["name"].lower())
            props = {"count": int(ap.get("count", 1)), "vmSize": ap["vmSize"], "mode": ap.get("mode", "User"),
                     "osType": "Linux", "type": "VirtualMachineScaleSets", "nodeLabels": ap.get("nodeLabels", {}),
                     "nodeTaints": ap.get("nodeTaints", []), "enableAutoScaling": bool(ap.get("enableAutoScaling")),
                     **{k: ap[k] for k in ("minCount", "maxCount") if k in ap}, "scaleDownMode": "Delete",
                     "provisioningState": "Succeeded", "powerState": {"code": "Running"},
                     "orchestratorVersion": "1.33.2"}
            self.agent_pools[key] = {
                "id": f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.ContainerService/"
                      f"managedClusters/{cluster}/agentPools/{ap['name']}",
                "name": ap["name"], "type": "Microsoft.ContainerService/managedClusters/agentPools",
                "properties": props, "_etag": uuid.uuid4().hex,
                "_vmss": f"aks-{ap['name']}-{zlib.crc32('/'.join(key).encode()) % 10**8:08d}-vmss"}
            self.machines[key] = {}
            self._vm_index[key] = 0
            self._aks_scale(key, props["count"], "seed")
        return {"pools": sorted(k[3] for k in self.agent_pools if k[:3] == ckey)}

    def _aks_scale(self, key: tuple[str, str, str, str], count: int, via: str) -> None:
        pool, machines = self.agent_pools[key], self.machines[key]
        cluster = self.aks_clusters[key[:3]]
        while len(machines) < count:
            n = self._vm_index[key]
            self._vm_index[key] = n + 1
            name = f"{pool['_vmss']}{_base36(n)}"
            machines[name] = {
                "id": f"{pool['id']}/machines/{name}", "name": name,
                "type": "Microsoft.ContainerService/managedClusters/agentPools/machines",
                "properties": {"resourceId": f"/subscriptions/{cluster['sub']}/resourceGroups/"
                               f"{cluster['nodeResourceGroup']}/providers/Microsoft.Compute/virtualMachineScaleSets/"
                               f"{pool['_vmss']}/virtualMachines/{n}",
                               "network": {"ipAddresses": [{"family": "IPv4", "ip": f"10.224.0.{n % 250 + 4}"}]}}}
        for name in sorted(machines, key=lambda m: int(machines[m]["properties"]["resourceId"].rsplit("/", 1)[1]),
                           reverse=True)[:max(0, len(machines) - count)]:  # scale-in: the highest instance ids
            machines.pop(name)
            self.machine_deleted.append({"pool": pool["name"], "machine": name, "via": via})
        pool["properties"]["count"] = count
        pool["_etag"] = uuid.uuid4().hex

    # -- time passes -------------------------------------------------------------------------------------
    def advance_aks(self, op: dict[str, Any]) -> None:
        """Called by ResourceManager._advance for an operation of ours that is due."""
        pool = self.agent_pools.get(op["_pool"])
        if op.get("_error"):
            op["status"], op["error"] = "Failed", op.pop("_error")
            if pool is not None:
                pool["properties"]["provisioningState"] = "Failed"
                pool["_etag"] = uuid.uuid4().hex
            return
        op["status"] = "Succeeded"
        op.pop("_apply")()
        if pool is not None:
            pool["properties"]["provisioningState"] = "Succeeded"

    # -- routes ----------------------------------------------------------------------------------------
    def route_aks(self, m: re.Match[str], request: Request, body: Any, base: str) -> Response:
        if (n := int(self.faults.get("aks_429", 0))) > 0:
            self.faults["aks_429"] = n - 1
            raise arm_error(429, "TooManyRequests", "The request is being throttled as the limit has been reached "
                            "for operation type - ReadOps/WriteOps.", {"Retry-After": "0"})
        sub, rg, cluster, name, verb = m.group("sub"), m.group("rg"), m.group("c"), m.group("p"), m.group("verb")
        ckey = (sub.lower(), rg.lower(), cluster.lower())
        if ckey not in self.aks_clusters:
            raise arm_error(404, "ResourceNotFound", f"The Resource 'Microsoft.ContainerService/managedClusters/"
                            f"{cluster}' under resource group '{rg}' was not found.")
        if not name:
            return json_response({"value": [self._aks_public(self.agent_pools[k]) for k in sorted(self.agent_pools)
                                            if k[:3] == ckey]})
        key = (*ckey, name.lower())
        if key not in self.agent_pools and not (request.method == "PUT" and not verb):
            raise arm_error(404, "NotFound", f"Agent pool '{name}' of managed cluster '{cluster}' was not found.")
        if verb == "machines" and request.method == "GET":
            machines = self.machines[key]
            if m.group("m"):
                if m.group("m") not in machines:
                    raise arm_error(404, "NotFound", f"Machine '{m.group('m')}' was not found in agent pool '{name}'.")
                return json_response(machines[m.group("m")])
            return json_response({"value": [machines[k] for k in sorted(machines)]})
        if verb == "deleteMachines" and request.method == "POST":
            return self._aks_delete_machines(key, (body or {}).get("machineNames") or [], base, request)
        if not verb and request.method == "GET":
            pool = self.agent_pools[key]
            return json_response(self._aks_public(pool), headers={"ETag": f'"{pool["_etag"]}"'})
        if not verb and request.method == "PUT":
            return self._aks_put(key, body or {}, base, request)
        raise arm_error(405, "MethodNotAllowed", f"{request.method} is not allowed on {request.path}")

    def _aks_public(self, pool: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in pool.items() if not k.startswith("_")}
        return {**out, "properties": dict(pool["properties"], eTag=pool["_etag"])}

    def _aks_busy(self, ckey: tuple[str, str, str]) -> None:
        if self.faults.pop("aks_concurrent", None) or any(
                op["status"] == "InProgress" and op.get("_pool", ("",))[:3] == ckey for op in self.operations.values()):
            raise arm_error(409, "OperationNotAllowed", "Operation is not allowed because there's an in progress "
                            "update managed cluster operation on the managed cluster started at "
                            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}.")

    def _aks_operation_headers(self, key: tuple[str, str, str, str], apply: Any, base: str, request: Request
                           ) -> dict[str, str]:
        cluster = self.aks_clusters[key[:3]]
        op_id = str(uuid.uuid4())
        op: dict[str, Any] = {"name": op_id, "status": "InProgress", "startTime": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "_kind": "aks", "_pool": key, "_apply": apply, "_vm": None,
            "_done_at": time.time() + float(self.faults.get("operation_seconds", 0)), "_error": None}
        if err := self.faults.pop("aks_operation_error", None):
            op["_error"] = {"code": err.get("code", "InternalOperationError"),
                            "message": err.get("message", "Internal operation error.")}
        self.operations[op_id] = op
        url = (f"{base}/subscriptions/{cluster['sub']}/providers/Microsoft.ContainerService/locations/"
               f"{cluster['location']}/operations/{op_id}?api-version={request.args['api-version']}")
        return {"Azure-AsyncOperation": url, "Retry-After": str(self.faults.get("retry_after", 1))}

    def _aks_check_match(self, key: tuple[str, str, str, str], request: Request) -> None:
        match = request.headers.get("If-Match")
        pool = self.agent_pools.get(key)
        if match and match != "*" and (pool is None or match.strip('"') != pool["_etag"]):
            raise arm_error(412, "PreconditionFailed", f"Operation failed: the ETag '{match}' of the request does "
                            "not match the agent pool's; read it again and retry.")

    def _aks_put(self, key: tuple[str, str, str, str], body: dict[str, Any], base: str, request: Request) -> Response:
        if key not in self.agent_pools:
            raise arm_error(400, "NotSupported", "Creating an agent pool is not supported by this local server.")
        self._aks_check_match(key, request)
        self._aks_busy(key[:3])
        pool = self.agent_pools[key]
        props = dict(body.get("properties") or {})
        if "count" not in props or "vmSize" not in props:
            raise arm_error(400, "InvalidParameter", "The agent pool's properties must be sent whole: 'count' and "
                            "'vmSize' are required (GET, modify, PUT).")
        if props["vmSize"] != pool["properties"]["vmSize"]:
            raise arm_error(400, "PropertyChangeNotAllowed", "Changing property 'vmSize' is not allowed.")
        count = int(props["count"])
        mode = props.get("mode", pool["properties"]["mode"])
        if count < (1 if mode == "System" else 0) or count > 1000:
            raise arm_error(400, "InvalidParameter", f"The value of parameter agentPoolProfile.count is invalid: "
                            f"{count}. A {mode} agent pool must have between {1 if mode == 'System' else 0} and "
                            "1000 nodes.")
        keep = {k: pool["properties"][k] for k in ("provisioningState", "powerState")}
        pool["properties"] = {**pool["properties"], **{k: v for k, v in props.items() if k != "eTag"}, **keep}
        pool["properties"]["count"] = len(self.machines[key])  # the new count once the operation is done
        pool["properties"]["provisioningState"] = "Updating" if count != len(self.machines[key]) else "Succeeded"
        pool["_etag"] = uuid.uuid4().hex
        headers = self._aks_operation_headers(key, lambda: self._aks_scale(key, count, "scale"), base, request)
        return json_response(self._aks_public(pool), 200, headers)

    def _aks_delete_machines(self, key: tuple[str, str, str, str], names: list[str], base: str,
                         request: Request) -> Response:
        self._aks_busy(key[:3])
        machines, pool = self.machines[key], self.agent_pools[key]
        unknown = [n for n in names if n not in machines]
        if not names or unknown:
            raise arm_error(400, "InvalidParameter", f"The machine(s) {unknown or names} are not in agent pool "
                            f"'{pool['name']}'.")
        if pool["properties"]["mode"] == "System" and len(machines) - len(set(names)) < 1:
            raise arm_error(400, "InvalidParameter", f"Agent pool '{pool['name']}' is a System pool: it must keep "
                            "at least 1 node.")

        def apply() -> None:
            for n in dict.fromkeys(names):
                if machines.pop(n, None) is not None:
                    self.machine_deleted.append({"pool": pool["name"], "machine": n, "via": "deleteMachines"})
            pool["properties"]["count"] = len(machines)
            pool["_etag"] = uuid.uuid4().hex

        pool["properties"]["provisioningState"] = "Deleting"
        headers = self._aks_operation_headers(key, apply, base, request)
        headers["Location"] = headers["Azure-AsyncOperation"]
        self.slow_answer("slow_remove_seconds")  # type: ignore[attr-defined]  # FakeCloud's
        return Response(status=202, headers=headers)


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(6):
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out
