"""The GPU Deployments (and bare GPU pods) tests create: one builder each, so every test's pods differ only in what
the test is about."""

from __future__ import annotations

from kubernetes import client

# Requests as small as a kwok node's allocatable CPU and memory hold many of.
SMALL_REQUESTS = {"cpu": "100m", "memory": "128Mi"}
GPU_TAINT_TOLERATION = client.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


def gpu_pods(name: str, *, replicas: int = 1, gpus: int = 1, node_selector: dict[str, str] | None = None,
             tolerations: list[client.V1Toleration] | None = None, requests: dict[str, str] | None = None,
             pod_annotations: dict[str, str] | None = None) -> client.V1Deployment:
    """A Deployment of ``replicas`` pods labelled ``app=<name>``, each asking for ``gpus`` nvidia.com/gpu, gone at
    once when deleted (grace 0)."""
    labels = {"app": name}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=replicas, selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels, annotations=pod_annotations),
                spec=client.V1PodSpec(
                    containers=[client.V1Container(
                        name="infer", image="registry.invalid/infer:1", resources=client.V1ResourceRequirements(
                            requests=requests, limits={"nvidia.com/gpu": str(gpus)}))],
                    tolerations=tolerations, node_selector=node_selector, termination_grace_period_seconds=0))))


def gpu_pod(name: str, *, labels: dict[str, str] | None = None, node_selector: dict[str, str] | None = None,
            node_name: str | None = None) -> client.V1Pod:
    """A bare pod asking for one nvidia.com/gpu (request and limit), on ``node_name`` or where ``node_selector``
    lets the scheduler put it."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(node_name=node_name, node_selector=node_selector, containers=[client.V1Container(
            name="main", image="busybox", resources=client.V1ResourceRequirements(
                limits={"nvidia.com/gpu": "1"}, requests={"nvidia.com/gpu": "1"}))]))


def node_group_pods(name: str, group_label: str, group: str, replicas: int) -> client.V1Deployment:
    """1-GPU pods that only one managed node group serves (its label) and that tolerate its GPU taint."""
    return gpu_pods(name, replicas=replicas, node_selector={group_label: group},
                    tolerations=[GPU_TAINT_TOLERATION], requests=SMALL_REQUESTS)


def live_pods(core: client.CoreV1Api, namespace: str, app: str) -> list[client.V1Pod]:
    """The pods of Deployment ``app`` that are not being deleted."""
    return [p for p in core.list_namespaced_pod(namespace, label_selector=f"app={app}").items
            if p.metadata is not None and p.metadata.deletion_timestamp is None]


def running_pods(core: client.CoreV1Api, namespace: str, app: str, count: int) -> list[client.V1Pod]:
    """Deployment ``app``'s ``count`` live pods once all of them run (waited for, bounded)."""
    from tests.harness.kube import wait_for

    def running() -> list[client.V1Pod]:
        pods = live_pods(core, namespace, app)
        return pods if len(pods) == count and all(p.status and p.status.phase == "Running" for p in pods) else []

    return list(wait_for(running, timeout=60, what=f"{count} {app} pods running"))


def unschedulable_once_settled(core: client.CoreV1Api, namespace: str, app: str, total: int,
                               running: int) -> list[client.V1Pod]:
    """The pods the scheduler found no node for, once ``running`` of ``total`` run and the rest wait (else [])."""
    pods = live_pods(core, namespace, app)
    up = [p for p in pods if p.status is not None and p.status.phase == "Running"]
    waiting = [p for p in pods if any(c.type == "PodScheduled" and c.reason == "Unschedulable"
                                      for c in (p.status.conditions if p.status else None) or [])]
    return waiting if len(pods) == total and len(up) == running and len(waiting) == total - running else []
