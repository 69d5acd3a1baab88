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
- ``azure``: the attested data as IMDS gives it, a base64 PKCS7 SignedData (parsed with ``asn1crypto``: the
  ``cryptography`` package verifies no PKCS7): its signed JSON (vmId, subscriptionId, nonce, timeStamp), its
  signer's certificate, which must be a trust root or issued by one and be for ``metadata.azure.com`` (or the
  sovereign clouds' ``metadata.azure.us`` / ``.cn``), the signed attributes' message digest of the JSON and their
  RSA signature. The nonce must be the ticket's (``models.join.attestation_nonce``: a document fetched for
  another ticket is refused, ``attestation_replayed``), ``expiresOn`` not past. Azure signs no location into it:
  the region stays unverified (recorded empty) and the subscription (``accounts``) is what binds the VM.
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
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from models.errors import JoinRefused
from models.join import Attestation
from models.join import NodeIdentity
from models.join import attestation_nonce

SIM_PROVIDER = "sim"
# Who signs Azure's attested data: the metadata service's certificate (public cloud, US Government, China).
AZURE_SIGNER_NAMES = ("metadata.azure.com", "metadata.azure.us", "metadata.azure.cn")
# Its digest algorithm, as a digest or (as Azure's own PKCS7 names it) the sha*WithRSAEncryption OID.
_AZURE_DIGESTS: dict[str, hashes.HashAlgorithm] = {
    "sha256": hashes.SHA256(), "sha384": hashes.SHA384(), "sha512": hashes.SHA512(),
    "1.2.840.113549.1.1.11": hashes.SHA256(), "1.2.840.113549.1.1.12": hashes.SHA384(),
    "1.2.840.113549.1.1.13": hashes.SHA512()}


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

    def verify(self, attestation: Attestation, location: str, *, ticket: str = "") -> NodeIdentity:
        """The identity of a node redeeming ``ticket`` (the raw ticket: Azure's nonce is derived from it) for
        ``location``; refused with a code unless it verifies."""
        provider, region = split_location(location)
        method = attestation.method
        if provider == "onprem" and method in ("none", "onprem"):
            # The server's join credential is the proof: POST /v1/join checks the pool claim the hub signed for it
            # (gateway.pool_tokens) before the admission; the location is its pool.
            return NodeIdentity(method="onprem", verified=True, region=region)
        if method == "none":
            if self.required(provider):
                raise _refuse("attestation_required", f"the ticket is for {location}: a {provider} node must "
                              "present its signed instance identity")
            return NodeIdentity(method="none", verified=False)
        if method != provider:
            raise _refuse("attestation_invalid", f"method {method} for a ticket of {location}")
        roots = list(self.roots.get(provider, []))
        if not roots:
            raise _refuse("attestation_untrusted", f"no trust roots configured for {provider}")
        if provider == "azure":
            got = self._azure(attestation, roots, ticket)
        else:
            got = self._gcp(attestation, roots) if provider == "gcp" else self._aws(attestation, roots)
        if provider != "azure" and got.region != region:
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
        return [self._trusted(cert, roots)]

    def _trusted(self, cert: x509.Certificate, roots: list[x509.Certificate]) -> x509.Certificate:
        """``cert`` if it is in date and a root or directly issued by one."""
        now = dt.datetime.fromtimestamp(self.clock(), dt.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise _refuse("attestation_forged", "the signer's certificate is not valid now")
        for root in roots:
            if cert == root:
                return cert
            try:
                cert.verify_directly_issued_by(root)
                return cert
            except (ValueError, TypeError, InvalidSignature):
                continue
        raise _refuse("attestation_forged", f"the signer's certificate ({cert.subject.rfc4514_string()}) is not "
                      "issued by a trusted root")

    def _check(self, signers: list[x509.Certificate], signature: bytes, data: bytes,
               digest: hashes.HashAlgorithm | None = None) -> None:
        for cert in signers:
            key = cert.public_key()
            if not isinstance(key, rsa.RSAPublicKey):
                continue
            try:
                key.verify(signature, data, padding.PKCS1v15(), digest or hashes.SHA256())
                return
            except InvalidSignature:
                continue
        raise _refuse("attestation_forged", "the signature does not verify with a trusted certificate")

    def _aws(self, attestation: Attestation, roots: list[x509.Certificate]) -> NodeIdentity:
        try:
            signature = base64.b64decode(attestation.signature, validate=True)
            doc: dict[str, Any] = json.loads(attestation.document)
        except ValueError:
            raise _refuse("attestation_invalid", "document or signature malformed") from None
        self._check(self._signer(attestation, roots), signature, attestation.document.encode())
        return NodeIdentity(method="aws", verified=True, region=str(doc.get("region", "")),
                            zone=str(doc.get("availabilityZone", "")),
                            instance_id=str(doc.get("instanceId", "")), account=str(doc.get("accountId", "")))

    def _azure(self, attestation: Attestation, roots: list[x509.Certificate], ticket: str) -> NodeIdentity:
        from asn1crypto import cms

        try:
            info = cms.ContentInfo.load(base64.b64decode(attestation.signature, validate=True))
            signed = info["content"]
            if info["content_type"].native != "signed_data" or len(signed["signer_infos"]) != 1:
                raise ValueError("not a PKCS7 SignedData with one signer")
            content: bytes = signed["encap_content_info"]["content"].native
            doc: dict[str, Any] = json.loads(content)
            signer = signed["signer_infos"][0]
            sid = signer["sid"].chosen
            certs = [c.chosen for c in signed["certificates"] or [] if c.name == "certificate"]
            der = next(c.dump() for c in certs
                       if c.issuer == sid["issuer"] and c.serial_number == sid["serial_number"].native)
            digest = _AZURE_DIGESTS[signer["digest_algorithm"]["algorithm"].native]
            attrs = signer["signed_attrs"]
        except (ValueError, TypeError, KeyError, StopIteration, AttributeError) as exc:
            raise _refuse("attestation_invalid", f"the attested data is not a signed PKCS7 document ({exc})") from None
        cert = self._trusted(x509.load_der_x509_certificate(der), roots)
        names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        if not any(str(n).lstrip("*.").endswith(AZURE_SIGNER_NAMES) for n in names):
            raise _refuse("attestation_forged", f"the attested data is signed by {cert.subject.rfc4514_string()}, not "
                          "Azure's metadata service")
        if len(attrs):  # the signature is over the signed attributes, which carry the content's digest
            digests = [a["values"][0].native for a in attrs if a["type"].native == "message_digest"]
            want = hashes.Hash(digest)
            want.update(content)
            if digests != [want.finalize()]:
                raise _refuse("attestation_forged", "the attested data does not match its signed digest")
            data = b"\x31" + attrs.dump()[1:]  # signed as a SET OF, stored [0] IMPLICIT (RFC 5652 5.4)
        else:
            data = content
        self._check([cert], signer["signature"].native, data, digest)
        if doc.get("nonce") != attestation_nonce(ticket):
            raise _refuse("attestation_replayed", "the attested data was not fetched for this ticket (its nonce)")
        try:
            expires = dt.datetime.strptime(str(doc["timeStamp"]["expiresOn"]), "%m/%d/%y %H:%M:%S %z")
        except (KeyError, TypeError, ValueError):
            raise _refuse("attestation_invalid", "the attested data has no timeStamp.expiresOn") from None
        if expires.timestamp() < self.clock():
            raise _refuse("attestation_expired", f"the attested data expired at {expires.isoformat()}")
        return NodeIdentity(method="azure", verified=True, instance_id=str(doc.get("vmId", "")),
                            account=str(doc.get("subscriptionId", "")))

    def _gcp(self, attestation: Attestation, roots: list[x509.Certificate]) -> NodeIdentity:
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
        return NodeIdentity(method="gcp", verified=True, region=zone_region(zone), zone=zone,
                            instance_id=str(gce.get("instance_id", "")),
                            instance_name=str(gce.get("instance_name", "")), account=str(gce.get("project_id", "")))


def verifier_from(roots: tuple[tuple[str, str], ...], accounts: tuple[tuple[str, str], ...], audience: str,
                  ) -> AttestationVerifier:
    """The verifier of the gateway's settings (``GatewayServerConfig.attestation_*``)."""
    return AttestationVerifier(roots={p: load_roots(pem) for p, pem in roots}, accounts=dict(accounts),
                               audience=audience)
