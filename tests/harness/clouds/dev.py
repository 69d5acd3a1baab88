"""`make dev`'s clouds: aws/eu-central-1 (moto), gcp/europe-west4 and azure/westeurope (the local servers), with
the real catalogues and prices, instances that boot from their user data and join through the gateway, and
``endpoints.json`` naming each emulator and what a client needs to address it."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from tests.harness.clouds import local
from tests.harness.clouds.boot import Booter
from tests.harness.clouds.boot import Join
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.moto_server import MotoServer

AWS_REGION = "eu-central-1"
AWS_ROLE = "arn:aws:iam::111122223333:role/kubeon-burst-eu-central-1"


@dataclass
class DevClouds:
    workdir: Path
    endpoints_file: Path
    moto: MotoServer | None = None
    gcp: FakeServer | None = None
    azure: FakeServer | None = None
    locations: list[dict[str, Any]] = field(default_factory=list)
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    _booters: list[Any] = field(default_factory=list)
    popen: Callable[..., Any] = field(default=subprocess.Popen, repr=False)  # `make dev`'s registry's

    def start(self) -> DevClouds:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.moto = MotoServer(self.workdir, popen=self.popen).start()
        self.gcp = local.start_gcp(self.workdir, popen=self.popen)
        self.azure = local.start_azure(self.workdir, popen=self.popen)
        image = self._aws_setup()
        self.locations = [
            {"name": f"aws/{AWS_REGION}", "credentials": {"awsRoleArn": AWS_ROLE}, "aws": {"imageId": image}},
            local.gcp_location("europe-west4"),
            local.azure_location("westeurope"),
        ]
        self.endpoints = endpoints(self.moto, self.gcp, self.azure)
        self.endpoints_file.write_text(json.dumps(self.endpoints, indent=2) + "\n")
        return self

    def worker_env(self) -> dict[str, str]:
        """What the worker process needs besides its settings: AWS keys for moto, Azure's identity endpoint."""
        assert self.azure is not None
        return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                **local.azure_identity_env(self.azure)}

    def settings(self) -> dict[str, Any]:
        assert self.moto and self.gcp and self.azure
        return {"aws_endpoint_url": self.moto.endpoint, "gcp_endpoint_url": self.gcp.url,
                "azure_endpoint_url": self.azure.url, "azure_ca_file": self.azure.ca_file}

    def banner(self) -> str:
        return "".join(f"  {name:<12} {json.dumps(value)}\n" for name, value in self.endpoints.items())

    def boot(self, join: Join) -> None:
        """Boot every instance of the three clouds as it starts, joining through ``join``."""
        assert self.moto and self.gcp and self.azure
        for server in (self.gcp, self.azure):
            booter = Booter(server, join, interval=1.0)
            booter.__enter__()
            self._booters.append(booter)
        aws = _AwsBooter(self._ec2(), join)
        aws.thread.start()
        self._booters.append(aws)

    def stop(self) -> None:
        for booter in self._booters:
            booter.__exit__(None, None, None)
        for server in (self.gcp, self.azure, self.moto):
            if server is not None:
                server.stop()

    # -- AWS: the burst account as the setup guide prepares it -----------------------------------------------
    def _ec2(self, name: str = "ec2") -> Any:
        import boto3

        assert self.moto is not None
        sts = boto3.client("sts", region_name=AWS_REGION, endpoint_url=self.moto.endpoint,
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        creds = sts.assume_role(RoleArn=AWS_ROLE, RoleSessionName="dev-setup")["Credentials"]
        return boto3.client(name, region_name=AWS_REGION, endpoint_url=self.moto.endpoint,
                            aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                            aws_session_token=creds["SessionToken"])

    def _aws_setup(self) -> str:
        iam = self._ec2("iam")
        with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
            iam.create_instance_profile(InstanceProfileName="kubeon-burst-node")
        return str(self._ec2().describe_images()["Images"][0]["ImageId"])


def endpoints(moto: MotoServer, gcp: FakeServer, azure: FakeServer) -> dict[str, dict[str, Any]]:
    """``endpoints.json``: each emulator's address and how its official SDK authenticates to it (``env``: what to
    export; docs/development.md shows each in use)."""
    return {
        # moto accepts any key pair; these are the ones make dev's worker uses (AWS_ENDPOINT_URL: boto3 >= 1.28).
        "aws": {"url": moto.endpoint, "region": AWS_REGION, "accessKeyId": "testing", "secretAccessKey": "testing",
                "env": {"AWS_ENDPOINT_URL": moto.endpoint, "AWS_DEFAULT_REGION": AWS_REGION,
                        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}},
        # The local Compute Engine / Kubernetes Engine server checks no token: google.auth AnonymousCredentials.
        "gcp": {"url": gcp.url, "project": local.GCP_PROJECT, "credentials": "anonymous"},
        # ARM over HTTPS (trust "ca") takes only bearer tokens its managed-identity endpoint issued:
        # ManagedIdentityCredential / DefaultAzureCredential read IDENTITY_ENDPOINT and IDENTITY_HEADER.
        "azure": {"url": azure.url, "subscription": local.AZURE_SUBSCRIPTION,
                  "resourceGroup": local.azure_resource_group("westeurope"), "ca": str(azure.ca_file),
                  "identityEndpoint": azure.identity_url, "clientId": local.AZURE_CLIENT_ID,
                  "env": {**local.azure_identity_env(azure), "AZURE_CLIENT_ID": local.AZURE_CLIENT_ID}},
    }


class _AwsBooter:
    """moto's instances boot too: each running one joins with the ticket in its user data."""

    def __init__(self, ec2: Any, join: Join) -> None:
        self.ec2, self.join = ec2, join
        self.joined: set[str] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        from activities.providers.catalog import AWS_GPU_INSTANCES

        gpus: dict[str, int] = {o.instance_type: o.gpus for o in AWS_GPU_INSTANCES}
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):
                found = self.ec2.describe_instances(Filters=[{"Name": "tag-key", "Values": ["kubeon.io/burst"]},
                                                             {"Name": "instance-state-name", "Values": ["running"]}])
                for inst in (i for r in found["Reservations"] for i in r["Instances"]):
                    iid = inst["InstanceId"]
                    if iid in self.joined:
                        continue
                    self.joined.add(iid)
                    attr = self.ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
                    user_data = base64.b64decode(attr["UserData"]["Value"]).decode()
                    capacity = {"cpu": "8", "memory": "32Gi", "pods": "110",
                                "nvidia.com/gpu": str(gpus.get(inst["InstanceType"], 1))}
                    self.join(iid, user_data, capacity, f"aws:///{AWS_REGION}/{iid}")

