"""The documented test (R4.10) end to end on AWS (moto in server mode): the instance carries both tags, the
node joins from its own user data, and the instance is terminated when the workload leaves."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.client import Client

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.service import KubeGateway
from models.join import parse_user_data
from models.labels import TAG_BURST, TAG_OPERATION
from models.node import NodePhase
from node.register import join_simulated
from tests.harness.background import Background
from tests.harness.burst import (
    BurstStack,
    StartWorker,
    approve_batch,
    assert_serves_on_burst_node,
    gpu_deployment,
    node_gone,
    provision_state,
    result,
    unique,
    wait_for,
    wait_phase,
)
from tests.harness.clouds.moto_server import MotoServer
from tests.harness.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.temporal, pytest.mark.aws]
REGION = "eu-central-1"
ROLE = "arn:aws:iam::111122223333:role/kubeon-burst-eu-central-1"


def _ec2(moto: MotoServer, name: str = "ec2") -> Any:
    """A client in the burst account: moto keeps resources per account, and the role's account is the
    burst account (the role's, not the caller's)."""
    sts = boto3.client("sts", region_name=REGION, endpoint_url=moto.endpoint, aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    creds = sts.assume_role(RoleArn=ROLE, RoleSessionName="test-setup")["Credentials"]
    return boto3.client(name, region_name=REGION, endpoint_url=moto.endpoint,
                        aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                        aws_session_token=creds["SessionToken"])


@pytest.fixture(scope="module")
def aws_location(moto_server: MotoServer) -> dict[str, Any]:
    # The burst account has the nodes' instance profile, as the setup guide asks (R4.5).
    iam = _ec2(moto_server, "iam")
    with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
        iam.create_instance_profile(InstanceProfileName="kubeon-burst-node")
    image = _ec2(moto_server).describe_images()["Images"][0]["ImageId"]
    return {"name": f"aws/{REGION}", "credentials": {"awsRoleArn": ROLE}, "aws": {"imageId": image}}


class BootedInstances(Background):
    """Plays the booted burst instances: reads each instance's user data from moto and joins through the
    gateway with the ticket found there, as the node's bootstrap would; kwok then runs the Node."""

    def __init__(self, moto: MotoServer, gateway: KubeGateway, policy: str, state_dir: Path) -> None:
        super().__init__()
        self.state_dir = state_dir
        self.ec2 = _ec2(moto)
        self.gateway = gateway
        self.policy = policy
        self.joined: dict[str, str] = {}

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            found = self.ec2.describe_instances(Filters=[
                {"Name": f"tag:{TAG_BURST}", "Values": [self.policy]},
                {"Name": "instance-state-name", "Values": ["pending", "running"]}])
            for inst in (i for r in found["Reservations"] for i in r["Instances"]):
                iid = inst["InstanceId"]
                if iid in self.joined:
                    continue
                attr = self.ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")
                user_data = base64.b64decode(attr["UserData"]["Value"]).decode()
                doc = parse_user_data(user_data)
                # The node's own join (keys, CSR, ticket) and registration with its own certificate.
                node = join_simulated(doc, self.state_dir / iid, self.gateway.join,
                                      provider_id=f"aws:///{REGION}/{iid}", annotations=KWOK_ANNOTATIONS,
                                      capacity={"cpu": "4", "memory": "16Gi", "pods": "110", "nvidia.com/gpu": "1"})
                self.joined[iid] = str(node.metadata.name)


@pytest.fixture
async def worker(start_worker: StartWorker, moto_server: MotoServer, aws_location: dict[str, Any],
                 monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Client, str, KubeGateway]]:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    async with start_worker([aws_location], aws_endpoint_url=moto_server.endpoint) as (temporal, settings, runtime):
        assert isinstance(runtime.gateway, KubeGateway)
        yield temporal, settings.cluster, runtime.gateway


async def test_documented_burst_on_aws(stack: BurstStack, worker: tuple[Client, str, KubeGateway],
                                       moto_server: MotoServer, namespace: str, policy: str) -> None:
    temporal, cluster_name, gateway = worker
    stack.create_policy(policy, mode="Approve", locations=[f"aws/{REGION}"], max_nodes=4)
    deploy = unique("infer")
    # A GPU type home does not offer: the pod stays Unschedulable at home.
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy, gpu_product="NVIDIA-A10G"))
    proposed = await provision_state(temporal, cluster_name, policy, lambda v: v.proposal is not None)
    assert proposed.proposal is not None
    (planned,) = proposed.proposal.plan.new_nodes
    assert planned.offering.instance_type == "g5.xlarge"  # the cheapest A10G instance offered in the region
    assert planned.offering.usd_per_gpu_hour == pytest.approx(1.006 + 0.02)
    ec2 = _ec2(moto_server)
    assert not ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_BURST}", "Values": [policy]}])["Reservations"]

    with BootedInstances(moto_server, gateway, policy, stack.workdir / f"aws-nodes-{policy}") as booted:
        _, handle = await approve_batch(temporal, cluster_name, policy, f"{namespace}/{deploy}-", "bob")
        view = await wait_phase(handle, NodePhase.SERVING, timeout=120)
        assert view.instance is not None
        raw = ec2.describe_instances(InstanceIds=[view.instance.instance_id])["Reservations"][0]["Instances"][0]
        tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
        assert tags[TAG_BURST] == policy
        assert tags[TAG_OPERATION] == view.operation
        assert raw["InstanceType"] == "g5.xlarge"
        assert booted.joined == {view.instance.instance_id: view.node_name}

        assert_serves_on_burst_node(stack, view, namespace, deploy, "aws.eu-central-1")

        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        done = await result(handle)
    assert done.phase == NodePhase.COMPLETED, done.message
    state = ec2.describe_instances(InstanceIds=[view.instance.instance_id])["Reservations"][0]["Instances"][0]
    assert state["State"]["Name"] in ("shutting-down", "terminated")
    wait_for(lambda: node_gone(stack, view.node_name), what="node gone")
    live = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_BURST}", "Values": [policy]},
                                           {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    assert not live["Reservations"]


async def test_optimizer_credentials_cannot_create_or_delete_nodes(stack: BurstStack) -> None:
    from kubernetes import client

    optimizer: Kube = stack.optimizer
    with pytest.raises(client.ApiException) as err:
        optimizer.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=unique("rogue"))))
    assert err.value.status == 403
    with pytest.raises(client.ApiException) as err:
        optimizer.core.delete_node("anything")
    assert err.value.status == 403
