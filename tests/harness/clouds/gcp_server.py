"""A local Compute Engine API (compute/v1, the REST shapes google-cloud-compute's REST transport sends and parses;
see shared notes clouds.md): instances insert/get/list/aggregatedList/delete, zone operations get/wait,
machineTypes list/aggregatedList, regions get. Instances live in memory.

Faults (``FakeServer.fault``): ``stockout_zones`` (an insert's operation ends DONE with
ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS, as GCE reports a stockout), ``quota`` ({"metric": "NVIDIA_L4_GPUS",
"in_operation": false}: a 403 quotaExceeded, or the operation's QUOTA_EXCEEDED), ``done_error_only`` (the
operation ends DONE with only ``error`` set: no httpErrorStatusCode), plus the shared ones (fake.py).

An instance "boots" when its insert operation is done: it is RUNNING and its ``user-data`` metadata is what the
booter (tests/harness/clouds/boot.py) joins the cluster with.

GKE node pools and their managed instance groups live here too (the Kubernetes Engine API under ``/v1/``, the
MIGs under compute): see gke.py.

    python -m tests.harness.clouds.gcp_server --port 8470
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from datetime import UTC
from datetime import datetime
from typing import Any

from werkzeug.wrappers import Request
from werkzeug.wrappers import Response

from tests.harness.clouds.fake import ApiError
from tests.harness.clouds.fake import FakeCloud
from tests.harness.clouds.fake import json_response
from tests.harness.clouds.fake import serve
from tests.harness.clouds.gke import MIG
from tests.harness.clouds.gke import NodePools

GCE = "https://www.googleapis.com/compute/v1"
ZONES = {
    "europe-west4": ["europe-west4-a", "europe-west4-b", "europe-west4-c"],
    "us-central1": ["us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"],
}
# name -> (vCPUs, memory MiB, accelerator, count): what machineTypes answers (accelerators per the GCE docs).
MACHINE_TYPES: dict[str, tuple[int, int, str, int]] = {
    **{f"g2-standard-{n}": (n, n * 4 * 1024, "nvidia-l4", g)
       for n, g in ((4, 1), (8, 1), (12, 1), (16, 1), (24, 2), (32, 1), (48, 4))},
    **{f"a2-highgpu-{g}g": (12 * g, 85 * g * 1024, "nvidia-tesla-a100", g) for g in (1, 2, 4, 8)},
    "a3-highgpu-8g": (208, 1872 * 1024, "nvidia-h100-80gb", 8),
    "e2-standard-4": (4, 16 * 1024, "", 0),
}
PATH = re.compile(r"^/compute/v1/projects/(?P<project>[^/]+)/(?P<rest>.+)$")


def error(status: int, reason: str, message: str, domain: str = "global") -> ApiError:
    return ApiError(status, {"error": {"code": status, "message": message,
                                       "errors": [{"message": message, "domain": domain, "reason": reason}]}})


# -- the filter language of list calls (AIP-160 subset and the regex form) ---------------------------------------
_TOKEN = re.compile(r"""\s*(?:(?P<paren>[()])|(?P<word>AND\b|OR\b)|
    (?P<field>[a-zA-Z_][\w.\-]*)\s*(?P<op>!=|=|:|\beq\b|\bne\b)\s*(?P<value>"[^"]*"|'[^']*'|[^\s()]+))""", re.X)


def _field(obj: dict[str, Any], name: str) -> Any:
    if name.startswith("labels."):
        return obj.get("labels", {}).get(name[len("labels."):])
    value = obj.get(name)
    return value.rsplit("/", 1)[-1] if isinstance(value, str) and name in ("zone", "machineType") else value


