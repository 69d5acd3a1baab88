"""`make dev`: everything on one machine, no cloud account.

The Temporal dev server (UI at http://127.0.0.1:8233), the local control plane with kwok, two `sim` locations
with different prices, aws/eu-central-1 (moto), gcp/europe-west4 and azure/westeurope (local servers, named in
endpoints.json), a home GPU node, a local hub (`kubeon-gpu hub`, SQLite) seeded with an admin key, the
cluster `dev` with its token and the example policies from examples/policies, and the worker (`kubeon-gpu
worker`, with the optimizer's own ServiceAccount; `kubeon-gpu gateway` as its own process with its own, as the
chart runs them: simulated nodes redeem their tickets there and register with their own certificates), which pulls the
policies from the hub and syncs them into GpuPolicy resources. Ctrl-C stops everything.

``--capacity karpenter|eks-nodegroups|gke-nodepools|aks-nodepools`` (tests/harness/dev_capacity.py): home GPU
capacity behind that capacity provider, a group gpu-home of two 4-GPU nodes (the real Karpenter with a static
NodePool, or a managed group on the local EKS/GKE/AKS server), the worker configured for it, its entry
``capacity`` in endpoints.json and the example Packing policy packing-home in Recommend. The default, none, keeps
the start as it was: no Karpenter process on the 2 cores, nothing at home to defer bursts to.

No way of ending it leaves a process behind (tests/harness/children.py): every service is started through
``Children.start`` (pids in ``<dir>/children.json``, killed by the kernel if the harness dies); Ctrl-C, SIGTERM or
SIGHUP stop them all, SIGTERM then SIGKILL after a bounded grace (a second Ctrl-C: at once); a new run ends what
a killed one left; a second run while one is running fails at once and leaves its state directory alone.
"""

from __future__ import annotations

import argparse
import json
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
from models.policy import API_GROUP
from models.policy import PLURAL
from models.policy import parse_policy
from tests.harness.burst import WORKER_ARGV
from tests.harness.burst import build_stack
from tests.harness.burst import gateway_process
from tests.harness.burst import worker_env
from tests.harness.children import GRACE_SECONDS
from tests.harness.children import Children
from tests.harness.children import InstanceLock
from tests.harness.children import busy_ports
from tests.harness.children import reap
from tests.harness.children import recorded
from tests.harness.clouds.boot import gateway_join
from tests.harness.clouds.dev import DevClouds
from tests.harness.controlplane import ControlPlane
from tests.harness.controlplane import ControlPlaneError
from tests.harness.controlplane import free_port
from tests.harness.dev_capacity import PROVIDERS
from tests.harness.dev_capacity import DevCapacity
from tests.harness.kube import Kube
from tests.harness.kube import wait_for
from tests.harness.onprem import AgentProcess
from tests.harness.onprem import claim_keys
from tests.harness.onprem import register_server
from tests.harness.onprem import write_gateways
from tests.harness.temporal import dev_server_path

ROOT = Path(__file__).resolve().parents[2]
PACKING_EXAMPLE = ROOT / "examples" / "dev" / "packing-home.yaml"  # seeded with --capacity
DEV_LOCATIONS = [
    {"name": "sim/eu-west", "sim": {"bootSeconds": 3},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 0.95},
                   {"instanceType": "sim.l4.4", "gpus": 4, "gpuProduct": "NVIDIA-L4", "usdPerHour": 3.6}]},
    {"name": "sim/us-east", "sim": {"bootSeconds": 3},
     "offerings": [{"instanceType": "sim.l4.1", "gpus": 1, "gpuProduct": "NVIDIA-L4", "usdPerHour": 1.35}]},
]


def say(msg: str) -> None:
    print(f"[kubeon dev] {msg}", flush=True)


