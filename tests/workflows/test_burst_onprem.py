"""R4.10 with an on-prem pool, end to end: the hub as a real process holding the pool `onprem/dc1`, server agents
as their own processes (`kubeon-gpu onprem-agent --simulated`, enrolled with the pool's token, pinned to the
cluster's gateway), the gateway's real HTTP app checking the claims the hub signs, the real control plane, the
Temporal dev server and the worker."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from temporalio.client import Client
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from common.kube import kube_api
from gateway.pool_tokens import POOL_CLAIM_HEADER
from gateway.service import KubeGateway
from models import pool_claim
from models.join import JoinTicketRequest
from models.join import burst_node_name
from models.labels import LABEL_LOCATION
from models.labels import Taint
from models.node import NodePhase
from models.policy import API_GROUP
from models.policy import PLURAL
from models.provisioning import ProvisionView
from node.join import JoinRefusedByGateway
from tests.harness.burst import BURST_TAINT_KEY
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import approve_batch
from tests.harness.burst import build_stack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import provision_state
from tests.harness.burst import unique
from tests.harness.burst import wait_phase
from tests.harness.joining import join_over_http
from tests.harness.joining import new_burst_node
from tests.harness.kube import Cluster
from tests.harness.kube import until
from tests.harness.onprem import AgentProcess
from tests.harness.onprem import GatewayThread
from tests.harness.onprem import claim_keys
from tests.harness.onprem import register_server
from tests.harness.onprem import write_gateways
from tests.hub.conftest import BOOTSTRAP_KEY
from tests.hub.process import HubProcess
from worker.main import worker_services

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]
POOL = "dc1"
LOCATION = f"onprem/{POOL}"
LOCATIONS: list[dict[str, Any]] = [{"name": LOCATION}, SIM_LOCATIONS[0]]
OFFLINE_AFTER = 5


@dataclass
class OnPrem:
    stack: BurstStack
    hub: HubProcess
    admin: httpx.Client
    cluster: str
    join_token_file: Path
    gateway: GatewayThread
    workdir: Path
    temporal: Client | None = None
    agents: list[AgentProcess] = field(default_factory=list)

    def agent(self, server: str) -> AgentProcess:
        if not self.server(server):
            register_server(self.hub.url, BOOTSTRAP_KEY, POOL, server)
        gateways = write_gateways(self.workdir / "gateways.yaml", {self.cluster: self.gateway.url})
        agent = AgentProcess(hub_url=self.hub.url, join_token_file=self.join_token_file, pool=POOL, server=server,
                             state_dir=self.workdir / f"agent-{server}", gateways_file=gateways)
        self.agents.append(agent)
        return agent.start()

    def server(self, name: str) -> dict[str, Any]:
        r = self.admin.get(f"/v1/pools/{POOL}")
        assert r.status_code == 200, r.text
        found: dict[str, Any] = next((s for s in r.json()["servers"] if s["name"] == name), {})
        return found

    async def server_in(self, name: str, *states: str, timeout: float = 30) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            s = self.server(name)
            return s if s.get("state") in states else None

        return await until(check, timeout=timeout, what=f"server {name} {'/'.join(states)} in the hub",
                           retry_on=(httpx.HTTPError,))

    def audit(self) -> list[dict[str, Any]]:
        r = self.admin.get("/v1/audit", params={"limit": 1000})
        assert r.status_code == 200, r.text
        return [e for e in r.json()["events"] if e["action"].startswith("pool.")]

    async def policy(self) -> str:
        name = unique("onprem")
        doc = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": name},
               "spec": {"kind": "Burst", "mode": "Approve", "workloads": {"tolerate": BURST_TAINT_KEY},
                        "locations": [LOCATION, "sim/eu-west"], "limits": {"maxNodes": 2, "maxGpuHour": 4.5},
                        "returnHome": True}}
        r = self.admin.put(f"/v1/clusters/{self.cluster}/policies/{name}", json=doc)
        assert r.status_code == 201, r.text

        def synced() -> bool:
            return bool(self.stack.cluster.admin.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, name))

        await until(synced, timeout=30, what=f"policy {name} synced from the hub")
        return name

    async def proposed(self, namespace: str, policy: str) -> tuple[str, ProvisionView]:
        """A deployment of one L4 pod, and the provisioning's state once it proposes a batch for it."""
        assert self.temporal is not None
        deploy = unique("infer")
        self.stack.cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        prefix = f"{namespace}/{deploy}-"
        view = await provision_state(self.temporal, self.cluster, policy, lambda v: v.proposal is not None and any(
            p.startswith(prefix) for n in v.proposal.plan.new_nodes for p in n.pods))
        return deploy, view

    async def approve(self, namespace: str, policy: str, deploy: str) -> WorkflowHandle[Any, Any]:
        """Approve the batch proposed for the deployment's pod: the handle of the node workflow it started."""
        assert self.temporal is not None
        _, handle = await approve_batch(self.temporal, self.cluster, policy, f"{namespace}/{deploy}-")
        return handle

    def nodes(self, policy: str) -> list[str]:
        items = self.stack.cluster.admin.core.list_node(label_selector=f"gpu.kubeon.io/policy={policy}").items
        return [str(n.metadata.name) for n in items]


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> BurstStack:
    return build_stack(cluster, tmp_path_factory.mktemp("onprem"))


