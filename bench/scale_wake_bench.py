"""Wake -> pods Ready overhead the optimizer adds: `ops wake` of a workload at zero until its ScaleWorkflow has
verified every pod Ready, against scaling the same Deployment 0 -> N through /scale yourself and polling for Ready.
Real parts: the local control plane (kwok pods), the Temporal dev server, the worker in-process, Prometheus.

    .venv/bin/python -m bench.scale_wake_bench             # --rounds 5 --replicas 2
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.options import parse_options
from models.scale import ScalePhase
from models.scale import WakeRequest
from models.scale import WorkloadRef
from models.scale import scale_workflow_id
from tests.harness.controlplane import ControlPlane
from tests.harness.kube import Cluster
from tests.harness.kube import Kube
from tests.harness.scale import ScaleStack
from tests.harness.scale import build_scale_stack
from tests.harness.scale import wait_scale_phase
from tests.harness.temporal import start_dev_server
from worker import ops
from worker.main import worker_services


async def no_pods(stack: ScaleStack, ns: str, name: str) -> None:
    deadline = time.monotonic() + 90
    while stack.cluster.admin.core.list_namespaced_pod(ns, label_selector=f"app={name}").items:
        if time.monotonic() > deadline:
            raise RuntimeError(f"pods of {ns}/{name} still there after 90 s")
        await asyncio.sleep(0.2)


async def run(rounds: int, replicas: int, workdir: Path) -> tuple[list[float], list[float]]:
    plane = ControlPlane(workdir / "controlplane")
    plane.start()
    env = await start_dev_server()
    stack = None
    try:
        cluster = Cluster(plane=plane, admin=Kube.from_kubeconfig(plane.admin_kubeconfig))
        stack = build_scale_stack(cluster, workdir / "stack")
        ns = cluster.create_namespace("bench")
        stack.grant_scale_role(ns)
        settings = stack.settings(temporal_address=env.client.service_client.config.target_host,
                                  task_queue="bench", scale_resync_seconds=1)
        optimizer, baseline = [], []
        async with worker_services(settings, stack.burst.runtime(settings)) as (temporal, _runtime, _watcher):
            for i in range(rounds):
                name, policy = f"wake-{i}", f"bench-{i}"
                stack.deploy(ns, name, replicas=replicas)
                stack.give_gpus(ns, stack.running_pods(ns, name, replicas), activity=0.0, minutes=40)
                stack.create_policy(policy, [ns], mode="Automatic")
                ref = WorkloadRef(namespace=ns, kind="Deployment", name=name)
                handle = temporal.get_workflow_handle(scale_workflow_id(settings.cluster, policy, ref))
                view = await wait_scale_phase(handle, ScalePhase.SCALED_TO_ZERO, timeout=120)
                await no_pods(stack, ns, name)
                t0 = time.monotonic()
                await ops.wake(temporal, view.operation, WakeRequest(by="bench"))
                await handle.result()
                optimizer.append(time.monotonic() - t0)
                stack.burst.delete_policy(policy)
                # The same Deployment, by hand: 0 -> N through /scale, poll until Ready.
                apps = cluster.admin.apps
                apps.patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": 0}})
                await no_pods(stack, ns, name)
                t0 = time.monotonic()
                apps.patch_namespaced_deployment_scale(name, ns, {"spec": {"replicas": replicas}})
                while stack.replicas(ns, name)[1] < replicas:
                    await asyncio.sleep(0.05)
                baseline.append(time.monotonic() - t0)
        return optimizer, baseline
    finally:
        if stack is not None:
            stack.prometheus.stop()
            stack.exporter.stop()
        await env.shutdown()
        plane.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_options("scale_wake_bench", __doc__, argv, rounds=5, replicas=2)
    with tempfile.TemporaryDirectory(prefix="wake-bench-") as tmp:
        optimizer, baseline = asyncio.run(run(args.rounds, args.replicas, Path(tmp)))
    med_o, med_b = statistics.median(optimizer), statistics.median(baseline)
    print(f"wake -> {args.replicas} pods Ready, {args.rounds} rounds (kwok pods):")
    print(f"  ops wake to Completed (verified Ready): median {med_o:.2f} s, max {max(optimizer):.2f} s")
    print(f"  /scale by hand, polled at 50 ms:       median {med_b:.2f} s, max {max(baseline):.2f} s")
    print(f"  overhead added by the optimizer:       median {med_o - med_b:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