def start_temporal(children: Children, workdir: Path, port: int, ui_port: int) -> subprocess.Popen[bytes]:
    argv = [str(dev_server_path()), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port),
            "--ui-port", str(ui_port), "--db-filename", str(workdir / "temporal.db"), "--log-level", "warn",
            "--metrics-port", str(free_port())]
    for key in search_attributes.ALL:
        argv += ["--search-attribute", f"{key.name}={search_attributes.cli_type(key)}"]
    proc = children.start("temporal", argv, log=workdir / "temporal.log")
    import socket

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"Temporal dev server exited {proc.returncode}; see {workdir / 'temporal.log'}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, what=f"Temporal on 127.0.0.1:{port}", timeout=60)
    return proc


def policy_files(folder: Path, capacity: str) -> list[Path]:
    """The GpuPolicy files make dev seeds: the folder's; with home capacity, its Packing example is
    examples/dev/packing-home.yaml instead of packing-l4.yaml (make dev's group gpu-home, in Recommend, fresh pods
    not protected, so a newcomer's workload shows a proposal at once)."""
    files = sorted(folder.glob("*.yaml"))
    if capacity == "none":
        return files
    return [*(f for f in files if f.name != "packing-l4.yaml"), PACKING_EXAMPLE]


def load_policies(admin: Kube, files: list[Path]) -> list[str]:
    names = []
    for path in files:
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


def start_hub(children: Children, workdir: Path, port: int, policies: list[Path]) -> subprocess.Popen[bytes]:
    """The self-hosted hub, seeded like hub/dev-seed.yaml but with its secrets in the (fresh) work directory."""
    seed = {
        "users": [{"name": "dev", "role": "admin", "keyFile": "hub/dev.key"}],
        "clusters": [{"name": "dev", "description": "make dev", "tokenFile": "hub/dev.token",
                      "policyFiles": [str(p.resolve()) for p in policies]}],
    }
    seed_file = workdir / "hub-seed.yaml"
    seed_file.write_text(yaml.safe_dump(seed))
    proc = children.start(
        "hub", [sys.executable, "-m", "hub.server", "--listen", f"127.0.0.1:{port}", "--database-url",
                f"sqlite:///{workdir / 'hub.db'}", "--seed-file", str(seed_file), "--log-level", "warning"],
        log=workdir / "hub.log", cwd=ROOT)

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


ONPREM_POOL = "dc1"
ONPREM_SERVERS = ("gpu-1", "gpu-2")
ONPREM_USD_PER_GPU_HOUR = 0.45


def start_onprem_pool(children: Children, workdir: Path, hub_url: str, admin_key: str, claim_keys_file: Path,
                      gateway_url: str) -> list[AgentProcess]:
    """The pool onprem/dc1 in the hub (rate card NVIDIA-L4 at $0.45/GPU-h) with two local "servers", registered
    as an operator does: agents as processes that enrol with the pool's token (once: each then keeps its own
    server credential) and join through the gateway like real burst nodes (kwok runs their nodes), pinned to the
    cluster `dev`'s gateway. The gateway gets only the hub's public claim keys (``claim_keys_file``, where the
    chart mounts hub.claimPublicKeys), never the pool's token."""
    import httpx

    created = httpx.post(f"{hub_url}/v1/pools", headers={"Authorization": f"Bearer {admin_key}"}, timeout=10, json={
        "name": ONPREM_POOL, "description": "make dev: two local agents", "offline_after_seconds": 20,
        "rate_card": {"usd_per_gpu_hour": {"NVIDIA-L4": ONPREM_USD_PER_GPU_HOUR}}})
    created.raise_for_status()
    token = created.json()["join_token"]["token"]
    token_file = workdir / "onprem" / "join-token"
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(token)
    token_file.chmod(0o600)
    claim_keys_file.write_text(claim_keys(hub_url))
    gateways = write_gateways(workdir / "onprem" / "gateways.yaml", {"dev": gateway_url})
    for name in ONPREM_SERVERS:
        register_server(hub_url, admin_key, ONPREM_POOL, name)
    agents = [AgentProcess(hub_url=hub_url, join_token_file=token_file, pool=ONPREM_POOL, server=name,
                           state_dir=workdir / "onprem" / name, gateways_file=gateways, heartbeat_seconds=2,
                           popen=children.popen).start()
              for name in ONPREM_SERVERS]
    return agents