@pytest.fixture
def onprem_hub(stack: BurstStack, tmp_path: Path) -> Iterator[OnPrem]:
    key_file = tmp_path / "bootstrap.key"
    key_file.write_text(BOOTSTRAP_KEY + "\n")
    hub = HubProcess(["--database-url", f"sqlite:///{tmp_path / 'hub.db'}", "--bootstrap-admin-key-file",
                      str(key_file)], logdir=tmp_path).start()
    admin = httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {BOOTSTRAP_KEY}"}, timeout=10)
    cluster = unique("c")
    created = admin.post("/v1/clusters", json={"name": cluster})
    assert created.status_code == 201, created.text
    (tmp_path / "cluster.token").write_text(created.json()["token"]["token"])
    pool = admin.post("/v1/pools", json={"name": POOL, "offline_after_seconds": OFFLINE_AFTER,
                                         "rate_card": {"usd_per_gpu_hour": {"NVIDIA-L4": 0.35}}})
    assert pool.status_code == 201, pool.text
    join_token = pool.json()["join_token"]["token"]
    join_token_file = tmp_path / "join.token"
    join_token_file.write_text(join_token)
    gateway = GatewayThread(stack.gateway_kubeconfig, stack.ticket_key_file.read_bytes().strip(),
                            tmp_path / "hub-claim-keys.pem")
    gateway.mount_claim_keys(claim_keys(hub.url))  # no pool secret in the cluster: the hub's public keys
    env = OnPrem(stack=stack, hub=hub, admin=admin, cluster=cluster, join_token_file=join_token_file,
                 gateway=gateway, workdir=tmp_path)
    try:
        yield env
    finally:
        for agent in env.agents:
            agent.stop()
        gateway.stop()
        admin.close()
        hub.stop()


@pytest.fixture
async def onprem(onprem_hub: OnPrem, stack: BurstStack, temporal_dev_server: WorkflowEnvironment
                 ) -> AsyncIterator[OnPrem]:
    env = onprem_hub
    settings = stack.settings(
        temporal_address=temporal_dev_server.client.service_client.config.target_host, task_queue=unique("q"),
        locations=LOCATIONS, cluster_name=env.cluster, hub_url=env.hub.url,
        hub_token_file=env.workdir / "cluster.token", hub_poll_interval=1.0, gateway_url=env.gateway.url)
    async with worker_services(settings, stack.runtime(settings)) as (temporal, _runtime, _watcher):
        env.temporal = temporal
        try:
            yield env
        finally:
            from models.hub import hub_sync_workflow_id

            await temporal.get_workflow_handle(hub_sync_workflow_id(env.cluster)).terminate("test over")
            for obj in stack.cluster.admin.custom.list_cluster_custom_object(API_GROUP, "v1", PLURAL)["items"]:
                stack.delete_policy(obj["metadata"]["name"])


async def _serve_then_remove(env: OnPrem, namespace: str, server: str) -> tuple[Any, str]:
    policy = await env.policy()
    deploy, proposed = await env.proposed(namespace, policy)
    assert proposed.proposal is not None
    (planned,) = proposed.proposal.plan.new_nodes
    assert planned.offering.location == LOCATION  # the pool is cheapest: 0.35 USD/GPU-h, transfer 0
    assert planned.offering.transfer_usd_per_gpu_hour == 0
    handle = await env.approve(namespace, policy, deploy)
    view = await wait_phase(handle, NodePhase.SERVING, timeout=90)
    node = env.stack.cluster.admin.core.read_node(str(view.node_name))
    assert node.metadata.labels[LABEL_LOCATION] == "onprem.dc1"
    assert node.spec.provider_id == f"onprem://{POOL}/{server}"
    assert any(t.key == BURST_TAINT_KEY and t.effect == "NoSchedule" for t in node.spec.taints)
    pods = env.stack.cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
    assert [p.spec.node_name for p in pods] == [view.node_name]
    serving = await env.server_in(server, "serving")
    assert serving["claim_cluster"] == env.cluster and serving["claim_operation"] == view.operation
    env.stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    await wait_phase(handle, NodePhase.COMPLETED, timeout=120)
    return view, policy


