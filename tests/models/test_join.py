"""The attested identity a node joined with, bound to the instance launched for its operation (issue 27): the
gateway verifies signature, location and account; this check says whether the identity names the launched
instance, per cloud's way of naming it."""

from __future__ import annotations

import pytest

from models.join import NodeIdentity
from models.join import bind_attested_instance


def aws(instance_id: str) -> NodeIdentity:
    return NodeIdentity(method="aws", verified=True, region="eu-central-1", zone="eu-central-1a",
                        instance_id=instance_id, account="111122223333")


def gcp(name: str, zone: str = "europe-west4-a") -> NodeIdentity:
    return NodeIdentity(method="gcp", verified=True, region="europe-west4", zone=zone, instance_id="4471",
                        instance_name=name, account="burst-project")


def azure(vm_id: str) -> NodeIdentity:
    return NodeIdentity(method="azure", verified=True, instance_id=vm_id, account="sub-1")


@pytest.mark.parametrize(("identity", "provider", "instance_id", "attested_id"), [
    (aws("i-0a"), "aws", "i-0a", ""),
    (gcp("burst-op-1"), "gcp", "europe-west4-a/burst-op-1", ""),
    (azure("9f1c"), "azure", "burst-op-1", "9f1c"),
    # Nothing to bind: nothing attested, or the hub's pool claim bound the on-prem server already.
    (NodeIdentity(method="none", verified=False), "sim", "sim-1", ""),
    (NodeIdentity(method="onprem", verified=True, region="dc1"), "onprem", "gpu-a", ""),
    # An Azure launch recorded before vmIds were: the binding cannot be checked (said in the audit, not refused).
    (azure("9f1c"), "azure", "burst-op-1", ""),
], ids=["aws", "gcp", "azure", "none", "onprem", "azure-vmid-unknown"])
def test_the_launched_instance_is_accepted(identity: NodeIdentity, provider: str, instance_id: str,
                                           attested_id: str) -> None:
    bound, problem = bind_attested_instance(identity, provider, instance_id, attested_id)
    assert problem == ""
    # Said bound only where the identity was checked against the instance (the audit says so, or not).
    assert bound == (identity.method in ("aws", "gcp") or (identity.method == "azure" and bool(attested_id)))


@pytest.mark.parametrize(("identity", "provider", "instance_id", "attested_id", "named"), [
    (aws("i-0thief"), "aws", "i-0a", "", "aws instance i-0thief, not of the launched instance i-0a"),
    (gcp("thief"), "gcp", "europe-west4-a/burst-op-1", "",
     "gcp instance europe-west4-a/thief, not of the launched instance europe-west4-a/burst-op-1"),
    # The same name in another zone is another instance.
    (gcp("burst-op-1", zone="europe-west4-b"), "gcp", "europe-west4-a/burst-op-1", "",
     "instance europe-west4-b/burst-op-1, not"),
    (azure("0bad"), "azure", "burst-op-1", "9f1c", "azure instance 0bad, not of the launched instance 9f1c"),
    (aws("i-0a"), "gcp", "europe-west4-a/burst-op-1", "", "a aws identity, the operation launched a gcp instance"),
], ids=["aws", "gcp-name", "gcp-zone", "azure", "other-cloud"])
def test_another_machine_holding_the_ticket_is_named(identity: NodeIdentity, provider: str, instance_id: str,
                                                     attested_id: str, named: str) -> None:
    bound, problem = bind_attested_instance(identity, provider, instance_id, attested_id)
    assert named in problem and not bound


def test_the_audit_text_says_what_was_attested() -> None:
    assert aws("i-0a").describe() == "attested aws instance i-0a in eu-central-1a, account 111122223333"
    assert gcp("burst-op-1").describe() == ("attested gcp instance 4471 burst-op-1 in europe-west4-a, project "
                                            "burst-project")
    assert NodeIdentity(method="none", verified=False).describe() == "identity not attested (method none)"
    assert NodeIdentity(method="onprem", verified=True, region="dc1").describe().startswith(
        "on-prem server of pool dc1")
