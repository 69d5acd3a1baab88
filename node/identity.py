"""The node's signed instance identity, read from its cloud's metadata service for its join (issue 27).

The join document says which (``attestation``: ``{"method": "aws"|"gcp"|"azure"|"onprem"|"none", "audience":
...}``) and may say where (``metadataUrl``; default: the cloud's own link-local metadata address). Tests point
``metadataUrl`` at the local cloud servers on loopback, never at 169.254.169.254.

- aws: IMDSv2 (``PUT /latest/api/token``), then ``/latest/dynamic/instance-identity/document`` and ``.../signature``.
- gcp: ``/computeMetadata/v1/instance/service-accounts/default/identity?audience=<gateway>&format=full``
  (``Metadata-Flavor: Google``).
- azure: ``/metadata/attested/document?api-version=2021-02-01&nonce=<from the ticket>`` (``Metadata: true``); the
  answer's ``signature`` is a PKCS7 SignedData (``encoding: pkcs7``) holding the signed JSON and its signer's
  certificate, sent as it is.
"""

from __future__ import annotations

from typing import Any

import httpx

from models.join import Attestation
from models.join import attestation_nonce

DEFAULT_METADATA_URLS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
TIMEOUT_SECONDS = 10.0


class IdentityUnavailable(RuntimeError):
    """The metadata service gave no identity (the node cannot join where its location must be attested)."""


def fetch_attestation(doc: dict[str, Any], *, timeout: float = TIMEOUT_SECONDS) -> Attestation:
    """The attestation the join document asks for (none: method ``none``)."""
    spec = doc.get("attestation") or {}
    method = str(spec.get("method") or "none")
    if method in ("none", "onprem"):
        return Attestation(method=method)
    if method not in DEFAULT_METADATA_URLS:
        raise IdentityUnavailable(f"attestation method {method!r} is not aws, gcp, azure, onprem or none")
    base = str(doc.get("metadataUrl") or DEFAULT_METADATA_URLS[method]).rstrip("/")
    try:
        with httpx.Client(base_url=base, timeout=timeout, trust_env=False, follow_redirects=False) as http:
            if method == "aws":
                token = _ok(http.put("/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}))
                headers = {"X-aws-ec2-metadata-token": token.text}
                document = _ok(http.get("/latest/dynamic/instance-identity/document", headers=headers)).text
                signature = _ok(http.get("/latest/dynamic/instance-identity/signature", headers=headers)).text
                return Attestation(method="aws", document=document, signature=signature.strip())
            if method == "gcp":
                token = _ok(http.get("/computeMetadata/v1/instance/service-accounts/default/identity",
                                     params={"audience": str(spec.get("audience", "")), "format": "full"},
                                     headers={"Metadata-Flavor": "Google"}))
                return Attestation(method="gcp", document=token.text.strip())
            got = _ok(http.get("/metadata/attested/document",
                               params={"api-version": "2021-02-01", "nonce": attestation_nonce(str(doc["ticket"]))},
                               headers={"Metadata": "true"})).json()
            if got.get("encoding") != "pkcs7":
                raise ValueError(f"attested data encoded as {got.get('encoding')!r}, not pkcs7")
            return Attestation(method="azure", signature=str(got.get("signature", "")))
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise IdentityUnavailable(f"the {method} metadata service at {base}: {type(exc).__name__}: {exc}") from None


def _ok(response: httpx.Response) -> httpx.Response:
    response.raise_for_status()
    return response