async def test_r4_10_claim_join_serve_drain_release_the_server_is_idle_again(
        onprem: OnPrem, namespace: str) -> None:
    onprem.gateway.start()
    agent = onprem.agent("gpu-a")
    await onprem.server_in("gpu-a", "idle")
    view, policy = await _serve_then_remove(onprem, namespace, "gpu-a")

    await until(lambda: not onprem.nodes(policy), timeout=30, what="the burst Node removed")
    idle = await onprem.server_in("gpu-a", "idle")
    assert idle["claim_operation"] is None and idle["claim_cluster"] is None
    assert not agent.credentials_dir.exists()  # credentials wiped
    assert agent.state().get("user_data") is None and agent.state()["phase"] == "idle"
    events = [(e["action"], e["detail"].get("operation")) for e in onprem.audit()]
    assert ("pool.server_claimed", view.operation) in events
    assert ("pool.server_released", view.operation) in events
    claimed = next(e for e in onprem.audit() if e["action"] == "pool.server_claimed")
    assert claimed["actor"] == f"cluster:{onprem.cluster}" and claimed["detail"]["location"] == LOCATION


async def test_agent_killed_while_joining_resumes_with_the_same_ticket(onprem: OnPrem, namespace: str) -> None:
    # The gateway is not up yet: the agent picks the claim up and cannot join; it is killed there.
    agent = onprem.agent("gpu-a")
    await onprem.server_in("gpu-a", "idle")
    policy = await onprem.policy()
    deploy, _ = await onprem.proposed(namespace, policy)
    handle = await onprem.approve(namespace, policy, deploy)
    view = await wait_phase(handle, NodePhase.LAUNCHING, NodePhase.JOINING)  # the operation the claim carries
    await onprem.server_in("gpu-a", "joining")
    await until(lambda: agent.state().get("phase") == "joining" or None, timeout=10, what="agent joining")
    agent.kill()
    assert agent.state()["operation"] == view.operation and agent.state()["user_data"]
    onprem.gateway.start()
    agent.start()  # the reboot: it resumes from its state file
    view = await wait_phase(handle, NodePhase.SERVING, timeout=90)
    assert view.node_name in onprem.nodes(policy)
    assert "joined cluster" in agent.log
    await _remove(onprem, namespace, deploy, handle, policy)
    await onprem.server_in("gpu-a", "idle")


async def _remove(env: OnPrem, namespace: str, deploy: str, handle: WorkflowHandle[Any, Any], policy: str) -> None:
    """Remove the workload and wait until its burst node is gone (a Node left behind would take later pods)."""
    env.stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    await wait_phase(handle, NodePhase.COMPLETED, timeout=120)
    await until(lambda: not env.nodes(policy), timeout=30, what="the burst Node removed")


async def test_hub_down_during_release_the_release_is_delivered_when_it_is_back(
        onprem: OnPrem, namespace: str) -> None:
    onprem.gateway.start()
    onprem.agent("gpu-a")
    await onprem.server_in("gpu-a", "idle")

    async def hub_down() -> None:
        onprem.hub.stop()

    view, policy = await _serve_then_remove_hub_down(onprem, namespace, hub_down)
    await until(lambda: not onprem.nodes(policy), timeout=30, what="the burst Node removed")
    idle = await onprem.server_in("gpu-a", "idle", timeout=60)
    assert idle["claim_operation"] is None
    released = [e for e in onprem.audit() if e["action"] == "pool.server_released"]
    assert [e["detail"]["operation"] for e in released] == [view.operation]


