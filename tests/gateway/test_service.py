"""KubeGateway's removal of burst Nodes (only the operation's own), and the user data a burst node boots with:
where the gateway says to join (its public URL or LoadBalancer address), the name and the CA to verify it with,
within EC2's limit."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from gateway.service import GatewayAddressPending
from gateway.service import GatewayAddressUnknown
from gateway.service import KubeGateway
from gateway.service import ServiceRef
from gateway.service import endpoint_from_service
from models.errors import TicketError
from models.join import USER_DATA_MAX_BYTES
from models.join import JoinTicketRequest
from models.join import UserDataTooLarge
from models.join import parse_user_data
from models.join import render_user_data
from models.labels import LABEL_GPU_PRODUCT
from models.labels import LABEL_INSTANCE_TYPE
from models.labels import LABEL_LOCATION
from models.labels import LABEL_OPERATION
from models.labels import LABEL_POLICY
from models.labels import Taint
from models.locations import BurstConfig
from node.join import NodeFiles
from tests.charts.helm import BURST_VALUES
from tests.charts.helm import NAMESPACE
from tests.charts.helm import template
from tests.gateway.helpers import BURST_TAINT
from tests.gateway.helpers import gateway
from tests.gateway.helpers import join_and_register
from tests.gateway.helpers import node_absent
from tests.gateway.helpers import ticket_request
from tests.harness.joining import new_burst_node
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.rbac import GATEWAY_SA
from worker.config import load_settings

pytestmark = pytest.mark.cluster


def test_remove_refuses_another_operations_node(cluster: Cluster, gateway_api: client.ApiClient,
                                                nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api)
    req = ticket_request(nodes)
    join_and_register(gw, req, files())

    with pytest.raises(TicketError, match="has no address slot of operation op-other"):
        gw.remove_node(req.node_name, operation="op-other")
    assert cluster.admin.core.read_node(req.node_name).metadata.name == req.node_name

    # A node the gateway never admitted (no operation label) is never removed either.
    home = f"home-{uuid.uuid4().hex[:6]}"
    nodes.append(home)
    cluster.create_kwok_node(home)
    with pytest.raises(TicketError, match=f"has no address slot of operation {req.operation}"):
        gw.remove_node(home, operation=req.operation)

    assert gw.remove_node(req.node_name, operation=req.operation) is True
    wait_for(lambda: node_absent(cluster, req.node_name), what=f"{req.node_name} deleted")
    assert all(s.node != req.node_name for s in gw.records.slots())  # its addresses are free
    assert gw.remove_node(req.node_name, operation=req.operation) is False  # already gone: idempotent


PUBLIC_URL = "https://burst-gw.example.com:8443"


SERVICE_URL = f"https://kubeon-gpu-optimizer-gateway.{NAMESPACE}.svc:8443"


@pytest.fixture(scope="module")
def chart_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CA certificate the chart generates for the gateway, as the worker mounts it from its ConfigMap."""
    configmap = template(values=[BURST_VALUES]).get("ConfigMap", "kubeon-gpu-optimizer-gateway-ca", NAMESPACE)
    path = tmp_path_factory.mktemp("gateway-ca") / "ca.crt"
    path.write_text(configmap["data"]["ca.crt"])
    return path


def worker_burst_config(**env: str) -> BurstConfig:
    """The worker's burst configuration from the variables the chart sets."""
    return load_settings({"KUBEON_CLUSTER": "prod-use1-a", "KUBEON_GATEWAY_URL": SERVICE_URL, **env}).burst_config()


def launch_user_data(config: BurstConfig, gateway: KubeGateway | None = None) -> str:
    """User data as launch_instance renders it, for a node with every label a launch sets and a real ticket:
    where the gateway's grant says to join, else the worker's configured URL."""
    op, node = new_burst_node()
    labels = {LABEL_OPERATION: op, LABEL_POLICY: "inference-burst-" + "x" * 40, LABEL_LOCATION: "aws.eu-central-1",
              LABEL_GPU_PRODUCT: "NVIDIA-H100-80GB-HBM3", LABEL_INSTANCE_TYPE: "p5.48xlarge"}
    taints = [Taint(key=BURST_TAINT)]
    gw = gateway or KubeGateway(client.ApiClient(), secrets.token_bytes(32))
    # The grant issue_ticket answers, without its address slot reservation (no API server here).
    endpoint, server_name = gw.endpoint()
    ticket = gw.sign_ticket(JoinTicketRequest(
        operation=op, policy=labels[LABEL_POLICY], location="aws/eu-central-1", node_name=node, labels=labels,
        taints=taints))
    return render_user_data(gateway_url=endpoint or config.gateway_url,
                            server_name=server_name if endpoint else "", ticket=ticket,
                            node_name=node, labels=labels, taints=taints, ca_bundle=config.gateway_ca_bundle)


def test_user_data_names_the_gateways_public_url() -> None:
    doc = parse_user_data(launch_user_data(worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL=PUBLIC_URL + "/")))
    assert doc["gateway"] == PUBLIC_URL
    assert doc["serverName"] == "burst-gw.example.com"


