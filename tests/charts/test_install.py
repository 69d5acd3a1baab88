"""`helm install` into the real control plane, then the least-privilege proof with the chart's own
ServiceAccounts' credentials (R5.1 - R5.4): what they may do succeeds, what they may not is refused with 403.

No image exists here, so the pods never run; every object and every permission is real.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from kubernetes import client

from models.policy import API_GROUP
from models.policy import PLURAL
from tests.charts.helm import BAD_VALUES
from tests.charts.helm import BURST_VALUES
from tests.charts.helm import CHART
from tests.charts.helm import MINIMAL_VALUES
from tests.charts.helm import NAMESPACE
from tests.charts.helm import RELEASE
from tests.charts.helm import run_helm
from tests.charts.test_chart import DOCUMENTED_BURST_VALUES
from tests.charts.test_chart import DOCUMENTED_CLUSTER_ROLE
from tests.charts.test_chart import VERIFY_STEPS
from tests.charts.test_chart import expectations
from tests.harness.joining import new_burst_node
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.kube import wait_for

pytestmark = pytest.mark.cluster

OPTIMIZER = "kubeon-gpu-optimizer"
GATEWAY = "kubeon-gpu-optimizer-gateway"
GPU_OPERATOR = "gpu-operator"
CRD = "gpupolicies.gpu.kubeon.io"


@dataclass
class Install:
    cluster: Cluster
    kubeconfig: Path
    output: str
    allowed_ns: str  # named in scaleToZero.namespaces
    other_ns: str  # not named


def helm(install: Install | Cluster, *args: str | Path, check: bool = True) -> Any:
    plane = install.cluster.plane if isinstance(install, Install) else install.plane
    return run_helm([*args, "--kubeconfig", plane.admin_kubeconfig], check=check)


def _ignore_missing(call: Callable[[], object]) -> None:
    try:
        call()
    except client.ApiException as exc:
        if exc.status != 404:
            raise


@pytest.fixture(scope="module")
def installed(cluster: Cluster) -> Iterator[Install]:
    admin = cluster.admin
    operator_existed = namespace_settled(cluster, GPU_OPERATOR)
    if not operator_existed:  # the GPU Operator's namespace exists wherever the Operator is installed
        admin.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=GPU_OPERATOR)))
    allowed_ns, other_ns = cluster.create_namespace("stz"), cluster.create_namespace("other")
    # tests/harness/rbac.grant() makes the same ServiceAccounts and ClusterRoles without Helm; adopt them if a
    # test that ran earlier left them.
    adopt = any(_exists(read) for read in (
        lambda: admin.core.read_namespaced_service_account(OPTIMIZER, NAMESPACE),
        lambda: admin.rbac.read_cluster_role(OPTIMIZER),
        lambda: admin.rbac.read_cluster_role(GATEWAY),
    ))
    try:
        proc = run_helm([
            "install", RELEASE, CHART, "--namespace", NAMESPACE, "--create-namespace",
            "--kubeconfig", cluster.plane.admin_kubeconfig, "--wait=false", *(["--take-ownership"] if adopt else []),
            "-f", MINIMAL_VALUES, "-f", BURST_VALUES,
            "--set", "cluster=test", "--set", "temporal.mode=embedded",
            "--set", f"scaleToZero.namespaces={{{allowed_ns}}}",
        ])
        yield Install(cluster, cluster.plane.admin_kubeconfig, proc.stdout, allowed_ns, other_ns)
    finally:
        # Everything the release made goes (--wait: before the next module creates the same names). The
        # namespace kubeon-gpu and the CRD stay, as after a real uninstall: other tests use both.
        run_helm(["uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "120s",
                  "--kubeconfig", cluster.plane.admin_kubeconfig], check=False)
        _ignore_missing(lambda: admin.core.delete_namespaced_persistent_volume_claim(f"{OPTIMIZER}-temporal",
                                                                                      NAMESPACE))
        for ns in (allowed_ns, other_ns, *([] if operator_existed else [GPU_OPERATOR])):
            _ignore_missing(lambda ns=ns: admin.core.delete_namespace(ns))  # type: ignore[misc]


def namespace_settled(cluster: Cluster, name: str) -> bool:
    """Whether the namespace exists, once one that another module's teardown is deleting has gone."""
    def phase() -> str:
        try:
            return str(cluster.admin.core.read_namespace(name).status.phase)
        except client.ApiException as exc:
            if exc.status == 404:
                return "Gone"
            raise
    return wait_for(lambda: phase() if phase() != "Terminating" else None, timeout=60,
                    what=f"namespace {name} deleted or active") == "Active"