def parse_filter(text: str) -> Any:
    """A predicate on one resource; unknown syntax is a 400, as GCE answers it."""
    tokens: list[tuple[str, Any]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise error(400, "invalid", f"Invalid value for field 'filter': '{text}'. Invalid list filter expression.")
        pos = m.end()
        if m.group("paren"):
            tokens.append((m.group("paren"), None))
        elif m.group("word"):
            tokens.append((m.group("word"), None))
        else:
            value = m.group("value")
            if value[:1] in "\"'":
                value = value[1:-1]
            tokens.append(("term", (m.group("field"), m.group("op"), value)))
    it = iter([*tokens, ("end", None)])
    current = [next(it)]

    def take() -> tuple[str, Any]:
        tok = current[0]
        current[0] = next(it)
        return tok

    def term() -> Any:
        kind, val = take()
        if kind == "(":
            inner = expr()
            if take()[0] != ")":
                raise error(400, "invalid", f"Invalid list filter expression: '{text}'")
            return inner
        if kind != "term":
            raise error(400, "invalid", f"Invalid list filter expression: '{text}'")
        name, op, value = val

        def match(obj: dict[str, Any]) -> bool:
            got = _field(obj, name)
            if op == ":":
                return got is not None and (value == "*" or str(got) == value)
            if op in ("eq", "ne"):
                hit = got is not None and re.fullmatch(value, str(got)) is not None
                return hit if op == "eq" else not hit
            hit = got is not None and str(got) == value
            return hit if op == "=" else not hit

        return match

    def conj() -> Any:
        parts = [term()]
        while current[0][0] in ("AND", "(", "term"):
            if current[0][0] == "AND":
                take()
            parts.append(term())
        return lambda obj: all(p(obj) for p in parts)

    def expr() -> Any:
        parts = [conj()]
        while current[0][0] == "OR":
            take()
            parts.append(conj())
        return lambda obj: any(p(obj) for p in parts)

    predicate = expr()
    if current[0][0] != "end":
        raise error(400, "invalid", f"Invalid list filter expression: '{text}'")
    return predicate


def page(items: list[Any], args: Any) -> tuple[list[Any], str | None]:
    size = min(int(args.get("maxResults", 500)), 500)
    start = int(args.get("pageToken") or 0)
    nxt = start + size
    return items[start:nxt], (str(nxt) if nxt < len(items) else None)


class ComputeEngine(NodePools, FakeCloud):
    def reset(self) -> None:
        super().reset()
        with self.lock:
            self.instances: dict[tuple[str, str, str], dict[str, Any]] = {}  # (project, zone, name)
            self.user_data: dict[str, str] = {}  # instance id -> user data
            self.operations: dict[str, dict[str, Any]] = {}
            self.request_ids: dict[str, str] = {}
            self._ids = itertools.count(4_000_000_000_000_000_001)
            self.reset_gke()

    def server_error(self, status: int) -> ApiError:
        return error(status, "backendError", "Internal error. Please try again or contact Google Support.")

    def state(self) -> dict[str, Any]:
        with self.lock:
            self._advance()
            return {"instances": [dict(inst, userData=self.user_data.get(inst["id"], ""))
                                  for inst in self.instances.values()],
                    "nodePools": [dict(pool, cluster=k[2], project=k[0]) for k, pool in self.pools.items()],
                    "deleted": list(self.deleted)}

    def seed(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return self.seed_gke(body["gke"])

    def metadata(self, instance: str, path: str, request: Request) -> Response:
        """The GCE metadata server's instance identity token for ``instance`` (its project, zone, ID and name)."""
        if path != "/computeMetadata/v1/instance/service-accounts/default/identity":
            raise error(404, "notFound", f"no metadata at {path}")
        if request.headers.get("Metadata-Flavor") != "Google":
            raise error(403, "forbidden", "Missing Metadata-Flavor:Google header.")
        inst = next((i for i in self.instances.values() if i["id"] == instance), None)
        if inst is None:
            raise error(404, "notFound", f"no instance {instance}")
        project, _, zone, _, name = inst["selfLink"].split("/projects/", 1)[1].split("/")
        token = self.identity_ca.gcp(zone=zone, audience=request.args.get("audience", ""), project=project,
                                     instance_id=instance, instance_name=name).document
        return Response(token, content_type="text/plain")

    # -- time passes: operations finish ------------------------------------------------------------------------
    def _advance(self) -> None:
        now = time.time()
        for op in self.operations.values():
            if op["status"] == "DONE" or op["_done_at"] > now:
                continue
            op["status"], op["progress"], op["endTime"] = "DONE", 100, _now()
            key = op["_instance"]
            if op.get("_apply"):  # a managed instance group's operation (gke.py)
                op.pop("_apply")()
            elif op.get("_fail"):
                op.update(op.pop("_fail"))
                self.instances.pop(key, None)
            elif op["operationType"] == "insert" and key in self.instances:
                self.instances[key]["status"] = "RUNNING"
            elif op["operationType"] == "delete":
                self.instances.pop(key, None)
        self.advance_gke(now)

    def _operation(self, project: str, zone: str, kind: str, key: tuple[str, str, str],
                   fail: dict[str, Any] | None = None) -> dict[str, Any]:
        name = f"operation-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
        seconds = float(self.faults.get("operation_seconds", 0))
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name,
              "zone": f"{GCE}/projects/{project}/zones/{zone}", "operationType": kind,
              "targetLink": f"{GCE}/projects/{project}/zones/{zone}/instances/{key[2]}",
              "targetId": self.instances[key]["id"] if key in self.instances else "",
              "status": "RUNNING", "progress": 0, "insertTime": _now(), "startTime": _now(),
              "selfLink": f"{GCE}/projects/{project}/zones/{zone}/operations/{name}",
              "user": "kubeon-burst@test.iam.gserviceaccount.com",
              "_done_at": time.time() + (0 if fail else seconds), "_instance": key}
        if fail:
            op["_fail"] = fail
        self.operations[name] = op
        self._advance()
        return op

    @staticmethod
    def _public(op: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in op.items() if not k.startswith("_")}

    # -- routes ----------------------------------------------------------------------------------------------
    def route(self, request: Request, body: Any) -> Response:
        if request.path.startswith("/v1/"):  # the Kubernetes Engine API (gke.py)
            with self.lock:
                self._advance()
                return self.route_container(request, body)
        m = PATH.match(request.path)
        if not m:
            raise error(404, "notFound", f"The requested URL {request.path} was not found on this server.")
        project, rest = m.group("project"), m.group("rest")
        method = request.method
        with self.lock:
            self._advance()
            if rest == "aggregated/instances" and method == "GET":
                return self._aggregated(project, request.args, "instances", self._instances(project))
            if rest == "aggregated/machineTypes" and method == "GET":
                return self._aggregated(project, request.args, "machineTypes", self._machine_types(project))
            if m2 := re.fullmatch(r"regions/([^/]+)", rest):
                return json_response(self._region(project, m2.group(1)))
            if mig := MIG.fullmatch(rest):
                return self.route_mig(project, mig, request, body)
            if not (mz := re.fullmatch(r"zones/(?P<zone>[^/]+)/(?P<kind>[a-zA-Z]+)(/(?P<name>[^/]+))?(?P<wait>/wait)?",
                                       rest)):
                raise error(404, "notFound", f"The requested URL {request.path} was not found on this server.")
            zone, kind, name = mz.group("zone"), mz.group("kind"), mz.group("name")
            if not any(zone in zones for zones in ZONES.values()):
                raise error(400, "invalid", f"Invalid value for field 'zone': '{zone}'. Unknown zone.")
            if kind == "machineTypes" and method == "GET" and not name:
                items = [mt for mt in self._machine_types(project) if mt["zone"] == zone]
                return self._list(request.args, "compute#machineTypeList", items)
            if kind == "operations" and name:
                return self._wait(project, zone, name, wait=bool(mz.group("wait")))
            if kind == "instances":
                if method == "POST" and not name:
                    return self._insert(project, zone, request.args.get("requestId", ""), body or {})
                if method == "GET" and not name:
                    items = [i for (p, z, _), i in self.instances.items() if p == project and z == zone]
                    return self._list(request.args, "compute#instanceList", items)
                if method == "GET":
                    return json_response(self._get(project, zone, name))
                if method == "DELETE":
                    return self._delete(project, zone, name, request.args.get("requestId", ""))
        raise error(404, "notFound", f"The requested URL {request.path} was not found on this server.")

    def _region(self, project: str, region: str) -> dict[str, Any]:
        if region not in ZONES:
            raise error(404, "notFound", f"The resource 'projects/{project}/regions/{region}' was not found")
        return {"kind": "compute#region", "name": region, "status": "UP",
                "zones": [f"{GCE}/projects/{project}/zones/{z}" for z in ZONES[region]],
                "selfLink": f"{GCE}/projects/{project}/regions/{region}"}

    def _machine_types(self, project: str) -> list[dict[str, Any]]:
        missing = self.faults.get("missing_machine_types", {})  # zone -> [names] not offered there
        out = []
        for zones in ZONES.values():
            for zone in zones:
                for name, (cpus, mem, acc, count) in MACHINE_TYPES.items():
                    if name in missing.get(zone, []):
                        continue
                    mt: dict[str, Any] = {
                        "kind": "compute#machineType", "id": str(abs(hash((zone, name))) % 10**15), "name": name,
                        "guestCpus": cpus, "memoryMb": mem, "zone": zone, "isSharedCpu": False,
                        "selfLink": f"{GCE}/projects/{project}/zones/{zone}/machineTypes/{name}"}
                    if acc:
                        mt["accelerators"] = [{"guestAcceleratorType": acc, "guestAcceleratorCount": count}]
                    out.append(mt)
        return out

    def _instances(self, project: str) -> list[dict[str, Any]]:
        return [i for (p, _, _), i in self.instances.items() if p == project]

    def _filtered(self, items: list[dict[str, Any]], args: Any) -> list[dict[str, Any]]:
        text = args.get("filter", "")
        if not text:
            return items
        predicate = parse_filter(text)
        return [i for i in items if predicate(i)]

    def _list(self, args: Any, kind: str, items: list[dict[str, Any]]) -> Response:
        items, token = page(self._filtered(items, args), args)
        out: dict[str, Any] = {"kind": kind, "items": items}
        if token:
            out["nextPageToken"] = token
        return json_response(out)

    def _aggregated(self, project: str, args: Any, key: str, items: list[dict[str, Any]]) -> Response:
        items, token = page(self._filtered(items, args), args)
        scopes: dict[str, Any] = {}
        for item in items:
            zone = str(item["zone"]).rsplit("/", 1)[-1]
            scopes.setdefault(f"zones/{zone}", {key: []})[key].append(item)
        for zones in ZONES.values():
            for zone in zones:
                scopes.setdefault(f"zones/{zone}", {"warning": {
                    "code": "NO_RESULTS_ON_PAGE", "message": "There are no results for scope 'zones/"
                    f"{zone}' on this page.", "data": [{"key": "scope", "value": f"zones/{zone}"}]}})
        out: dict[str, Any] = {"kind": f"compute#{key[:-1]}AggregatedList", "items": scopes}
        if token:
            out["nextPageToken"] = token
        return json_response(out)

    def _get(self, project: str, zone: str, name: str) -> dict[str, Any]:
        inst = self.instances.get((project, zone, name))
        if inst is None:
            raise error(404, "notFound",
                        f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found")
        return inst

    def _wait(self, project: str, zone: str, name: str, *, wait: bool) -> Response:
        op = self.operations.get(name)
        if op is None or not str(op["zone"]).endswith(f"/projects/{project}/zones/{zone}"):
            raise error(404, "notFound", f"The resource 'projects/{project}/zones/{zone}/operations/{name}' "
                        "was not found")
        if wait:  # like GCE: return when DONE, or after a while (here at most 2 s) with the current status
            deadline = time.time() + 2
            while op["status"] != "DONE" and time.time() < deadline:
                self.lock.release()
                try:
                    time.sleep(0.05)
                finally:
                    self.lock.acquire()
                self._advance()
        return json_response(self._public(op))

    def _insert(self, project: str, zone: str, request_id: str, body: dict[str, Any]) -> Response:
        if request_id and request_id in self.request_ids:  # a retried insert: the same operation
            return json_response(self._public(self.operations[self.request_ids[request_id]]))
        name = str(body.get("name", ""))
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name):
            raise error(400, "invalid", f"Invalid value for field 'resource.name': '{name}'. Must be a match of regex "
                        "'(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?|[1-9][0-9]{0,19})'")
        machine = str(body.get("machineType", "")).rsplit("/", 1)[-1]
        if machine not in MACHINE_TYPES or machine in self.faults.get("missing_machine_types", {}).get(zone, []):
            raise error(400, "invalid", f"Invalid value for field 'resource.machineType': "
                        f"'{body.get('machineType')}'. Machine type with name '{machine}' does not exist in zone "
                        f"'{zone}'.")
        if MACHINE_TYPES[machine][3] and body.get("scheduling", {}).get("onHostMaintenance") != "TERMINATE":
            raise error(400, "badRequest", "Instances with guest accelerators do not support live migration.")
        for key, value in body.get("labels", {}).items():
            if not re.fullmatch(r"[a-z][\w-]{0,62}", key) or not re.fullmatch(r"[\w-]{0,63}", value) \
                    or key.lower() != key or value.lower() != value:
                raise error(400, "invalid", f"Invalid value for field 'resource.labels': '{key}={value}'")
        if (project, zone, name) in self.instances:
            raise error(409, "alreadyExists",
                        f"The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists")
        quota = self.faults.get("quota")
        region = zone.rsplit("-", 1)[0]
        if quota and not quota.get("in_operation"):
            raise error(403, "quotaExceeded", f"Quota '{quota['metric']}' exceeded.  Limit: 0.0 in region {region}.",
                        domain="usageLimits")
        fail: dict[str, Any] | None = None
        if zone in self.faults.get("stockout_zones", []):
            fail = {"httpErrorStatusCode": 503, "httpErrorMessage": "SERVICE UNAVAILABLE", "error": {"errors": [{
                "code": "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                "message": f"The zone 'projects/{project}/zones/{zone}' does not have enough resources available to "
                           "fulfill the request.  '(resource type:compute)'."}]}}
        elif quota:
            fail = {"httpErrorStatusCode": 403, "httpErrorMessage": "FORBIDDEN", "error": {"errors": [{
                "code": "QUOTA_EXCEEDED",
                "message": f"Quota '{quota['metric']}' exceeded.  Limit: 0.0 in region {region}."}]}}
        elif self.faults.get("done_error_only"):
            fail = {"error": {"errors": [{"code": "RESOURCE_OPERATION_RATE_EXCEEDED",
                                          "message": "Operation rate exceeded for resource."}]}}
        iid = str(next(self._ids))
        metadata = body.get("metadata", {}).get("items", [])
        self.user_data[iid] = next((i["value"] for i in metadata if i["key"] == "user-data"), "")
        self.instances[(project, zone, name)] = {
            **body, "kind": "compute#instance", "id": iid, "name": name, "status": "PROVISIONING",
            "zone": f"{GCE}/projects/{project}/zones/{zone}",
            "machineType": f"{GCE}/projects/{project}/zones/{zone}/machineTypes/{machine}",
            "creationTimestamp": _now(), "cpuPlatform": "Intel Cascade Lake",
            "metadata": {**body.get("metadata", {}), "fingerprint": uuid.uuid4().hex[:12], "kind": "compute#metadata"},
            "networkInterfaces": [{**nic, "name": f"nic{n}", "networkIP": f"10.164.0.{len(self.instances) % 250 + 2}"}
                                  for n, nic in enumerate(body.get("networkInterfaces", [{}]))],
            "selfLink": f"{GCE}/projects/{project}/zones/{zone}/instances/{name}",
        }
        op = self._operation(project, zone, "insert", (project, zone, name), fail)
        if request_id:
            self.request_ids[request_id] = op["name"]
        public = self._public(op)
        self.lock.release()
        try:
            self.slow_create()
        finally:
            self.lock.acquire()
        return json_response(public)

    def _delete(self, project: str, zone: str, name: str, request_id: str) -> Response:
        if request_id and request_id in self.request_ids:
            return json_response(self._public(self.operations[self.request_ids[request_id]]))
        inst = self._get(project, zone, name)
        inst["status"] = "STOPPING"
        op = self._operation(project, zone, "delete", (project, zone, name))
        if request_id:
            self.request_ids[request_id] = op["name"]
        return json_response(self._public(op))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "-00:00")


app = ComputeEngine()

if __name__ == "__main__":
    serve(app)
