"""The join for real, on real parts, every non-loopback address inside namespaces this test creates (see
tests/harness/netbed.py): `kubeon-gpu gateway` with wireguard-go in its namespace, a burst node in its own running
`kubeon-gpu node join` and the kubelet stand-in with only its own certificate, all through the tunnel."""

from __future__ import annotations

import contextlib
import json
import signal
import ssl
import sys
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from kubernetes import client
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from activities.clients.audit_log import AuditLog
from activities.clients.gateway import GatewayRefused
from activities.clients.gateway import HttpGatewayClient
from gateway.slots import Slot
from gateway.tunnel_end import GatewayTunnel
from models.errors import TicketError
from models.join import GpuHealth
from models.join import JoinTicketRequest
from models.join import render_user_data
from models.labels import BURNED_IN_ANNOTATION
from models.labels import JOINING_TAINT
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.labels import Taint
from models.node import Instance
from models.node import NodePhase
from models.provisioning import BatchPhase
from tests.gateway.helpers import BURST_TAINT
from tests.harness.burst import SIM_LOCATIONS
from tests.harness.burst import BurstStack
from tests.harness.burst import approve_batch
from tests.harness.burst import build_stack
from tests.harness.burst import gpu_deployment
from tests.harness.burst import node_for
from tests.harness.burst import provision_state
from tests.harness.burst import result
from tests.harness.burst import unique
from tests.harness.burst import wait_phase
from tests.harness.joining import new_burst_node
from tests.harness.kube import Cluster
from tests.harness.kube import until
from tests.harness.kube import wait_for
from tests.harness.netbed import GATEWAY_PUBLIC_IP
from tests.harness.netbed import SERVICE_CIDR
from tests.harness.netbed import UDP_PORT
from tests.harness.netbed import Gateway
from tests.harness.netbed import Joined
from tests.harness.netbed import NetBed
from tests.harness.netbed import boot_node
from tests.harness.netbed import sh
from tests.harness.netbed import wireguard_device
from tests.harness.rbac import GATEWAY_SA
from tests.harness.rbac import OPTIMIZER_NAMESPACE
from tests.harness.rbac import OPTIMIZER_SA
from tunnel import keys
from tunnel.uapi import Uapi
from worker.main import worker_services

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent.parent
SERVICE_IP = "10.96.77.77"
MARKER = f"kubeon-marker-{uuid.uuid4().hex}"


def optimizer_token(cluster: Cluster, path: Path) -> Path:
    """A token of the optimizer's ServiceAccount (the gateway's allowed client) in ``path``."""
    path.write_text(cluster.service_account_token(OPTIMIZER_NAMESPACE, OPTIMIZER_SA))
    return path


