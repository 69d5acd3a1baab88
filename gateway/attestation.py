"""Location attested at join: the node's signed instance identity verified against configurable trust roots, and
its instance, account or project and region/zone checked against the ticket's location.

- ``aws``: the instance identity document (JSON) and its base64 RSA-SHA256 signature
  (``/latest/dynamic/instance-identity/signature``, verified with the region's published AWS RSA certificate:
  AWS documents this as "verify the instance identity document using the base64-encoded signature", the same
  check as ``openssl dgst -sha256 -verify``). The PKCS7 form is not used: ``cryptography`` verifies no PKCS7
  signatures, and both sign the same document with the same key.
- ``gcp``: the instance identity token (``/computeMetadata/v1/instance/service-accounts/default/identity?
  audience=...&format=full``), an RS256 JWT; its ``aud`` must be the gateway's audience, its
  ``google.compute_engine`` claims name the project, zone and instance.
- ``azure``: the attested data (JSON) and its base64 RSA-SHA256 signature by a certificate issued by a trust root.
  Azure's own attested document carries no location: a document without ``location`` is refused where the
  location is required (the local server's carries it).
- ``onprem``: no cloud identity; the server's join credential (the pool claim the hub signed, checked by the HTTP
  API before the admission) is the proof; an ``onprem`` ticket is recorded as method ``onprem`` (sent as ``none``
  or ``onprem``), and method ``onprem`` is refused for any other ticket.
- ``none``: no identity; accepted only where the ticket's provider has no trust roots configured (``sim`` always:
  it has none). A provider with trust roots requires its method: a real-cloud ticket is never redeemed with
  ``none`` once its roots are configured.

Refusals: ``attestation_required`` (none where required), ``attestation_invalid`` (malformed, wrong method),
``attestation_forged`` (the signature does not verify with a trusted certificate), ``location_mismatch`` (region
or zone not the ticket's), ``account_mismatch`` (account or project not the configured one), ``attestation_expired``.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from pydantic import BaseModel, ConfigDict, Field

from models.errors import JoinRefused
from models.join import Attestation

SIM_PROVIDER = "sim"


class AttestedIdentity(BaseModel):
    """What the gateway verified of a joining node (kept in its redemption record, the node's audit)."""

    model_config = ConfigDict(populate_by_name=True)

    method: str
    verified: bool = Field(description="false: method none, nothing verified")
    region: str = ""
    zone: str = ""
    instance_id: str = Field(default="", alias="instanceId")
    account: str = ""


def _refuse(code: str, message: str) -> JoinRefused:
    return JoinRefused(code, f"attestation: {message}", status=403)


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def split_location(location: str) -> tuple[str, str]:
    """``provider/region`` (``aws/eu-central-1``) -> (provider, region)."""
    provider, _, region = location.partition("/")
    return provider, region


def zone_region(zone: str) -> str:
    """The region of a GCE zone (``europe-west4-a`` -> ``europe-west4``)."""
    return zone.rsplit("-", 1)[0] if zone.count("-") >= 2 else zone


def load_roots(pem: str) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(pem.encode()) if pem.strip() else []


@dataclass
class AttestationVerifier:
    """``roots``: per provider (aws, gcp, azure) the trusted certificates (a cloud's published signing certificates,
    or a CA that issued them; tests make their own). ``accounts``: per provider the account ID, project or
    subscription the nodes must be in (absent: not checked). ``audience``: what a GCP token's ``aud`` must be."""

    roots: Mapping[str, list[x509.Certificate]] = field(default_factory=dict)
    accounts: Mapping[str, str] = field(default_factory=dict)
    audience: str = ""
    clock: Callable[[], float] = time.time

    def required(self, provider: str) -> bool:
        return provider != SIM_PROVIDER and bool(self.roots.get(provider))

    def request(self, location: str) -> dict[str, str]:
        """What a node of ``location`` must be told to send (its user data's ``attestation``): its provider's
        method, and the audience a GCP identity token is minted for, where that provider's identity is required."""
        provider, _ = split_location(location)
        if not self.required(provider):
            return {}
        return {"method": provider, **({"audience": self.audience} if self.audience else {})}

    def verify(self, attestation: Attestation, location: str) -> AttestedIdentity:
        provider, region = split_location(location)
        method = attestation.method
        if provider == "onprem" and method in ("none", "onprem"):
            # The server's join credential is the proof: POST /v1/join checks the pool claim the hub signed for it
            # (gateway.pool_tokens) before the admission; the location is its pool.
            return AttestedIdentity(method="onprem", verified=True, region=region)
        if method == "none":
            if self.required(provider):
                raise _refuse("attestation_required", f"the ticket is for {location}: a {provider} node must "
                              "present its signed instance identity")
            return AttestedIdentity(method="none", verified=False)
        if method != provider:
            raise _refuse("attestation_invalid", f"method {method} for a ticket of {location}")
        roots = list(self.roots.get(provider, []))
        if not roots:
            raise _refuse("attestation_untrusted", f"no trust roots configured for {provider}")
        got = self._gcp(attestation, roots) if provider == "gcp" else self._signed_json(attestation, roots)
        if got.region != region:
            raise _refuse("location_mismatch", f"the node's instance is in {got.region or 'no region'}"
                          f"{f' (zone {got.zone})' if got.zone else ''}, the ticket is for {location}: refused")
        want = self.accounts.get(provider, "")
        if want and got.account != want:
            raise _refuse("account_mismatch", f"the node's instance is in account {got.account!r}, not {want!r}")
        return got

    def _signer(self, attestation: Attestation, roots: list[x509.Certificate]) -> list[x509.Certificate]:
        """The certificates that may have signed: the presented one if it is a root or issued (and in date) by one,
        else the roots themselves."""
        if not attestation.certificate.strip():
            return roots
        try:
            cert = x509.load_pem_x509_certificate(attestation.certificate.encode())
        except ValueError:
            raise _refuse("attestation_invalid", "certificate: not a PEM certificate") from None
        now = dt.datetime.fromtimestamp(self.clock(), dt.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise _refuse("attestation_forged", "the signer's certificate is not valid now")
        for root in roots:
            if cert == root:
                return [cert]
            try:
                cert.verify_directly_issued_by(root)
                return [cert]
            except (ValueError, TypeError, InvalidSignature):
                continue
        raise _refuse("attestation_forged", f"the signer's certificate ({cert.subject.rfc4514_string()}) is not "
                      "issued by a trusted root")

    def _check(self, signers: list[x509.Certificate], signature: bytes, data: bytes) -> None:
        for cert in signers:
            key = cert.public_key()
            if not isinstance(key, rsa.RSAPublicKey):
                continue
            try:
                key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
                return
            except InvalidSignature:
                continue
        raise _refuse("attestation_forged", "the signature does not verify with a trusted certificate")

    def _signed_json(self, attestation: Attestation, roots: list[x509.Certificate]) -> AttestedIdentity:
        try:
            signature = base64.b64decode(attestation.signature, validate=True)
            doc: dict[str, Any] = json.loads(attestation.document)
        except ValueError:
            raise _refuse("attestation_invalid", "document or signature malformed") from None
        self._check(self._signer(attestation, roots), signature, attestation.document.encode())
        if attestation.method == "aws":
            return AttestedIdentity(method="aws", verified=True, region=str(doc.get("region", "")),
                                    zone=str(doc.get("availabilityZone", "")),
                                    instance_id=str(doc.get("instanceId", "")), account=str(doc.get("accountId", "")))
        return AttestedIdentity(method="azure", verified=True, region=str(doc.get("location", "")),
                                zone=str(doc.get("zone", "")), instance_id=str(doc.get("vmId", "")),
                                account=str(doc.get("subscriptionId", "")))

    def _gcp(self, attestation: Attestation, roots: list[x509.Certificate]) -> AttestedIdentity:
        try:
            head, body, sig = attestation.document.split(".")
            header = json.loads(_unb64url(head))
            claims: dict[str, Any] = json.loads(_unb64url(body))
            signature = _unb64url(sig)
        except ValueError:
            raise _refuse("attestation_invalid", "the identity token is not a JWT") from None
        if header.get("alg") != "RS256":
            raise _refuse("attestation_invalid", f"identity token alg {header.get('alg')!r}, RS256 expected")
        self._check(self._signer(attestation, roots), signature, f"{head}.{body}".encode())
        if not self.audience or claims.get("aud") != self.audience:
            raise _refuse("attestation_invalid", f"identity token audience {claims.get('aud')!r} is not this "
                          "gateway's")
        if float(claims.get("exp", 0)) < self.clock():
            raise _refuse("attestation_expired", "the identity token expired")
        gce = claims.get("google", {}).get("compute_engine", {})
        zone = str(gce.get("zone", ""))
        return AttestedIdentity(method="gcp", verified=True, region=zone_region(zone), zone=zone,
                                instance_id=str(gce.get("instance_id", "")), account=str(gce.get("project_id", "")))


def verifier_from(roots: tuple[tuple[str, str], ...], accounts: tuple[tuple[str, str], ...], audience: str,
                  ) -> AttestationVerifier:
    """The verifier of the gateway's settings (``GatewayServerConfig.attestation_*``)."""
    return AttestationVerifier(roots={p: load_roots(pem) for p, pem in roots}, accounts=dict(accounts),
                               audience=audience)
