"""The EC2 instance metadata service (IMDSv2) for moto's instances, on a loopback port (issue 27): moto keeps the
instances but signs no identity, so this serves each one's instance identity document (its ID, account, region and
zone as moto has them) and its base64 RSA-SHA256 signature, signed with a test CA's signer certificate (the trust
root, as AWS publishes its region's certificate). A node reads it at
``<url>/<region>/<instance id>`` (its ``metadataUrl``): ``PUT /latest/api/token``, then
``GET /latest/dynamic/instance-identity/document`` and ``.../signature`` with the token."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import boto3
from werkzeug.serving import BaseWSGIServer
from werkzeug.serving import make_server
from werkzeug.wrappers import Request
from werkzeug.wrappers import Response

from tests.harness.identity import IdentityCA


@dataclass
class AwsMetadata:
    moto_endpoint: str
    ca: IdentityCA = field(default_factory=lambda: IdentityCA(name="aws test identity CA"))
    # An EC2 client of the region, in the account the instances are in (default: moto's default account).
    ec2: Callable[[str], Any] | None = None
    url: str = ""
    _tokens: set[str] = field(default_factory=set)
    # (region, instance id) -> its identity: one document each, as EC2 serves
    _documents: dict[tuple[str, str], Any] = field(default_factory=dict)
    _server: BaseWSGIServer | None = field(default=None, repr=False)

    def start(self) -> AwsMetadata:
        self._server = make_server("127.0.0.1", 0, self._app, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()

    def metadata_url(self, region: str, instance_id: str) -> str:
        return f"{self.url}/{region}/{instance_id}"

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        region, _, rest = request.path.lstrip("/").partition("/")
        instance_id, _, path = rest.partition("/")
        if path == "latest/api/token" and request.method == "PUT":
            token = secrets.token_hex(16)
            self._tokens.add(token)
            response = Response(token)
        elif request.headers.get("X-aws-ec2-metadata-token") not in self._tokens:
            response = Response("Unauthorized", status=401)
        elif path in ("latest/dynamic/instance-identity/document", "latest/dynamic/instance-identity/signature"):
            got = self._identity(region, instance_id)
            response = (Response("not found", status=404) if got is None
                        else Response(got.document if path.endswith("document") else got.signature))
        else:
            response = Response("not found", status=404)
        return response(environ, start_response)

    def _identity(self, region: str, instance_id: str) -> Any:
        if (region, instance_id) in self._documents:
            return self._documents[region, instance_id]
        ec2 = self.ec2(region) if self.ec2 else boto3.client(
            "ec2", region_name=region, endpoint_url=self.moto_endpoint, aws_access_key_id="testing",
            aws_secret_access_key="testing")
        reservations = ec2.describe_instances(
            Filters=[{"Name": "instance-id", "Values": [instance_id]}])["Reservations"]
        if not reservations:
            return None
        inst = reservations[0]["Instances"][0]
        got = self._documents[region, instance_id] = self.ca.aws(
            region=region, instance_id=instance_id, account=reservations[0]["OwnerId"],
            zone=inst["Placement"]["AvailabilityZone"])
        return got