def join_node(cluster: Cluster, bed: NetBed, gateway: Gateway, workdir: Path) -> Joined:
    """What launch_instance and the booting VM do: a ticket from the gateway (as the optimizer), user data,
    then `kubeon-gpu node join` in the node's own namespace, which starts the kubelet stand-in."""
    op, name = new_burst_node()
    token = optimizer_token(cluster, workdir / f"{name}.token")
    labels = {LABEL_OPERATION: op, LABEL_POLICY: "inference-burst", LABEL_LOCATION: "tunnel.test"}
    with HttpGatewayClient(gateway.url, token, ca_file=gateway.ca_file) as http:
        grant_ = http.issue_ticket(JoinTicketRequest(
            operation=op, policy="inference-burst", location="sim/eu-west", node_name=name, labels=labels,
            taints=[Taint(key=BURST_TAINT)], gpus=1))
    assert grant_.endpoint == f"https://{GATEWAY_PUBLIC_IP}:8443"
    user_data = render_user_data(gateway_url=grant_.endpoint, ticket=grant_.ticket, node_name=name, labels=labels,
                                 taints=[Taint(key=BURST_TAINT)], ca_bundle=gateway.ca_file.read_text())
    capacity = {"cpu": "8", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"}
    return boot_node(bed, user_data, capacity, workdir, f"sim://tunnel/{name}")


def ready(cluster: Cluster, name: str) -> bool:
    try:
        return cluster.node_ready(name)
    except client.ApiException:
        return False


def http_get(netns: str, url: str, timeout: float = 10) -> str:
    return sh(sys.executable, "-c", f"import urllib.request; print(urllib.request.urlopen({url!r}, "
              f"timeout={timeout}).read().decode())", netns=netns)



def test_the_node_registers_itself_through_the_tunnel(cluster: Cluster, gateway: Gateway, joined: Joined) -> None:
    # Its identity, asked through the tunnel from its own namespace with its own kubeconfig: system:node:<name>.
    who = sh(sys.executable, "-c", "import sys; from kubernetes import client; from node.register import node_api; "
             f"api = node_api(__import__('pathlib').Path({str(joined.state / 'kubelet.kubeconfig')!r})); "
             "print(client.AuthenticationV1Api(api).create_self_subject_review(client.V1SelfSubjectReview())"
             ".status.user_info.username)", netns=joined.node.netns).strip()
    assert who == f"system:node:{joined.name}"
    kubeconfig = (joined.state / "kubelet.kubeconfig").read_text()
    assert "https://10.250.0.1:443" in kubeconfig and "tls-server-name: kubernetes.default.svc" in kubeconfig
    # Its CSR: approved by the gateway, for the kubelet client signer.
    csrs = client.CertificatesV1Api(cluster.admin.api).list_certificate_signing_request().items
    mine = [c for c in csrs if c.spec.username == f"system:serviceaccount:{OPTIMIZER_NAMESPACE}:{GATEWAY_SA}"
            and c.status.certificate and joined.name in (c.status.conditions[0].message or "")]
    assert [(c.spec.signer_name, c.status.conditions[0].reason) for c in mine] == [
        ("kubernetes.io/kube-apiserver-client-kubelet", "KubeonGatewayValidated")]
    # Its Lease, renewed by the node itself; the ticket's labels and taint; the joining taint lifted.
    lease = client.CoordinationV1Api(cluster.admin.api).read_namespaced_lease(joined.name, "kube-node-lease")
    assert lease.spec.holder_identity == joined.name
    wait_for(lambda: JOINING_TAINT.key not in {t.key for t in cluster.admin.core.read_node(joined.name).spec.taints},
             timeout=30, what="the joining taint lifted")
    node = cluster.admin.core.read_node(joined.name)
    assert node.metadata.labels[LABEL_OPERATION] == joined.operation
    assert [(t.key, t.effect) for t in node.spec.taints] == [(BURST_TAINT, "NoSchedule")]
    assert node.spec.pod_cidr and node.spec.pod_cidr.startswith("10.245.")
    # The gateway's peer for it: its key, its tunnel IP and pod CIDR.
    peer = Uapi(gateway.bed.gateway_interface).get().peers[joined.public_key]
    assert sorted(peer.allowed_ips) == sorted([f"{node.status.addresses[0].address}/32", node.spec.pod_cidr])
    assert peer.last_handshake > 0
    # MSS clamped both ways through the tunnel; tunnel traffic to Services masqueraded.
    rules = sh("nft", "list", "table", "ip", "kubeon_gateway", netns=gateway.bed.gw)
    assert rules.count("tcp option maxseg size set rt mtu") == 2
    assert f"ip daddr {SERVICE_CIDR} masquerade" in rules


def test_the_burn_in_probe_finds_a_tunnel_that_drops_full_mtu_packets(cluster: Cluster, gateway: Gateway,
                                                                       joined: Joined, tmp_path: Path) -> None:
    token = optimizer_token(cluster, tmp_path / "optimizer.token")
    with HttpGatewayClient(gateway.url, token, ca_file=gateway.ca_file) as http:
        whole = http.probe(joined.name, operation=joined.operation)
        assert whole.tunnel and whole.answered and whole.mtu == 1380, whole
        assert whole.rtt_ms is not None and whole.detail == (
            f"a 1380-byte packet with DF reached {joined_tunnel_ip(cluster, joined)} and came back")
        # A path that drops big packets (DROP_FULL_MTU, in the node's namespace).
        sh("nft", "-f", "-", netns=joined.node.netns, input_text=DROP_FULL_MTU)
        try:
            dropped = http.probe(joined.name, operation=joined.operation)
        finally:
            sh("nft", "delete", "table", "ip", "kubeon_probe_test", netns=joined.node.netns)
        assert dropped.tunnel and not dropped.answered, dropped
        assert dropped.detail.endswith("the path drops full-MTU packets"), dropped.detail
        assert http.probe(joined.name, operation=joined.operation).answered
        # The optimizer probes only the node of the operation it names.
        with pytest.raises(TicketError, match="belongs to another operation"):
            http.probe(joined.name, operation="op-000000000000")
        with pytest.raises(GatewayRefused, match="no address slot for node burst-nobody"):
            http.probe("burst-nobody", operation=joined.operation)
    # And only the optimizer: no probe without its token.
    anonymous = httpx.post(f"{gateway.url}/v1/nodes/{joined.name}/probe", params={"operation": joined.operation},
                           timeout=5, verify=ssl.create_default_context(cafile=str(gateway.ca_file)))
    assert anonymous.status_code == 401 and "answered" not in anonymous.text


def joined_tunnel_ip(cluster: Cluster, joined: Joined) -> str:
    return str(cluster.admin.core.read_node(joined.name).status.addresses[0].address)


@pytest.fixture(scope="module")
def served(cluster: Cluster, bed: NetBed, joined: Joined, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[client.V1Pod]:
    """A pod on the burst node (the stand-in runs it: an HTTP server at its pod IP) and an in-cluster Service
    whose ClusterIP the cluster side answers with the marker."""
    ns = cluster.create_namespace("tunnel")
    cluster.admin.core.create_namespaced_pod(ns, client.V1Pod(
        metadata=client.V1ObjectMeta(name="infer"),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="registry.invalid/x:1")],
                              node_selector={"kubernetes.io/hostname": joined.name},
                              tolerations=[client.V1Toleration(key=BURST_TAINT, operator="Exists")],
                              termination_grace_period_seconds=0)))
    cluster.admin.core.create_namespaced_service(ns, client.V1Service(
        metadata=client.V1ObjectMeta(name="marker"),
        spec=client.V1ServiceSpec(cluster_ip=SERVICE_IP, ports=[client.V1ServicePort(port=80)])))
    site = tmp_path_factory.mktemp("site")
    (site / "marker.txt").write_text(MARKER)
    sh("ip", "addr", "add", f"{SERVICE_IP}/32", "dev", "lo", netns=bed.cl)
    bed.spawn([sys.executable, "-m", "http.server", "80", "--bind", SERVICE_IP, "--directory", str(site)],
              netns=bed.cl, log=site.parent / "service.log")

    def running() -> client.V1Pod | None:
        got = cluster.admin.core.read_namespaced_pod("infer", ns)
        return got if got.status.phase == "Running" and got.status.pod_ip else None

    wait_for(lambda: running() is not None, timeout=60, what="the pod Running on the burst node")
    yield running()  # type: ignore[misc]
    with contextlib.suppress(client.ApiException):
        cluster.admin.core.delete_namespace(ns)


