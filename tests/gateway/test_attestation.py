"""Location attested at join (issue 27): the node's signed instance identity verified against the trust roots the
test makes (its own CA), its region/zone and account matched to the ticket's location, with a code per refusal;
sim nodes join without one, a real-cloud ticket never does once its provider's roots are configured."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from gateway.attestation import AttestationVerifier
from gateway.attestation import verifier_from
from gateway.settings import ConfigError
from gateway.settings import GatewayServerConfig
from gateway.settings import load_settings
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import Attestation
from models.join import NodeIdentity
from node.join import NodeFiles
from tests.gateway.helpers import gateway
from tests.gateway.helpers import nonce_of
from tests.gateway.helpers import ticket_request
from tests.harness.identity import IdentityCA
from tests.harness.joining import redeem_for

AUDIENCE = "https://gateway.kubeon.test"


@pytest.fixture(scope="module")
def ca() -> IdentityCA:
    return IdentityCA()


def verifier(ca: IdentityCA, **accounts: str) -> AttestationVerifier:
    return AttestationVerifier(roots={"aws": [ca.ca], "azure": [ca.ca], "gcp": [ca.signer]}, accounts=accounts,
                               audience=AUDIENCE)


def refused(v: AttestationVerifier, attestation: Attestation, location: str, *, ticket: str = "") -> str:
    with pytest.raises(JoinRefused) as err:
        v.verify(attestation, location, ticket=ticket)
    assert err.value.status == 403
    return err.value.code


def test_the_real_path_is_accepted_for_aws_gcp_and_azure(ca: IdentityCA) -> None:
    v = verifier(ca, aws="123456789012", gcp="kubeon-test")
    aws = v.verify(ca.aws(region="eu-central-1", instance_id="i-0abc"), "aws/eu-central-1")
    assert (aws.method, aws.verified, aws.region, aws.zone, aws.instance_id, aws.account) == (
        "aws", True, "eu-central-1", "eu-central-1a", "i-0abc", "123456789012")
    gcp = v.verify(ca.gcp(zone="europe-west4-b", audience=AUDIENCE, instance_id="42"), "gcp/europe-west4")
    assert (gcp.region, gcp.zone, gcp.instance_id, gcp.account) == ("europe-west4", "europe-west4-b", "42",
                                                                     "kubeon-test")
    azure = v.verify(ca.azure(ticket="t.1", vm_id="vm-1"), "azure/westeurope", ticket="t.1")
    # Azure signs no location into its attested data: the VM is bound by its subscription and vmId.
    assert (azure.verified, azure.region, azure.instance_id, azure.account) == (
        True, "", "vm-1", "00000000-0000-0000-0000-00000000aaaa")


def test_an_identity_of_another_region_is_refused_with_location_mismatch(ca: IdentityCA) -> None:
    v = verifier(ca)
    assert refused(v, ca.aws(region="us-east-1"), "aws/eu-central-1") == "location_mismatch"
    assert refused(v, ca.gcp(zone="us-central1-a", audience=AUDIENCE), "gcp/europe-west4") == "location_mismatch"


def test_azure_attested_data_is_bound_to_its_ticket_its_signer_and_its_subscription(ca: IdentityCA) -> None:
    """Azure's attested data names no region, so what binds it is checked instead: its nonce (fetched for this
    ticket, not replayed from another), the metadata service's certificate, the signed digest, expiry, the
    subscription."""
    v = verifier(ca, azure="00000000-0000-0000-0000-00000000aaaa")
    assert refused(v, ca.azure(ticket="t.other"), "azure/westeurope", ticket="t.1") == "attestation_replayed"
    assert refused(v, ca.azure(ticket="t.1", ttl=-600), "azure/westeurope", ticket="t.1") == "attestation_expired"
    # Signed by a certificate the trusted CA issued, but not the metadata service's.
    assert refused(v, ca.azure(ticket="t.1", signer=ca.signer), "azure/westeurope", ticket="t.1") == (
        "attestation_forged")
    # The signed JSON edited inside the PKCS7 (another VM's ID of the same length): its digest no longer matches.
    good = base64.b64decode(ca.azure(ticket="t.1", vm_id="vm-1").signature)
    edited = Attestation(method="azure", signature=base64.b64encode(good.replace(b'"vm-1"', b'"vm-2"')).decode())
    assert refused(v, edited, "azure/westeurope", ticket="t.1") == "attestation_forged"
    assert refused(v, ca.azure(ticket="t.1", subscription="ffff"), "azure/westeurope", ticket="t.1") == (
        "account_mismatch")
    assert refused(v, Attestation(method="azure", signature="bm90IHBrY3M3"), "azure/westeurope",
                   ticket="t.1") == "attestation_invalid"


def test_a_forged_signature_is_refused(ca: IdentityCA) -> None:
    v = verifier(ca)
    good = ca.aws(region="eu-central-1")
    # The document edited after signing (another region written in), and one signed by a CA nobody trusts.
    edited = good.model_copy(update={"document": good.document.replace("eu-central-1", "us-east-1")})
    assert refused(v, edited, "aws/us-east-1") == "attestation_forged"
    other = IdentityCA(name="not trusted")
    assert refused(v, other.aws(region="eu-central-1"), "aws/eu-central-1") == "attestation_forged"
    # The untrusted signer's certificate swapped for the trusted one: the signature still does not verify.
    swapped = other.aws(region="eu-central-1").model_copy(update={"certificate": ca.signer_pem})
    assert refused(v, swapped, "aws/eu-central-1") == "attestation_forged"
    assert refused(v, other.gcp(zone="europe-west4-a", audience=AUDIENCE), "gcp/europe-west4") == "attestation_forged"
    assert refused(v, other.azure(ticket="t.1"), "azure/westeurope", ticket="t.1") == "attestation_forged"


def test_audience_expiry_account_and_method_are_checked(ca: IdentityCA) -> None:
    v = verifier(ca, aws="123456789012")
    assert refused(v, ca.gcp(zone="europe-west4-a", audience="https://elsewhere"),
                   "gcp/europe-west4") == "attestation_invalid"
    assert refused(v, ca.gcp(zone="europe-west4-a", audience=AUDIENCE, ttl=-60),
                   "gcp/europe-west4") == "attestation_expired"
    assert refused(v, ca.aws(region="eu-central-1", account="999999999999"), "aws/eu-central-1") == "account_mismatch"
    assert refused(v, ca.azure(ticket="t.1"), "aws/eu-central-1") == "attestation_invalid"
    assert refused(v, Attestation(method="onprem"), "aws/eu-central-1") == "attestation_invalid"


def test_method_none_only_where_no_trust_roots_are_configured(ca: IdentityCA) -> None:
    v = verifier(ca)
    for location in ("aws/eu-central-1", "gcp/europe-west4", "azure/westeurope"):
        assert refused(v, Attestation(), location) == "attestation_required"
    sim = v.verify(Attestation(), "sim/eu-west")
    assert (sim.method, sim.verified) == ("none", False)
    # Sim never requires one, even with roots named for it; a gateway without roots accepts none (as before).
    assert not AttestationVerifier(roots={"sim": [ca.ca]}).required("sim")
    assert AttestationVerifier().verify(Attestation(), "aws/eu-central-1").method == "none"
    for sent in ("onprem", "none"):  # on-prem: its server credential (the pool claim) is the proof
        onprem = v.verify(Attestation(method=sent), "onprem/rack-1")
        assert (onprem.method, onprem.verified, onprem.region) == ("onprem", True, "rack-1")


def test_the_trust_roots_and_accounts_come_from_the_gateway_settings(ca: IdentityCA, tmp_path: Path) -> None:
    (tmp_path / "aws.pem").write_text(ca.root_pem)
    key = tmp_path / "ticket.key"
    key.write_bytes(b"k" * 32)
    cfg = GatewayServerConfig.from_settings(load_settings({
        "KUBEON_GATEWAY_TICKET_KEY_FILE": str(key), "KUBEON_GATEWAY_ATTESTATION_ROOTS_DIR": str(tmp_path),
        "KUBEON_GATEWAY_ATTESTATION_ACCOUNTS": "aws=123456789012", "KUBEON_GATEWAY_PUBLIC_URL": AUDIENCE}))
    v = verifier_from(cfg.attestation_roots, cfg.attestation_accounts, cfg.attestation_audience)
    assert (v.required("aws"), v.required("gcp"), v.audience) == (True, False, AUDIENCE)
    assert v.verify(ca.aws(region="eu-central-1"), "aws/eu-central-1").account == "123456789012"
    with pytest.raises(ConfigError, match="KUBEON_GATEWAY_ATTESTATION_ACCOUNTS"):
        GatewayServerConfig.from_settings(load_settings({
            "KUBEON_GATEWAY_TICKET_KEY_FILE": str(key), "KUBEON_GATEWAY_ATTESTATION_ACCOUNTS": "ibm=1"}))


@pytest.mark.cluster
def test_the_gateway_refuses_a_node_of_another_region_and_records_the_verified_identity(
        ca: IdentityCA, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    gw = gateway(gateway_api, attestation=verifier(ca))
    req = ticket_request(nodes).model_copy(update={"location": "aws/eu-central-1"})
    ticket = gw.sign_ticket(req)
    node_files = files()
    plain = redeem_for(node_files, ticket, req.node_name)
    with pytest.raises(JoinRefused) as err:
        gw.join(plain.model_copy(update={"attestation": ca.aws(region="us-east-1")}))
    assert err.value.code == "location_mismatch"
    with pytest.raises(JoinRefused) as err:
        gw.join(plain)  # method none: an aws ticket is never redeemed without its identity
    assert err.value.code == "attestation_required"
    assert gw.records.ticket(nonce_of(gw, ticket)) is None  # refused before anything was recorded
    gw.join(plain.model_copy(update={"attestation": ca.aws(region="eu-central-1", instance_id="i-0good")}))
    record = gw.records.ticket(nonce_of(gw, ticket)) or {}
    assert json.loads(record["attestation"]) == {
        "method": "aws", "verified": True, "region": "eu-central-1", "zone": "eu-central-1a",
        "instanceId": "i-0good", "instanceName": "", "account": "123456789012"}


@pytest.mark.cluster
def test_the_optimizer_reads_the_identity_of_its_own_joined_node_only(
        ca: IdentityCA, gateway_api: client.ApiClient, nodes: list[str], files: Callable[[], NodeFiles]) -> None:
    """What the optimizer binds to the launched instance (``check_node_identity``): the identity as verified at the
    join, for the node of the operation it names; nothing for another operation's node, an unknown one, or one
    whose ticket is not redeemed yet."""
    gw = gateway(gateway_api, attestation=verifier(ca))
    req = ticket_request(nodes).model_copy(update={"location": "aws/eu-central-1"})
    waiting = ticket_request(nodes).model_copy(update={"location": "aws/eu-central-1"})
    gw.issue_ticket(waiting)  # its address slot reserved, never redeemed
    ticket = gw.sign_ticket(req)
    gw.join(redeem_for(files(), ticket, req.node_name).model_copy(
        update={"attestation": ca.aws(region="eu-central-1", instance_id="i-0good")}))

    assert gw.identity(req.node_name, operation=req.operation) == NodeIdentity(
        method="aws", verified=True, region="eu-central-1", zone="eu-central-1a", instance_id="i-0good",
        account="123456789012")
    with pytest.raises(TicketError, match="another operation"):
        gw.identity(req.node_name, operation=waiting.operation)
    with pytest.raises(JoinRefused) as err:
        gw.identity(waiting.node_name, operation=waiting.operation)
    assert (err.value.code, err.value.status) == ("not_joined", 404)
    with pytest.raises(JoinRefused) as err:
        gw.identity("burst-op-ffffffffffff", operation="op-ffffffffffff")
    assert (err.value.code, err.value.status) == ("unknown_node", 404)