def _exists(read: Callable[[], object]) -> bool:
    try:
        read()
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@pytest.fixture(scope="module")
def optimizer(installed: Install) -> Kube:
    wait_for(lambda: installed.cluster.admin.core.read_namespaced_service_account(OPTIMIZER, NAMESPACE),
             what="the chart's optimizer ServiceAccount")
    return installed.cluster.service_account_client(NAMESPACE, OPTIMIZER, create=False)


@pytest.fixture(scope="module")
def gateway(installed: Install) -> Kube:
    wait_for(lambda: installed.cluster.admin.core.read_namespaced_service_account(GATEWAY, NAMESPACE),
             what="the chart's gateway ServiceAccount")
    return installed.cluster.service_account_client(NAMESPACE, GATEWAY, create=False)


def refused(call: Callable[[], object]) -> None:
    with pytest.raises(client.ApiException) as info:
        call()
    assert info.value.status == 403, f"expected 403, got {info.value.status}: {info.value.body}"


def can(kube: Kube, verb: str, resource: str, *, group: str = "", subresource: str = "", namespace: str = "",
        name: str = "") -> bool:
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, group=group, resource=resource, subresource=subresource or None,
            namespace=namespace or None, name=name or None)))
    return bool(client.AuthorizationV1Api(kube.api).create_self_subject_access_review(review).status.allowed)


# --- the install ----------------------------------------------------------------------------------------------