def test_traffic_goes_through_the_tunnel_only(bed: NetBed, joined: Joined, served: client.V1Pod,
                                              tmp_path: Path) -> None:
    pcap, inner = tmp_path / "underlay.pcap", tmp_path / "tunnel.pcap"
    dumps = [bed.spawn(["tcpdump", "-i", iface, "-U", "-w", str(path)], netns=joined.node.netns,
                       log=tmp_path / f"{iface}.tcpdump.log")
             for iface, path in ((joined.node.underlay, pcap), (joined.node.interface, inner))]
    wait_for(lambda: all("listening on" in (tmp_path / f"{i}.tcpdump.log").read_text(errors="replace")
                         for i in (joined.node.underlay, joined.node.interface)
                         if (tmp_path / f"{i}.tcpdump.log").exists()) and pcap.exists() and inner.exists(),
             timeout=10, what="tcpdump capturing")
    # The node reaches an in-cluster Service through the tunnel...
    assert http_get(joined.node.netns, f"http://{SERVICE_IP}/marker.txt").strip() == MARKER
    # ...and the cluster side reaches the burst pod's address through the gateway.
    pod = f"{served.metadata.namespace}/{served.metadata.name}"
    assert http_get(bed.cl, f"http://{served.status.pod_ip}:8080/").strip() == f"kubeon-pod {pod}"
    # The positive control has the marker in clear: the capture has seen the traffic (packet-buffered, -U).
    wait_for(lambda: MARKER.encode() in inner.read_bytes(), timeout=10, what="the marker in the tunnel capture")
    for proc in dumps:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    lines = [x for x in sh("tcpdump", "-nn", "-r", str(pcap)).splitlines() if x.strip()]
    assert lines, "nothing captured on the underlay"
    gw = f"{GATEWAY_PUBLIC_IP}.{UDP_PORT}"
    # ARP (the underlay's neighbours resolving each other's MAC when their entry goes stale) carries no data: every
    # IP packet on the underlay must be the tunnel's UDP between the node and the gateway.
    packets = [x for x in lines if " ARP, " not in x]
    odd = [x for x in packets if " UDP" not in x or not (f"> {gw}:" in x or f"{gw} > {joined.node.address}." in x)]
    assert odd == [], odd[:5]
    assert MARKER.encode() not in pcap.read_bytes()
    assert MARKER.encode() in inner.read_bytes()  # positive control: in clear inside the tunnel only


