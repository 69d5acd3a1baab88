"""The documented test (R4.10), capacity failover, quota and crash safety on Google Cloud and Azure, each against
its local server through its official client: the instance carries the burst labels or tags, the node joins from
the instance's own user data, and nothing is left running when the operation ends."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import pytest
from kubernetes import client
from temporalio.testing import WorkflowEnvironment

from common.kube import kube_api
from gateway.service import KubeGateway
from models.labels import TAG_BURST
from models.labels import TAG_OPERATION
from models.node import NodePhase
from models.provisioning import BatchPhase
from tests.harness.burst import BurstStack
from tests.harness.burst import approve_batch
from tests.harness.burst import assert_serves_on_burst_node
from tests.harness.burst import gpu_deployment
from tests.harness.burst import in_process_worker
from tests.harness.burst import node_for
from tests.harness.burst import node_gone
from tests.harness.burst import node_workflows
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.burst import wait_for
from tests.harness.burst import wait_phase
from tests.harness.burst import worker_process
from tests.harness.clouds import local
from tests.harness.clouds.boot import Booter
from tests.harness.clouds.boot import gateway_join
from tests.harness.clouds.fake import FakeServer
from tests.harness.clouds.gcp_server import ZONES

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
CHEAP = [{"instanceType": "outside.gpu", "gpus": 1, "gpuProduct": "x", "usdPerHour": 0.01}]


@dataclass
class Cloud:
    """What a test needs of one cloud: its locations, faults, and a look at it through the official client."""

    name: str
    server: FakeServer
    home_region: str  # the seed's location
    cheap_region: str  # a second location, cheaper: tried first
    outside_region: str  # configured, cheapest of all, in no policy
    product: str
    best_type: str
    env: dict[str, str] = field(default_factory=dict)

    def location(self, region: str) -> dict[str, Any]:
        if self.name == "gcp":
            if region == self.outside_region:
                return local.gcp_location(region, project="outside-project",
                                           offerings=[{**o, "instanceType": "g2-standard-4"} for o in CHEAP])
            return local.gcp_location(region)
        extra = {"offerings": [{**o, "instanceType": "Standard_NC4as_T4_v3"} for o in CHEAP]} \
            if region == self.outside_region else {}
        return local.azure_location(region, **extra)

    def settings(self) -> dict[str, Any]:
        if self.name == "gcp":
            return {"gcp_endpoint_url": self.server.url}
        return {"azure_endpoint_url": self.server.url, "azure_ca_file": self.server.ca_file}

    def no_capacity(self, *regions: str) -> None:
        if self.name == "gcp":
            self.server.fault(stockout_zones=[z for r in regions for z in ZONES[r]])
        else:
            self.server.fault(allocation_failed_locations=list(regions))

    def outside_called(self) -> list[str]:
        marker = "/projects/outside-project/" if self.name == "gcp" else f"kubeon-burst-{self.outside_region}"
        return [r["path"] for r in self.server.requests()
                if marker in r["path"] or self.outside_region in str(r["query"].get("$filter", ""))]

    def creates(self, policy: str) -> list[str]:
        """Names of every instance a create call was made for, for the policy (in order)."""
        out = []
        for r in self.server.requests():
            body = r["body"] or {}
            if self.name == "gcp" and r["method"] == "POST" and r["path"].endswith("/instances"):
                if body.get("labels", {}).get("kubeon-burst") == policy.replace(".", "_"):
                    out.append(f"{r['path'].split('/zones/')[1].split('/')[0]}/{body['name']}")
            elif self.name == "azure" and r["method"] == "PUT" and body.get("tags", {}).get(TAG_BURST) == policy:
                out.append(f"{body['location']}/{r['path'].rsplit('/', 1)[1]}")
        return out

    def region_of(self, created: str) -> str:
        zone_or_region = created.split("/")[0]
        return zone_or_region.rsplit("-", 1)[0] if self.name == "gcp" else zone_or_region

    def live(self, policy: str) -> list[dict[str, Any]]:
        """The policy's instances that exist and are not being deleted, per the official client."""
        if self.name == "gcp":
            found = local.gcp_live(self.server, f'(labels.kubeon-burst = "{policy.replace(".", "_")}")')
            return [{"id": f"{i.zone.rsplit('/', 1)[1]}/{i.name}", "type": i.machine_type.rsplit("/", 1)[1],
                     "tags": dict(i.labels), "state": i.status} for i in found if i.status != "STOPPING"]
        compute = local.azure_compute(self.server)
        out = []
        for region in (self.home_region, self.cheap_region):
            for vm in compute.virtual_machines.list(local.azure_resource_group(region)):
                if (vm.tags or {}).get(TAG_BURST) == policy and vm.properties.provisioning_state != "Deleting":
                    out.append({"id": vm.name, "type": vm.properties.hardware_profile.vm_size, "tags": vm.tags,
                                "state": vm.properties.provisioning_state})
        return out

    def operation_tag(self, inst: dict[str, Any]) -> str:
        return str(inst["tags"]["kubeon-operation" if self.name == "gcp" else TAG_OPERATION])


