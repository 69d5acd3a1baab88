"""Google Compute Engine burst locations (google-cloud-compute, REST transport, imported lazily).

Credentials: the location's ``gcpServiceAccount`` is impersonated from the worker's own identity (workload
identity; google-auth impersonated credentials), so the optimizer holds no key and the custom role on the burst
project is the service account's (R4.5). With an emulator endpoint (tests, ``make dev``) the calls carry
anonymous credentials: no token is ever sent to an endpoint that is not Google's.

Identity is labels: ``kubeon-burst=<policy>`` and ``kubeon-operation=<operation>`` (GCE label values allow no
``.``; a policy name's dots become ``_``, which Kubernetes names never hold, so the mapping is exact). A launch
first looks for the operation's instance (server-side label filter) and inserts with a request ID, so a retried
launch is one instance. The zonal operation is polled here (``zoneOperations.wait``) with this provider's own
client and deadline: ``ExtendedOperation.result()`` polls compute.googleapis.com whatever the endpoint says.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from datetime import datetime
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
from .catalog import GCP_GPU_INSTANCES
from .catalog import region_offerings
from .errors import InstanceNotFoundError
from .errors import InsufficientCapacityError
from .errors import ProviderError

# Only clusters with GCP locations load the SDK (activities/providers/adaptors.py).
compute_v1 = LazyImport("google.cloud.compute_v1")
api_exceptions = LazyImport("google.api_core.exceptions")
google_auth = LazyImport("google.auth")
google_credentials = LazyImport("google.auth.credentials")
impersonated_credentials = LazyImport("google.auth.impersonated_credentials")


LABEL_BURST = "kubeon-burst"
LABEL_OPERATION = "kubeon-operation"
LABEL_CLUSTER = "kubeon-cluster"
SCOPE = "https://www.googleapis.com/auth/compute"
# Operation errors that mean "no capacity here now": the next zone is tried (SkyPilot blocks the zone for these).
ZONE_CAPACITY = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "RESOURCE_NOT_READY",
                 "UNSUPPORTED_OPERATION")
REGION_CAPACITY = ("REGION_RESOURCE_POOL_EXHAUSTED",)
STATES = {"PROVISIONING": "pending", "STAGING": "pending", "RUNNING": "running", "STOPPING": "shutting-down",
          "SUSPENDING": "stopping", "SUSPENDED": "stopped", "REPAIRING": "pending", "TERMINATED": "stopped"}
LIVE = ("PROVISIONING", "STAGING", "RUNNING", "REPAIRING")
OPERATION_DEADLINE = 240.0  # inside the launch activity's 5 minutes
_QUOTA = re.compile(r"Quota '([A-Z0-9_]+)' exceeded")


def label_value(name: str) -> str:
    if len(name) > 63:
        raise ProviderError(f"{name!r} is longer than a GCE label value (63 characters)", retryable=False)
    return name.replace(".", "_")


def _call_error(exc: Exception) -> tuple[int, str, str]:
    """(HTTP status, reason, message) of a google.api_core error."""
    status = int(getattr(exc, "code", 0) or 0)
    errors = getattr(exc, "errors", None) or []
    reason = str(errors[0].get("reason", "")) if errors and isinstance(errors[0], dict) else ""
    return status, reason, str(getattr(exc, "message", exc))


class GcpProvider(CloudProvider):
    name = "gcp"

    def __init__(self, config: BurstConfig, *, endpoint_url: str | None = None,
                 operation_deadline: float = OPERATION_DEADLINE) -> None:
        self._config = config
        # An emulator (tests, make dev): http(s)://host:port; None: compute.googleapis.com.
        self._endpoint = endpoint_url
        self._deadline = operation_deadline
        self._clients: dict[str, dict[str, Any]] = {}
        self._zones: dict[tuple[str, str], tuple[list[str], float]] = {}
        self._lock = threading.Lock()

    # -- clients -----------------------------------------------------------------------------------------
    def _credentials(self, loc: LocationConfig) -> Any:
        if self._endpoint:
            return google_credentials.AnonymousCredentials()

        try:
            source, _ = google_auth.default()
        except Exception as exc:
            raise ProviderError(f"{loc.name}: no Google credentials for the worker (workload identity): {exc}",
                                retryable=False) from exc
        return impersonated_credentials.Credentials(
            source_credentials=source, target_principal=loc.credentials.gcp_service_account,
            target_scopes=[SCOPE], lifetime=3600)

    def _client(self, location: str, kind: str) -> Any:
        with self._lock:
            clients = self._clients.get(location)
            if clients is None:
                loc = self._config.location(location)
                creds = self._credentials(loc)
                options = {"api_endpoint": self._endpoint} if self._endpoint else None
                clients = {name: cls(credentials=creds, transport="rest", client_options=options) for name, cls in (
                    ("instances", compute_v1.InstancesClient), ("operations", compute_v1.ZoneOperationsClient),
                    ("machine_types", compute_v1.MachineTypesClient))}
                self._clients[location] = clients
            return clients[kind]

    @staticmethod
    def _project(loc: LocationConfig) -> str:
        assert loc.gcp.project  # the location model requires it for gcp
        return loc.gcp.project

    # -- catalogue and zones ---------------------------------------------------------------------------------
    def _offered_zones(self, location: str, types: list[str]) -> dict[str, list[str]]:
        """Machine type -> zones of the region offering it (one aggregated machineTypes call)."""
        loc = self._config.location(location)
        pattern = "|".join(t for t in types if re.fullmatch(r"[a-z0-9-]+", t))
        out: dict[str, list[str]] = {t: [] for t in types}
        try:
            pager = self._client(location, "machine_types").aggregated_list(
                request=compute_v1.AggregatedListMachineTypesRequest(project=self._project(loc),
                                                                     filter=f"name eq '{pattern}'"))
            for scope, scoped in pager:
                zone = scope.rsplit("/", 1)[-1]
                if not zone.startswith(loc.region + "-"):
                    continue
                for mt in scoped.machine_types:
                    if mt.name in out:
                        out[mt.name].append(zone)
        except ProviderError:
            raise
        except Exception as exc:
            raise self._error(location, "machineTypes.aggregatedList", exc) from exc
        now = time.time()
        with self._lock:
            for t, zones in out.items():
                self._zones[(location, t)] = (sorted(zones), now)
        return out

    def _zones_for(self, location: str, loc: LocationConfig, machine_type: str) -> list[str]:
        with self._lock:
            cached = self._zones.get((location, machine_type))
        if cached and cached[1] > time.time() - 600:
            zones = cached[0]
        else:
            zones = sorted(self._offered_zones(location, [machine_type])[machine_type])
        if loc.gcp.zones:
            zones = [z for z in loc.gcp.zones if z in zones]
        return zones

    def price_offerings(self, location: str) -> list[Offering]:
        loc = self._config.location(location)
        catalogue = {o.instance_type: o for o in region_offerings(loc, GCP_GPU_INSTANCES)}
        offered = self._offered_zones(location, sorted(catalogue))
        transfer = transfer_usd_per_gpu_hour(self._config.home, loc)
        return [
            Offering(location=location, instance_type=o.instance_type, gpus=o.gpus, gpu_product=o.gpu_product,
                     instance_usd_per_hour=o.usd_per_hour, transfer_usd_per_gpu_hour=transfer)
            for name, o in sorted(catalogue.items())
            if offered.get(name) and (not loc.gcp.zones or set(loc.gcp.zones) & set(offered[name]))
        ]

    # -- errors ----------------------------------------------------------------------------------------------
    def _error(self, location: str, call: str, exc: Exception) -> ProviderError:
        status, reason, message = _call_error(exc)
        quota = _QUOTA.search(message)
        if reason == "quotaExceeded" or quota:
            return self._quota(location, quota.group(1) if quota else reason, message)
        retryable = status >= 500 or status == 429 or status == 0
        return ProviderError(f"{location}: {call} failed: {exc}", retryable=retryable)

    @staticmethod
    def _quota(location: str, metric: str, message: str) -> ProviderError:
        return ProviderError(f"{location}: quota {metric} exceeded ({message.strip()}); ask for more quota in the "
                             "Google Cloud console (IAM & Admin > Quotas) or remove the location", retryable=False)

    # -- instances ---------------------------------------------------------------------------------------------
    def _to_instance(self, location: str, raw: Any) -> Instance:
        labels = dict(raw.labels)
        zone = raw.zone.rsplit("/", 1)[-1]
        tags = {k: v for k, v in labels.items() if k not in (LABEL_BURST, LABEL_OPERATION)}
        if LABEL_BURST in labels:
            tags[TAG_BURST] = labels[LABEL_BURST].replace("_", ".")
        if LABEL_OPERATION in labels:
            tags[TAG_OPERATION] = labels[LABEL_OPERATION]
        created = raw.creation_timestamp
        return Instance(
            provider="gcp", location=location, instance_id=f"{zone}/{raw.name}",
            instance_type=raw.machine_type.rsplit("/", 1)[-1], state=STATES.get(raw.status, raw.status.lower()),
            tags=tags, node_name=raw.name, launched_at=datetime.fromisoformat(created) if created else None)

    def _aggregated(self, location: str, filter_: str) -> list[Any]:
        loc = self._config.location(location)
        try:
            out = []
            for scope, scoped in self._client(location, "instances").aggregated_list(
                    request=compute_v1.AggregatedListInstancesRequest(project=self._project(loc), filter=filter_)):
                if scope.rsplit("/", 1)[-1].startswith(loc.region + "-"):
                    out.extend(scoped.instances)
            return out
        except ProviderError:
            raise
        except Exception as exc:
            raise self._error(location, "instances.aggregatedList", exc) from exc

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]:
        terms = [f"(labels.{LABEL_BURST}:*)"]
        if policy is not None:
            terms.append(f'(labels.{LABEL_BURST} = "{label_value(policy)}")')
        if operation is not None:
            terms.append(f'(labels.{LABEL_OPERATION} = "{label_value(operation)}")')
        return [self._to_instance(location, raw) for raw in self._aggregated(location, " AND ".join(terms))]

    def get(self, location: str, instance_id: str) -> Instance:
        loc = self._config.location(location)
        zone, _, name = instance_id.partition("/")
        try:
            raw = self._client(location, "instances").get(project=self._project(loc), zone=zone, instance=name)
        except api_exceptions.NotFound:
            raise InstanceNotFoundError(f"{location}: instance {instance_id} not found") from None
        except Exception as exc:
            raise self._error(location, "instances.get", exc) from exc
        return self._to_instance(location, raw)

    def _wait(self, location: str, project: str, zone: str, op: Any) -> Any:
        """The operation, once DONE (polled with this provider's client, endpoint and deadline)."""
        deadline = time.monotonic() + self._deadline
        ops = self._client(location, "operations")
        while op.status != op.Status.DONE:
            if time.monotonic() > deadline:
                raise ProviderError(f"{location}: operation {op.name} in {zone} not done after {self._deadline:.0f}s")
            report_progress(f"{op.operation_type} in {zone}: {op.status.name}")
            try:
                # GCE holds a wait up to 2 minutes; 10 s keeps heartbeats well inside the activity's timeout.
                op = ops.wait(project=project, zone=zone, operation=op.name, timeout=10)
            except Exception as exc:
                status = int(getattr(exc, "code", 0) or 0)
                if status and status < 500 and status != 429:
                    raise self._error(location, "zoneOperations.wait", exc) from exc
                time.sleep(1)  # a transient failure of the poll itself: the operation goes on
        return op

    def launch(self, request: LaunchRequest, user_data: str) -> Instance:
        check_allowed(request)
        location = request.offering.location
        loc = self._config.location(location)
        project = self._project(loc)
        machine = request.offering.instance_type
        existing = [i for i in self._aggregated(
            location, f'(labels.{LABEL_OPERATION} = "{label_value(request.operation)}")') if i.status in LIVE]
        if existing:
            return self._to_instance(location, existing[0])
        zones = self._zones_for(location, loc, machine)
        if not zones:
            raise InsufficientCapacityError(f"{location}: no zone of {loc.region} offers {machine}")
        started = time.time()
        stockouts: list[str] = []
        for zone in zones:
            body = self._instance_body(request, loc, project, zone, user_data)
            request_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"kubeon:{request.operation}/{zone}"))
            op = self._insert(location, project, zone, body, request_id, request.node_name)
            if op is None:  # already there (a retried insert in this zone): it is the operation's instance
                return self.get(location, f"{zone}/{request.node_name}")
            op = self._wait(location, project, zone, op)
            errors = list(op.error.errors) if op.error else []
            if errors and self._began(op) < started - 1:
                # GCE answered the request ID of an earlier, failed attempt with its old operation: insert anew.
                request_id = str(uuid.uuid4())
                op = self._insert(location, project, zone, body, request_id, request.node_name)
                if op is None:
                    return self.get(location, f"{zone}/{request.node_name}")
                op = self._wait(location, project, zone, op)
                errors = list(op.error.errors) if op.error else []
            if not errors:
                return self.get(location, f"{zone}/{request.node_name}")
            codes = [e.code for e in errors]
            detail = "; ".join(f"{e.code}: {e.message}" for e in errors)
            if any(c in ZONE_CAPACITY for c in codes):
                stockouts.append(f"{zone}: {codes[0]}")
                continue
            if any(c in REGION_CAPACITY for c in codes):
                stockouts.append(f"{loc.region}: {codes[0]}")
                break
            quota = next((e for e in errors if e.code == "QUOTA_EXCEEDED"), None)
            if quota is not None:
                found = _QUOTA.search(quota.message)
                raise self._quota(location, found.group(1) if found else "QUOTA_EXCEEDED", quota.message)
            # DONE with an error is a failure, whatever httpErrorStatusCode says (or does not say).
            raise ProviderError(f"{location}: insert of {request.node_name} in {zone} failed: {detail}")
        raise InsufficientCapacityError(f"{location}: no capacity for {machine} ({', '.join(stockouts)})")

    @staticmethod
    def _began(op: Any) -> float:
        try:
            return datetime.fromisoformat(op.insert_time.replace("-00:00", "+00:00")).timestamp()
        except (ValueError, AttributeError):
            return time.time()

    def _insert(self, location: str, project: str, zone: str, body: Any, request_id: str, name: str) -> Any:
        try:
            return self._client(location, "instances").insert_unary(
                request=compute_v1.InsertInstanceRequest(project=project, zone=zone, instance_resource=body,
                                                         request_id=request_id), timeout=60)
        except api_exceptions.Conflict:
            return None
        except Exception as exc:
            status, reason, message = _call_error(exc)
            if reason in ("ZONE_RESOURCE_POOL_EXHAUSTED", "resourceExhausted") and status == 503:
                raise InsufficientCapacityError(f"{location}: {zone}: {message}") from exc
            raise self._error(location, f"instances.insert of {name} in {zone}", exc) from exc

    def _instance_body(self, request: LaunchRequest, loc: LocationConfig, project: str, zone: str,
                       user_data: str) -> Any:
        settings = loc.gcp
        image = settings.image or f"projects/{project}/global/images/family/kubeon-burst-node"
        nic = compute_v1.NetworkInterface(
            subnetwork=settings.subnetwork or None, network=None if settings.subnetwork else "global/networks/default")
        body = compute_v1.Instance(
            name=request.node_name,
            machine_type=f"zones/{zone}/machineTypes/{request.offering.instance_type}",
            labels={LABEL_BURST: label_value(request.policy), LABEL_OPERATION: label_value(request.operation),
                    LABEL_CLUSTER: label_value(request.cluster)},
            # GPU VMs cannot live-migrate: host maintenance stops them (GCE refuses MIGRATE with GPUs).
            scheduling=compute_v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=False,
                                             provisioning_model="STANDARD"),
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key="user-data", value=user_data)]),
            disks=[compute_v1.AttachedDisk(
                boot=True, auto_delete=True, initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=image, disk_size_gb=settings.disk_size_gb,
                    labels={LABEL_BURST: label_value(request.policy)}))],
            network_interfaces=[nic],
        )
        if settings.node_service_account:
            body.service_accounts = [compute_v1.ServiceAccount(email=settings.node_service_account,
                                                               scopes=["https://www.googleapis.com/auth/cloud-platform"])]
        return body

    def owner_tag(self, policy: str) -> str:
        return f"{LABEL_BURST}={label_value(policy)}"

    def delete_instance(self, location: str, instance: Instance) -> None:
        loc = self._config.location(location)
        zone, _, name = instance.instance_id.partition("/")
        request_id = uuid.uuid5(uuid.NAMESPACE_URL, f"kubeon:delete/{instance.instance_id}/{instance.launched_at}")
        try:
            # A deleting instance is STOPPING, then 404.
            self._client(location, "instances").delete_unary(request=compute_v1.DeleteInstanceRequest(
                project=self._project(loc), zone=zone, instance=name, request_id=str(request_id)), timeout=60)
        except api_exceptions.NotFound:
            return
        except Exception as exc:
            raise self._error(location, f"instances.delete of {instance.instance_id}", exc) from exc
