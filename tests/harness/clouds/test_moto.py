"""moto runs as a server process on loopback and speaks EC2 through boto3."""

from __future__ import annotations

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