def slot_keys(cluster: Cluster) -> set[str]:
    return {cm.data["wireguardPublicKey"] for cm in cluster.admin.core.list_namespaced_config_map(
        OPTIMIZER_NAMESPACE, label_selector="gpu.kubeon.io/gateway-record=slot").items
        if cm.data["wireguardPublicKey"]}


def test_a_reserved_slot_has_no_peer_and_the_resync_skips_it(
        cluster: Cluster, gateway: Gateway, joined: Joined, tmp_path: Path) -> None:
    """A ticket not redeemed yet holds its address slot without a WireGuard key: a restarted gateway's full
    resync (and every reconcile after it) leaves it out of the peers and still restores the joined node's."""
    token = optimizer_token(cluster, tmp_path / "token")
    op, name = new_burst_node()
    with HttpGatewayClient(gateway.url, token, ca_file=gateway.ca_file) as http:
        http.issue_ticket(JoinTicketRequest(
            operation=op, policy="inference-burst", location="sim/eu-west", node_name=name,
            labels={LABEL_OPERATION: op, LABEL_POLICY: "inference-burst", LABEL_LOCATION: "tunnel.test"},
            taints=[Taint(key=BURST_TAINT)], gpus=1))
        slots = cluster.admin.core.list_namespaced_config_map(
            OPTIMIZER_NAMESPACE, label_selector="gpu.kubeon.io/gateway-record=slot").items
        (reserved,) = [cm for cm in slots if cm.data["node"] == name]
        assert reserved.data["wireguardPublicKey"] == ""
        assert gateway.stop() in (0, -signal.SIGTERM), gateway.log
        keyed = slot_keys(cluster)
        gateway.start()  # resyncs every peer from the slots before it is ready
        # Peers come only from slots with a key (the joined node's; others that earlier tests' gateways left in
        # this namespace, which the reconciler may be releasing meanwhile); the reservation has none.
        peers = set(Uapi(gateway.bed.gateway_interface).get().peers)
        assert joined.public_key in peers and "" not in peers and peers <= keyed | slot_keys(cluster)
        assert "cannot restore the tunnel's peers" not in gateway.log
        assert "gateway reconcile failed" not in gateway.log
        assert http.remove_node(name, operation=op) is False  # never joined: the reservation goes
    slots = cluster.admin.core.list_namespaced_config_map(
        OPTIMIZER_NAMESPACE, label_selector="gpu.kubeon.io/gateway-record=slot").items
    assert all(cm.data["node"] != name for cm in slots)


def test_a_restarted_gateway_restores_the_peer_and_the_node_stays_ready(
        cluster: Cluster, gateway: Gateway, joined: Joined, served: client.V1Pod) -> None:
    assert gateway.stop() in (0, -signal.SIGTERM), gateway.log
    assert not Uapi(gateway.bed.gateway_interface).path.exists()  # its wireguard-go went with it
    restarted = time.monotonic()
    gateway.start()
    assert joined.public_key in Uapi(gateway.bed.gateway_interface).get().peers  # restored from the API
    answered = None
    while time.monotonic() - restarted < 45:
        assert ready(cluster, joined.name), "the node went NotReady across the gateway restart"
        if answered is None:
            with contextlib.suppress(RuntimeError):
                if http_get(gateway.bed.cl, f"http://{served.status.pod_ip}:8080/", timeout=2).startswith(
                        "kubeon-pod"):
                    answered = time.monotonic() - restarted
        time.sleep(1)
    assert answered is not None and answered < 30, f"the pod answered again after {answered}s"


