"""The burst gateway's TLS as the chart renders it (R4.3, R5.4): the gateway serves HTTPS with a certificate the
chart generates (or the user's Secret), the worker trusts it through a ConfigMap holding only the CA certificate,
and burst nodes join where the gateway says: burst.gateway.publicUrl (which the certificate names) or, without
it, the gateway's LoadBalancer address, verified as the Service name the certificate carries.

Offline (`helm template`); that the generated certificate really works against `kubeon-gpu gateway` is in
tests/gateway/test_app.py, that it survives an upgrade in test_install.py."""

from __future__ import annotations

import base64
import ipaddress
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.charts.helm import BURST_VALUES
from tests.charts.helm import CHART
from tests.charts.helm import MINIMAL_VALUES
from tests.charts.helm import NAMESPACE
from tests.charts.helm import RELEASE
from tests.charts.helm import Rendered
from tests.charts.helm import container
from tests.charts.helm import env
from tests.charts.helm import run_helm
from tests.charts.helm import template

OPTIMIZER = "kubeon-gpu-optimizer"
GATEWAY = "kubeon-gpu-optimizer-gateway"
PUBLIC_URL = "https://burst-gw.example.com:8443"  # as in values-burst.yaml
SERVICE_NAMES = [GATEWAY, f"{GATEWAY}.{NAMESPACE}", f"{GATEWAY}.{NAMESPACE}.svc",
                 f"{GATEWAY}.{NAMESPACE}.svc.cluster.local"]
# Burst with nothing else that mounts a Secret into the worker: no location credentials, embedded Temporal.
SIM_ONLY = ("--set", "burst.enabled=true", "--set", f"burst.gateway.publicUrl={PUBLIC_URL}", "--set-json",
            'burst.locations=[{"name": "sim/eu-west", "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, '
            '"gpuProduct": "NVIDIA-L4", "usdPerHour": 0.9}]}]')


@pytest.fixture(scope="module")
def burst() -> Rendered:
    return template(values=[BURST_VALUES])


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return dict(deployment["spec"]["template"]["spec"])