def test_release_is_deployed_with_the_verify_steps_in_its_notes(installed: Install) -> None:
    status = json.loads(helm(installed, "status", RELEASE, "--namespace", NAMESPACE, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    for step in VERIFY_STEPS:
        assert step in installed.output, f"install NOTES lack {step!r}:\n{installed.output}"


def test_objects_exist(installed: Install) -> None:
    admin = installed.cluster.admin
    deployment = admin.apps.read_namespaced_deployment(OPTIMIZER, NAMESPACE)
    pod = deployment.spec.template.spec
    assert pod.service_account_name == OPTIMIZER
    assert pod.security_context.run_as_non_root is True and pod.security_context.run_as_user == 10001
    assert pod.containers[0].security_context.read_only_root_filesystem is True
    assert pod.containers[0].security_context.capabilities.drop == ["ALL"]
    admin.core.read_namespaced_service_account(OPTIMIZER, NAMESPACE)
    role = admin.rbac.read_cluster_role(OPTIMIZER)
    assert [admin.api.sanitize_for_serialization(r) for r in role.rules] == DOCUMENTED_CLUSTER_ROLE
    admin.rbac.read_cluster_role_binding(OPTIMIZER)
    admin.rbac.read_namespaced_role(f"{OPTIMIZER}-scale", installed.allowed_ns)
    assert not _exists(lambda: admin.rbac.read_namespaced_role(f"{OPTIMIZER}-scale", installed.other_ns)), \
        "no scale Role in a namespace that scaleToZero.namespaces does not name"
    admin.rbac.read_namespaced_role(f"{OPTIMIZER}-time-slicing", GPU_OPERATOR)

    # The worker's gateway token: projected for the gateway's audience, accepted by the API server as a volume.
    (projected,) = [v.projected.sources[0].service_account_token for v in pod.volumes if v.name == "gateway-token"]
    assert (projected.audience, projected.path) == ("kubeon-gateway", "token")
    gateway_env = {e.name: e.value for e in
                   admin.apps.read_namespaced_deployment(GATEWAY, NAMESPACE).spec.template.spec.containers[0].env}
    assert gateway_env["KUBEON_GATEWAY_ALLOWED_CLIENTS"] == f"system:serviceaccount:{NAMESPACE}:{OPTIMIZER}"
    assert gateway_env["KUBEON_GATEWAY_TOKEN_AUDIENCES"] == "kubeon-gateway"
    admin.core.read_namespaced_service_account(GATEWAY, NAMESPACE)
    admin.rbac.read_cluster_role(GATEWAY)
    service = admin.core.read_namespaced_service(GATEWAY, NAMESPACE)
    assert service.spec.type == "LoadBalancer"
    assert service.metadata.annotations["service.beta.kubernetes.io/aws-load-balancer-scheme"] == "internal"
    key = admin.core.read_namespaced_secret(f"{GATEWAY}-ticket-key", NAMESPACE)
    assert len(key.data["key"]) > 40
    admin.core.read_namespaced_config_map(f"{OPTIMIZER}-burst-locations", NAMESPACE)
    admin.apps.read_namespaced_deployment(f"{OPTIMIZER}-temporal", NAMESPACE)
    admin.core.read_namespaced_persistent_volume_claim(f"{OPTIMIZER}-temporal", NAMESPACE)


def test_ticket_key_survives_an_upgrade(installed: Install) -> None:
    read = installed.cluster.admin.core.read_namespaced_secret
    before = read(f"{GATEWAY}-ticket-key", NAMESPACE).data["key"]
    helm(installed, "upgrade", RELEASE, CHART, "--namespace", NAMESPACE, "--reuse-values", "--wait=false")
    assert read(f"{GATEWAY}-ticket-key", NAMESPACE).data["key"] == before, "an upgrade must not rotate the key"


def test_gateway_certificate_and_ca_survive_an_upgrade(installed: Install) -> None:
    core = installed.cluster.admin.core
    before = core.read_namespaced_secret(f"{GATEWAY}-tls", NAMESPACE).data
    ca = core.read_namespaced_config_map(f"{GATEWAY}-ca", NAMESPACE).data["ca.crt"]
    assert base64.b64decode(before["ca.crt"]).decode() == ca, "the worker's CA is the one that signed the gateway's"
    helm(installed, "upgrade", RELEASE, CHART, "--namespace", NAMESPACE, "--reuse-values", "--wait=false")
    assert core.read_namespaced_secret(f"{GATEWAY}-tls", NAMESPACE).data == before, "an upgrade keeps the cert"
    assert core.read_namespaced_config_map(f"{GATEWAY}-ca", NAMESPACE).data["ca.crt"] == ca


def test_gateway_certificate_follows_a_new_public_host(installed: Install) -> None:
    core = installed.cluster.admin.core
    helm(installed, "upgrade", RELEASE, CHART, "--namespace", NAMESPACE, "--reuse-values", "--wait=false",
         "--set", "burst.gateway.publicUrl=https://gw2.example.com:8443")
    secret = core.read_namespaced_secret(f"{GATEWAY}-tls", NAMESPACE).data
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "gw2.example.com" in names.get_values_for_type(x509.DNSName)
    assert f"{GATEWAY}.{NAMESPACE}.svc" in names.get_values_for_type(x509.DNSName)
    ca = core.read_namespaced_config_map(f"{GATEWAY}-ca", NAMESPACE).data["ca.crt"]
    assert base64.b64decode(secret["ca.crt"]).decode() == ca


def test_crd_printer_columns_and_get_gpupolicies(installed: Install, optimizer: Kube) -> None:
    admin = installed.cluster.admin

    def established() -> client.V1CustomResourceDefinition | None:
        crd = admin.apiext.read_custom_resource_definition(CRD)
        ok = any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
        return crd if ok else None

    crd = wait_for(established, what="GpuPolicy CRD established")
    columns = [c.name for c in crd.spec.versions[0].additional_printer_columns]
    assert "Kind" in columns and "Mode" in columns

    name = f"chart-{uuid.uuid4().hex[:6]}"
    policy = yaml.safe_load(f"""
        apiVersion: gpu.kubeon.io/v1
        kind: GpuPolicy
        metadata: {{name: {name}}}
        spec:
          kind: Burst
          mode: Approve
          workloads: {{tolerate: gpu.kubeon.io/burst}}
          locations: [aws/eu-central-1, gcp/europe-west4, onprem/dc1]
          limits: {{maxNodes: 4, maxGpuHour: 4.50}}
          returnHome: true
    """)
    admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, policy)
    try:
        # `kubectl get gpupolicies`, as the optimizer: the apiserver's table, with the CRD's printer columns
        response: Any = optimizer.custom.list_cluster_custom_object(
            API_GROUP, "v1", PLURAL, _headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
            _preload_content=False)
        table = json.loads(response.data)
        headers = [c["name"] for c in table["columnDefinitions"]]
        assert headers[:3] == ["Name", "Kind", "Mode"], headers
        rows = {r["cells"][0]: dict(zip(headers, r["cells"], strict=True)) for r in table["rows"]}
        assert rows[name]["Kind"] == "Burst" and rows[name]["Mode"] == "Approve"
    finally:
        admin.custom.delete_cluster_custom_object(API_GROUP, "v1", PLURAL, name)


# --- RBAC with the optimizer's own credentials ---------------------------------------------------------------

def test_optimizer_reads_no_secrets(installed: Install, optimizer: Kube) -> None:
    refused(lambda: optimizer.core.read_namespaced_secret("kubeon-gpu-optimizer-token", NAMESPACE))
    refused(lambda: optimizer.core.read_namespaced_secret(f"{GATEWAY}-ticket-key", NAMESPACE))
    refused(lambda: optimizer.core.list_namespaced_secret(NAMESPACE))
    refused(lambda: optimizer.core.list_secret_for_all_namespaces())
    for verb in ("get", "list", "watch", "create", "update", "patch", "delete"):
        assert not can(optimizer, verb, "secrets", namespace=NAMESPACE), verb


def test_optimizer_drains_only_through_eviction(installed: Install, optimizer: Kube) -> None:
    admin, ns = installed.cluster.admin, installed.other_ns
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="victim"), spec=client.V1PodSpec(
        containers=[client.V1Container(name="c", image="registry.invalid/none")]))
    admin.core.create_namespaced_pod(ns, pod)
    # the optimizer's reads work (wait for its bindings to reach the authorizer's cache)
    wait_for(lambda: optimizer.core.read_namespaced_pod("victim", ns), what="optimizer may read pods")
    refused(lambda: optimizer.core.delete_namespaced_pod("victim", ns))
    refused(lambda: optimizer.core.delete_collection_namespaced_pod(ns))
    refused(lambda: optimizer.core.create_namespaced_pod(ns, pod))
    assert can(optimizer, "create", "pods", subresource="eviction", namespace=ns)
    assert not can(optimizer, "delete", "pods", namespace=ns)
    optimizer.core.create_namespaced_pod_eviction("victim", ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name="victim", namespace=ns)))
    wait_for(lambda: not _exists(lambda: admin.core.read_namespaced_pod("victim", ns)),
             what="the evicted pod to be gone")


