"""`kubeon-gpu node join`'s steps without a tunnel (the sim path), against the real in-process gateway: its keys
stay on the node and are reused by a rerun, its CSR has the gateway's expected shape, its kubeconfig holds only
its own credentials, and a gateway that does not answer yet is tried again (a refusal is not)."""

from __future__ import annotations

import secrets
import stat
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import yaml
from kubernetes import client

from gateway.admission import check_csr
from gateway.service import KubeGateway
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import JoinAnswer
from models.join import JoinRedeem
from models.join import JoinTicketRequest
from models.labels import LABEL_OPERATION
from models.labels import Taint
from node.join import JoinError
from node.join import JoinUnavailable
from node.join import NodeFiles
from node.join import join
from node.join import kubelet_csr
from node.join import kubelet_key
from node.join import redeem_over_https
from node.join import redeem_retrying
from node.join import wireguard_private_key
from node.join import write_registration
from node.register import node_api
from tests.harness.controlplane import free_port
from tests.harness.joining import gateway_credentials
from tests.harness.joining import new_burst_node
from tests.harness.kube import Cluster
from tunnel import keys

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def gateway(cluster: Cluster) -> KubeGateway:
    return KubeGateway(gateway_credentials(cluster), secrets.token_bytes(32))


def document(gateway: KubeGateway) -> dict[str, object]:
    op, name = new_burst_node()
    ticket = gateway.sign_ticket(JoinTicketRequest(operation=op, policy="p", location="sim/x", node_name=name,
                                                   labels={LABEL_OPERATION: op}, taints=[Taint(key="k")]))
    return {"ticket": ticket, "nodeName": name}


def test_keys_are_private_to_the_node_and_reused(tmp_path: Path) -> None:
    files = NodeFiles(tmp_path / "n")
    wg, key = wireguard_private_key(files), kubelet_key(files)
    for path in (files.wireguard_key, files.kubelet_key):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert wireguard_private_key(files) == wg
    assert kubelet_key(files).private_numbers() == key.private_numbers()
    # The CSR is what the gateway accepts for this node, and nothing else.
    check_csr(kubelet_csr(key, "burst-1"), "burst-1", ["digital signature", "client auth"])


def test_a_rerun_reuses_keys_and_answer_without_redeeming_again(cluster: Cluster, gateway: KubeGateway,
                                                                tmp_path: Path) -> None:
    doc = document(gateway)
    files = NodeFiles(tmp_path / "n")
    sent: list[JoinRedeem] = []

    def redeem(request: JoinRedeem) -> JoinAnswer:
        sent.append(request)
        return gateway.join(request)

    first = join(doc, files, redeem=redeem, tunnel=False)
    assert sent[0].wireguard_public_key == keys.public_key(files.wireguard_key.read_text().strip())
    assert "PRIVATE" not in sent[0].model_dump_json() and files.wireguard_key.read_text().strip() not in \
        sent[0].model_dump_json()
    again = join(doc, files, redeem=redeem, tunnel=False)  # after a reboot
    assert len(sent) == 1 and again == first
    kubeconfig = yaml.safe_load(files.kubeconfig.read_text())
    assert kubeconfig["users"][0]["user"] == {"client-certificate": str(files.kubelet_cert),
                                              "client-key": str(files.kubelet_key)}
    assert stat.S_IMODE(files.kubeconfig.stat().st_mode) == 0o600
    # What the kubelet registers with: the ticket's labels and taints plus the joining taint.
    write_registration(files, first, provider_id="sim://x/i-1")
    env = (files.state_dir / "kubelet.env").read_text()
    assert f"--node-labels={LABEL_OPERATION}=" in env and "--register-with-taints=k=true:NoSchedule," in env
    assert "gpu.kubeon.io/joining=true:NoSchedule" in env and "--provider-id=sim://x/i-1" in env
    # The gateway runs no tunnel here: a node that wants one says so.
    with pytest.raises(JoinError, match="runs no tunnel"):
        join(doc, files, redeem=redeem, tunnel=True)
    with pytest.raises(client.ApiException) as err:  # its credentials are a node's: no listing of all nodes
        client.CoreV1Api(node_api(files.kubeconfig)).list_node()
    assert err.value.status == 403