@pytest.fixture(scope="module", params=["gcp", "azure"])
def cloud(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    logdir = tmp_path_factory.mktemp(request.param)
    if request.param == "gcp":
        server = local.start_gcp(logdir)
        yield Cloud("gcp", server, "europe-west4", "us-central1", "us-east1", "NVIDIA-A100-SXM4-40GB",
                    "a2-highgpu-1g")
    else:
        server = local.start_azure(logdir)
        yield Cloud("azure", server, "westeurope", "eastus", "northeurope", "Tesla-T4", "Standard_NC4as_T4_v3",
                    env=local.azure_identity_env(server))
    server.stop()


@pytest.fixture
def policy(stack: BurstStack, cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    cloud.server.reset()
    for key, value in cloud.env.items():
        monkeypatch.setenv(key, value)
    name = unique(cloud.name)
    yield name
    stack.delete_policy(name)


@contextlib.asynccontextmanager
async def worker(stack: BurstStack, temporal: WorkflowEnvironment, cloud: Cloud, regions: list[str]
                 ) -> AsyncIterator[tuple[Any, str, KubeGateway]]:
    locations = [cloud.location(r) for r in regions]
    async with in_process_worker(stack, temporal, locations, **cloud.settings()) as (client_, settings, runtime):
        assert isinstance(runtime.gateway, KubeGateway)
        yield client_, settings.cluster, runtime.gateway


def _deploy(stack: BurstStack, namespace: str, cloud: Cloud) -> str:
    deploy = unique("infer")
    stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy, gpu_product=cloud.product))
    return deploy


async def test_documented_burst(stack: BurstStack, temporal_dev_server: WorkflowEnvironment, cloud: Cloud,
                                namespace: str, policy: str) -> None:
    home = f"{cloud.name}/{cloud.home_region}"
    async with worker(stack, temporal_dev_server, cloud, [cloud.home_region, cloud.outside_region]) as (
            temporal, cluster_name, gateway):
        stack.create_policy(policy, mode="Approve", locations=[home], max_nodes=4)
        deploy = _deploy(stack, namespace, cloud)
        proposed = await provision_state(temporal, cluster_name, policy, lambda v: v.proposal is not None)
        assert proposed.proposal is not None and proposed.phase == BatchPhase.AWAITING_APPROVAL
        (planned,) = proposed.proposal.plan.new_nodes
        assert planned.offering.instance_type == cloud.best_type and planned.offering.location == home
        assert planned.pods and all(p.startswith(f"{namespace}/{deploy}-") for p in planned.pods)
        assert cloud.live(policy) == []

        with Booter(cloud.server, gateway_join(gateway)) as booted:
            batch, handle = await approve_batch(temporal, cluster_name, policy, f"{namespace}/{deploy}-", "bob")
            assert batch.batch == proposed.proposal.batch
            view = await wait_phase(handle, NodePhase.SERVING, timeout=120)
            assert view.batch == batch.batch
            assert view.instance is not None
            [inst] = cloud.live(policy)
            assert inst["id"] == view.instance.instance_id and inst["type"] == cloud.best_type
            assert cloud.operation_tag(inst) == view.operation
            assert list(booted.joined.values()) == [view.node_name], booted.errors

            assert_serves_on_burst_node(stack, view, namespace, deploy, home.replace("/", "."))

            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            done = await result(handle)
        assert done.phase == NodePhase.COMPLETED, done.message
        wait_for(lambda: node_gone(stack, view.node_name), what="node gone")
        wait_for(lambda: cloud.live(policy) == [], what="no instance left")
        assert cloud.outside_called() == [], "a location outside the policy was called"


