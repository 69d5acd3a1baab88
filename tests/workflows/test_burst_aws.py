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
from kubernetes import watch
from temporalio.client import Client

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.attestation import AttestationVerifier
from gateway.service import KubeGateway
from models.join import parse_user_data
from models.labels import BURN_IN_LABEL
from models.labels import JOINING_TAINT
from models.labels import LABEL_POLICY
from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.node import NodePhase
from node.register import join_simulated
from tests.harness.background import Background
from tests.harness.burst import BurstStack
from tests.harness.burst import StartWorker
from tests.harness.burst import approve_batch
from tests.harness.burst import assert_serves_on_burst_node
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import node_gone
from tests.harness.burst import node_workflows
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.burst import wait_for
from tests.harness.burst import wait_phase
from tests.harness.clouds.aws_metadata import AwsMetadata
from tests.harness.clouds.moto_server import MotoServer
from tests.harness.kube import Kube
from tests.harness.kube import until

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

    def __init__(self, moto: MotoServer, gateway: KubeGateway, policy: str, state_dir: Path, *,
                 imds: AwsMetadata | None = None, first_attests: str = "") -> None:
        super().__init__()
        self.state_dir = state_dir
        self.ec2 = _ec2(moto)
        self.gateway = gateway
        self.policy = policy
        self.joined: dict[str, str] = {}
        # Where a node reads its signed identity (IMDS), and the instance whose identity the first node to boot
        # presents instead of its own: the ticket read from that node's user data, redeemed by another machine.
        self.imds = imds
        self.first_attests = first_attests

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
                if self.imds is not None:
                    attests = self.first_attests if self.first_attests and not self.joined else iid
                    doc["metadataUrl"] = self.imds.metadata_url(REGION, attests)
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


class Untainted(Background):
    """Watches the policy's Nodes and keeps the name of each one seen without the gateway's joining taint (from
    then on workloads may land on it), and of each one registered without the burn-in label (what has the gateway
    hold that taint until the optimizer's checks, the identity's first, have passed)."""

    def __init__(self, kube: Kube, policy: str) -> None:
        super().__init__()
        self.kube, self.policy, self.names, self.not_held = kube, policy, set[str](), set[str]()

    def _run(self) -> None:
        while not self._stop.is_set():
            stream = watch.Watch().stream(self.kube.core.list_node, label_selector=f"{LABEL_POLICY}={self.policy}",
                                          timeout_seconds=2)
            with contextlib.suppress(Exception):
                for event in stream:
                    node = event["object"]
                    if BURN_IN_LABEL not in (node.metadata.labels or {}):
                        self.not_held.add(node.metadata.name)
                    if not any(t.key == JOINING_TAINT.key for t in node.spec.taints or []):
                        self.names.add(node.metadata.name)


@pytest.mark.parametrize("burn_in", [None, {"checks": []}], ids=["default-burn-in", "no-burn-in-checks"])
async def test_a_node_attesting_another_instance_is_refused_and_replaced(
        stack: BurstStack, start_worker: StartWorker, moto_server: MotoServer, aws_location: dict[str, Any],
        namespace: str, policy: str, monkeypatch: pytest.MonkeyPatch, burn_in: dict[str, Any] | None) -> None:
    """Issue 27: the gateway verifies the signed identity (signature, region, account), but any machine of that
    account and region holding the ticket passes that. A machine in the burst account redeems the first node's
    ticket with its own genuine identity: the node fails (named: its instance, the launched one), the launched
    instance is terminated while the node still has its joining taint (so no pod can land, also with no burn-in
    checks at all), and the replacement serves with its attested identity in its "joined" audit record."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(var, "testing")
    ec2 = _ec2(moto_server)
    image = aws_location["aws"]["imageId"]
    thief = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, InstanceType="t3.micro")["Instances"][0]
    account = ec2.describe_instances(InstanceIds=[thief["InstanceId"]])["Reservations"][0]["OwnerId"]
    imds = AwsMetadata(moto_server.endpoint, ec2=lambda _region: ec2).start()
    # AWS publishes each region's signing certificate itself: that is the trust root (the node sends none).
    attestation = AttestationVerifier(roots={"aws": [imds.ca.signer]}, accounts={"aws": account})
    deploy = unique("attest")
    try:
        async with start_worker([aws_location], aws_endpoint_url=moto_server.endpoint, node_retry_seconds=1,
                                attestation=attestation) as (temporal, settings, runtime):
            assert isinstance(runtime.gateway, KubeGateway)
            try:
                stack.create_policy(policy, mode="Automatic", locations=[f"aws/{REGION}"], max_nodes=1,
                                    burn_in=burn_in)
                with BootedInstances(moto_server, runtime.gateway, policy, stack.workdir / f"aws-nodes-{policy}",
                                     imds=imds, first_attests=thief["InstanceId"]) as booted, \
                        Untainted(stack.cluster.admin, policy) as untainted:
                    stack.cluster.admin.apps.create_namespaced_deployment(
                        namespace, gpu_deployment(deploy, gpu_product="NVIDIA-A10G"))
                    first = await node_for(temporal, settings.cluster, policy, f"{namespace}/{deploy}-")
                    failed = await result(first)
                    assert failed.phase == NodePhase.FAILED, failed.message
                    assert failed.instance is not None
                    launched = failed.instance.instance_id
                    assert (f"the node joined with the attested identity of aws instance {thief['InstanceId']}, "
                            f"not of the launched instance {launched}") in failed.message, failed.message
                    state = ec2.describe_instances(InstanceIds=[launched])["Reservations"][0]["Instances"][0]
                    assert state["State"]["Name"] in ("shutting-down", "terminated")
                    assert node_gone(stack, failed.node_name)
                    mine = [(r.action, r.detail) for r in runtime.audit.read() if r.operation == failed.operation]
                    assert any(a == "failed" and thief["InstanceId"] in d for a, d in mine), mine
                    assert not any(a in ("joined", "verified") for a, _ in mine), mine
                    assert failed.node_name not in untainted.not_held, "the gateway did not hold its joining taint"
                    assert failed.node_name not in untainted.names, "its joining taint was lifted before it failed"

                    # Planned again: the next instance joins as itself and serves.
                    prefix = f"{namespace}/{deploy}-"
                    planned = await provision_state(temporal, settings.cluster, policy,
                                                    lambda v: len(node_workflows(v, prefix)) > 1, 90)
                    view = await wait_phase(temporal.get_workflow_handle(node_workflows(planned, prefix)[1]),
                                            NodePhase.SERVING, timeout=120)
                    assert view.instance is not None and booted.joined[view.instance.instance_id] == view.node_name
                    assert_serves_on_burst_node(stack, view, namespace, deploy, "aws.eu-central-1")
                    assert view.node_name in untainted.names, "the watch saw no taint lifted at all"
                    raw = ec2.describe_instances(InstanceIds=[view.instance.instance_id])["Reservations"][0]
                    zone = raw["Instances"][0]["Placement"]["AvailabilityZone"]
                    [joined] = [r for r in runtime.audit.read()
                                if r.operation == view.operation and r.action == "joined"]
                    assert joined.detail == (f"attested aws instance {view.instance.instance_id} in {zone}, "
                                             f"account {account} (the launched instance)")
            finally:  # the worker still runs: the serving node drains and goes home
                with contextlib.suppress(Exception):
                    stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
                await until(lambda: not stack.cluster.admin.core.list_node(
                    label_selector=f"{LABEL_POLICY}={policy}").items, timeout=120, what="the burst node home")
    finally:
        imds.stop()
        ec2.terminate_instances(InstanceIds=[thief["InstanceId"]])
