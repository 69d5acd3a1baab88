"""A local Azure Resource Manager for Microsoft.Compute virtual machines (the REST shapes azure-mgmt-compute sends
and parses; see shared notes clouds.md), served over HTTPS with a certificate made by trustme, so the client's
real bearer-token policy runs. VMs live in memory.

* PUT/GET/DELETE .../resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines/{vm} (201/202 with
  Azure-AsyncOperation + Retry-After; the operation status at .../locations/{loc}/operations/{id}), GET
  .../virtualMachines (nextLink pages), GET .../virtualMachines/{vm}/instanceView, GET .../Microsoft.Compute/skus.
* Every ARM request needs ``Authorization: Bearer <token>`` with a token the identity endpoint issued.
* The identity endpoint (plain HTTP on its own port, as App Service's is): ``GET /msi/token?resource=&client_id=``
  with ``X-IDENTITY-HEADER``, what azure-identity's ManagedIdentityCredential calls with IDENTITY_ENDPOINT set.

Faults: ``sku_not_available`` ([sizes]: a synchronous 409 SkuNotAvailable), ``allocation_failed_zones`` ([zones]:
the create's operation fails with ZonalAllocationFailed, the VM stays, Failed, as Azure leaves it),
``allocation_failed`` (AllocationFailed, any zone; ``allocation_failed_locations``: in those regions),
``quota`` ({"family": ...}: 409 OperationNotAllowed), plus the
shared ones (fake.py). A VM "boots" when its create operation succeeds: PowerState/running, its customData
is what the booter joins with.

AKS agent pools and their machines live here too (Microsoft.ContainerService): see aks.py.

    python -m tests.harness.clouds.azure_server --port 8471 --identity-port 8472 --tls-dir .kubeon/dev/azure
"""

from __future__ import annotations

import base64
import re
import threading
import time
import uuid
from datetime import UTC
from datetime import datetime
from typing import Any

from werkzeug.wrappers import Request
from werkzeug.wrappers import Response

from tests.harness.clouds.aks import AKS
from tests.harness.clouds.aks import AgentPools
from tests.harness.clouds.fake import ApiError
from tests.harness.clouds.fake import FakeCloud
from tests.harness.clouds.fake import json_response

IDENTITY_HEADER = "kubeon-dev-identity"
SIZES: dict[str, tuple[str, int, int, int]] = {  # name -> (family, vCPUs, memory GB, GPUs)
    "Standard_NC4as_T4_v3": ("standardNCASv3_T4Family", 4, 28, 1),
    "Standard_NC8as_T4_v3": ("standardNCASv3_T4Family", 8, 56, 1),
    "Standard_NC16as_T4_v3": ("standardNCASv3_T4Family", 16, 110, 1),
    "Standard_NC64as_T4_v3": ("standardNCASv3_T4Family", 64, 440, 4),
    "Standard_NV36ads_A10_v5": ("StandardNVADSA10v5Family", 36, 440, 1),
    "Standard_NV72ads_A10_v5": ("StandardNVADSA10v5Family", 72, 880, 2),
    "Standard_NC24ads_A100_v4": ("StandardNCADSA100v4Family", 24, 220, 1),
    "Standard_NC48ads_A100_v4": ("StandardNCADSA100v4Family", 48, 440, 2),
    "Standard_NC96ads_A100_v4": ("StandardNCADSA100v4Family", 96, 880, 4),
    "Standard_ND96isr_H100_v5": ("standardNDSH100v5Family", 96, 1900, 8),
    "Standard_D4s_v5": ("standardDSv5Family", 4, 16, 0),
}
LOCATIONS = {"westeurope": ["1", "2", "3"], "eastus": ["1", "2", "3"], "northeurope": ["1", "2", "3"]}
RG = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.Compute/"
                r"virtualMachines(/(?P<vm>[^/]+))?(?P<view>/instanceView)?$", re.I)
OPS = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/Microsoft\.(Compute|ContainerService)/"
                 r"locations/(?P<loc>[^/]+)/operations/(?P<op>[^/]+)$", re.I)