class Interrupted(Exception):
    """A signal arrived while starting: stop what has started."""


def prepare(workdir: Path, ports: dict[str, int]) -> tuple[InstanceLock | None, str]:
    """Before anything is touched: the state directory's lock (a running `make dev` keeps it), the leftovers of an
    earlier run that was killed (ended), and the ports (each free, or named with the process holding it). Only
    then is the state directory wiped. Returns the lock, or None and why it cannot start."""
    lock = InstanceLock(workdir)
    holder = lock.acquire()
    if holder is not None:
        running = recorded(workdir)
        held = ", ".join(f"{port} ({what})" for what, port in (running.get("ports") or {}).items())
        return None, (f"another `make dev` (pid {holder or '?'}) is running with the state directory {workdir}"
                      + (f" and ports {held}" if held else "") + f": left untouched; stop it first (kill {holder})")
    reaped = reap(workdir)
    if reaped:
        say(f"ended what an earlier run left running: {', '.join(reaped)}")
    busy = busy_ports(ports)
    if busy:
        lock.release()
        return None, "; ".join(busy) + ": stop it or choose other ports (--temporal-port, --ui-port, --hub-port)"
    for entry in workdir.iterdir() if workdir.exists() else []:
        # a fresh cluster each time: the state of a previous run is stale
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    return lock, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make dev", description=__doc__)
    parser.add_argument("--dir", type=Path, default=ROOT / ".kubeon" / "dev")
    parser.add_argument("--temporal-port", type=int, default=7233)
    parser.add_argument("--ui-port", type=int, default=8233)
    parser.add_argument("--console-port", type=int, default=8234,
                        help="kubeon-gpu console: the UI opening on what awaits approval, with the Kubeon columns")
    parser.add_argument("--hub-port", type=int, default=8090)
    parser.add_argument("--policies", type=Path, default=ROOT / "examples" / "policies",
                        help="GpuPolicy files the hub is seeded with")
    parser.add_argument("--prometheus-port", type=int, default=0, help="default: a free port")
    parser.add_argument("--no-hub", action="store_true",
                        help="no hub: create the policies in the cluster directly (kubectl-style)")
    parser.add_argument("--capacity", choices=PROVIDERS, default="none",
                        help="the home GPU capacity (capacity.provider): none (default, the fastest start), the real "
                             "Karpenter with a static GPU NodePool, or a managed node group on the local EKS (moto), "
                             "GKE or AKS server; each: one group gpu-home of two 4-GPU nodes, and the example "
                             "Packing policy packing-home in Recommend")
    args = parser.parse_args(argv)

    workdir: Path = args.dir.resolve()
    ports = {"Temporal": args.temporal_port, "Temporal UI": args.ui_port, "console": args.console_port}
    if not args.no_hub:
        ports["hub"] = args.hub_port
    lock, why = prepare(workdir, ports)
    if lock is None:
        say(why)
        return 1
    children = Children(workdir, ports=ports)
    stopping = threading.Event()
    started = threading.Event()
    signalled: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Ctrl-C, SIGTERM, the terminal closing (SIGHUP): stop. While starting, at once; a second one while
        # stopping kills what is left without waiting for it.
        if stopping.is_set():
            children.hurry = True
            say(f"{signal.Signals(signum).name} again: killing what is left")
            return
        signalled.append(signal.Signals(signum).name)
        stopping.set()
        if not started.is_set():
            raise Interrupted(signal.Signals(signum).name)

    def starting(step: str | None = None) -> None:
        """Go on with the start (saying ``step``), unless a signal came meanwhile: the handler's exception can be
        lost (raised inside a weakref callback or a finalizer, where Python ignores it), the flag cannot."""
        if stopping.is_set() and not started.is_set():
            raise Interrupted(signalled[0] if signalled else "signal")
        if step:
            say(step)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)

    plane = ControlPlane(workdir / "controlplane", popen=children.popen)
    hub: subprocess.Popen[bytes] | None = None
    devclouds: DevClouds | None = None
    capacity: DevCapacity | None = None
    agents: list[AgentProcess] = []
    stopping_metrics: list[Callable[[], None]] = []
    try:
        starting("starting the control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok)")
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
        starting(f"starting the Temporal dev server on 127.0.0.1:{args.temporal_port}")
        start_temporal(children, workdir, args.temporal_port, args.ui_port)
        children.start("console", [sys.executable, "-m", "worker.cli", "console", "--upstream",
                                   f"http://127.0.0.1:{args.ui_port}", "--listen", f"127.0.0.1:{args.console_port}"],
                       log=workdir / "console.log")

        stack = build_stack(cluster, workdir / "stack")
        starting("starting the local clouds: moto (aws/eu-central-1), gcp/europe-west4, azure/westeurope")
        devclouds = DevClouds(workdir / "clouds", endpoints_file=workdir / "endpoints.json",
                              popen=children.popen).start()
        os.environ.update(devclouds.worker_env())  # the worker inherits them
        # Their instances join like the sim nodes: at the gateway process their user data names.
        devclouds.boot(gateway_join(None))
        if args.capacity != "none":
            starting(f"home GPU capacity ({args.capacity}): group gpu-home, two 4-GPU nodes")
            capacity = DevCapacity(args.capacity, cluster, workdir / "capacity", devclouds).start()
            devclouds.endpoints["capacity"] = capacity.endpoint()
            devclouds.endpoints_file.write_text(json.dumps(devclouds.endpoints, indent=2) + "\n")
            starting(f"home GPU group gpu-home ({args.capacity}): nodes {', '.join(capacity.nodes())}")
        policies = policy_files(args.policies, args.capacity)
        # Home capacity: one GPU node of another type, so the example's L4 pods cannot fit at home.
        cluster.create_kwok_node("home-a10g-1", labels={"nvidia.com/gpu.product": "NVIDIA-A10G"})
        claim_keys_file = workdir / "gateway-hub-claim-keys.pem"
        gateway_port, worker_health_port = free_port(), free_port()
        gateway, gateway_settings = gateway_process(stack, workdir / "gateway.log", gateway_port, popen=children.popen,
                                                    extra_env={"KUBEON_HUB_CLAIM_KEYS_FILE": str(claim_keys_file)})
        starting(f"gateway started at {gateway_settings['gateway_url']} (log: {workdir / 'gateway.log'})")
        # ScaleToZero and GPU type fit: namespace ml-inference, a GPU node, the DCGM exporter fixture, Prometheus.
        from tests.harness.dev_metrics import GPU_OPERATOR_NAMESPACE
        from tests.harness.dev_metrics import NODE
        from tests.harness.dev_metrics import SHARING_PROPAGATION_SECONDS
        from tests.harness.dev_metrics import TIME_SLICING_CONFIGMAP
        from tests.harness.dev_metrics import DevMetrics

        metrics = DevMetrics(cluster, workdir / "metrics", popen=children.popen).start(
            port=args.prometheus_port, products={"kubeon-worker": f"127.0.0.1:{worker_health_port}",
                                                 "kubeon-gateway": f"127.0.0.1:{gateway_port}"})
        stopping_metrics.append(metrics.stop)
        starting(f"Prometheus on {metrics.url} scraping the DCGM exporter fixture, the worker's /metrics "
                 f"(127.0.0.1:{worker_health_port}) and the gateway's (127.0.0.1:{gateway_port})")
        hub_settings: dict[str, object] = {"prometheus_url": metrics.url,
                                           "gpu_operator_namespace": GPU_OPERATOR_NAMESPACE,
                                           "time_slicing_configmap": TIME_SLICING_CONFIGMAP,
                                           "sharing_propagation_seconds": SHARING_PROPAGATION_SECONDS}
        hub_lines = ""
        locations = DEV_LOCATIONS
        if args.no_hub:
            names = load_policies(admin, policies)
            starting(f"policies created in the cluster: {', '.join(names)}")
        else:
            hub_url = f"http://127.0.0.1:{args.hub_port}"
            starting(f"starting the hub on {hub_url}")
            hub = start_hub(children, workdir, args.hub_port, policies)
            hub_settings.update({"hub_url": hub_url, "hub_token_file": workdir / "hub" / "dev.token",
                                 "hub_poll_interval": 5})
            admin_key = (workdir / "hub" / "dev.key").read_text().strip()
            agents = start_onprem_pool(children, workdir, hub_url, admin_key, claim_keys_file,
                                       str(gateway_settings["gateway_url"]))
            locations = [*DEV_LOCATIONS, {"name": f"onprem/{ONPREM_POOL}"}]
            starting(f"pool onprem/{ONPREM_POOL} with servers {', '.join(ONPREM_SERVERS)} "
                     f"(agents: {workdir / 'onprem'})")
            key = os.path.relpath(workdir / "hub" / "dev.key", Path.cwd())
            hub_lines = (f"  hub          {hub_url}  (admin key: {key}; cluster dev, policies every 5s)\n"
                         f"  hub UI       {hub_url}/ui/  (sign in with the API key {admin_key})\n"
                         f"               curl -H \"Authorization: Bearer $(cat {key})\" "
                         f"{hub_url}/v1/clusters/dev/reports\n")
        settings = stack.settings(temporal_address=f"127.0.0.1:{args.temporal_port}", task_queue="kubeon-gpu",
                                  locations=locations + devclouds.locations, cluster_name="dev",
                                  serve_check_seconds=5, approval_timeout_seconds=86400,
                                  health_port=worker_health_port, **hub_settings,
                                  **gateway_settings, **devclouds.settings(),
                                  **(capacity.settings() if capacity is not None else {}))
        worker = children.start("worker", WORKER_ARGV, env=worker_env(settings), log=workdir / "worker.log")
        starting(f"worker started (log: {workdir / 'worker.log'})")
        if not args.no_hub:
            seeded = len(policies)

            def all_synced() -> list[str] | None:  # all: the sync applies them one by one
                found = [p["metadata"]["name"] for p in admin.custom.list_cluster_custom_object(
                    API_GROUP, "v1", PLURAL)["items"]]
                return found if len(found) >= seeded else None

            names = wait_for(all_synced, what=f"the {seeded} policies synced from the hub", timeout=120)
            starting(f"policies synced from the hub: {', '.join(names)}")
        rel = os.path.relpath(kubeconfig, Path.cwd())
        approve_in_hub = "" if args.no_hub else (
            "\n  (or approve in the hub: curl -H \"Authorization: Bearer $(cat "
            f"{os.path.relpath(workdir / 'hub' / 'dev.key', Path.cwd())})\" -H \"Content-Type: application/json\" "
            f"-d '{{\"operation\": \"<OPERATION>\", "
            f"\"decision\": \"approve\"}}' http://127.0.0.1:{args.hub_port}/v1/clusters/dev/approvals,\n"
            f"   or in the hub UI: http://127.0.0.1:{args.hub_port}/ui/approvals)")
        onprem_line = "" if not agents else (
            f", onprem/{ONPREM_POOL} (${ONPREM_USD_PER_GPU_HOUR}/GPU-h, servers {', '.join(ONPREM_SERVERS)})")
        sharing_mode_change = (
            f"kubectl --kubeconfig {rel} patch gpupolicy sharing-a100 --type merge -p "
            "'{\"spec\":{\"mode\":\"Approve\"}}'" if args.no_hub else
            f"in the hub UI, http://127.0.0.1:{args.hub_port}/ui/clusters/dev/policies/sharing-a100\n"
            "  (the cluster's policies come from the hub: a kubectl edit is put back)")
        packing_lines = "" if capacity is None else (
            f"\nPacking (home GPU capacity {args.capacity}: group gpu-home; policy packing-home in Recommend):\n"
            f"  kubectl --kubeconfig {rel} get nodes -l example.com/gpu-group=gpu-home\n"
            f"  kubectl --kubeconfig {rel} apply -f examples/packing-workload.yaml   (two 1-GPU pods, one per node)\n"
            f"  kubectl --kubeconfig {rel} get gpupolicy packing-home -o jsonpath='{{.status.packing.proposal}}'\n"
            f"  env $(jq -r '.capacity.env | to_entries[] | \"\\(.key)=\\(.value)\"' "
            f"{os.path.relpath(devclouds.endpoints_file, Path.cwd())}) .venv/bin/kubeon-gpu doctor "
            f"--kubeconfig {rel} --prometheus-url {metrics.url}   (the group, as the worker's capacity provider "
            "sees it)\n")
        # Started before "ready" is printed: a signal sent by whoever reads "ready" is a stop, not an interruption.
        starting()
        started.set()
        print(f"""
KubeOn GPU optimizer is running locally.

  kubeconfig   {rel}
  console      http://127.0.0.1:{args.console_port}  (the Temporal UI, opening on what awaits approval)
  Temporal UI  http://127.0.0.1:{args.ui_port}
  Prometheus   {metrics.url}  (scrapes the DCGM fixture, worker :{worker_health_port}, gateway :{gateway_port})
{hub_lines}  locations    sim/eu-west ($0.95/GPU-h), sim/us-east ($1.35/GPU-h){onprem_line}, aws/eu-central-1,
               gcp/europe-west4, azure/westeurope (list prices; emulators in
               {os.path.relpath(devclouds.endpoints_file, Path.cwd())}):
{devclouds.banner()}
Next:
  kubectl --kubeconfig {rel} apply -f examples/burst-workload.yaml
  .venv/bin/kubeon-gpu ops list
  .venv/bin/kubeon-gpu ops approve <OPERATION>{approve_in_hub}

Then watch the burst node join: kubectl --kubeconfig {rel} get nodes -L gpu.kubeon.io/location

ScaleToZero (Prometheus {metrics.url}; docs/scale-to-zero.md):
  kubectl --kubeconfig {rel} apply -f examples/scale-to-zero-workload.yaml   (idle, 7 days of history)
  kubectl --kubeconfig {rel} get gpupolicy scale-to-zero-inference -o jsonpath='{{.status.scaleToZero.decisions}}'

Sharing (the GPU Operator stand-in on {NODE}; docs/sharing.md), with the workload above applied:
  kubectl --kubeconfig {rel} get gpupolicy sharing-a100 -o jsonpath='{{.status.sharing.nodes}}'  (proposal, saving)
  to act on it, set the policy's mode to Approve: {sharing_mode_change}
  .venv/bin/kubeon-gpu ops list   then   .venv/bin/kubeon-gpu ops approve <OPERATION>   (the Mig operation)
  kubectl --kubeconfig {rel} get node {NODE} -o jsonpath='{{.status.allocatable}}'
{packing_lines}
Ctrl-C stops everything.
ready""", flush=True)
        while not stopping.wait(0.5):  # Ctrl-C, or the worker or hub dying, ends the run
            if worker.poll() is not None:
                say(f"worker exited {worker.returncode}; see {workdir / 'worker.log'}")
                return 1
            if gateway.poll() is not None:
                say(f"gateway exited {gateway.returncode}; see {workdir / 'gateway.log'}")
                return 1
            if hub is not None and hub.poll() is not None:
                say(f"hub exited {hub.returncode}; see {workdir / 'hub.log'}")
                return 1
        say("stopping")
        return 0
    except Interrupted as exc:
        say(f"{exc} while starting: stopping")
        return 1
    finally:
        stopping.set()
        for agent in agents:
            agent.stop()
        if capacity is not None:
            capacity.stop()
        if devclouds is not None:
            devclouds.stop()
        for stop_metrics in stopping_metrics:
            stop_metrics()
        # The control plane's clients first; then the control plane, etcd last (ControlPlane.stop).
        killed = children.stop_all(keep=plane.pids)
        if killed:
            say(f"killed after {GRACE_SECONDS:.0f}s without exiting: {', '.join(killed)}")
        killed = plane.stop(hurry=lambda: children.hurry)
        if killed and not children.hurry:
            say(f"killed after 10s without exiting: {', '.join(killed)}")
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