async def _serve_then_remove_hub_down(env: OnPrem, namespace: str, hub_down: Callable[[], Any]) -> tuple[Any, str]:
    policy = await env.policy()
    deploy, _ = await env.proposed(namespace, policy)
    handle = await env.approve(namespace, policy, deploy)
    view = await wait_phase(handle, NodePhase.SERVING, timeout=90)
    await env.server_in("gpu-a", "serving")
    await hub_down()
    env.stack.cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
    # The drain runs; the release (terminate) cannot reach the hub and is retried.
    await wait_phase(handle, NodePhase.DRAINING, timeout=60)
    assert env.temporal is not None

    async def release_retried() -> bool:
        # The drain child's terminate (the release) has failed at least once against the stopped hub.
        drain = env.temporal.get_workflow_handle(f"drain/{handle.id}/{view.operation}")
        try:
            desc = await drain.describe()
        except Exception:
            return False
        return any(a.activity_type.name == "terminate_instance" and a.attempt >= 2 for a in desc.raw_description
                   .pending_activities)

    deadline = time.monotonic() + 90
    while not await release_retried():
        assert time.monotonic() < deadline, "the release was not retried while the hub is down"
        await asyncio.sleep(0.5)
    state = await handle.query("state", result_type=type(view))
    assert state.phase in (NodePhase.DRAINING,), state.phase  # not done: the server is not released yet
    env.hub.start()
    await wait_phase(handle, NodePhase.COMPLETED, timeout=120)
    return view, policy


async def test_server_offline_while_claimed_fails_over_to_the_next_location(onprem: OnPrem, namespace: str) -> None:
    onprem.gateway.start()
    agent = onprem.agent("gpu-a")
    await onprem.server_in("gpu-a", "idle")
    policy = await onprem.policy()
    deploy, proposed = await onprem.proposed(namespace, policy)
    assert proposed.proposal is not None
    (planned,) = proposed.proposal.plan.new_nodes
    assert planned.offering.location == LOCATION
    assert "sim/eu-west" in [o.location for o in planned.alternatives]  # the next location, tried on no capacity
    agent.signal(signal.SIGSTOP)  # silent from now on, still online in the hub for OFFLINE_AFTER seconds
    handle = await onprem.approve(namespace, policy, deploy)
    view = await wait_phase(handle, NodePhase.SERVING, timeout=90)
    assert view.instance is not None and view.instance.location == "sim/eu-west"
    assert view.history and any("onprem/dc1" in h for h in view.history), view.history
    events = [e["action"] for e in onprem.audit()]
    assert "pool.server_claimed" in events and "pool.claim_withdrawn" in events
    offline = onprem.server("gpu-a")
    assert offline["state"] == "offline" and offline["claim_operation"] is None
    agent.signal(signal.SIGCONT)  # back: told nothing, idle, claimable again
    await onprem.server_in("gpu-a", "idle")
    assert agent.state().get("phase", "idle") == "idle"
    await _remove(onprem, namespace, deploy, handle, policy)


def test_the_gateway_refuses_a_server_without_the_hubs_claim_for_it(stack: BurstStack, tmp_path: Path) -> None:
    hub_key = Ed25519PrivateKey.generate()
    gateway = GatewayThread(stack.gateway_kubeconfig, stack.ticket_key_file.read_bytes().strip(), tmp_path / "k.pem")
    gateway.mount_claim_keys(pool_claim.public_pem(hub_key.public_key()))
    gateway.start()
    signer = KubeGateway(kube_api(stack.gateway_kubeconfig), stack.ticket_key_file.read_bytes().strip())
    try:
        def ticket(location: str, operation: str) -> str:
            return signer.sign_ticket(JoinTicketRequest(
                operation=operation, policy="p", location=location, node_name=burst_node_name(operation),
                labels={}, taints=[Taint(key=BURST_TAINT_KEY)]))

        def claim(key: Ed25519PrivateKey, node: str, for_ticket: str) -> str:
            now = int(time.time())
            return pool_claim.sign(key, pool_claim.PoolClaim(
                kid=pool_claim.key_id(key.public_key()), pool=POOL, server="gpu-a", cluster="c",
                operation=operation, node=node, ticket_sha256=pool_claim.ticket_digest(for_ticket),
                iat=now, exp=now + 600))

        capacity = {"cpu": "1", "pods": "10"}
        operation, node = new_burst_node()
        mine = ticket(LOCATION, operation)
        other = ticket(LOCATION, new_burst_node()[0])
        for presented, why in ((None, "must present"), ("kgp_0123456789abcdef_" + "a" * 43, "malformed"),
                               (claim(Ed25519PrivateKey.generate(), node, mine), "not one of the hub's keys"),
                               (claim(hub_key, node, other), "ticket differ")):
            transport = None
            if presented is not None:
                def transport(verify: Any, token: str = presented) -> httpx.BaseTransport:
                    return _Header(httpx.HTTPTransport(verify=verify), token)
            with pytest.raises(JoinRefusedByGateway, match=why):
                join_over_http(gateway.url, mine, capacity, {}, "", transport=transport)
    finally:
        gateway.stop()


class _Header(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, token: str) -> None:
        self.inner, self.token = inner, token

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.headers[POOL_CLAIM_HEADER] = self.token
        return self.inner.handle_request(request)
