"""AWS EC2 burst locations. boto3 is imported lazily, so a cluster without AWS locations never loads it.

Credentials: the location's ``awsRoleArn`` is assumed through STS (R4.5: that role may RunInstances only with
the burst tag, TerminateInstances only on instances carrying it, CreateTags only at launch). Launches are
idempotent by the operation tag: EC2's ClientToken is not relied on (emulators ignore it), the instance
already started for an operation is looked up first.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.locations import BurstConfig
from models.locations import LocationConfig
from models.locations import OfferingSpec
from models.locations import transfer_usd_per_gpu_hour
from models.node import Instance
from models.node import LaunchRequest
from models.provisioning import Offering

from .adaptors import LazyImport
from .base import CloudProvider
from .base import check_allowed
from .catalog import AWS_GPU_INSTANCES
from .errors import InstanceNotFoundError
from .errors import InsufficientCapacityError
from .errors import ProviderError

# Only clusters with AWS locations load the SDK (activities/providers/adaptors.py).
boto3 = LazyImport("boto3")


LIVE_STATES = ["pending", "running", "stopping", "stopped"]
CAPACITY_ERRORS = {
    "InsufficientInstanceCapacity", "InstanceLimitExceeded", "Unsupported", "InsufficientHostCapacity",
    "InsufficientCapacity", "VcpuLimitExceeded",
}
SESSION_NAME = "kubeon-gpu-optimizer"


class AwsProvider(CloudProvider):
    name = "aws"

    def __init__(self, config: BurstConfig, *, endpoint_url: str | None = None) -> None:
        self._config = config
        # Tests point this at moto's server; production leaves it None (or sets AWS_ENDPOINT_URL).
        self._endpoint_url = endpoint_url
        self._clients: dict[str, tuple[Any, float]] = {}
        self._lock = threading.Lock()

    def _ec2(self, location: str) -> Any:
        with self._lock:
            cached = self._clients.get(location)
            if cached and cached[1] > time.time() + 300:
                return cached[0]
        loc = self._config.location(location)
        expires = time.time() + 86400
        kwargs: dict[str, Any] = {"region_name": loc.region, "endpoint_url": self._endpoint_url}
        role = loc.credentials.aws_role_arn
        if role:
            sts = boto3.client("sts", region_name=loc.region, endpoint_url=self._endpoint_url)
            try:
                creds = sts.assume_role(RoleArn=role, RoleSessionName=SESSION_NAME)["Credentials"]
            except Exception as exc:
                raise ProviderError(f"{location}: cannot assume role {role}: {exc}") from exc
            kwargs.update(aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                          aws_session_token=creds["SessionToken"])
            expires = creds["Expiration"].timestamp()
        ec2 = boto3.client("ec2", **kwargs)
        with self._lock:
            self._clients[location] = (ec2, expires)
        return ec2

    @staticmethod
    def _error_code(exc: Exception) -> str:
        response = getattr(exc, "response", None) or {}
        return str(response.get("Error", {}).get("Code", ""))

    @staticmethod
    def _retryable(exc: Exception) -> bool:
        """Throttling and 5xx are worth retrying; any other refusal by EC2 is a configuration problem."""
        response = getattr(exc, "response", None) or {}
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500) or 500)
        code = str(response.get("Error", {}).get("Code", ""))
        return status >= 500 or "Throttl" in code or code == "RequestLimitExceeded"

    def _catalogue(self, loc: LocationConfig) -> tuple[OfferingSpec, ...]:
        return tuple(loc.offerings) or AWS_GPU_INSTANCES

    # -- Provider ----------------------------------------------------------------------------------------
    def price_offerings(self, location: str) -> list[Offering]:
        loc = self._config.location(location)
        catalogue = {o.instance_type: o for o in self._catalogue(loc)}
        try:
            resp = self._ec2(location).describe_instance_type_offerings(
                LocationType="region", Filters=[{"Name": "instance-type", "Values": sorted(catalogue)}])
        except ProviderError:
            raise
        except Exception as exc:
            raise ProviderError(f"{location}: DescribeInstanceTypeOfferings failed: {exc}") from exc
        offered = {o["InstanceType"] for o in resp.get("InstanceTypeOfferings", [])}
        transfer = transfer_usd_per_gpu_hour(self._config.home, loc)
        return [
            Offering(location=location, instance_type=o.instance_type, gpus=o.gpus, gpu_product=o.gpu_product,
                     instance_usd_per_hour=o.usd_per_hour, transfer_usd_per_gpu_hour=transfer)
            for name, o in sorted(catalogue.items()) if name in offered
        ]

    def _describe(self, location: str, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ec2 = self._ec2(location)
        out: list[dict[str, Any]] = []
        for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                out.extend(reservation["Instances"])
        return out

    def _to_instance(self, location: str, raw: dict[str, Any]) -> Instance:
        tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
        return Instance(
            provider="aws", location=location, instance_id=raw["InstanceId"], instance_type=raw["InstanceType"],
            state=raw["State"]["Name"], tags=tags, node_name=tags.get("Name", ""), launched_at=raw.get("LaunchTime"),
        )

    def _image(self, location: str, loc: LocationConfig) -> str:
        if loc.aws.image_id:
            return loc.aws.image_id
        images = self._ec2(location).describe_images(
            Owners=["self"], Filters=[{"Name": "name", "Values": ["kubeon-burst-node*"]}])["Images"]
        if not images:
            raise ProviderError(f"{location}: no image named kubeon-burst-node* and no aws.imageId configured")
        return str(max(images, key=lambda i: i.get("CreationDate", ""))["ImageId"])

    def launch(self, request: LaunchRequest, user_data: str) -> Instance:
        check_allowed(request)
        location = request.offering.location
        loc = self._config.location(location)
        existing = self._describe(location, [
            {"Name": f"tag:{TAG_OPERATION}", "Values": [request.operation]},
            {"Name": "instance-state-name", "Values": LIVE_STATES},
        ])
        if existing:
            return self._to_instance(location, existing[0])
        tags = [
            {"Key": TAG_BURST, "Value": request.policy},
            {"Key": TAG_OPERATION, "Value": request.operation},
            {"Key": "Name", "Value": request.node_name},
            {"Key": "kubeon.io/cluster", "Value": request.cluster},
        ]
        params: dict[str, Any] = {
            "ImageId": self._image(location, loc),
            "InstanceType": request.offering.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "UserData": user_data,
            "ClientToken": request.operation,  # honoured by EC2, ignored by emulators; the lookup above is what counts
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags},
                                  {"ResourceType": "volume", "Tags": tags}],
            "IamInstanceProfile": {"Name": loc.aws.instance_profile},
            "MetadataOptions": {"HttpTokens": "required"},
        }
        if loc.aws.subnet_id:
            params["SubnetId"] = loc.aws.subnet_id
        if loc.aws.security_group_ids:
            params["SecurityGroupIds"] = loc.aws.security_group_ids
        try:
            resp = self._ec2(location).run_instances(**params)
        except Exception as exc:
            code = self._error_code(exc)
            if code in CAPACITY_ERRORS:
                raise InsufficientCapacityError(f"{location}: {code} for {request.offering.instance_type}") from exc
            raise ProviderError(f"{location}: RunInstances failed: {exc}", retryable=self._retryable(exc)) from exc
        return self._to_instance(location, resp["Instances"][0])

    def get(self, location: str, instance_id: str) -> Instance:
        try:
            found = self._describe(location, [{"Name": "instance-id", "Values": [instance_id]}])
        except Exception as exc:
            if self._error_code(exc).startswith("InvalidInstanceID"):
                found = []
            else:
                raise ProviderError(f"{location}: DescribeInstances failed: {exc}") from exc
        if not found:
            raise InstanceNotFoundError(f"{location}: instance {instance_id} not found")
        return self._to_instance(location, found[0])

    def list(self, location: str, *, policy: str | None = None, operation: str | None = None) -> list[Instance]:
        filters: list[dict[str, Any]] = [{"Name": "tag-key", "Values": [TAG_BURST]}]
        if policy is not None:
            filters.append({"Name": f"tag:{TAG_BURST}", "Values": [policy]})
        if operation is not None:
            filters.append({"Name": f"tag:{TAG_OPERATION}", "Values": [operation]})
        return [self._to_instance(location, raw) for raw in self._describe(location, filters)]

    def delete_instance(self, location: str, instance: Instance) -> None:
        try:
            self._ec2(location).terminate_instances(InstanceIds=[instance.instance_id])
        except Exception as exc:
            if self._error_code(exc).startswith("InvalidInstanceID"):
                return
            raise ProviderError(f"{location}: TerminateInstances {instance.instance_id} failed: {exc}") from exc
