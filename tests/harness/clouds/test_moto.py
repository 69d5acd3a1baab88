"""moto runs as a server process on loopback and speaks EC2 through boto3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.harness.clouds.moto_server import MotoServer

pytestmark = pytest.mark.aws


def test_moto_server_runs_tagged_instances(moto_server: MotoServer) -> None:
    ec2 = boto3.client("ec2", region_name="eu-central-1", endpoint_url=moto_server.endpoint,
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    image = ec2.describe_images()["Images"][0]["ImageId"]
    run = ec2.run_instances(
        ImageId=image, InstanceType="p4d.24xlarge", MinCount=1, MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "kubeon.io/burst", "Value": "p1"}]}],
    )
    instance_id = run["Instances"][0]["InstanceId"]
    found = ec2.describe_instances(Filters=[{"Name": "tag:kubeon.io/burst", "Values": ["p1"]}])
    ids = [i["InstanceId"] for r in found["Reservations"] for i in r["Instances"]]
    assert instance_id in ids
    assert moto_server.endpoint.startswith("http://127.0.0.1:")


def test_an_instance_reads_its_signed_identity_document_from_imds(moto_server: MotoServer) -> None:
    """Issue 27: a moto instance's identity document and signature from the local IMDSv2, verified by the gateway's
    own code against the test CA; a us-east-1 instance redeeming an eu-central-1 ticket is refused."""
    from gateway.attestation import AttestationVerifier
    from models.errors import JoinRefused
    from node.identity import fetch_attestation
    from tests.harness.clouds.aws_metadata import AwsMetadata

    imds = AwsMetadata(moto_server.endpoint).start()
    try:
        verifier = AttestationVerifier(roots={"aws": [imds.ca.signer]}, accounts={"aws": "123456789012"})
        for region in ("eu-central-1", "us-east-1"):
            ec2 = boto3.client("ec2", region_name=region, endpoint_url=moto_server.endpoint,
                               aws_access_key_id="testing", aws_secret_access_key="testing")
            image = ec2.describe_images()["Images"][0]["ImageId"]
            iid = ec2.run_instances(ImageId=image, InstanceType="g5.xlarge", MinCount=1,
                                    MaxCount=1)["Instances"][0]["InstanceId"]
            attestation = fetch_attestation({"attestation": {"method": "aws"},
                                             "metadataUrl": imds.metadata_url(region, iid)})
            if region == "eu-central-1":
                got = verifier.verify(attestation, "aws/eu-central-1")
                assert (got.region, got.instance_id, got.account) == (region, iid, "123456789012")
                assert got.zone.startswith(region)
            else:
                with pytest.raises(JoinRefused) as err:
                    verifier.verify(attestation, "aws/eu-central-1")
                assert err.value.code == "location_mismatch"
    finally:
        imds.stop()


def test_the_node_program_sends_the_identity_its_user_data_asks_for(moto_server: MotoServer, tmp_path: Path) -> None:
    """The join document (rendered as the launch renders it) names the method, the audience and the metadata URL;
    ``node join`` reads the identity there and sends it with its ticket, and the gateway's code verifies it."""
    from gateway.attestation import AttestationVerifier
    from models.join import JoinRedeem
    from models.join import parse_user_data
    from models.join import render_user_data
    from node.join import NodeFiles
    from node.join import join
    from tests.harness.clouds.aws_metadata import AwsMetadata

    imds = AwsMetadata(moto_server.endpoint).start()
    try:
        ec2 = boto3.client("ec2", region_name="eu-central-1", endpoint_url=moto_server.endpoint,
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        iid = ec2.run_instances(ImageId=ec2.describe_images()["Images"][0]["ImageId"], InstanceType="g5.xlarge",
                                MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
        doc = parse_user_data(render_user_data(
            gateway_url="https://gw.example:8443", ticket="t.t", node_name="burst-op-0123456789ab", labels={},
            taints=[], attestation={"method": "aws"}, metadata_url=imds.metadata_url("eu-central-1", iid)))
        sent: list[JoinRedeem] = []

        class Sent(Exception):
            pass

        def redeem(request: JoinRedeem) -> Any:
            sent.append(request)
            raise Sent

        with pytest.raises(Sent):
            join(doc, NodeFiles(tmp_path / "state"), redeem=redeem, tunnel=False)
        got = AttestationVerifier(roots={"aws": [imds.ca.signer]}).verify(sent[0].attestation, "aws/eu-central-1")
        assert (got.method, got.instance_id) == ("aws", iid)
    finally:
        imds.stop()