def test_optimizer_scales_only_in_scale_to_zero_namespaces(installed: Install, optimizer: Kube) -> None:
    admin = installed.cluster.admin
    for ns in (installed.allowed_ns, installed.other_ns):
        admin.apps.create_namespaced_deployment(ns, client.V1Deployment(
            metadata=client.V1ObjectMeta(name="infer"),
            spec=client.V1DeploymentSpec(
                replicas=1, selector=client.V1LabelSelector(match_labels={"app": "infer"}),
                template=client.V1PodTemplateSpec(
                    metadata=client.V1ObjectMeta(labels={"app": "infer"}),
                    spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="registry.invalid/x")])))))
    allowed = installed.allowed_ns
    scale = wait_for(lambda: optimizer.apps.patch_namespaced_deployment_scale(
        "infer", allowed, {"spec": {"replicas": 0}}), what="optimizer may scale in a ScaleToZero namespace")
    assert not scale.spec.replicas  # 0 is omitted on the wire
    assert admin.apps.read_namespaced_deployment("infer", allowed).spec.replicas == 0
    assert can(optimizer, "patch", "statefulsets", group="apps", subresource="scale", namespace=allowed)
    # the Deployment itself stays read-only; scaling goes through the scale subresource only
    refused(lambda: optimizer.apps.patch_namespaced_deployment("infer", allowed, {"spec": {"replicas": 2}}))

    other = installed.other_ns
    refused(lambda: optimizer.apps.patch_namespaced_deployment_scale("infer", other, {"spec": {"replicas": 0}}))
    refused(lambda: optimizer.apps.read_namespaced_deployment_scale("infer", other))
    assert not can(optimizer, "patch", "statefulsets", group="apps", subresource="scale", namespace=other)
    assert admin.apps.read_namespaced_deployment("infer", other).spec.replicas == 1


