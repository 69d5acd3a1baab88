"""`make dev`: everything on one machine, no cloud account.

The Temporal dev server (UI at http://127.0.0.1:8233), the local control plane with kwok, two `sim` locations
with different prices, a home GPU node, a local hub (`kubeon-gpu hub`, SQLite) seeded with an admin key, the
cluster `dev` with its token and the example policies from examples/policies, and the worker (`kubeon-gpu
worker`, with the optimizer's own ServiceAccount; the gateway in-process with its own), which pulls the
policies from the hub and syncs them into GpuPolicy resources. Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import yaml

from models import search_attributes
from models.policy import API_GROUP, PLURAL, parse_policy
from tests.harness.burst import build_stack, worker_process
from tests.harness.controlplane import ControlPlane, ControlPlaneError, free_port
from tests.harness.kube import Kube, wait_for
from tests.harness.temporal import dev_server_path

ROOT = Path(__file__).resolve().parents[2]
DEV_LOCATIONS = [
    {"name": "sim/eu-west", "sim": {"bootSeconds": 3},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.95},
                   {"instanceType": "sim.l4.4", "gpus": 4, "gpuProduct": "NVIDIA-L4", "usdPerHour": 3.6}]},
    {"name": "sim/us-east", "sim": {"bootSeconds": 3},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 1.35}]},
]


def say(msg: str) -> None:
    print(f"[kubeon dev] {msg}", flush=True)


def start_temporal(workdir: Path, port: int, ui_port: int) -> subprocess.Popen[bytes]:
    argv = [str(dev_server_path()), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port),
            "--ui-port", str(ui_port), "--db-filename", str(workdir / "temporal.db"), "--log-level", "warn",
            "--metrics-port", str(free_port())]
    for key in search_attributes.ALL:
        argv += ["--search-attribute", f"{key.name}=Keyword"]
    log = open(workdir / "temporal.log", "ab")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    import socket

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"Temporal dev server exited {proc.returncode}; see {workdir / 'temporal.log'}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, what=f"Temporal on 127.0.0.1:{port}", timeout=60)
    return proc


def load_policies(admin: Kube, folder: Path) -> list[str]:
    names = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            policy = parse_policy(doc)  # refuse a broken example loudly, naming the field
            try:
                admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, doc)
            except Exception as exc:
                if getattr(exc, "status", None) != 409:
                    raise
                admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, policy.name,
                                                         {"spec": doc["spec"]})
            names.append(policy.name)
    return names


def start_hub(workdir: Path, port: int, policies: Path) -> subprocess.Popen[bytes]:
    """The self-hosted hub, seeded like hub/dev-seed.yaml but with its secrets in the (fresh) work directory."""
    seed = {
        "users": [{"name": "dev", "role": "admin", "keyFile": "hub/dev.key"}],
        "clusters": [{"name": "dev", "description": "make dev", "tokenFile": "hub/dev.token",
                      "policyFiles": [str(p.resolve()) for p in sorted(policies.glob("*.yaml"))]}],
    }
    seed_file = workdir / "hub-seed.yaml"
    seed_file.write_text(yaml.safe_dump(seed))
    log = open(workdir / "hub.log", "ab")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "hub.server", "--listen", f"127.0.0.1:{port}", "--database-url",
         f"sqlite:///{workdir / 'hub.db'}", "--seed-file", str(seed_file), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)

    def answering() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"hub exited {proc.returncode}; see {workdir / 'hub.log'}")
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(answering, what=f"the hub on 127.0.0.1:{port}", timeout=60)
    return proc


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make dev", description=__doc__)
    parser.add_argument("--dir", type=Path, default=ROOT / ".kubeon" / "dev")
    parser.add_argument("--temporal-port", type=int, default=7233)
    parser.add_argument("--ui-port", type=int, default=8233)
    parser.add_argument("--hub-port", type=int, default=8090)
    parser.add_argument("--policies", type=Path, default=ROOT / "examples" / "policies",
                        help="GpuPolicy files the hub is seeded with")
    parser.add_argument("--prometheus-port", type=int, default=0, help="default: a free port")
    parser.add_argument("--no-hub", action="store_true",
                        help="no hub: create the policies in the cluster directly (kubectl-style)")
    args = parser.parse_args(argv)

    workdir: Path = args.dir
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh cluster each time: state of a previous run is stale
    workdir.mkdir(parents=True)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    plane = ControlPlane(workdir / "controlplane")
    temporal: subprocess.Popen[bytes] | None = None
    hub: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    stopping_metrics: list[Callable[[], None]] = []
    try:
        say("starting the control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok)")
        try:
            plane.start()
        except ControlPlaneError as exc:
            say(f"control plane failed: {exc}")
            return 1
        kubeconfig = workdir / "kubeconfig"
        shutil.copy(plane.admin_kubeconfig, kubeconfig)
        admin = Kube.from_kubeconfig(kubeconfig)
        from tests.harness.kube import Cluster

        cluster = Cluster(plane=plane, admin=admin)
        say(f"starting the Temporal dev server on 127.0.0.1:{args.temporal_port}")
        temporal = start_temporal(workdir, args.temporal_port, args.ui_port)

        stack = build_stack(cluster, workdir / "stack")
        # Home capacity: one GPU node of another type, so the example's L4 pods cannot fit at home.
        cluster.create_kwok_node("home-a10g-1", labels={"nvidia.com/gpu.product": "NVIDIA-A10G"})
        # ScaleToZero and GPU type fit: namespace ml-inference, a GPU node, the DCGM exporter fixture, Prometheus.
        from tests.harness.dev_metrics import DevMetrics

        metrics = DevMetrics(cluster, workdir / "metrics").start(port=args.prometheus_port)
        stopping_metrics.append(metrics.stop)
        say(f"Prometheus on {metrics.url} scraping the DCGM exporter fixture")
        hub_settings: dict[str, object] = {"prometheus_url": metrics.url}
        hub_lines = ""
        if args.no_hub:
            names = load_policies(admin, args.policies)
            say(f"policies created in the cluster: {', '.join(names)}")
        else:
            hub_url = f"http://127.0.0.1:{args.hub_port}"
            say(f"starting the hub on {hub_url}")
            hub = start_hub(workdir, args.hub_port, args.policies)
            hub_settings.update({"hub_url": hub_url, "hub_token_file": workdir / "hub" / "dev.token",
                                 "hub_poll_interval": 5})
            key = os.path.relpath(workdir / "hub" / "dev.key", Path.cwd())
            hub_lines = (f"  hub          {hub_url}  (admin key: {key}; cluster dev, policies every 5s)\n"
                         f"               curl -H \"Authorization: Bearer $(cat {key})\" "
                         f"{hub_url}/v1/clusters/dev/reports\n")
        settings = stack.settings(temporal_address=f"127.0.0.1:{args.temporal_port}", task_queue="kubeon-gpu",
                                  locations=DEV_LOCATIONS, cluster_name="dev", serve_check_seconds=5,
                                  approval_timeout_seconds=86400, **hub_settings)
        worker = worker_process(settings, workdir / "worker.log")
        say(f"worker started (log: {workdir / 'worker.log'})")
        if not args.no_hub:
            names = wait_for(lambda: [p["metadata"]["name"] for p in admin.custom.list_cluster_custom_object(
                API_GROUP, "v1", PLURAL)["items"]], what="policies synced from the hub", timeout=120)
            say(f"policies synced from the hub: {', '.join(names)}")
        rel = os.path.relpath(kubeconfig, Path.cwd())
        approve_in_hub = "" if args.no_hub else (
            "\n  (or approve in the hub: curl -H \"Authorization: Bearer $(cat "
            f"{os.path.relpath(workdir / 'hub' / 'dev.key', Path.cwd())})\" -d '{{\"operation\": \"<OPERATION>\", "
            f"\"decision\": \"approve\"}}' http://127.0.0.1:{args.hub_port}/v1/clusters/dev/approvals)")
        print(f"""