def test_removing_the_node_removes_its_peer_and_frees_its_addresses(
        cluster: Cluster, gateway: Gateway, joined: Joined, served: client.V1Pod, tmp_path: Path) -> None:
    token = optimizer_token(cluster, tmp_path / "token")
    with HttpGatewayClient(gateway.url, token, ca_file=gateway.ca_file) as http:
        assert http.remove_node(joined.name, operation=joined.operation) is True
    wait_for(lambda: not cluster.admin.core.list_node(field_selector=f"metadata.name={joined.name}").items,
             what="the Node gone")
    assert joined.public_key not in Uapi(gateway.bed.gateway_interface).get().peers
    slots = cluster.admin.core.list_namespaced_config_map(
        OPTIMIZER_NAMESPACE, label_selector="gpu.kubeon.io/gateway-record=slot").items
    assert all(cm.data["node"] != joined.name for cm in slots)


# ----- R4.10 in Approve mode with a tunnel node ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(cluster: Cluster, gateway: Gateway, tmp_path_factory: pytest.TempPathFactory) -> BurstStack:
    return build_stack(cluster, tmp_path_factory.mktemp("burst-tunnel"))


# The rule a test sets in a node's namespace for "its tunnel drops full-MTU packets": ICMP of the tunnel's full MTU
# arriving through the tunnel is dropped (its TCP, clamped to the MTU, and small packets pass: the node registers).
DROP_FULL_MTU = ("table ip kubeon_probe_test {\n  chain input {\n    type filter hook input priority 0;\n"
                 "    iifname != \"lo\" ip protocol icmp meta length >= 1380 drop\n  }\n}\n")


@dataclass
class TunnelWorker:
    temporal: Client
    cluster: str
    booted: dict[str, Joined]  # instance ID -> the node it booted as
    # How many of the next instances boot into a namespace whose tunnel drops full-MTU packets.
    dropping: int = 0
    # How many of the next instances boot with a GPU whose DCGM diagnostic fails (its Inforom test).
    failing_gpu: int = 0


@pytest.fixture
async def tunnel_worker(stack: BurstStack, bed: NetBed, gateway: Gateway, temporal_dev_server: WorkflowEnvironment,
                        tmp_path: Path) -> AsyncIterator[TunnelWorker]:
    """The worker as in a cluster (the optimizer's own credentials, the gateway over HTTPS); each simulated
    instance boots as a burst node in a namespace of its own: `kubeon-gpu node join` with its user data, then the
    kubelet stand-in, through the tunnel."""
    queue = unique("q")
    token = optimizer_token(stack.cluster, tmp_path / "optimizer.token")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=SIM_LOCATIONS, cluster_name=queue,
                              gateway_url=gateway.url,
                              gateway_ca_file=gateway.ca_file, node_retry_seconds=1)
    http = HttpGatewayClient(settings.gateway_url, token, ca_file=gateway.ca_file)
    booted: dict[str, Joined] = {}
    worker: TunnelWorker | None = None

    def boot(instance: Instance, user_data: str, capacity: dict[str, str], _health: GpuHealth) -> None:
        node = bed.add_node()
        failing_gpu_test = ""
        if worker is not None and worker.dropping > 0:
            worker.dropping -= 1
            sh("nft", "-f", "-", netns=node.netns, input_text=DROP_FULL_MTU)
        if worker is not None and worker.failing_gpu > 0:
            worker.failing_gpu -= 1
            failing_gpu_test = "Inforom"
        booted[instance.instance_id] = boot_node(bed, user_data, capacity, tmp_path,
                                                 f"sim://{instance.location}/{instance.instance_id}", node=node,
                                                 failing_gpu_test=failing_gpu_test)

    async with worker_services(settings, stack.http_runtime(settings, http, boot)) as (temporal, _runtime, _watcher):
        worker = TunnelWorker(temporal=temporal, cluster=settings.cluster, booted=booted)
        yield worker