def test_optimizer_patches_nodes_but_never_creates_or_deletes_them(installed: Install, optimizer: Kube) -> None:
    admin = installed.cluster.admin
    name = f"home-gpu-{uuid.uuid4().hex[:6]}"
    node = client.V1Node(metadata=client.V1ObjectMeta(name=name))
    admin.core.create_node(node)
    try:
        wait_for(lambda: optimizer.core.patch_node(name, {"spec": {"unschedulable": True}}),
                 what="optimizer may cordon a node")
        assert admin.core.read_node(name).spec.unschedulable is True
        refused(lambda: optimizer.core.delete_node(name))
        refused(lambda: optimizer.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=f"{name}-x"))))
    finally:
        _ignore_missing(lambda: admin.core.delete_node(name))


def test_optimizer_time_slicing_configmap_only(installed: Install, optimizer: Kube) -> None:
    admin = installed.cluster.admin
    for cm in ("time-slicing-config", "something-else"):
        try:
            admin.core.create_namespaced_config_map(GPU_OPERATOR, client.V1ConfigMap(
                metadata=client.V1ObjectMeta(name=cm), data={"any": "{}"}))
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    wait_for(lambda: optimizer.core.read_namespaced_config_map("time-slicing-config", GPU_OPERATOR),
             what="optimizer may read the time-slicing ConfigMap")
    optimizer.core.patch_namespaced_config_map("time-slicing-config", GPU_OPERATOR, {"data": {"any": "{ }"}})
    refused(lambda: optimizer.core.read_namespaced_config_map("something-else", GPU_OPERATOR))
    refused(lambda: optimizer.core.list_namespaced_config_map(GPU_OPERATOR))
    refused(lambda: optimizer.core.delete_namespaced_config_map("time-slicing-config", GPU_OPERATOR))
    refused(lambda: optimizer.core.read_namespaced_config_map("kube-root-ca.crt", NAMESPACE))


def test_optimizer_permission_matrix(installed: Install, optimizer: Kube) -> None:
    """R5.1 on the apiserver: each documented grant allowed, its neighbours refused."""
    ns = installed.other_ns
    grants = [
        (verb, group, resource, sub, namespace)
        for verb in ("get", "list", "watch")
        for group, resource, namespace in (("", "nodes", ""), ("", "pods", ns), ("", "namespaces", ""),
                                           ("apps", "deployments", ns), ("apps", "statefulsets", ns),
                                           ("apps", "replicasets", ns), ("policy", "poddisruptionbudgets", ns))
        for sub in ("",)
    ] + [("patch", "", "nodes", "", ""), ("create", "", "pods", "eviction", ns)] + [
        (verb, "karpenter.sh", resource, "", "")
        for verb in ("get", "list", "watch", "create", "patch", "delete") for resource in ("nodepools", "nodeclaims")
    ] + [
        (verb, API_GROUP, PLURAL, sub, "")
        for verb in ("get", "list", "watch", "create", "update", "patch", "delete") for sub in ("", "status")
        if not (sub == "status" and verb in ("list", "watch", "create", "delete"))
    ]
    for verb, group, resource, sub, namespace in grants:
        assert can(optimizer, verb, resource, group=group, subresource=sub, namespace=namespace), \
            f"{verb} {group}/{resource}/{sub} refused"
    denials = [
        ("create", "", "nodes", "", ""), ("delete", "", "nodes", "", ""), ("update", "", "nodes", "", ""),
        ("delete", "", "pods", "", ns), ("create", "", "pods", "", ns), ("patch", "", "pods", "", ns),
        ("create", "", "pods", "exec", ns), ("get", "", "secrets", "", NAMESPACE), ("list", "", "secrets", "", ""),
        ("list", "", "configmaps", "", ns), ("patch", "apps", "deployments", "scale", ns),
        ("patch", "apps", "deployments", "", ns), ("delete", "apps", "deployments", "", ns),
        ("deletecollection", "karpenter.sh", "nodeclaims", "", ""), ("update", "karpenter.sh", "nodepools", "", ""),
        ("deletecollection", API_GROUP, PLURAL, "", ""), ("create", "", "events", "", ns),
        ("create", "rbac.authorization.k8s.io", "roles", "", ns), ("create", "coordination.k8s.io", "leases", "", ns),
    ]
    for verb, group, resource, sub, namespace in denials:
        assert not can(optimizer, verb, resource, group=group, subresource=sub, namespace=namespace), \
            f"{verb} {group}/{resource}/{sub} allowed"