def volume_for(deployment: dict[str, Any], mount_path: str, container_name: str) -> dict[str, Any]:
    mount = next(m for m in container(deployment, container_name)["volumeMounts"] if m["mountPath"] == mount_path)
    assert mount["readOnly"] is True, mount
    return dict(next(v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"]))


def secret_names(deployment: dict[str, Any]) -> set[str]:
    return {v["secret"]["secretName"] for v in pod_spec(deployment)["volumes"] if "secret" in v}


def generated(rendered: Rendered) -> tuple[x509.Certificate, bytes, x509.Certificate]:
    """The generated Secret's certificate, key (PEM) and CA certificate."""
    data = rendered.get("Secret", f"{GATEWAY}-tls", NAMESPACE)["data"]
    pem = {k: base64.b64decode(v) for k, v in data.items()}
    return x509.load_pem_x509_certificate(pem["tls.crt"]), pem["tls.key"], x509.load_pem_x509_certificate(pem["ca.crt"])


def sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return names.get_values_for_type(x509.DNSName), [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]


# --- the gateway ----------------------------------------------------------------------------------------------

def test_gateway_serves_tls_from_its_mounted_secret(burst: Rendered) -> None:
    deployment = burst.get("Deployment", GATEWAY, NAMESPACE)
    e = env(container(deployment, "gateway"))
    assert e["KUBEON_GATEWAY_TLS_CERT_FILE"] == "/var/run/kubeon/gateway-tls/tls.crt"
    assert e["KUBEON_GATEWAY_TLS_KEY_FILE"] == "/var/run/kubeon/gateway-tls/tls.key"
    tls = volume_for(deployment, "/var/run/kubeon/gateway-tls", "gateway")["secret"]
    assert tls == {"secretName": f"{GATEWAY}-tls", "defaultMode": 0o440,
                   "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}
    secret = burst.get("Secret", f"{GATEWAY}-tls", NAMESPACE)
    assert secret["type"] == "kubernetes.io/tls"
    assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}


def test_generated_certificate_names_the_service_and_the_public_host(burst: Rendered) -> None:
    cert, _, _ = generated(burst)
    dns, ips = sans(cert)
    assert dns == [*SERVICE_NAMES, "burst-gw.example.com"]
    assert ips == []
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False


def test_generated_certificate_is_signed_by_the_ca_and_matches_its_key(burst: Rendered) -> None:
    cert, key_pem, ca = generated(burst)
    assert cert.issuer == ca.subject
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    ca_key = ca.public_key()
    assert isinstance(ca_key, rsa.RSAPublicKey)
    assert cert.signature_hash_algorithm is not None
    ca_key.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm)
    key, public = serialization.load_pem_private_key(key_pem, password=None), cert.public_key()
    assert isinstance(key, rsa.RSAPrivateKey) and isinstance(public, rsa.RSAPublicKey)
    assert key.public_key().public_numbers() == public.public_numbers()


def test_a_public_ip_becomes_an_ip_san() -> None:
    rendered = template(*SIM_ONLY, "--set", "burst.gateway.publicUrl=https://203.0.113.10:31443")
    dns, ips = sans(generated(rendered)[0])
    assert ips == ["203.0.113.10"]
    assert dns == SERVICE_NAMES
    v6 = template(*SIM_ONLY, "--set", "burst.gateway.publicUrl=https://[2001:db8::10]:8443")
    assert [ipaddress.ip_address(ip) for ip in sans(generated(v6)[0])[1]] == [ipaddress.ip_address("2001:db8::10")]


def test_gateway_and_worker_roll_when_the_certificate_changes(burst: Rendered) -> None:
    key = "checksum/gateway-tls"

    def checksums(rendered: Rendered) -> set[str]:
        return {rendered.get("Deployment", name)["spec"]["template"]["metadata"]["annotations"][key]
                for name in (OPTIMIZER, GATEWAY)}

    before = checksums(burst)
    assert len(before) == 1, "the gateway and the worker carry the same checksum"
    assert checksums(template(values=[BURST_VALUES])) == before, "same values, same checksum: no restart"
    moved = template("--set", "burst.gateway.publicUrl=https://gw2.example.com:8443", values=[BURST_VALUES])
    assert len(checksums(moved)) == 1 and checksums(moved) != before


# --- the worker: the CA by ConfigMap, never a Secret (R5.4) ----------------------------------------------------

def test_worker_mounts_the_gateway_ca_from_a_configmap(burst: Rendered) -> None:
    deployment = burst.get("Deployment", OPTIMIZER, NAMESPACE)
    assert env(container(deployment, "worker"))["KUBEON_GATEWAY_CA_FILE"] == "/etc/kubeon/gateway-ca/ca.crt"
    volume = volume_for(deployment, "/etc/kubeon/gateway-ca", "worker")
    assert volume["configMap"] == {"name": f"{GATEWAY}-ca"}
    configmap = burst.get("ConfigMap", f"{GATEWAY}-ca", NAMESPACE)
    assert list(configmap["data"]) == ["ca.crt"]
    secret = burst.get("Secret", f"{GATEWAY}-tls", NAMESPACE)
    assert configmap["data"]["ca.crt"].encode() == base64.b64decode(secret["data"]["ca.crt"])
    assert b"PRIVATE KEY" not in configmap["data"]["ca.crt"].encode()


def test_worker_mounts_no_secret_but_its_hub_token() -> None:
    rendered = template(*SIM_ONLY)
    assert secret_names(rendered.get("Deployment", OPTIMIZER)) == {"kubeon-gpu-optimizer-token"}


def test_worker_mounts_none_of_the_gateways_secrets(burst: Rendered) -> None:
    # What values-burst.yaml asks for (the Temporal API key), nothing of the gateway's. No on-prem pool token in
    # either: the worker claims servers with its hub token, the gateway checks the hub's claims (public keys).
    assert secret_names(burst.get("Deployment", OPTIMIZER)) == {"kubeon-gpu-optimizer-token", "kubeon-temporal-api-key"}
    assert secret_names(burst.get("Deployment", GATEWAY)) == {
        f"{GATEWAY}-ticket-key", f"{GATEWAY}-tls", f"{GATEWAY}-wireguard"}


# --- the user's own certificate -------------------------------------------------------------------------------

def test_existing_secret_renders_no_generated_certificate(burst: Rendered) -> None:
    ca_pem = generated(burst)[2].public_bytes(serialization.Encoding.PEM).decode()
    rendered = template(*SIM_ONLY, "--set", "burst.gateway.tls.existingSecret=burst-gw-tls",
                        "--set-string", f"burst.gateway.tls.caBundle={ca_pem}")
    assert [s["metadata"]["name"] for s in rendered.all("Secret")] == [f"{GATEWAY}-ticket-key", f"{GATEWAY}-wireguard"]
    tls = volume_for(rendered.get("Deployment", GATEWAY), "/var/run/kubeon/gateway-tls", "gateway")
    assert tls["secret"]["secretName"] == "burst-gw-tls"
    assert rendered.get("ConfigMap", f"{GATEWAY}-ca", NAMESPACE)["data"]["ca.crt"] == ca_pem.strip() + "\n"
    worker = rendered.get("Deployment", OPTIMIZER)
    assert env(container(worker, "worker"))["KUBEON_GATEWAY_CA_FILE"] == "/etc/kubeon/gateway-ca/ca.crt"
    assert secret_names(worker) == {"kubeon-gpu-optimizer-token"}


def test_existing_secret_without_a_ca_uses_the_system_trust_store() -> None:
    rendered = template(*SIM_ONLY, "--set", "burst.gateway.tls.existingSecret=burst-gw-tls")
    assert not rendered.find("ConfigMap", f"{GATEWAY}-ca")
    worker = rendered.get("Deployment", OPTIMIZER)
    assert "KUBEON_GATEWAY_CA_FILE" not in env(container(worker, "worker"))
    assert not any(v["name"] == "gateway-ca" for v in pod_spec(worker)["volumes"])


# --- publicUrl --------------------------------------------------------------------------------------------------

def test_worker_tells_burst_nodes_the_public_url(burst: Rendered) -> None:
    e = env(container(burst.get("Deployment", OPTIMIZER), "worker"))
    assert e["KUBEON_GATEWAY_PUBLIC_URL"] == PUBLIC_URL
    assert e["KUBEON_GATEWAY_URL"] == f"https://{GATEWAY}.{NAMESPACE}.svc:8443"


def test_public_url_is_optional_with_a_load_balancer() -> None:
    """No publicUrl: the gateway finds its LoadBalancer's address; nodes verify the Service name, which the
    generated certificate carries (and nothing else: there is no public host to name)."""
    rendered = template("--set", "burst.enabled=true")
    assert rendered.get("Service", GATEWAY)["spec"]["type"] == "LoadBalancer"
    assert sans(generated(rendered)[0]) == (SERVICE_NAMES, [])
    gateway = env(container(rendered.get("Deployment", GATEWAY), "gateway"))
    assert gateway["KUBEON_GATEWAY_PUBLIC_URL"] == ""
    assert (gateway["KUBEON_GATEWAY_SERVICE"], gateway["KUBEON_GATEWAY_SERVICE_NAMESPACE"]) == (GATEWAY, NAMESPACE)
    # Its own Service, and the embedded Temporal's (its tunnel refuses that ClusterIP).
    assert rendered.get("Role", GATEWAY, NAMESPACE)["rules"][0]["resourceNames"] == [
        GATEWAY, "kubeon-gpu-optimizer-temporal"]
    assert gateway["KUBEON_GATEWAY_TUNNEL_DENIED_SERVICES"] == "kubeon-gpu-optimizer-temporal"
    rendered.get("ConfigMap", f"{GATEWAY}-ca", NAMESPACE)


@pytest.mark.parametrize("service_type", ["NodePort", "ClusterIP"])
def test_public_url_is_required_without_a_load_balancer_even_without_the_schema(service_type: str) -> None:
    proc = run_helm(["template", RELEASE, CHART, "--namespace", NAMESPACE, "-f", MINIMAL_VALUES,
                     "--set", "burst.enabled=true", "--set", f"burst.gateway.service.type={service_type}",
                     "--skip-schema-validation"], check=False)
    assert proc.returncode != 0
    assert f"burst.gateway.publicUrl is required with burst.gateway.service.type={service_type}" in proc.stderr
    assert "only a LoadBalancer Service has an address the gateway can find itself" in proc.stderr
    template("--set", "burst.enabled=true", "--set", f"burst.gateway.service.type={service_type}",
             "--set", "burst.gateway.publicUrl=https://203.0.113.10:31443")


def test_public_url_is_not_needed_without_burst() -> None:
    rendered = template()
    assert not rendered.find("Secret", f"{GATEWAY}-tls") and not rendered.find("ConfigMap", f"{GATEWAY}-ca")