async def test_r4_10_approve_mode_with_a_tunnel_node(stack: BurstStack, bed: NetBed, gateway: Gateway,
                                                     tunnel_worker: TunnelWorker, namespace: str) -> None:
    temporal, cluster_name, booted = tunnel_worker.temporal, tunnel_worker.cluster, tunnel_worker.booted
    cluster = stack.cluster
    policy = unique("tunnel")
    stack.create_policy(policy, mode="Approve", locations=["sim/eu-west"], max_nodes=1)
    try:
        deploy = unique("infer")
        cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        # One proposal for the batch, one new node on the policy's location; approved by batch and plan.
        proposed = await provision_state(temporal, cluster_name, policy, lambda v: v.proposal is not None)
        assert proposed.phase == BatchPhase.AWAITING_APPROVAL and proposed.proposal is not None
        (planned,) = proposed.proposal.plan.new_nodes
        assert planned.offering.location == "sim/eu-west"
        assert len(planned.pods) == 1 and planned.pods[0].startswith(f"{namespace}/{deploy}-")
        batch, handle = await approve_batch(temporal, cluster_name, policy, f"{namespace}/{deploy}-")
        assert batch.batch == proposed.proposal.batch
        view = await wait_phase(handle, NodePhase.SERVING, timeout=180)
        assert view.batch == batch.batch and view.node is not None and view.node.offering == planned.offering
        (joined,) = booted.values()
        assert joined.name == view.node_name
        # The node registered itself: its own Lease, its own CSR approved by the gateway; taint and location.
        lease = client.CoordinationV1Api(cluster.admin.api).read_namespaced_lease(joined.name, "kube-node-lease")
        assert lease.spec.holder_identity == joined.name
        node = cluster.admin.core.read_node(joined.name)
        assert node.metadata.labels[LABEL_OPERATION] == view.operation
        assert node.metadata.labels[LABEL_LOCATION] == "sim.eu-west"
        assert [(t.key, t.effect) for t in node.spec.taints] == [(BURST_TAINT, "NoSchedule")]
        assert joined.public_key in Uapi(bed.gateway_interface).get().peers
        # Burned in (the default checks): its GPUs, and its tunnel carried a full-MTU packet.
        burned = node.metadata.annotations[BURNED_IN_ANNOTATION]
        assert burned.startswith("Gpus: allocatable nvidia.com/gpu 1; Tunnel: 1380-byte DF probe answered in "), burned
        # The pod landed and runs: the cluster side reaches it at its pod IP through the gateway.
        (pod,) = cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
        assert pod.spec.node_name == joined.name
        pod_name = str(pod.metadata.name)
        ip = wait_for(lambda: cluster.admin.core.read_namespaced_pod(pod_name, namespace).status.pod_ip,
                      what="the pod's IP", timeout=30)
        assert http_get(bed.cl, f"http://{ip}:8080/").strip() == f"kubeon-pod {namespace}/{pod_name}"

        # The workload goes: drained, terminated, the Node, its peer and its addresses gone.
        cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        done = await result(handle, timeout=180)
        assert done.phase == NodePhase.COMPLETED, done.message
        wait_for(lambda: not cluster.admin.core.list_node(field_selector=f"metadata.name={joined.name}").items,
                 what="the burst Node removed")
        assert joined.public_key not in Uapi(bed.gateway_interface).get().peers
        slots = cluster.admin.core.list_namespaced_config_map(
            OPTIMIZER_NAMESPACE, label_selector="gpu.kubeon.io/gateway-record=slot").items
        assert all(cm.data["node"] != joined.name for cm in slots)
        states = json.loads((stack.workdir / f"state-{cluster_name}" / "sim-instances.json").read_text())
        assert [r["state"] for r in states.values()] == ["terminated"]
        after = await provision_state(temporal, cluster_name, policy, lambda v: not v.nodes)
        assert after.batches[-1].approver == "alice" and after.batches[-1].nodes == [handle.id]
    finally:
        stack.delete_policy(policy)


@dataclass(frozen=True)
class NodeFault:
    """A fault the next booted node has, the burn-in check that finds it, and what is said."""

    fault: str  # the TunnelWorker field counting the nodes to boot with it
    check: str
    failure: tuple[str, ...]  # in the failed node's message
    audited: str  # in its audit record
    passed: str  # in the replacement's burned-in annotation


DROPS_FULL_MTU = NodeFault("dropping", "Tunnel", ("its tunnel does not carry a full-MTU packet",
                                                  "the path drops full-MTU packets"), "full-MTU",
                           "Tunnel: 1380-byte DF probe answered")
# The real node program runs the node image's DCGM (the stand-in) and posts what it said on its own Node.
FAILS_DCGM_DIAG = NodeFault("failing_gpu", "GpuHealth", ("its GPU health check failed (DcgmDiagFailed)",
                                                          "` failed (exit 226): Inforom: Fail - GPU: 0"),
                            "GPU health check failed", "GpuHealth: `")


