"""A test CA that signs instance identities as the clouds do (issue 27, location attested at join): an AWS
instance identity document and its base64 RSA-SHA256 signature, a GCP instance identity token (RS256 JWT), Azure
attested data (a PKCS7 SignedData of its JSON by a ``metadata.azure.com`` certificate, as IMDS answers). The
gateway verifies them with ``gateway.attestation``, the same code as for the clouds' own certificates; the CA is
the trust root the test configures."""

from __future__ import annotations

import base64
import datetime as dt
import json
import time
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs7
from cryptography.x509.oid import NameOID

from models.join import Attestation
from models.join import attestation_nonce


def _cert(subject: str, key: rsa.RSAPrivateKey, issuer: str, issuer_key: rsa.RSAPrivateKey, *,
          ca: bool) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(issuer_key, hashes.SHA256()))


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class IdentityCA:
    """A CA (the trust root) and the identity signer certificate it issued."""

    name: str = "kubeon test identity CA"
    ca_key: rsa.RSAPrivateKey = field(default_factory=lambda: rsa.generate_private_key(65537, 2048))
    key: rsa.RSAPrivateKey = field(default_factory=lambda: rsa.generate_private_key(65537, 2048))

    def __post_init__(self) -> None:
        self.ca = _cert(self.name, self.ca_key, self.name, self.ca_key, ca=True)
        self.signer = _cert(f"{self.name} signer", self.key, self.name, self.ca_key, ca=False)
        # Azure's attested data is signed by its metadata service's certificate, which a verifier checks by name.
        self.azure_signer = _cert("metadata.azure.com", self.key, self.name, self.ca_key, ca=False)

    @property
    def root_pem(self) -> str:
        return self.ca.public_bytes(serialization.Encoding.PEM).decode()

    @property
    def signer_pem(self) -> str:
        return self.signer.public_bytes(serialization.Encoding.PEM).decode()

    def _sign(self, data: bytes) -> bytes:
        return self.key.sign(data, padding.PKCS1v15(), hashes.SHA256())

    def aws(self, *, region: str, instance_id: str = "i-0123456789abcdef0", account: str = "123456789012",
            zone: str = "") -> Attestation:
        document = json.dumps({"accountId": account, "instanceId": instance_id, "region": region,
                               "availabilityZone": zone or f"{region}a", "instanceType": "g5.xlarge",
                               "pendingTime": dt.datetime.now(dt.UTC).isoformat()}, indent=2)
        return Attestation(method="aws", document=document, certificate=self.signer_pem,
                           signature=base64.b64encode(self._sign(document.encode())).decode())

    def gcp(self, *, zone: str, audience: str, project: str = "kubeon-test", instance_id: str = "1234567890",
            instance_name: str = "", ttl: float = 3600) -> Attestation:
        now = time.time()
        claims: dict[str, Any] = {
            "aud": audience, "iss": "https://accounts.google.com", "iat": int(now), "exp": int(now + ttl),
            "google": {"compute_engine": {"project_id": project, "zone": zone, "instance_id": instance_id,
                                          "instance_name": instance_name or f"vm-{instance_id}"}}}
        head = _b64url(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "test"}).encode())
        body = _b64url(json.dumps(claims).encode())
        sig = _b64url(self._sign(f"{head}.{body}".encode()))
        return Attestation(method="gcp", document=f"{head}.{body}.{sig}")

    def azure(self, *, ticket: str, vm_id: str = "00000000-0000-0000-0000-000000000001",
              subscription: str = "00000000-0000-0000-0000-00000000aaaa", ttl: float = 300,
              signer: x509.Certificate | None = None) -> Attestation:
        """What a VM sends when it asked IMDS with the nonce of ``ticket``."""
        return Attestation(method="azure", signature=self.azure_signed(
            attestation_nonce(ticket), vm_id=vm_id, subscription=subscription, ttl=ttl, signer=signer))

    def azure_signed(self, nonce: str, *, vm_id: str, subscription: str, ttl: float = 300,
                     signer: x509.Certificate | None = None) -> str:
        """IMDS's attested data (its ``signature``, base64 DER): the signed JSON carries no location, as Azure's
        does not."""
        now = dt.datetime.now(dt.UTC)
        stamp = "%m/%d/%y %H:%M:%S -0000"
        content = json.dumps({
            "licenseType": "", "nonce": nonce, "plan": {"name": "", "product": "", "publisher": ""},
            "sku": "22_04-lts-gen2", "subscriptionId": subscription, "vmId": vm_id,
            "timeStamp": {"createdOn": now.strftime(stamp),
                          "expiresOn": (now + dt.timedelta(seconds=ttl)).strftime(stamp)}}).encode()
        signed = (pkcs7.PKCS7SignatureBuilder().set_data(content)
                  .add_signer(signer or self.azure_signer, self.key, hashes.SHA256())
                  .sign(serialization.Encoding.DER, [pkcs7.PKCS7Options.Binary]))
        return base64.b64encode(signed).decode()