# --- RBAC with the gateway's own credentials -----------------------------------------------------------------

def test_the_chart_gateway_joins_labels_and_removes_nodes_and_nothing_else(installed: Install, gateway: Kube,
                                                                          tmp_path: Path) -> None:
    """Sufficient: as the chart's own ServiceAccount, the whole join (CSR created, approved for the kubelet
    signer, signed; records kept), the registered node labelled and its joining taint lifted, and its removal."""
    import secrets

    from gateway.service import KubeGateway
    from models.join import JoinTicketRequest
    from models.labels import Taint
    from node.join import NodeFiles
    from tests.harness.joining import node_client
    from tests.harness.joining import redeem_for
    from tests.harness.joining import register_self

    wait_for(lambda: can(gateway, "approve", "signers", group="certificates.k8s.io",
                         name="kubernetes.io/kube-apiserver-client-kubelet"), what="the chart's gateway rules")
    gw = KubeGateway(gateway.api, secrets.token_bytes(32), namespace=NAMESPACE)
    op, name = new_burst_node()
    ticket = gw.sign_ticket(JoinTicketRequest(
        operation=op, policy="p", location="sim/eu-west", node_name=name,
        labels={"gpu.kubeon.io/operation": op, "gpu.kubeon.io/location": "sim.eu-west"},
        taints=[Taint(key="gpu.kubeon.io/burst")]))
    files = NodeFiles(tmp_path / name)
    try:
        answer = gw.join(redeem_for(files, ticket, name))
        register_self(node_client(files, answer), answer)
        assert name in gw.reconcile()["labelled"]
        taints = {t.key for t in gateway.core.read_node(name).spec.taints}
        assert "gpu.kubeon.io/burst" in taints and "gpu.kubeon.io/joining" not in taints
        assert gw.remove_node(name, operation=op) is True
    finally:
        _ignore_missing(lambda: installed.cluster.admin.core.delete_node(name))
    # It creates no Node (nodes register themselves) and approves for no other signer.
    refused(lambda: gateway.core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=f"x-{name}"))))
    for signer in ("kubernetes.io/kube-apiserver-client", "kubernetes.io/kubelet-serving"):
        assert not can(gateway, "approve", "signers", group="certificates.k8s.io", name=signer), signer
    refused(lambda: gateway.core.read_namespaced_secret(f"{GATEWAY}-ticket-key", NAMESPACE))
    refused(lambda: gateway.core.list_namespaced_secret(NAMESPACE))
    refused(lambda: gateway.core.list_pod_for_all_namespaces())
    refused(lambda: gateway.custom.list_cluster_custom_object(API_GROUP, "v1", PLURAL))
    for verb, resource, sub in (("create", "pods", "eviction"), ("delete", "pods", ""), ("get", "secrets", ""),
                                ("patch", "deployments", "scale"), ("list", "configmaps", "")):
        group = "apps" if resource == "deployments" else ""
        assert not can(gateway, verb, resource, group=group, subresource=sub, namespace=installed.other_ns), \
            f"gateway may {verb} {resource}/{sub}"