KubeOn GPU optimizer is running locally.

  kubeconfig   {rel}
  Temporal UI  http://127.0.0.1:{args.ui_port}
{hub_lines}  locations    sim/eu-west ($0.95/GPU-h), sim/us-east ($1.35/GPU-h)

Next:
  kubectl --kubeconfig {rel} apply -f examples/burst-workload.yaml
  .venv/bin/kubeon-gpu ops list
  .venv/bin/kubeon-gpu ops approve <OPERATION>{approve_in_hub}

Then watch the burst node join: kubectl --kubeconfig {rel} get nodes -L gpu.kubeon.io/location

ScaleToZero (Prometheus {metrics.url}; README "Scale idle GPU workloads to zero"):
  kubectl --kubeconfig {rel} apply -f examples/scale-to-zero-workload.yaml   (idle, with 40m of history)
  kubectl --kubeconfig {rel} get gpupolicy scale-to-zero-inference -o jsonpath='{{.status.scaleToZero.decisions}}'

Ctrl-C stops everything.
ready""", flush=True)
        while not stopping.wait(0.5):  # Ctrl-C, or the worker or hub dying, ends the run
            if worker.poll() is not None:
                say(f"worker exited {worker.returncode}; see {workdir / 'worker.log'}")
                return 1
            if hub is not None and hub.poll() is not None:
                say(f"hub exited {hub.returncode}; see {workdir / 'hub.log'}")
                return 1
        say("stopping")
        return 0
    finally:
        stop(worker)
        stop(hub)
        stop(temporal)
        for stop_metrics in stopping_metrics:
            stop_metrics()
        plane.stop()


if __name__ == "__main__":
    sys.exit(main())
