"""WireGuard X25519 keys: base64 like ``wg genkey``/``wg pubkey``; lowercase hex on the UAPI wire."""

from __future__ import annotations

import base64
import binascii

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

KEY_BYTES = 32


class WireGuardKeyError(ValueError):
    """A WireGuard key is malformed; the message names the field."""


def generate_private_key() -> str:
    raw = X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return base64.b64encode(raw).decode()


def public_key(private_key: str) -> str:
    """The public half of a base64 private key (as ``wg pubkey``)."""
    raw = decode_key(private_key, "private key")
    pub = X25519PrivateKey.from_private_bytes(raw).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(pub).decode()


def decode_key(value: str, field: str) -> bytes:
    """The 32 raw bytes of a base64 WireGuard key; ``WireGuardKeyError`` naming ``field`` when it is not one."""
    if not isinstance(value, str) or len(value) != 44 or not value.endswith("="):
        raise WireGuardKeyError(f"{field}: not a WireGuard key (44 characters of base64, as `wg pubkey` prints)")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise WireGuardKeyError(f"{field}: not valid base64") from None
    if len(raw) != KEY_BYTES:
        raise WireGuardKeyError(f"{field}: {len(raw)} bytes, a WireGuard key has {KEY_BYTES}")
    if raw == bytes(KEY_BYTES):
        raise WireGuardKeyError(f"{field}: the all-zero key is not a usable WireGuard key")
    return raw


def check_key(value: str, field: str) -> str:
    """``value`` normalised (base64), after ``decode_key``'s checks."""
    return base64.b64encode(decode_key(value, field)).decode()


def to_hex(value: str) -> str:
    return decode_key(value, "key").hex()


def from_hex(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode()