SKUS = re.compile(r"^/subscriptions/(?P<sub>[^/]+)/providers/Microsoft\.Compute/skus$", re.I)


def arm_error(status: int, code: str, message: str) -> ApiError:
    return ApiError(status, {"error": {"code": code, "message": message}})


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


class ResourceManager(AgentPools, FakeCloud):
    def reset(self) -> None:
        super().reset()
        with self.lock:
            self.faults["retry_after"] = 1
            self.faults["page_size"] = 50
            self.vms: dict[tuple[str, str, str], dict[str, Any]] = {}  # (subscription, rg, name lowercased)
            self.custom_data: dict[str, str] = {}  # vmId -> decoded customData
            self.operations: dict[str, dict[str, Any]] = {}
            self.tokens: dict[str, str] = {}  # token -> client id
            self.reset_aks()

    def server_error(self, status: int) -> ApiError:
        return arm_error(status, "InternalServerError", "Encountered internal server error. Diagnostic information: "
                         f"timestamp '{_now()}', tracking id '{uuid.uuid4()}'.")

    def state(self) -> dict[str, Any]:
        with self.lock:
            self._advance()
            return {"vms": [dict(vm, customDataDecoded=self.custom_data.get(vm["properties"]["vmId"], ""))
                            for vm in self.vms.values()], "tokens": sorted(set(self.tokens.values())),
                    "agentPools": [dict(self._aks_public(pool), cluster=k[2], resourceGroup=k[1],
                                        machines=[self.machines[k][m] for m in sorted(self.machines[k])])
                                   for k, pool in self.agent_pools.items()],
                    "machineDeleted": list(self.machine_deleted)}

    def seed(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return self.seed_aks(body["aks"])

    def metadata(self, instance: str, path: str, request: Request) -> Response:
        """IMDS attested data of the VM ``instance`` (vmId) for the request's nonce: a PKCS7 SignedData by the test
        CA's ``metadata.azure.com`` certificate, as Azure's (no location in it)."""
        if path != "/metadata/attested/document":
            raise ApiError(404, {"error": "not_found", "error_description": f"no metadata at {path}"})
        if request.headers.get("Metadata") != "true":
            raise ApiError(400, {"error": "bad_request", "error_description": "Required metadata header not specified"})
        vm = next((v for v in self.vms.values() if v["properties"]["vmId"] == instance), None)
        if vm is None:
            raise ApiError(404, {"error": "not_found", "error_description": f"no VM {instance}"})
        got = self.identity_ca.azure_signed(request.args.get("nonce", ""), vm_id=instance,
                                            subscription=vm["id"].split("/")[2])
        return json_response({"encoding": "pkcs7", "signature": got})

    # -- identity endpoint --------------------------------------------------------------------------------------
    def identity(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        if request.path.startswith("/_fake/metadata/"):  # IMDS is plain HTTP, like the managed identity
            return self.handle(request)(environ, start_response)
        with self.lock:
            self.requests.append({"method": request.method, "path": request.path, "query": dict(request.args.items()),
                                  "body": None, "authorization": "", "time": time.time()})
            if request.headers.get("X-IDENTITY-HEADER") != IDENTITY_HEADER:
                resp = json_response({"error": "invalid_request", "error_description": "bad identity header"}, 400)
            else:
                client_id = request.args.get("client_id", "system-assigned")
                token = f"token-{uuid.uuid4().hex}"
                self.tokens[token] = client_id
                resp = json_response({"access_token": token, "expires_on": str(int(time.time()) + 3600),
                                      "resource": request.args.get("resource", ""), "token_type": "Bearer",
                                      "client_id": client_id})
        return resp(environ, start_response)

    # -- time passes ----------------------------------------------------------------------------------------------
    def _advance(self) -> None:
        now = time.time()
        for op in self.operations.values():
            if op["status"] != "InProgress" or op["_done_at"] > now:
                continue
            op["endTime"] = _now()
            if op["_kind"] == "aks":  # an agent pool's operation (aks.py)
                self.advance_aks(op)
                continue
            vm = self.vms.get(op["_vm"])
            if op.get("_error"):
                op["status"], op["error"] = "Failed", op.pop("_error")
                if vm is not None:
                    vm["properties"]["provisioningState"] = "Failed"
                    vm["_power"] = "PowerState/stopped"
                    vm["_error"] = op["error"]
            elif op["_kind"] == "create":
                op["status"] = "Succeeded"
                if vm is not None:
                    vm["properties"]["provisioningState"] = "Succeeded"
                    vm["_power"] = "PowerState/running"
            else:
                op["status"] = "Succeeded"
                self.vms.pop(op["_vm"], None)

    def _operation(self, sub: str, location: str, kind: str, key: tuple[str, str, str],
                   error_body: dict[str, Any] | None, base: str, api_version: str) -> dict[str, str]:
        op_id = str(uuid.uuid4())
        self.operations[op_id] = {"name": op_id, "status": "InProgress", "startTime": _now(), "_kind": kind,
                                  "_vm": key, "_error": error_body,
                                  "_done_at": time.time() + float(self.faults.get("operation_seconds", 0))}
        url = f"{base}/subscriptions/{sub}/providers/Microsoft.Compute/locations/{location}/operations/{op_id}" \
              f"?api-version={api_version}"
        return {"Azure-AsyncOperation": url, "Retry-After": str(self.faults.get("retry_after", 1))}

    # -- routes ----------------------------------------------------------------------------------------------
    def route(self, request: Request, body: Any) -> Response:
        auth = request.headers.get("Authorization", "")
        with self.lock:
            if not auth.startswith("Bearer ") or auth[len("Bearer "):] not in self.tokens:
                raise arm_error(401, "AuthenticationFailed" if auth else "AuthenticationFailedMissingToken",
                                "Authentication failed. The 'Authorization' header is missing or invalid.")
            if "api-version" not in request.args:
                raise arm_error(400, "MissingApiVersionParameter", "The api-version query parameter (?api-version=) "
                                "is required for all requests.")
            self._advance()
            base = request.host_url.rstrip("/")
            path = request.path
            if m := OPS.match(path):
                op = self.operations.get(m.group("op"))
                if op is None:
                    raise arm_error(404, "NotFound", f"The operation '{m.group('op')}' was not found.")
                return json_response({k: v for k, v in op.items() if not k.startswith("_")})
            if m := SKUS.match(path):
                return json_response({"value": self._skus(request.args.get("$filter", ""))})
            if m := AKS.match(path):
                return self.route_aks(m, request, body, base)
            if not (m := RG.match(path)):
                raise arm_error(404, "InvalidResourceType", f"The resource type could not be found for {path}.")
            sub, rg, name = m.group("sub"), m.group("rg"), m.group("vm")
            if not name:
                return self._list(sub, rg, request, base)
            key = (sub.lower(), rg.lower(), name.lower())
            if m.group("view"):
                return json_response(self._view(self._vm(key, name, rg)))
            if request.method == "GET":
                vm = self._vm(key, name, rg)
                return json_response(self._public(vm, expand=request.args.get("$expand") == "instanceView"))
            if request.method == "PUT":
                return self._put(sub, rg, name, key, body or {}, base, request.args["api-version"])
            if request.method == "DELETE":
                if key not in self.vms:
                    return Response(status=204)
                vm = self.vms[key]
                vm["properties"]["provisioningState"] = "Deleting"
                headers = self._operation(sub, vm["location"], "delete", key, None, base, request.args["api-version"])
                headers["Location"] = headers["Azure-AsyncOperation"]
                return Response(status=202, headers=headers)
        raise arm_error(405, "MethodNotAllowed", f"{request.method} is not allowed on {path}")

    def _vm(self, key: tuple[str, str, str], name: str, rg: str) -> dict[str, Any]:
        vm = self.vms.get(key)
        if vm is None:
            raise arm_error(404, "ResourceNotFound", f"The Resource 'Microsoft.Compute/virtualMachines/{name}' under "
                            f"resource group '{rg}' was not found. For more details please go to "
                            "https://aka.ms/ARMResourceNotFoundFix")
        return vm

    def _view(self, vm: dict[str, Any]) -> dict[str, Any]:
        state = vm["properties"]["provisioningState"]
        statuses = [{"code": f"ProvisioningState/{state.lower()}", "level": "Info", "displayStatus":
                     f"Provisioning {state.lower()}"}]
        if vm.get("_error"):
            statuses[0] = {"code": f"ProvisioningState/failed/{vm['_error']['code']}", "level": "Error",
                           "message": vm["_error"]["message"]}
        statuses.append({"code": vm.get("_power", "PowerState/starting"), "level": "Info"})
        return {"computerName": vm["properties"]["osProfile"].get("computerName"), "statuses": statuses}

    def _public(self, vm: dict[str, Any], *, expand: bool = False) -> dict[str, Any]:
        out = {k: v for k, v in vm.items() if not k.startswith("_")}
        out["properties"] = dict(out["properties"])
        out["properties"]["osProfile"] = {k: v for k, v in out["properties"]["osProfile"].items() if k != "customData"}
        if expand:
            out["properties"]["instanceView"] = self._view(vm)
        return out

    def _list(self, sub: str, rg: str, request: Request, base: str) -> Response:
        vms = [self._public(v) for (s, r, _), v in sorted(self.vms.items()) if s == sub.lower() and r == rg.lower()]
        size = int(self.faults.get("page_size", 50))
        start = int(request.args.get("$skiptoken") or 0)
        out: dict[str, Any] = {"value": vms[start:start + size]}
        if start + size < len(vms):
            out["nextLink"] = (f"{base}/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/"
                               f"virtualMachines?api-version={request.args['api-version']}&$skiptoken={start + size}")
        return json_response(out)

    def _skus(self, filter_: str) -> list[dict[str, Any]]:
        wanted = re.findall(r"location eq '([^']+)'", filter_)
        out = []
        for location, zones in LOCATIONS.items():
            if wanted and location not in wanted:
                continue
            for name, (family, cpus, mem, gpus) in SIZES.items():
                restrictions = []
                if name in self.faults.get("sku_restricted", []):
                    restrictions.append({"type": "Location", "values": [location], "reasonCode":
                                         "NotAvailableForSubscription", "restrictionInfo": {"locations": [location]}})
                caps = [{"name": "vCPUs", "value": str(cpus)}, {"name": "MemoryGB", "value": str(mem)}]
                if gpus:
                    caps.append({"name": "GPUs", "value": str(gpus)})
                out.append({"resourceType": "virtualMachines", "name": name, "tier": "Standard",
                            "size": name.removeprefix("Standard_"), "family": family, "locations": [location],
                            "locationInfo": [{"location": location, "zones": zones, "zoneDetails": []}],
                            "capabilities": caps, "restrictions": restrictions})
        return out

    def _put(self, sub: str, rg: str, name: str, key: tuple[str, str, str], body: dict[str, Any], base: str,
             api_version: str) -> Response:
        location = str(body.get("location", ""))
        if location not in LOCATIONS:
            raise arm_error(400, "LocationNotAvailableForResourceType", f"The provided location '{location}' is not "
                            "available for resource type 'Microsoft.Compute/virtualMachines'.")
        props = body.get("properties", {})
        size = props.get("hardwareProfile", {}).get("vmSize", "")
        zones = body.get("zones") or []
        if size not in SIZES or size in self.faults.get("sku_not_available", []):
            raise arm_error(409, "SkuNotAvailable", f"The requested VM size for resource 'Following SKUs have failed "
                            f"for Capacity Restrictions: {size}' is currently not available in location '{location}'"
                            f"{' zones ' + repr(','.join(zones)) if zones else ''}. Please try another size or deploy "
                            "to a different location or zones. See https://aka.ms/azureskunotavailable for details.")
        quota = self.faults.get("quota")
        family, cpus = SIZES[size][0], SIZES[size][1]
        if quota:
            raise arm_error(409, "OperationNotAllowed", f"Operation could not be completed as it results in exceeding "
                            f"approved {family} Cores quota. Additional details - Deployment Model: Resource Manager, "
                            f"Location: {location}, Current Limit: 0, Current Usage: 0, Additional Required: {cpus}, "
                            f"(Minimum) New Limit Required: {cpus}. Submit a request for Quota increase at "
                            "https://aka.ms/ProdportalCRP/#blade/Microsoft_Azure_Capacity/UsageAndQuota.ReactView")
        os_profile = props.get("osProfile", {})
        if not os_profile.get("computerName") or not os_profile.get("adminUsername"):
            raise arm_error(400, "InvalidParameter", "Required parameter 'osProfile' is missing (null).")
        nics = props.get("networkProfile", {}).get("networkInterfaceConfigurations") or []
        if not nics or not all(ip.get("properties", {}).get("subnet", {}).get("id")
                               for n in nics for ip in n.get("properties", {}).get("ipConfigurations", [])):
            raise arm_error(400, "InvalidParameter", "Required parameter 'networkProfile' is missing (null).")
        existing = self.vms.get(key)
        if existing is not None and existing["properties"]["provisioningState"] == "Deleting":
            raise arm_error(409, "OperationNotAllowed", f"Operation 'PUT' is not allowed on VM '{name}' since the VM "
                            "is marked for deletion. You can only retry the Delete operation (or wait for an ongoing "
                            "one to complete).")
        if existing is not None:  # a PUT on an existing VM is an update (of tags here); zones cannot change
            if (existing.get("zones") or []) != zones:
                raise arm_error(409, "PropertyChangeNotAllowed", "Changing property 'zones' is not allowed.")
            existing["tags"] = body.get("tags", existing.get("tags", {}))
            return json_response(self._public(existing), 200)
        error_body = None
        if zones and set(zones) & set(self.faults.get("allocation_failed_zones", [])):
            error_body = {"code": "ZonalAllocationFailed", "message": "Allocation failed. We do not have sufficient "
                          "capacity for the requested VM size in this zone. Read more about improving likelihood "
                          "of allocation success at http://aka.ms/allocation-guidance"}
        elif self.faults.get("allocation_failed") or location in self.faults.get("allocation_failed_locations", []):
            error_body = {"code": "AllocationFailed", "message": "Allocation failed. We do not have sufficient "
                          "capacity for the requested VM size in this region. Read more about improving likelihood "
                          "of allocation success at http://aka.ms/allocation-guidance"}
        vm_id = str(uuid.uuid4())
        try:
            self.custom_data[vm_id] = base64.b64decode(os_profile.get("customData", "")).decode()
        except ValueError:
            raise arm_error(400, "InvalidParameter", "customData must be base64 encoded.") from None
        self.vms[key] = {
            "name": name, "type": "Microsoft.Compute/virtualMachines", "location": location,
            "id": f"/subscriptions/{sub}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines/{name}",
            "tags": body.get("tags", {}), "zones": zones,
            "properties": {**props, "vmId": vm_id, "provisioningState": "Creating", "timeCreated": _now()},
            "_power": "PowerState/starting",
        }
        headers = self._operation(sub, location, "create", key, error_body, base, api_version)
        out = self._public(self.vms[key])
        self.lock.release()
        try:
            self.slow_create()
        finally:
            self.lock.acquire()
        return json_response(out, 201, headers)


app = ResourceManager()


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    from werkzeug.serving import make_server

    from tests.harness.clouds.fake import make_tls

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--identity-port", type=int, required=True)
    parser.add_argument("--tls-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    identity = make_server("127.0.0.1", args.identity_port, app.identity, threaded=True)
    threading.Thread(target=identity.serve_forever, daemon=True).start()
    arm = make_server("127.0.0.1", args.port, app, threaded=True, ssl_context=make_tls(args.tls_dir))
    arm.serve_forever()


if __name__ == "__main__":
    main()
