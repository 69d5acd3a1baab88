"""The optimizer's and the gateway's permissions as the product documents them (R5.1), for tests that run the
optimizer with its own credentials instead of admin ones. The chart test checks the chart grants exactly these."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes import client

from tests.harness.kube import Cluster
from tests.harness.kube import Kube

OPTIMIZER_NAMESPACE = "kubeon-gpu"
OPTIMIZER_SA = "kubeon-gpu-optimizer"
GATEWAY_SA = "kubeon-gpu-optimizer-gateway"

# R5.1, verbatim from "Install the GPU optimizer" > Permissions.
OPTIMIZER_RULES = [
    {"apiGroups": [""], "resources": ["nodes", "pods", "namespaces"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets", "replicasets"],
     "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    {"apiGroups": ["karpenter.sh"], "resources": ["nodepools", "nodeclaims"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["gpu.kubeon.io"], "resources": ["gpupolicies", "gpupolicies/status"],
     "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
]

KUBELET_CLIENT_SIGNER = "kubernetes.io/kube-apiserver-client-kubelet"
# The burst gateway: the join (kubelet client CSRs for one signer), labelling joined nodes, Node removal; nothing
# the optimizer needs. It creates no Node: nodes register themselves.
GATEWAY_RULES = [
    # Read nodes (its reconciler watches them), apply ticket labels/taints and cordon, remove drained burst nodes.
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch", "delete"]},
    # Create the kubelet client CSR of a node it validated, read it back, approve it for that one signer.
    {"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests"], "verbs": ["create", "get"]},
    {"apiGroups": ["certificates.k8s.io"], "resources": ["certificatesigningrequests/approval"],
     "verbs": ["update"]},
    {"apiGroups": ["certificates.k8s.io"], "resources": ["signers"], "resourceNames": [KUBELET_CLIENT_SIGNER],
     "verbs": ["approve"]},
    # It authenticates the optimizer's calls by TokenReview.
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
]
# And a namespaced Role (kubeon-gpu only): get its own Service, nothing else, to find the LoadBalancer address
# burst nodes join at when burst.gateway.publicUrl is empty; its records (redeemed tickets, address slots) as
# ConfigMaps.
GATEWAY_SERVICE_RULES = [
    {"apiGroups": [""], "resources": ["services"], "resourceNames": [GATEWAY_SA], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "get", "list", "patch", "delete"]},
]


def _ensure(create: Callable[..., object], *args: object) -> None:
    try:
        create(*args)
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def _rules(rules: list[dict[str, list[str]]]) -> list[client.V1PolicyRule]:
    return [client.V1PolicyRule(api_groups=r["apiGroups"], resources=r["resources"], verbs=r["verbs"],
                                resource_names=r.get("resourceNames")) for r in rules]


def grant_namespaced(cluster: Cluster, name: str, rules: list[dict[str, list[str]]],
                     namespace: str = OPTIMIZER_NAMESPACE) -> None:
    """A Role of ``rules`` in ``namespace`` bound to the ServiceAccount ``name`` there."""
    admin = cluster.admin
    _ensure(admin.rbac.create_namespaced_role, namespace, client.V1Role(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace), rules=_rules(rules)))
    _ensure(admin.rbac.create_namespaced_role_binding, namespace, client.V1RoleBinding(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=name),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=namespace)]))


def grant(cluster: Cluster, name: str, rules: list[dict[str, list[str]]], namespace: str = OPTIMIZER_NAMESPACE
          ) -> Kube:
    """A ServiceAccount bound to a ClusterRole of ``rules``; returns a client acting as it."""
    admin = cluster.admin
    _ensure(admin.core.create_namespace, client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    policy_rules = _rules(rules)
    _ensure(admin.rbac.create_cluster_role, client.V1ClusterRole(metadata=client.V1ObjectMeta(name=name),
                                                                 rules=policy_rules))
    _ensure(admin.rbac.create_cluster_role_binding, client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=name),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=namespace)]))
    return cluster.service_account_client(namespace, name)


def grant_optimizer_and_gateway(cluster: Cluster, gateway_rules: list[dict[str, list[str]]] = GATEWAY_RULES) -> None:
    """The optimizer's ServiceAccount with its rules, the gateway's with ``gateway_rules`` (its ClusterRole made
    exactly these, whatever another module created it with) and its namespaced Service rules."""
    grant(cluster, OPTIMIZER_SA, OPTIMIZER_RULES)
    grant(cluster, GATEWAY_SA, gateway_rules)
    cluster.admin.rbac.patch_cluster_role(GATEWAY_SA, {"rules": gateway_rules})
    grant_namespaced(cluster, GATEWAY_SA, GATEWAY_SERVICE_RULES)


CHART_IDENTITY_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def install_chart_identities(cluster: Cluster) -> tuple[Kube, Kube]:
    """The optimizer's and the gateway's ServiceAccounts, ClusterRoles and bindings exactly as the chart renders
    them (burst enabled), applied to the cluster; returns clients acting as each. The end-to-end tests run with
    these credentials, never admin ones."""
    from tests.charts.helm import BURST_VALUES  # helm is built with the control plane
    from tests.charts.helm import template  # helm is built with the control plane

    rendered = template(values=[BURST_VALUES])
    admin = cluster.admin
    _ensure(admin.core.create_namespace, client.V1Namespace(metadata=client.V1ObjectMeta(name=OPTIMIZER_NAMESPACE)))
    api = client.ApiClient()
    for doc in rendered.docs:
        if doc["kind"] not in CHART_IDENTITY_KINDS or doc["metadata"]["name"] not in (OPTIMIZER_SA, GATEWAY_SA):
            continue
        if doc["kind"] == "ServiceAccount":
            obj = api._ApiClient__deserialize(doc, "V1ServiceAccount")  # type: ignore[attr-defined]
            _ensure(admin.core.create_namespaced_service_account, OPTIMIZER_NAMESPACE, obj)
        elif doc["kind"] in ("Role", "RoleBinding"):
            if doc["metadata"].get("namespace") != OPTIMIZER_NAMESPACE:
                continue
            kind = "V1Role" if doc["kind"] == "Role" else "V1RoleBinding"
            obj = api._ApiClient__deserialize(doc, kind)  # type: ignore[attr-defined]
            create = (admin.rbac.create_namespaced_role if doc["kind"] == "Role"
                      else admin.rbac.create_namespaced_role_binding)
            try:
                create(OPTIMIZER_NAMESPACE, obj)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
                if doc["kind"] == "Role":
                    admin.rbac.replace_namespaced_role(doc["metadata"]["name"], OPTIMIZER_NAMESPACE, obj)
        elif doc["kind"] == "ClusterRole":
            obj = api._ApiClient__deserialize(doc, "V1ClusterRole")  # type: ignore[attr-defined]
            try:
                admin.rbac.create_cluster_role(obj)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
                admin.rbac.replace_cluster_role(doc["metadata"]["name"], obj)
        else:
            obj = api._ApiClient__deserialize(doc, "V1ClusterRoleBinding")  # type: ignore[attr-defined]
            _ensure(admin.rbac.create_cluster_role_binding, obj)
    return (cluster.service_account_client(OPTIMIZER_NAMESPACE, OPTIMIZER_SA, create=False),
            cluster.service_account_client(OPTIMIZER_NAMESPACE, GATEWAY_SA, create=False))