def test_user_data_falls_back_to_the_gateway_url_without_a_public_one() -> None:
    doc = parse_user_data(launch_user_data(worker_burst_config()))
    assert doc["gateway"] == SERVICE_URL
    assert doc["serverName"] == f"kubeon-gpu-optimizer-gateway.{NAMESPACE}.svc"
    assert "caBundle" not in doc, "no CA file: the node uses its system trust store"


def test_user_data_names_where_the_gateway_says_nodes_join() -> None:
    """The gateway's grant wins over the worker's configured URL: its public URL (verified as its host), or its
    LoadBalancer address verified as the Service name."""
    config = worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL="https://stale.example.com:8443")
    public = KubeGateway(client.ApiClient(), secrets.token_bytes(32), public_url=PUBLIC_URL + "/")
    assert public.endpoint() == (PUBLIC_URL, "burst-gw.example.com")
    doc = parse_user_data(launch_user_data(config, public))
    assert (doc["gateway"], doc["serverName"]) == (PUBLIC_URL, "burst-gw.example.com")
    ip = KubeGateway(client.ApiClient(), secrets.token_bytes(32), public_url="https://[2001:db8::10]:8443")
    assert ip.endpoint() == ("https://[2001:db8::10]:8443", "2001:db8::10")
    # In-process (dev, tests): no public URL and no Service, so the worker's configured URL stands.
    assert KubeGateway(client.ApiClient(), secrets.token_bytes(32)).endpoint() == ("", "")


def lb_service(kind: str = "LoadBalancer", ingress: list[client.V1LoadBalancerIngress] | None = None,
               ports: list[client.V1ServicePort] | None = None) -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name=GATEWAY_SA, namespace=NAMESPACE),
        spec=client.V1ServiceSpec(type=kind, ports=ports or [client.V1ServicePort(name="tunnel", port=8443)]),
        status=client.V1ServiceStatus(load_balancer=client.V1LoadBalancerStatus(ingress=ingress)))


def test_endpoint_from_the_services_load_balancer() -> None:
    ref = ServiceRef(GATEWAY_SA, NAMESPACE)
    assert ref.dns_name == f"{GATEWAY_SA}.{NAMESPACE}.svc"
    for ingress in (None, [], [client.V1LoadBalancerIngress()]):
        with pytest.raises(GatewayAddressPending,
                           match=f"^gateway Service {GATEWAY_SA} has no LoadBalancer address yet"):
            endpoint_from_service(lb_service(ingress=ingress), ref)
    host = [client.V1LoadBalancerIngress(hostname="internal-gw-1.elb.eu-central-1.amazonaws.com", ip="10.0.0.9")]
    assert endpoint_from_service(lb_service(ingress=host), ref) == (
        "https://internal-gw-1.elb.eu-central-1.amazonaws.com:8443", ref.dns_name)
    v4 = [client.V1LoadBalancerIngress(ip="10.1.2.3")]
    ports = [client.V1ServicePort(name="other", port=1), client.V1ServicePort(name="tunnel", port=443)]
    assert endpoint_from_service(lb_service(ingress=v4, ports=ports), ref) == ("https://10.1.2.3:443", ref.dns_name)
    v6 = [client.V1LoadBalancerIngress(ip="2001:db8::7")]
    assert endpoint_from_service(lb_service(ingress=v6), ref)[0] == "https://[2001:db8::7]:8443"
    for kind in ("NodePort", "ClusterIP"):
        with pytest.raises(GatewayAddressUnknown, match=f"is of type {kind}, not LoadBalancer.*publicUrl"):
            endpoint_from_service(lb_service(kind, ingress=v4), ref)


def test_user_data_carries_the_gateways_ca(chart_ca: Path) -> None:
    config = worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL=PUBLIC_URL, KUBEON_GATEWAY_CA_FILE=str(chart_ca))
    doc = parse_user_data(launch_user_data(config))
    assert doc["caBundle"] == chart_ca.read_text().strip() + "\n"
    assert doc["caBundle"].startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE KEY" not in doc["caBundle"]


def test_user_data_with_the_ca_fits_ec2s_limit(chart_ca: Path) -> None:
    config = worker_burst_config(KUBEON_GATEWAY_PUBLIC_URL=PUBLIC_URL, KUBEON_GATEWAY_CA_FILE=str(chart_ca))
    size = len(launch_user_data(config).encode())
    assert USER_DATA_MAX_BYTES == 16 * 1024, "EC2: 16 KB before base64"
    # Room to spare for a CA chain: the chart's CA and a ticket take well under half the limit.
    assert size < USER_DATA_MAX_BYTES // 2, size


def test_user_data_over_the_limit_is_refused(chart_ca: Path) -> None:
    chain = chart_ca.read_text() * 16  # an absurd bundle: 16 copies of the CA
    config = BurstConfig(gateway_url=PUBLIC_URL, gateway_ca_bundle=chain)
    with pytest.raises(UserDataTooLarge, match=f"over the {USER_DATA_MAX_BYTES}-byte limit of EC2"):
        launch_user_data(config)


def test_a_ca_file_without_a_certificate_is_a_configuration_error(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.crt"
    not_pem.write_text("MIIDBTCCAe2gAwIBAgIQ\n")
    with pytest.raises(ValueError, match=f"KUBEON_GATEWAY_CA_FILE {not_pem}: no PEM certificate"):
        worker_burst_config(KUBEON_GATEWAY_CA_FILE=str(not_pem))
