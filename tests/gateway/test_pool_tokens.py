"""The gateway's check of an on-prem server's join: the claim the hub signed for that server, for this very join
(pool, node, operation, ticket), verified with the hub's public keys. No pool secret is mounted in the gateway."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.pool_tokens import JoinTokenRefused
from gateway.pool_tokens import check_pool_claim
from models import pool_claim

POOL_TOKEN = "kgp_0123456789abcdef_" + "a" * 43
TICKET = "ticket-body.ticket-signature"
HUB_KEY = Ed25519PrivateKey.generate()


@dataclass
class Ticket:
    location: str = "onprem/dc1"
    node_name: str = "burst-op-1"
    operation: str = "op-1"


def signed(key: Ed25519PrivateKey = HUB_KEY, *, ticket: str = TICKET, exp: float | None = None, **fields: str) -> str:
    now = int(time.time())
    body = {"pool": "dc1", "server": "gpu-a", "cluster": "prod-eu", "operation": "op-1", "node": "burst-op-1",
            **fields}
    return pool_claim.sign(key, pool_claim.PoolClaim(
        kid=pool_claim.key_id(key.public_key()), ticket_sha256=pool_claim.ticket_digest(ticket), iat=now,
        exp=int(exp if exp is not None else now + 600), **body))


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.pem"
    other = Ed25519PrivateKey.generate()  # a rotation: two keys, both trusted
    path.write_text(pool_claim.public_pem(other.public_key()) + pool_claim.public_pem(HUB_KEY.public_key()))
    return path


def test_the_hubs_claim_for_this_join_is_accepted(keys_file: Path) -> None:
    claim = check_pool_claim(Ticket(), TICKET, signed(), keys_file)
    assert claim is not None and claim.server == "gpu-a"


def test_nodes_of_cloud_locations_need_no_claim(keys_file: Path) -> None:
    assert check_pool_claim(Ticket(location="aws/eu-central-1"), TICKET, None, keys_file) is None
    assert check_pool_claim(Ticket(location="sim/eu-west"), TICKET, None, None) is None


# Each claim is signed when its case runs, not when the module is collected: a claim lives ten minutes, and in a
# full run this module's cases start more than ten minutes after collection (every claim then read as expired).
@pytest.mark.parametrize(("presented", "message"), [
    (lambda: None, "must present the claim the hub signed"),
    (lambda: "", "must present the claim the hub signed"),
    (lambda: POOL_TOKEN, "malformed"),  # the pool's old shared token opens nothing any more
    (lambda: signed(Ed25519PrivateKey.generate()), "not one of the hub's keys"),  # signed by someone else
    (lambda: _tampered(signed()), "signature is invalid"),
    (lambda: signed(exp=time.time() - 1), "expired"),
    (lambda: signed(node="burst-op-2"), "node differ"),  # another server's claim, for another node
    (lambda: signed(operation="op-2"), "operation differ"),
    (lambda: signed(pool="dc2"), "pool differ"),
    (lambda: signed(ticket="another-ticket"), "ticket differ"),  # a claim for another ticket of the same node
], ids=["none", "empty", "old-pool-token", "foreign-key", "tampered", "expired", "other-node", "other-operation",
        "other-pool", "other-ticket"])
def test_a_missing_forged_expired_or_foreign_claim_is_refused(keys_file: Path, presented: Callable[[], str | None],
                                                               message: str) -> None:
    with pytest.raises(JoinTokenRefused, match=message):
        check_pool_claim(Ticket(), TICKET, presented(), keys_file)


def _tampered(claim: str) -> str:
    return claim[:-3] + ("AAA" if not claim.endswith("AAA") else "BBB")


def test_a_gateway_without_the_hubs_keys_refuses_every_server(tmp_path: Path) -> None:
    with pytest.raises(JoinTokenRefused, match="no hub claim keys"):
        check_pool_claim(Ticket(), TICKET, signed(), None)
    with pytest.raises(JoinTokenRefused, match="cannot be read"):
        check_pool_claim(Ticket(), TICKET, signed(), tmp_path / "missing.pem")
    (tmp_path / "empty.pem").write_text("\n")
    with pytest.raises(JoinTokenRefused, match="holds no key"):
        check_pool_claim(Ticket(), TICKET, signed(), tmp_path / "empty.pem")