@pytest.mark.parametrize("fault", [DROPS_FULL_MTU, FAILS_DCGM_DIAG], ids=["drops-full-mtu", "fails-dcgm-diag"])
async def test_a_node_that_fails_a_burn_in_check_is_terminated_and_replaced(
        stack: BurstStack, bed: NetBed, gateway: Gateway, tunnel_worker: TunnelWorker, namespace: str,
        fault: NodeFault) -> None:
    cluster, temporal = stack.cluster, tunnel_worker.temporal
    setattr(tunnel_worker, fault.fault, 1)
    policy = unique("burn")
    stack.create_policy(policy, mode="Automatic", locations=["sim/eu-west"], max_nodes=1,
                        burn_in={"checks": ["Gpus", fault.check], "timeoutSeconds": 30})
    deploy = unique("infer")
    try:
        cluster.admin.apps.create_namespaced_deployment(namespace, gpu_deployment(deploy))
        first = await node_for(temporal, tunnel_worker.cluster, policy, f"{namespace}/{deploy}-")
        failed = await result(first, timeout=120)
        assert failed.phase == NodePhase.FAILED, failed.message
        assert all(text in failed.message for text in fault.failure), failed.message
        await until(lambda: not cluster.admin.core.list_node(
            field_selector=f"metadata.name={failed.node_name}").items, timeout=30, what="the failed node removed")

        # Planned again: the replacement's tunnel is whole, it serves, and the pod (never bound before) runs there.
        def served() -> str | None:
            pods = cluster.admin.core.list_namespaced_pod(namespace, label_selector=f"app={deploy}").items
            return str(pods[0].spec.node_name) if len(pods) == 1 and pods[0].status.phase == "Running" else None

        replacement = await until(served, timeout=120, what="the pod running on the replacement node")
        assert replacement != failed.node_name
        assert fault.passed in cluster.admin.core.read_node(replacement).metadata.annotations[BURNED_IN_ANNOTATION]
        # The pod may run before the replacement's `node join` has exited (booted is filled when it has).
        await until(lambda: len(tunnel_worker.booted) == 2, timeout=30, what="the replacement's node join done")
        audit = AuditLog(stack.workdir / f"state-{tunnel_worker.cluster}" / "audit.jsonl").read()
        assert any(r.action == "failed" and r.operation == failed.operation and fault.audited in r.detail
                   for r in audit), [(r.action, r.detail) for r in audit]
    finally:
        with contextlib.suppress(client.ApiException):
            cluster.admin.apps.delete_namespaced_deployment(deploy, namespace)
        await until(lambda: not cluster.admin.core.list_node(label_selector=f"{LABEL_POLICY}={policy}").items,
                    timeout=120, what="the burst node home")
        stack.delete_policy(policy)


def tunnel_slot(index: int, key: str) -> Slot:
    return Slot(index=index, node=f"burst-n{index}", wireguard_key=key, tunnel_ip=f"10.250.0.{index + 2}",
                pod_cidr=f"10.245.{index}.0/24", nonce=f"n{index}", operation="op", labels={}, taints=[], gpus=1,
                expires_at=0.0)


def test_a_sync_from_an_older_slot_list_keeps_the_peer_a_join_just_added() -> None:
    """A reconcile pass reads the slots, then the interface: a join that claimed its slot and added its peer in
    between is not in the pass's list. The peer stays when the slots read again hold it, and goes when they do
    not (its node was removed), with every other peer left as it was."""
    with wireguard_device() as device:
        tunnel = GatewayTunnel(interface=device.interface, private_key=keys.generate_private_key(), endpoint="",
                               listen_port=51998)
        kept, joining = (keys.public_key(keys.generate_private_key()) for _ in range(2))
        older = [tunnel_slot(0, kept)]
        assert tunnel.sync(older)["added"] == [kept]
        device.set_peer(joining, ["10.250.0.3/32", "10.245.1.0/24"])  # the join, after the pass read its slots
        reads = []

        def fresh() -> list[Slot]:
            reads.append(1)
            return [*older, tunnel_slot(1, joining)]

        assert tunnel.sync(older, joined_since=fresh) == {"added": [], "removed": [], "new": []}
        assert set(device.get().peers) == {kept, joining} and reads == [1]
        assert tunnel.sync(older, joined_since=lambda: older)["removed"] == [joining]
        assert set(device.get().peers) == {kept}
        tunnel.sync(older, joined_since=lambda: pytest.fail("read again with nothing to remove"))
