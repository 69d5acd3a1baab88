"""Azure burst locations (azure-mgmt-compute, credentials from azure-identity; both imported lazily).

Credentials: ``ManagedIdentityCredential(client_id=<azureClientId>)``, which is workload identity on AKS (the
federated token file the webhook mounts) and the user-assigned managed identity elsewhere; that identity holds
the custom role on the location's one resource group (VMs and NICs, R4.5). TLS is always verified; an emulator
or private endpoint is trusted through ``KUBEON_AZURE_CA_FILE``, never by switching verification off.

Identity is tags: ``kubeon.io/burst=<policy>`` and ``kubeon.io/operation=<operation>``. Azure has no server-side
tag filter for VMs, so lists are filtered here. A VM is named after the node, its size and zone, so a retried PUT
(after a crash, before the answer) updates that same VM and can never update another operation's; a launch first
looks for the operation's VM. The NIC is created inline with the VM (``networkInterfaceConfigurations``, deleted
with it). Long-running operations are polled through ``Azure-AsyncOperation`` with this provider's deadline.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import threading
import time
from typing import Any

from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.locations import BurstConfig
from models.locations import LocationConfig
from models.locations import transfer_usd_per_gpu_hour
from models.node import Instance
from models.node import LaunchRequest
from models.provisioning import Offering

from .adaptors import LazyImport
from .base import CloudProvider
from .base import check_allowed
from .base import report_progress
from .catalog import AZURE_GPU_INSTANCES
from .catalog import region_offerings
from .errors import InstanceNotFoundError
from .errors import InsufficientCapacityError
from .errors import ProviderError

# Only clusters with Azure locations load the SDK (activities/providers/adaptors.py).
azure_identity = LazyImport("azure.identity")
azure_compute = LazyImport("azure.mgmt.compute")
azure_exceptions = LazyImport("azure.core.exceptions")


CAPACITY_CODES = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed", "OverconstrainedAllocationRequest",
                  "OverconstrainedZonalAllocationRequest"}
QUOTA_CODES = {"OperationNotAllowed", "QuotaExceeded"}
PROVISIONING = {"creating": "pending", "updating": "pending", "succeeded": "running", "deleting": "shutting-down",
                "failed": "failed", "canceled": "failed"}
POWER = {"starting": "pending", "running": "running", "stopping": "stopping", "stopped": "stopped",
         "deallocating": "stopping", "deallocated": "stopped"}
GONE = ("shutting-down", "failed")
OPERATION_DEADLINE = 240.0


class AzureProvider(CloudProvider):
    name = "azure"

    def __init__(self, config: BurstConfig, *, endpoint_url: str | None = None, ca_file: str | None = None,
                 operation_deadline: float = OPERATION_DEADLINE, polling_interval: float = 5.0) -> None:
        self._config = config
        self._endpoint = endpoint_url  # None: https://management.azure.com
        self._ca_file = ca_file
        self._deadline = operation_deadline
        self._polling_interval = polling_interval
        self._clients: dict[str, Any] = {}
        self._zones: dict[tuple[str, str], tuple[list[str], float]] = {}
        self._lock = threading.Lock()

    def _compute(self, location: str) -> Any:
        with self._lock:
            client = self._clients.get(location)
            if client is None:
                loc = self._config.location(location)
                kwargs: dict[str, Any] = {"polling_interval": self._polling_interval, "retry_total": 3}
                if self._endpoint:
                    kwargs["base_url"] = self._endpoint
                if self._ca_file:
                    kwargs["connection_verify"] = self._ca_file
                credential = azure_identity.ManagedIdentityCredential(client_id=loc.credentials.azure_client_id)
                client = azure_compute.ComputeManagementClient(credential, str(loc.azure.subscription), **kwargs)
                self._clients[location] = client
            return client

    @staticmethod
    def _rg(loc: LocationConfig) -> str:
        assert loc.azure.resource_group  # the location model requires it for azure
        return loc.azure.resource_group

    # -- errors -----------------------------------------------------------------------------------------------
    @staticmethod
    def _code(exc: Exception) -> tuple[str, str]:
        err = getattr(exc, "error", None)
        code = str(getattr(err, "code", "") or "")
        message = str(getattr(err, "message", "") or exc)
        return code, message

    def _error(self, location: str, call: str, exc: Exception) -> ProviderError:
        code, message = self._code(exc)
        if code in QUOTA_CODES and "quota" in message.lower():
            return ProviderError(f"{location}: quota exceeded ({code}: {message.split('. Submit')[0]}); request "
                                 "more in the Azure portal (Subscriptions > Usage + quotas) or remove the location",
                                 retryable=False)
        status = int(getattr(exc, "status_code", 0) or 0)
        retryable = status == 0 or status >= 500 or status == 429
        if type(exc).__name__ == "ClientAuthenticationError":
            retryable = False
        return ProviderError(f"{location}: {call} failed: {code or type(exc).__name__}: {message}",
                             retryable=retryable)

    # -- catalogue and zones ---------------------------------------------------------------------------------------
    def _available(self, location: str) -> dict[str, list[str]]:
        """VM size -> its zones in the region, from the resource SKUs API (restricted sizes left out)."""
        loc = self._config.location(location)
        out: dict[str, list[str]] = {}
        try:
            for sku in self._compute(location).resource_skus.list(filter=f"location eq '{loc.region}'"):
                if sku.resource_type != "virtualMachines":
                    continue
                restricted_zones: set[str] = set()
                blocked = False
                for r in sku.restrictions or []:
                    if r.type == "Location" and loc.region in (r.values_property or []):
                        blocked = True
                    elif r.type == "Zone" and r.restriction_info is not None:
                        restricted_zones |= set(r.restriction_info.zones or [])
                if blocked:
                    continue
                zones = [z for info in sku.location_info or [] if (info.location or "").lower() == loc.region
                         for z in info.zones or [] if z not in restricted_zones]
                out[str(sku.name)] = sorted(zones)
        except Exception as exc:
            raise self._error(location, "resourceSkus.list", exc) from exc
        now = time.time()
        with self._lock:
            for size, zones in out.items():
                self._zones[(location, size)] = (zones, now)
        return out

    def _zones_for(self, location: str, loc: LocationConfig, size: str) -> list[str] | None:
        """Zones to try in turn; None: the size is not offered at all in the region."""
        with self._lock:
            cached = self._zones.get((location, size))
        if cached and cached[1] > time.time() - 600:
            zones: list[str] | None = cached[0]
        else:
            zones = self._available(location).get(size)
        if zones is None:
            return None
        if loc.azure.zones:
            zones = [z for z in loc.azure.zones if z in zones]
        return zones or [""]  # a region without zones: one regional attempt

    def price_offerings(self, location: str) -> list[Offering]:
        loc = self._config.location(location)
        catalogue = {o.instance_type: o for o in region_offerings(loc, AZURE_GPU_INSTANCES)}
        available = self._available(location)
        transfer = transfer_usd_per_gpu_hour(self._config.home, loc)
        return [
            Offering(location=location, instance_type=o.instance_type, gpus=o.gpus, gpu_product=o.gpu_product,
                     instance_usd_per_hour=o.usd_per_hour, transfer_usd_per_gpu_hour=transfer)
            for name, o in sorted(catalogue.items()) if name in available
        ]

    # -- instances ---------------------------------------------------------------------------------------------------
    @staticmethod
    def _state(vm: Any) -> str:
        props = vm.properties
        state = PROVISIONING.get(str(props.provisioning_state or "").lower(), "pending")
        view = props.instance_view
        if state == "running" and view is not None:
            for status in view.statuses or []:
                if str(status.code).startswith("PowerState/"):
                    return POWER.get(str(status.code).split("/", 1)[1], state)
        return state

    def _to_instance(self, location: str, vm: Any) -> Instance:
        props = vm.properties
        return Instance(provider="azure", location=location, instance_id=str(vm.name),
                        instance_type=str(props.hardware_profile.vm_size if props.hardware_profile else ""),
                        state=self._state(vm), tags=dict(vm.tags or {}),
                        node_name=str((vm.tags or {}).get("kubeon.io/node", "")), launched_at=props.time_created,
                        attested_id=str(props.vm_id or ""))  # what Azure signs into its attested data

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]:
        loc = self._config.location(location)
        try:
            vms = list(self._compute(location).virtual_machines.list(self._rg(loc)))
        except Exception as exc:
            raise self._error(location, "virtualMachines.list", exc) from exc
        out = []
        for vm in vms:  # no server-side tag filter for VMs
            tags = vm.tags or {}
            if TAG_BURST not in tags or (vm.location or "").lower() != loc.region:
                continue
            if policy is not None and tags.get(TAG_BURST) != policy:
                continue
            if operation is not None and tags.get(TAG_OPERATION) != operation:
                continue
            out.append(self._to_instance(location, vm))
        return out

    def get(self, location: str, instance_id: str) -> Instance:
        loc = self._config.location(location)
        try:
            vm = self._compute(location).virtual_machines.get(self._rg(loc), instance_id, expand="instanceView")
        except azure_exceptions.ResourceNotFoundError:
            raise InstanceNotFoundError(f"{location}: instance {instance_id} not found") from None
        except Exception as exc:
            raise self._error(location, "virtualMachines.get", exc) from exc
        return self._to_instance(location, vm)

    def _vm_body(self, request: LaunchRequest, loc: LocationConfig, zone: str, user_data: str) -> dict[str, Any]:
        settings = loc.azure
        if settings.image.startswith("/"):
            image: dict[str, str] = {"id": settings.image}
        else:
            publisher, offer, sku, version = settings.image.split(":")
            image = {"publisher": publisher, "offer": offer, "sku": sku, "version": version}
        body: dict[str, Any] = {
            "location": loc.region,
            "tags": {TAG_BURST: request.policy, TAG_OPERATION: request.operation, "kubeon.io/cluster": request.cluster,
                     "kubeon.io/node": request.node_name},
            "properties": {
                "hardwareProfile": {"vmSize": request.offering.instance_type},
                "storageProfile": {"imageReference": image, "osDisk": {
                    "createOption": "FromImage", "deleteOption": "Delete", "diskSizeGB": settings.disk_size_gb,
                    "managedDisk": {"storageAccountType": "Premium_LRS"}}},
                "osProfile": {
                    "computerName": request.node_name, "adminUsername": settings.admin_username,
                    "customData": base64.b64encode(user_data.encode()).decode(),
                    "linuxConfiguration": {"disablePasswordAuthentication": True, "ssh": {"publicKeys": [{
                        "path": f"/home/{settings.admin_username}/.ssh/authorized_keys",
                        "keyData": settings.ssh_public_key or _throwaway_ssh_key()}]}}},
                "networkProfile": {"networkApiVersion": "2020-11-01", "networkInterfaceConfigurations": [{
                    "name": f"{request.node_name}-nic", "properties": {
                        "primary": True, "deleteOption": "Delete",
                        "ipConfigurations": [{"name": "ipcfg", "properties": {"subnet": {"id": settings.subnet_id}}}],
                    }}]},
            },
        }
        if zone:
            body["zones"] = [zone]
        return body

    @staticmethod
    def _vm_name(request: LaunchRequest, zone: str) -> str:
        """One name per operation, size and zone: a retried PUT is the same VM; another size or zone (tried after
        a failure, whose VM may still be deleting) is another VM."""
        size = hashlib.sha256(request.offering.instance_type.encode()).hexdigest()[:6]
        return f"{request.node_name}-{size}-z{zone or 'r'}"

    def launch(self, request: LaunchRequest, user_data: str) -> Instance:
        check_allowed(request)
        location = request.offering.location
        loc = self._config.location(location)
        size = request.offering.instance_type
        live = [i for i in self.list(location, operation=request.operation) if i.state not in GONE]
        if live:
            return live[0]
        zones = self._zones_for(location, loc, size)
        if zones is None:
            raise InsufficientCapacityError(f"{location}: {size} is not offered in {loc.region}")
        failures: list[str] = []
        compute = self._compute(location)
        for zone in zones:
            name = self._vm_name(request, zone)
            try:
                poller = compute.virtual_machines.begin_create_or_update(
                    self._rg(loc), name, self._vm_body(request, loc, zone, user_data))
                deadline = time.monotonic() + self._deadline
                while not poller.done():
                    if time.monotonic() > deadline:
                        raise ProviderError(f"{location}: creating {name} not done after {self._deadline:.0f}s")
                    report_progress(f"creating {name}: {poller.status()}")
                    poller.wait(timeout=5)
                vm = poller.result()
            except ProviderError:
                raise
            except Exception as exc:
                code, _ = self._code(exc)
                if code in CAPACITY_CODES:
                    failures.append(f"zone {zone or '-'}: {code}")
                    self._discard(location, loc, name)  # a failed allocation leaves a Failed VM behind
                    if code in ("SkuNotAvailable", "AllocationFailed", "OverconstrainedAllocationRequest"):
                        break  # the whole region, not one zone
                    continue
                raise self._error(location, f"creating VM {name}", exc) from exc
            return self._to_instance(location, vm)
        raise InsufficientCapacityError(f"{location}: no capacity for {size} ({'; '.join(failures)})")

    def _discard(self, location: str, loc: LocationConfig, name: str) -> None:
        try:
            self._compute(location).virtual_machines.begin_delete(self._rg(loc), name, polling=False)
        except Exception as exc:  # cleanup_operation finds it by tag later
            code, _ = self._code(exc)
            if code != "ResourceNotFound":
                report_progress(f"could not delete failed VM {name}: {exc}")

    def delete_instance(self, location: str, instance: Instance) -> None:
        loc = self._config.location(location)
        try:
            # Deleting, then 404.
            self._compute(location).virtual_machines.begin_delete(self._rg(loc), instance.instance_id, polling=False)
        except azure_exceptions.ResourceNotFoundError:
            return
        except Exception as exc:
            raise self._error(location, f"deleting VM {instance.instance_id}", exc) from exc


@functools.cache
def _throwaway_ssh_key() -> str:
    """An RSA public key whose private half is dropped at once: Azure wants a key for Linux VMs, nobody logs in."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    return key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode() + " kubeon-burst-unused"
