"""The UAPI client against a real wireguard-go (in a network namespace this test creates) and keys as wg(8)
makes them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.harness.netbed import wireguard_device
from tunnel import keys
from tunnel.uapi import Uapi
from tunnel.uapi import UapiError


def test_keys_match_wg_pubkey() -> None:
    for _ in range(5):
        private = keys.generate_private_key()
        expected = subprocess.run(["wg", "pubkey"], input=private, capture_output=True, text=True, check=True)
        assert keys.public_key(private) == expected.stdout.strip()
        assert keys.from_hex(keys.to_hex(private)) == private


@pytest.fixture
def device() -> Iterator[Uapi]:
    with wireguard_device() as uapi:
        yield uapi


def test_peers_are_set_checked_and_removed(device: Uapi) -> None:
    device.configure(keys.generate_private_key(), 51999)
    peer_key = keys.public_key(keys.generate_private_key())
    peer = device.set_peer(peer_key, ["10.250.0.2/32", "10.245.3.0/24"], persistent_keepalive=25)
    assert sorted(peer.allowed_ips) == ["10.245.3.0/24", "10.250.0.2/32"]
    assert peer.persistent_keepalive == 25
    assert device.get().listen_port == 51999
    # An invalid CIDR is refused before anything is sent: the peer keeps what it had (a set is not transactional).
    for bad in (["10.245.3.1/24"], ["not-a-cidr"], ["10.250.0.2/33"]):
        with pytest.raises(UapiError, match="is not a network"):
            device.set_peer(peer_key, bad)
    assert sorted(device.get().peers[peer_key].allowed_ips) == ["10.245.3.0/24", "10.250.0.2/32"]
    with pytest.raises(ValueError, match="not a WireGuard key"):
        device.set_peer("nope", ["10.250.0.3/32"])
    assert device.remove_peer(peer_key) is True
    assert peer_key not in device.get().peers
    assert device.remove_peer(peer_key) is False


def test_an_absent_interface_is_named() -> None:
    with pytest.raises(UapiError, match="kbt-absent: cannot talk to"):
        Uapi("kbt-absent").get()