def test_gateway_gets_its_own_service_and_no_other(installed: Install, gateway: Kube) -> None:
    """The gateway's namespaced Role: get on its own Service (its LoadBalancer address) and on the embedded
    Temporal's (whose ClusterIP its tunnel refuses), nothing more."""
    own = wait_for(lambda: gateway.core.read_namespaced_service(GATEWAY, NAMESPACE),
                   what="the gateway may get its own Service")
    assert own.spec.type == "LoadBalancer"
    assert gateway.core.read_namespaced_service(f"{OPTIMIZER}-temporal", NAMESPACE).spec.cluster_ip
    refused(lambda: gateway.core.read_namespaced_service(f"{OPTIMIZER}-console", NAMESPACE))  # another Service
    refused(lambda: gateway.core.list_namespaced_service(NAMESPACE))
    refused(lambda: gateway.core.patch_namespaced_service(GATEWAY, NAMESPACE, {"metadata": {"labels": {"x": "y"}}}))
    refused(lambda: gateway.core.patch_namespaced_service_status(
        GATEWAY, NAMESPACE, {"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.1"}]}}}))
    # The same name in another namespace is another Service.
    admin = installed.cluster.admin
    admin.core.create_namespaced_service(installed.other_ns, client.V1Service(
        metadata=client.V1ObjectMeta(name=GATEWAY),
        spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=8443)])))
    refused(lambda: gateway.core.read_namespaced_service(GATEWAY, installed.other_ns))
    assert not can(gateway, "watch", "services", namespace=NAMESPACE, name=GATEWAY)
    assert not can(installed.cluster.service_account_client(NAMESPACE, OPTIMIZER, create=False), "get", "services",
                   namespace=NAMESPACE, name=GATEWAY), "the optimizer's rules (R5.1) do not change"


def test_r4_2_documented_values_install_without_a_public_url(installed: Install, gateway: Kube,
                                                             tmp_path: Path) -> None:
    """R4.2's block exactly as the spec writes it (a LoadBalancer Service and its annotations, no publicUrl).
    Runs last: it replaces the module's values with the documented ones."""
    documented = tmp_path / "r4.2.yaml"
    documented.write_text(DOCUMENTED_BURST_VALUES)
    proc = helm(installed, "upgrade", RELEASE, CHART, "--namespace", NAMESPACE, "--wait=false", "--reset-values",
                "-f", MINIMAL_VALUES, "-f", documented)
    assert "Burst nodes reach the gateway at the address its LoadBalancer Service gets" in proc.stdout, proc.stdout
    status = json.loads(helm(installed, "status", RELEASE, "--namespace", NAMESPACE, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    admin = installed.cluster.admin
    service = admin.core.read_namespaced_service(GATEWAY, NAMESPACE)
    assert service.spec.type == "LoadBalancer"
    assert service.metadata.annotations["service.beta.kubernetes.io/aws-load-balancer-scheme"] == "internal"
    container = admin.apps.read_namespaced_deployment(GATEWAY, NAMESPACE).spec.template.spec.containers[0]
    env = {e.name: e.value for e in container.env}
    assert not env["KUBEON_GATEWAY_PUBLIC_URL"], "no publicUrl: the LoadBalancer address"
    assert (env["KUBEON_GATEWAY_SERVICE"], env["KUBEON_GATEWAY_SERVICE_NAMESPACE"]) == (GATEWAY, NAMESPACE)
    secret = admin.core.read_namespaced_secret(f"{GATEWAY}-tls", NAMESPACE).data
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"{GATEWAY}.{NAMESPACE}.svc" in names.get_values_for_type(x509.DNSName), "what burst nodes verify"
    assert "gw2.example.com" not in names.get_values_for_type(x509.DNSName)
    assert wait_for(lambda: gateway.core.read_namespaced_service(GATEWAY, NAMESPACE), what="own Service").metadata
    role = admin.rbac.read_cluster_role(OPTIMIZER)
    assert [admin.api.sanitize_for_serialization(r) for r in role.rules] == DOCUMENTED_CLUSTER_ROLE


# --- bad values refused by a real install ---------------------------------------------------------------------

BAD_FILES = sorted(BAD_VALUES.glob("*.yaml"))


@pytest.mark.parametrize("bad", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_helm_install_refuses_bad_value_naming_it(cluster: Cluster, bad: Path) -> None:
    proc = helm(cluster, "install", "bad-values", CHART, "--namespace", "default", "--wait=false",
                "-f", MINIMAL_VALUES, "-f", bad, check=False)
    assert proc.returncode != 0, f"helm install accepted {bad.name}"
    for expected in expectations(bad):
        assert expected in proc.stderr, f"helm install refused {bad.name} without naming {expected!r}:\n{proc.stderr}"
    listed = json.loads(helm(cluster, "list", "--namespace", "default", "--all", "-o", "json").stdout)
    assert not [r for r in listed if r["name"] == "bad-values"], "a refused install must leave no release"