async def test_capacity_fails_over_to_the_next_location(stack: BurstStack, temporal_dev_server: WorkflowEnvironment,
                                                        cloud: Cloud, namespace: str, policy: str) -> None:
    cheap, home = f"{cloud.name}/{cloud.cheap_region}", f"{cloud.name}/{cloud.home_region}"
    cloud.no_capacity(cloud.cheap_region)
    async with worker(stack, temporal_dev_server, cloud, [cloud.cheap_region, cloud.home_region,
                                                          cloud.outside_region]) as (temporal, cluster_name, gateway):
        stack.create_policy(policy, mode="Automatic", locations=[cheap, home])
        deploy = _deploy(stack, namespace, cloud)
        handle = await node_for(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
        with Booter(cloud.server, gateway_join(gateway)) as booted:
            view = await wait_phase(handle, NodePhase.SERVING, timeout=120)
            # Planned in the cheaper location; it had no capacity, so the node fell back to its alternatives.
            assert view.node is not None and view.node.offering.location == cheap
            assert home in [o.location for o in view.node.alternatives]
            assert all(o.location in (cheap, home) for o in view.node.alternatives)
            assert view.instance is not None and view.instance.location == home
            assert list(booted.joined.values()) == [view.node_name], booted.errors
            # Every zone of the cheaper region (for each of its candidate types), then the next location.
            regions = [cloud.region_of(c) for c in cloud.creates(policy)]
            assert regions[-1] == cloud.home_region and set(regions[:-1]) == {cloud.cheap_region}, regions
            if cloud.name == "gcp":
                zones = [c.split("/")[0] for c in cloud.creates(policy)[:4]]
                assert zones == ZONES[cloud.cheap_region], zones
            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            assert (await result(handle)).phase == NodePhase.COMPLETED
        wait_for(lambda: cloud.live(policy) == [], what="no instance left")
        assert cloud.outside_called() == []


async def test_no_capacity_anywhere_fails_with_nothing_running(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, cloud: Cloud, namespace: str, policy: str) -> None:
    cloud.no_capacity(cloud.cheap_region, cloud.home_region)
    async with worker(stack, temporal_dev_server, cloud, [cloud.cheap_region, cloud.home_region]) as (
            temporal, cluster_name, _):
        stack.create_policy(policy, mode="Automatic", locations=[f"{cloud.name}/{cloud.cheap_region}",
                                                                 f"{cloud.name}/{cloud.home_region}"])
        deploy = _deploy(stack, namespace, cloud)
        pods = f"{namespace}/{deploy}-"
        handle = await node_for(temporal, cluster_name, policy, pods)
        done = await result(handle)
        assert done.phase == NodePhase.FAILED
        assert "no capacity in any eligible location" in done.message
        assert cloud.cheap_region in done.message and cloud.home_region in done.message
        assert done.node is not None
        tried = {o.location for o in [done.node.offering, *done.node.alternatives]}
        assert tried == {f"{cloud.name}/{cloud.cheap_region}", f"{cloud.name}/{cloud.home_region}"}
        assert {cloud.region_of(c) for c in cloud.creates(policy)} == {cloud.cheap_region, cloud.home_region}, \
            "each location was tried"
        # The provisioning holds no node for it any more; the pod waits to be planned again after a back-off.
        after = await provision_state(temporal, cluster_name, policy,
                                      lambda v: handle.id not in {n.workflow_id for n in v.nodes})
        assert after.nodes == [] and any(w.startswith(pods) for w in after.waiting)
        assert node_workflows(after, pods) == [handle.id]
        assert any(handle.id in h and "no capacity" in h for h in after.history), after.history
        wait_for(lambda: cloud.live(policy) == [], what="nothing running")
        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    wait_for(lambda: cloud.live(policy) == [], what="nothing running")


async def test_quota_fails_clearly_without_retrying(stack: BurstStack, temporal_dev_server: WorkflowEnvironment,
                                                    cloud: Cloud, namespace: str, policy: str) -> None:
    if cloud.name == "gcp":
        cloud.server.fault(quota={"metric": "NVIDIA_A100_GPUS"})
        named = "NVIDIA_A100_GPUS"
    else:
        cloud.server.fault(quota={"family": "standardNCASv3_T4Family"})
        named = "standardNCASv3_T4Family"
    async with worker(stack, temporal_dev_server, cloud, [cloud.home_region]) as (temporal, cluster_name, _):
        stack.create_policy(policy, mode="Automatic", locations=[f"{cloud.name}/{cloud.home_region}"])
        deploy = _deploy(stack, namespace, cloud)
        pods = f"{namespace}/{deploy}-"
        handle = await node_for(temporal, cluster_name, policy, pods)
        done = await result(handle)
        assert done.phase == NodePhase.FAILED
        assert named in done.message and "quota" in done.message
        assert len(cloud.creates(policy)) == 1, "a quota error is not retried (nor another offering tried)"
        # The provisioning shows the node failed on the quota, and holds no node for it any more.
        after = await provision_state(temporal, cluster_name, policy,
                                      lambda v: handle.id not in {n.workflow_id for n in v.nodes})
        assert after.nodes == [] and node_workflows(after, pods) == [handle.id]
        assert any(handle.id in h and named in h for h in after.history), after.history
        stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    assert len(cloud.creates(policy)) == 1, "a quota error is not retried"
    assert cloud.live(policy) == []


async def test_killed_after_the_create_is_sent_is_one_instance(
        stack: BurstStack, temporal_dev_server: WorkflowEnvironment, cloud: Cloud, namespace: str, policy: str) -> None:
    """SIGKILL of the worker after the insert / PUT reached the cloud and before its answer did."""
    queue = unique("crash")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=[cloud.location(cloud.home_region)], cluster_name=queue,
                              **cloud.settings())
    stack.create_policy(policy, mode="Automatic", locations=[f"{cloud.name}/{cloud.home_region}"])
    cloud.server.fault(slow_create_seconds=8)
    log = stack.workdir / f"{queue}.log"
    procs = [worker_process(settings, log, stack=stack)]
    gateway = KubeGateway(kube_api(stack.gateway_kubeconfig), stack.ticket_key_file.read_bytes().strip())
    deploy = _deploy(stack, namespace, cloud)
    try:
        wait_for(lambda: len(cloud.creates(policy)) == 1, what="the create sent", timeout=120)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the cloud is still holding its answer
        procs[0].wait(timeout=10)
        cloud.server.fault(slow_create_seconds=0)
        procs.append(worker_process(settings, log, stack=stack))
        # The node workflow the batch started (asked of the provisioning: a worker is running again).
        handle = await node_for(temporal_dev_server.client, queue, policy, f"{namespace}/{deploy}-", timeout=90)
        with Booter(cloud.server, gateway_join(gateway)) as booted:
            view = await wait_phase(handle, NodePhase.SERVING, timeout=180)
            assert view.instance is not None
            assert [i["id"] for i in cloud.live(policy)] == [view.instance.instance_id]
            assert cloud.operation_tag(cloud.live(policy)[0]) == view.operation
            assert list(booted.joined.values()) == [view.node_name], booted.errors
            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
            done = await result(handle, timeout=150)
        assert done.phase == NodePhase.COMPLETED, done.message
        assert len(set(cloud.creates(policy))) == 1, cloud.creates(policy)
        # One node workflow for the one pod: the crash did not make the provisioning plan it again.
        final = await provision_state(temporal_dev_server.client, queue, policy)
        assert node_workflows(final, f"{namespace}/{deploy}-") == [handle.id]
        wait_for(lambda: cloud.live(policy) == [], what="no instance left")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        with contextlib.suppress(client.ApiException):
            stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
