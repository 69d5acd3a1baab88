"""GKE node pools on the local Compute Engine server (gcp_server.py): the Kubernetes Engine API v1 (the REST shapes
google-cloud-container's REST transport sends and parses; shared notes capacity.md §7) and, on the compute side,
each pool's managed instance groups, one per zone (compute/v1 instanceGroupManagers, as google-cloud-compute
sends them).

Container API (``/v1/projects/{p}/locations/{l}/...``):

* ``GET clusters/{c}/nodePools`` and ``GET clusters/{c}/nodePools/{np}``: ``instanceGroupUrls`` name the MIGs;
  the pool's size is the MIGs' (``initialNodeCount`` is what it was created with, as on GKE).
* ``POST clusters/{c}/nodePools/{np}:setSize {"nodeCount": N}``: N **per zone** (absent = 0: the client omits
  zero values). Returns an ``Operation`` (``SET_NODE_POOL_SIZE``), RUNNING for ``operation_seconds``; the MIGs
  resize when it is DONE, and a shrink removes instances the server picks (as GKE does: "at random"), recorded
  with ``via: "setSize"``.
* ``GET operations/{op}``: the operation, DONE with ``error`` (google.rpc.Status) when it failed.
* One operation per cluster at a time: a mutation while one is RUNNING is a 400 FAILED_PRECONDITION whose
  ErrorInfo reason is ``CLUSTER_ALREADY_HAS_OPERATION`` (the shape GKE returns; cluster-api-provider-gcp#1363).

Compute side (``/compute/v1/projects/{p}/zones/{z}/instanceGroupManagers/{mig}``): ``GET`` the MIG,
``POST .../listManagedInstances``, ``POST .../deleteInstances`` (exactly the named instances: targetSize goes
down by their number, each is DELETING until the zone operation is DONE, then gone; recorded with
``via: "deleteInstances"``), ``POST .../resize?size=N`` (a shrink lets the server choose, recorded
``via: "resize"``). Their instances are ordinary compute instances (``instances.get``/``list`` show them), with the
labels GKE puts on its VMs (``goog-k8s-cluster-name``, ``goog-k8s-node-pool-name``).

Faults: ``slow_remove_seconds`` (deleteInstances has started; its answer waits: a caller killed meanwhile),
``gke_operation_error`` ({"message": ...}: the next container operation ends DONE with that error and
changes nothing), ``gke_429`` (N: the next N container mutations answer 429 RESOURCE_EXHAUSTED, "concurrent
operations quota"), plus ``operation_seconds`` (how long an operation runs) and the shared ones.

Seeding (``FakeServer.seed``, what a test starts from): ``{"gke": {"project", "location", "cluster", "nodePools":
[{"name", "machineType", "zones": [...], "nodeCount": per zone, "labels": {...}, "taints": [{"key", "value",
"effect": "NO_SCHEDULE"}], "autoscaling": {"enabled": ...}}]}}``.

What real GKE does that this does not: node pool create/delete/update, autoscaling, upgrades, surge; the node
objects themselves (the harness's reconciler plays the cloud controller manager: clouds/nodes.py).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
import uuid
from typing import Any

from werkzeug.wrappers import Request
from werkzeug.wrappers import Response

from tests.harness.clouds.fake import ApiError
from tests.harness.clouds.fake import json_response

GCE = "https://www.googleapis.com/compute/v1"
GKE = "https://container.googleapis.com/v1"
CONTAINER = re.compile(r"^/v1/projects/(?P<p>[^/]+)/locations/(?P<l>[^/]+)/(?P<rest>.+)$")
MIG = re.compile(r"zones/(?P<zone>[^/]+)/instanceGroupManagers/(?P<mig>[^/]+)(/(?P<verb>listManagedInstances|"
                 r"deleteInstances|resize))?")


def gke_error(status: int, state: str, message: str, reason: str = "") -> ApiError:
    """A google.rpc.Status as the JSON transcoding of GKE answers it (ErrorInfo in ``details``)."""
    err: dict[str, Any] = {"code": status, "message": message, "status": state}
    if reason:
        err["details"] = [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": reason,
                           "domain": "container.googleapis.com"}]
    return ApiError(status, {"error": err})


class NodePools:
    """Mixed into ComputeEngine: it owns ``instances``, ``operations`` (zone operations), ``lock`` and ``faults``."""

    instances: dict[tuple[str, str, str], dict[str, Any]]
    operations: dict[str, dict[str, Any]]
    faults: dict[str, Any]
    _ids: Any

    def reset_gke(self) -> None:
        self.clusters: dict[tuple[str, str, str], dict[str, Any]] = {}  # (project, location, cluster)
        self.pools: dict[tuple[str, str, str, str], dict[str, Any]] = {}  # + pool
        self.migs: dict[tuple[str, str, str], dict[str, Any]] = {}  # (project, zone, mig)
        self.gke_operations: dict[str, dict[str, Any]] = {}
        self.deleted: list[dict[str, Any]] = []  # every instance a MIG removed: {zone, instance, via}

    # -- seeding -------------------------------------------------------------------------------------------
    def seed_gke(self, spec: dict[str, Any]) -> dict[str, Any]:
        project, location, cluster = spec["project"], spec["location"], spec["cluster"]
        self.clusters[(project, location, cluster)] = {"name": cluster, "location": location}
        out = {}
        for np in spec.get("nodePools", []):
            name = np["name"]
            digest = hashlib.sha256(f"{project}/{cluster}/{name}".encode()).hexdigest()[:8]
            base = f"gke-{cluster}-{name}-{digest}"[:54]
            urls = []
            for zone in np["zones"]:
                mig = f"{base}-grp"
                self.migs[(project, zone, mig)] = {
                    "kind": "compute#instanceGroupManager", "id": str(next(self._ids)), "name": mig,
                    "zone": f"{GCE}/projects/{project}/zones/{zone}", "baseInstanceName": base, "targetSize": 0,
                    "instanceTemplate": f"{GCE}/projects/{project}/global/instanceTemplates/{base}",
                    "instanceGroup": f"{GCE}/projects/{project}/zones/{zone}/instanceGroups/{mig}",
                    "selfLink": f"{GCE}/projects/{project}/zones/{zone}/instanceGroupManagers/{mig}",
                    "_pool": (project, location, cluster, name), "_machine": np["machineType"],
                    "_labels": dict(np.get("labels", {}))}
                urls.append(self.migs[(project, zone, mig)]["selfLink"])
                self._resize_mig((project, zone, mig), int(np.get("nodeCount", 0)), "seed", running=True)
            self.pools[(project, location, cluster, name)] = {
                "name": name, "config": {"machineType": np["machineType"], "labels": np.get("labels", {}),
                                         "taints": np.get("taints", [])},
                **({"autoscaling": np["autoscaling"]} if "autoscaling" in np else {}),
                "initialNodeCount": int(np.get("nodeCount", 0)), "locations": list(np["zones"]),
                "instanceGroupUrls": urls, "status": "RUNNING", "version": "1.33.5-gke.1000",
                "selfLink": f"{GKE}/projects/{project}/locations/{location}/clusters/{cluster}/nodePools/{name}"}
            out[name] = urls
        return out

    # -- the MIGs' instances -------------------------------------------------------------------------------
    def members(self, key: tuple[str, str, str]) -> list[dict[str, Any]]:
        project, zone, _ = key
        base = self.migs[key]["baseInstanceName"]
        return [i for (p, z, n), i in sorted(self.instances.items())
                if p == project and z == zone and n.startswith(base + "-")]

    def _resize_mig(self, key: tuple[str, str, str], size: int, via: str, *, running: bool = False) -> None:
        project, zone, _ = key
        mig = self.migs[key]
        mig["targetSize"] = size
        alive = [i for i in self.members(key) if i["status"] != "STOPPING"]
        _, _, cluster, pool = mig["_pool"]
        while len(alive) < size:
            name = f"{mig['baseInstanceName']}-{secrets.token_hex(2)}"
            if (project, zone, name) in self.instances:
                continue
            self.instances[(project, zone, name)] = {
                "kind": "compute#instance", "id": str(next(self._ids)), "name": name,
                "status": "RUNNING" if running else "PROVISIONING",
                "zone": f"{GCE}/projects/{project}/zones/{zone}",
                "machineType": f"{GCE}/projects/{project}/zones/{zone}/machineTypes/{mig['_machine']}",
                "labels": {"goog-k8s-cluster-name": cluster, "goog-k8s-node-pool-name": pool},
                "metadata": {"kind": "compute#metadata", "items": [
                    {"key": "created-by", "value": mig["selfLink"].split("/compute/v1/", 1)[1]}]},
                "selfLink": f"{GCE}/projects/{project}/zones/{zone}/instances/{name}"}
            alive.append(self.instances[(project, zone, name)])
        for victim in alive[size:]:  # a shrink the caller let the cloud choose
            self.instances.pop((project, zone, victim["name"]), None)
            self.deleted.append({"zone": zone, "instance": victim["name"], "via": via})

    def _boot(self, key: tuple[str, str, str]) -> None:
        for inst in self.members(key):
            if inst["status"] == "PROVISIONING":
                inst["status"] = "RUNNING"

    # -- time passes -------------------------------------------------------------------------------------
    def advance_gke(self, now: float) -> None:
        for op in self.gke_operations.values():
            if op["status"] == "DONE" or op["_done_at"] > now:
                continue
            op["status"], op["progress"], op["endTime"] = "DONE", {"status": "DONE"}, _now()
            if op.get("_error"):
                op["error"] = {"code": 13, "message": op.pop("_error")}
                op["statusMessage"] = op["error"]["message"]
            else:
                op.pop("_apply")()

    def mig_operation(self, project: str, zone: str, kind: str, mig: str, apply: Any) -> dict[str, Any]:
        """A zone operation on a MIG; ``apply`` runs when it is DONE (ComputeEngine._advance)."""
        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name,
              "zone": f"{GCE}/projects/{project}/zones/{zone}", "operationType": kind,
              "targetLink": f"{GCE}/projects/{project}/zones/{zone}/instanceGroupManagers/{mig}",
              "targetId": self.migs[(project, zone, mig)]["id"], "status": "RUNNING", "progress": 0,
              "insertTime": _now(), "startTime": _now(),
              "selfLink": f"{GCE}/projects/{project}/zones/{zone}/operations/{name}",
              "_done_at": time.time() + float(self.faults.get("operation_seconds", 0)), "_instance": None,
              "_apply": apply}
        self.operations[name] = op
        return op

    # -- compute routes ----------------------------------------------------------------------------------
    def route_mig(self, project: str, m: re.Match[str], request: Request, body: Any) -> Response:
        zone, name, verb = m.group("zone"), m.group("mig"), m.group("verb")
        key = (project, zone, name)
        if key not in self.migs:
            raise ApiError(404, {"error": {"code": 404, "message": f"The resource 'projects/{project}/zones/{zone}/"
                                 f"instanceGroupManagers/{name}' was not found", "errors": [
                                     {"domain": "global", "reason": "notFound", "message": "not found"}]}})
        mig = self.migs[key]
        if request.method == "GET" and not verb:
            return json_response({k: v for k, v in mig.items() if not k.startswith("_")} | {
                "currentActions": self._actions(key)})
        if verb == "listManagedInstances" and request.method == "POST":
            return json_response({"managedInstances": [
                {"instance": i["selfLink"], "id": i["id"], "name": i["name"],
                 "instanceStatus": i["status"] if i["status"] != "STOPPING" else "STOPPING",
                 "currentAction": {"PROVISIONING": "CREATING", "STOPPING": "DELETING"}.get(i["status"], "NONE")}
                for i in self.members(key)]})
        if verb == "deleteInstances" and request.method == "POST":
            wanted = [str(u).rsplit("/", 1)[-1] for u in (body or {}).get("instances", [])]
            members = {i["name"]: i for i in self.members(key)}
            missing = [w for w in wanted if w not in members]
            if missing and not (body or {}).get("skipInstancesOnValidationError"):
                raise ApiError(400, {"error": {"code": 400, "message": f"Instance '{missing[0]}' is not a member "
                                     f"of '{name}'.", "errors": [{"domain": "global", "reason": "invalid",
                                                                  "message": "not a member"}]}})
            victims = [w for w in wanted if w in members and members[w]["status"] != "STOPPING"]
            mig["targetSize"] = max(0, mig["targetSize"] - len(victims))
            for v in victims:
                members[v]["status"] = "STOPPING"

            def gone() -> None:
                for v in victims:
                    if self.instances.pop((project, zone, v), None) is not None:
                        self.deleted.append({"zone": zone, "instance": v, "via": "deleteInstances"})

            op = self.mig_operation(project, zone, "compute.instanceGroupManagers.deleteInstances", name, gone)
            answer = {k: v for k, v in op.items() if not k.startswith("_")}
            self.slow_answer("slow_remove_seconds")  # type: ignore[attr-defined]  # FakeCloud's
            return json_response(answer)
        if verb == "resize" and request.method == "POST":
            size = int(request.args.get("size", -1))
            if size < 0:
                raise ApiError(400, {"error": {"code": 400, "message": "Invalid value for field 'size'", "errors": [
                    {"domain": "global", "reason": "invalid", "message": "size"}]}})
            self._resize_mig(key, size, "resize")
            op = self.mig_operation(project, zone, "compute.instanceGroupManagers.resize", name,
                                    lambda: self._boot(key))
            return json_response({k: v for k, v in op.items() if not k.startswith("_")})
        raise ApiError(405, {"error": {"code": 405, "message": f"{request.method} not allowed"}})

    def _actions(self, key: tuple[str, str, str]) -> dict[str, int]:
        states = [i["status"] for i in self.members(key)]
        return {"creating": states.count("PROVISIONING"), "deleting": states.count("STOPPING"),
                "none": states.count("RUNNING")}

    # -- container routes --------------------------------------------------------------------------------
    def route_container(self, request: Request, body: Any) -> Response:
        m = CONTAINER.match(request.path)
        if not m:
            raise gke_error(404, "NOT_FOUND", f"Not found: {request.path}")
        project, location, rest = m.group("p"), m.group("l"), m.group("rest")
        if mo := re.fullmatch(r"operations/([^/]+)", rest):
            op = self.gke_operations.get(mo.group(1))
            if op is None or op["_where"] != (project, location):
                raise gke_error(404, "NOT_FOUND", f"Not found: operation {mo.group(1)}.")
            return json_response(_public(op))
        mc = re.fullmatch(r"clusters/(?P<c>[^/]+)/nodePools(/(?P<np>[^/:]+)(?P<verb>:setSize)?)?", rest)
        if not mc:
            raise gke_error(404, "NOT_FOUND", f"Not found: {request.path}")
        cluster, pool = mc.group("c"), mc.group("np")
        if (project, location, cluster) not in self.clusters:
            raise gke_error(404, "NOT_FOUND", f"Not found: projects/{project}/locations/{location}/clusters/"
                            f"{cluster}.")
        if not pool and request.method == "GET":
            pools = [self._pool(k) for k in sorted(self.pools) if k[:3] == (project, location, cluster)]
            return json_response({"nodePools": pools})
        key = (project, location, cluster, str(pool))
        if key not in self.pools:
            raise gke_error(404, "NOT_FOUND", f"Not found: projects/{project}/locations/{location}/clusters/"
                            f"{cluster}/nodePools/{pool}.")
        if request.method == "GET" and not mc.group("verb"):
            return json_response(self._pool(key))
        if request.method == "POST" and mc.group("verb") == ":setSize":
            return json_response(_public(self._set_size(key, int((body or {}).get("nodeCount", 0)))))
        raise gke_error(405, "UNIMPLEMENTED", f"{request.method} {request.path} is not implemented here")

    def _pool(self, key: tuple[str, str, str, str]) -> dict[str, Any]:
        pool = dict(self.pools[key])
        pool["status"] = "RECONCILING" if self._running(key[:3]) else "RUNNING"
        return pool

    def _running(self, cluster: tuple[str, str, str]) -> dict[str, Any] | None:
        return next((op for op in self.gke_operations.values()
                     if op["_cluster"] == cluster and op["status"] != "DONE"), None)

    def _set_size(self, key: tuple[str, str, str, str], count: int) -> dict[str, Any]:
        project, location, cluster, pool = key
        if (n := int(self.faults.get("gke_429", 0))) > 0:
            self.faults["gke_429"] = n - 1
            raise gke_error(429, "RESOURCE_EXHAUSTED", "Insufficient quota to satisfy the request: the concurrent "
                            "operations quota of 5 for this cluster is exhausted.")
        if running := self._running(key[:3]):
            raise gke_error(400, "FAILED_PRECONDITION", f"Cluster is running incompatible operation "
                            f"{running['name']}.", reason="CLUSTER_ALREADY_HAS_OPERATION")
        migs = [(project, url.split("/zones/")[1].split("/")[0], url.rsplit("/", 1)[-1])
                for url in self.pools[key]["instanceGroupUrls"]]

        def apply() -> None:
            for mig in migs:
                self._resize_mig(mig, count, "setSize")
                self._boot(mig)

        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:8]}"
        where = f"projects/{project}/locations/{location}"
        op = {"name": name, "zone": location, "operationType": "SET_NODE_POOL_SIZE", "status": "RUNNING",
              "selfLink": f"{GKE}/{where}/operations/{name}",
              "targetLink": f"{GKE}/{where}/clusters/{cluster}/nodePools/{pool}", "startTime": _now(),
              "_done_at": time.time() + float(self.faults.get("operation_seconds", 0)), "_cluster": key[:3],
              "_where": (project, location), "_apply": apply}
        if err := self.faults.pop("gke_operation_error", None):
            op["_error"] = err.get("message", "Internal error.")
        self.gke_operations[name] = op
        self.advance_gke(time.time())
        return op


def _public(op: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in op.items() if not k.startswith("_")}


def _now() -> str:
    from datetime import UTC
    from datetime import datetime

    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