def test_an_unavailable_gateway_is_tried_again_and_a_refusal_is_not(cluster: Cluster, gateway: KubeGateway,
                                                                   tmp_path: Path) -> None:
    """The VM's user data runs `node join` once: a gateway that does not answer yet (restarting, busy) must not
    strand a paid instance. Nothing listens on ``closed``: the first tries fail as they would on a real VM."""
    closed = redeem_over_https({"gateway": f"http://127.0.0.1:{free_port()}"}, timeout=2)
    tries: list[JoinRedeem] = []

    def redeem(request: JoinRedeem) -> JoinAnswer:
        tries.append(request)
        return closed(request) if len(tries) <= 2 else gateway.join(request)

    doc = document(gateway)
    answer = join(doc, NodeFiles(tmp_path / "n"), redeem=redeem, tunnel=False, retry_seconds=60)
    assert answer.node_name == doc["nodeName"] and len(tries) == 3 and tries[0] == tries[2]  # the same keys

    # The waits between tries: 1 s, 2 s, 4 s ... each jittered down to no less than half, never over 30 s.
    pauses: list[float] = []
    down = iter(range(7))

    def down_seven_times(request: JoinRedeem) -> JoinAnswer:
        if next(down, None) is not None:
            raise JoinUnavailable("the gateway is down")
        return answer

    assert redeem_retrying(down_seven_times, tries[0], retry_seconds=3600, sleep=pauses.append,
                           say=lambda _: None) == answer
    assert len(pauses) == 7
    assert all(cap / 2 <= p <= cap for p, cap in zip(pauses, [1, 2, 4, 8, 16, 30, 30], strict=True)), pauses

    # Without retries (or past the deadline) the error names the gateway; a refusal is final at once.
    with pytest.raises(JoinUnavailable, match=r"127\.0\.0\.1"):
        join(document(gateway), NodeFiles(tmp_path / "m"), redeem=closed, tunnel=False, retry_seconds=0)
    with pytest.raises(JoinUnavailable, match=r"gave up after \d+ attempts in 2s"):
        join(document(gateway), NodeFiles(tmp_path / "o"), redeem=closed, tunnel=False, retry_seconds=2)
    other_key = KubeGateway(gateway_credentials(cluster), secrets.token_bytes(32))
    forged = dict(document(gateway), ticket=document(other_key)["ticket"])
    refusals: list[str] = []

    def refusing(request: JoinRedeem) -> JoinAnswer:
        refusals.append(request.ticket)
        return gateway.join(request)

    with pytest.raises(TicketError, match="signature is invalid"):
        join(forged, NodeFiles(tmp_path / "p"), redeem=refusing, tunnel=False, retry_seconds=60)
    assert len(refusals) == 1


def test_the_gateways_retry_refusal_is_retried_and_any_other_is_final() -> None:
    """A refusal the gateway answers with a 5xx (its address slot changed while the node joined: a retried launch
    pointed the reservation at its newer ticket) is tried again, as over HTTPS; a 4xx refusal is final at once.
    An in-process gateway (the sim provider's nodes) raises both as JoinRefused."""
    answer, request = cast(JoinAnswer, object()), cast(JoinRedeem, object())  # passed through as they are
    conflicts = iter(range(2))

    def slot_changed_twice(_: JoinRedeem) -> JoinAnswer:
        if next(conflicts, None) is not None:
            raise JoinRefused("slot_conflict", "the address slot changed while it joined; retry", status=503)
        return answer

    pauses: list[float] = []
    assert redeem_retrying(slot_changed_twice, request, retry_seconds=60, sleep=pauses.append,
                           say=lambda _: None) is answer
    assert len(pauses) == 2

    def removed(_: JoinRedeem) -> JoinAnswer:
        pauses.append(-1.0)
        raise JoinRefused("node_removed", "node was removed", status=409)

    with pytest.raises(JoinRefused, match="node was removed"):
        redeem_retrying(removed, request, retry_seconds=60, sleep=pauses.append, say=lambda _: None)
    assert pauses == [pauses[0], pauses[1], -1.0], "a 4xx refusal was retried"


def test_node_join_loads_no_heavy_sdk() -> None:
    """Issue 26: `kubeon-gpu node join` starts fast on the booting VM: its code path imports neither the
    Kubernetes client, nor the Temporal SDK, nor a cloud SDK, nor the optimizer's models beyond the join's."""
    heavy = ["kubernetes", "temporalio", "boto3", "botocore", "google.cloud", "azure", "models.provisioning",
             "models.hub", "models.policy", "worker.config"]
    probe = ("import sys; import worker.cli, node.join, node.register; "
             f"print(','.join(m for m in {heavy!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"the node join path imports {loaded}"
