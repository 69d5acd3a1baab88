"""Who the chart's gateway lets ask for tickets (issue 21, lows): the optimizer's ServiceAccount of the release's
own namespace (never a hard-wired `kubeon-gpu`), with a token projected for the gateway's audience alone (never
the API server's, which a compromised gateway could replay as the optimizer).

The chart is rendered for a release in another namespace; the real gateway process then runs with the rendered
settings against the harness API server, and tokens are minted as the kubelet would project them."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from activities.clients.gateway import GatewayRefused
from activities.clients.gateway import HttpGatewayClient
from tests.charts.helm import BURST_VALUES
from tests.charts.helm import Rendered
from tests.charts.helm import container
from tests.charts.helm import env
from tests.charts.helm import template
from tests.gateway.test_app import GatewayProcess
from tests.gateway.test_app import Setup
from tests.gateway.test_app import setup  # noqa: F401 - the module's fixture
from tests.harness.controlplane import write_kubeconfig
from tests.harness.kube import Cluster
from tests.harness.kube import Kube

OTHER_NS = "ml-platform"
OPTIMIZER = "kubeon-gpu-optimizer"
GATEWAY = "kubeon-gpu-optimizer-gateway"


@pytest.fixture(scope="module")
def rendered() -> Rendered:
    return template("--namespace", OTHER_NS, values=[BURST_VALUES])


def _deployment(rendered: Rendered, name: str) -> dict[str, Any]:
    (found,) = [d for d in rendered.all("Deployment") if d["metadata"]["name"] == name]
    return found


def projected_audience(rendered: Rendered) -> tuple[str, str]:
    """The worker's gateway token: (its file, the audience it is projected for)."""
    worker = _deployment(rendered, OPTIMIZER)
    token_file = env(container(worker, "worker"))["KUBEON_GATEWAY_TOKEN_FILE"]
    mounts = {m["name"]: m["mountPath"] for m in container(worker, "worker")["volumeMounts"]}
    for volume in worker["spec"]["template"]["spec"]["volumes"]:
        for source in volume.get("projected", {}).get("sources", []):
            sat = source.get("serviceAccountToken")
            if sat and f"{mounts.get(volume['name'])}/{sat['path']}" == token_file:
                return token_file, str(sat["audience"])
    raise AssertionError(f"KUBEON_GATEWAY_TOKEN_FILE {token_file} is no projected ServiceAccount token")


def test_the_gateway_allows_the_release_namespaces_optimizer_with_a_gateway_only_token(rendered: Rendered) -> None:
    token_file, audience = projected_audience(rendered)
    assert audience == "kubeon-gateway"
    assert not token_file.startswith("/var/run/secrets/kubernetes.io/")
    gw = env(container(_deployment(rendered, GATEWAY), "gateway"))
    assert gw["KUBEON_GATEWAY_ALLOWED_CLIENTS"] == f"system:serviceaccount:{OTHER_NS}:{OPTIMIZER}"
    assert gw["KUBEON_GATEWAY_TOKEN_AUDIENCES"] == audience


def mint(cluster: Cluster, namespace: str, audiences: list[str], path: Path) -> Path:
    path.write_text(cluster.service_account_token(namespace, OPTIMIZER, audiences=audiences, seconds=600))
    return path


@pytest.fixture(scope="module")
def other_namespace(cluster: Cluster) -> Iterator[str]:
    ns = f"{OTHER_NS}-{uuid.uuid4().hex[:6]}"
    core = cluster.admin.core
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    core.create_namespaced_service_account(ns, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=OPTIMIZER)))
    try:
        yield ns
    finally:
        core.delete_namespace(ns)


@pytest.mark.cluster
def test_the_rendered_gateway_refuses_an_api_audience_token_and_the_hard_wired_namespace(
        rendered: Rendered, setup: Setup, other_namespace: str, tmp_path: Path) -> None:  # noqa: F811
    _, audience = projected_audience(rendered)
    ns_rendered = template("--namespace", other_namespace, values=[BURST_VALUES])
    gw = env(container(_deployment(ns_rendered, GATEWAY), "gateway"))
    proc = GatewayProcess(setup.workdir, {
        "KUBEON_GATEWAY_KUBECONFIG": str(setup.gateway_kubeconfig),
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(setup.ticket_key_file),
        "KUBEON_GATEWAY_ALLOWED_CLIENTS": gw["KUBEON_GATEWAY_ALLOWED_CLIENTS"],
        "KUBEON_GATEWAY_TOKEN_AUDIENCES": gw["KUBEON_GATEWAY_TOKEN_AUDIENCES"],
    }, name="gateway-identity").start()
    try:
        # The projected token of the release namespace's optimizer: served.
        projected = mint(setup.cluster, other_namespace, [audience], tmp_path / "projected.token")
        with HttpGatewayClient(proc.url, projected) as http:
            assert http.capacity().total > 0
        # ...and useless against the API server: a gateway that holds it cannot act as the optimizer.
        plane = setup.cluster.plane
        as_gateway_holder = Kube.from_kubeconfig(write_kubeconfig(
            tmp_path / "replay.kubeconfig", plane.server, plane.ca_file, token=projected.read_text(), user="replay"))
        with pytest.raises(client.ApiException) as replayed:
            as_gateway_holder.core.list_node()
        assert replayed.value.status == 401
        # The same ServiceAccount's API-audience token (what a pod gets by default): refused.
        plain = mint(setup.cluster, other_namespace, [], tmp_path / "plain.token")
        with HttpGatewayClient(proc.url, plain) as http, pytest.raises(GatewayRefused) as refused:
            http.capacity()
        assert refused.value.status == 401
        # The optimizer of namespace kubeon-gpu, with a gateway-audience token: not this release's.
        elsewhere = mint(setup.cluster, "kubeon-gpu", [audience], tmp_path / "elsewhere.token")
        with HttpGatewayClient(proc.url, elsewhere) as http, pytest.raises(GatewayRefused) as refused:
            http.capacity()
        assert refused.value.status == 403
    finally:
        assert proc.stop() in (0, -signal.SIGTERM), proc.log
