"""A kubelet stand-in for tunnel nodes: only the node's own credentials (``system:node:<name>``, from the
kubeconfig ``kubeon-gpu node join`` wrote in ``$KUBEON_NODE_DIR``), and what a kubelet does at the API level.

- registers its Node (labels and taints of its registration, as --node-labels/--register-with-taints);
- renews its Lease in kube-node-lease every leaseDuration/4 and posts its Ready condition;
- lists its own pods (fieldSelector spec.nodeName=<self>, all the Node authorizer allows), "runs" each: an IP from
  its pod CIDR on the loopback of this network namespace and an HTTP server there on :8080 answering
  ``kubeon-pod <namespace>/<name>``; patches the pod's status Running/Ready with that IP;
- deletes its pods once they are being deleted (a kubelet's final delete), and stops their servers.

Run it inside the node's network namespace: ``python -m tests.harness.kubelet`` (SIGTERM stops it).
"""

from __future__ import annotations

import datetime as dt
import http.server
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kubernetes import client

from node.register import load_registration, node_api, register

LEASE_SECONDS = 40


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class PodServer:
    def __init__(self, ip: str, text: str) -> None:
        body = text.encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                return

        self.server = http.server.ThreadingHTTPServer((ip, 8080), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Kubelet:
    def __init__(self, node_dir: Path) -> None:
        self.registration = load_registration(node_dir / "registration.json")
        self.name = self.registration["nodeName"]
        self.api = node_api(node_dir / "kubelet.kubeconfig")
        self.core = client.CoreV1Api(self.api)
        self.leases = client.CoordinationV1Api(self.api)
        self.pods: dict[str, tuple[str, PodServer]] = {}
        network = ipaddress.ip_network(self.registration["podCIDR"])
        self.free_ips = [str(ip) for ip in list(network.hosts())[1:]]
        self.stopping = threading.Event()

    def log(self, message: str) -> None:
        print(f"{now().isoformat()} kubelet {self.name}: {message}", flush=True)

    def renew_lease(self) -> None:
        spec = client.V1LeaseSpec(holder_identity=self.name, lease_duration_seconds=LEASE_SECONDS, renew_time=now())
        try:
            self.leases.patch_namespaced_lease(self.name, "kube-node-lease", {"spec": {
                "holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now().isoformat().replace("+00:00", "Z")}})
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            node = self.core.read_node(self.name)
            self.leases.create_namespaced_lease("kube-node-lease", client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, owner_references=[client.V1OwnerReference(
                    api_version="v1", kind="Node", name=self.name, uid=node.metadata.uid)]), spec=spec))

    def post_status(self) -> None:
        stamp = now().isoformat().replace("+00:00", "Z")
        self.core.patch_node_status(self.name, {"status": {"conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet stand-in is ready",
            "lastHeartbeatTime": stamp}]}})

    def sync_pods(self) -> None:
        pods = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.name}").items
        seen = set()
        for pod in pods:
            name, namespace = str(pod.metadata.name), str(pod.metadata.namespace)
            key = f"{namespace}/{name}"
            seen.add(key)
            if pod.metadata.deletion_timestamp is not None:
                self.stop_pod(key)
                try:
                    self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise
                continue
            if key not in self.pods and self.free_ips:
                ip = self.free_ips.pop(0)
                subprocess.run(["ip", "addr", "replace", f"{ip}/32", "dev", "lo"], check=True)
                self.pods[key] = (ip, PodServer(ip, f"kubeon-pod {key}"))
                self.log(f"runs {key} at {ip}")
            if key in self.pods and (pod.status.phase != "Running" or pod.status.pod_ip != self.pods[key][0]):
                ip = self.pods[key][0]
                stamp = now().isoformat().replace("+00:00", "Z")
                self.core.patch_namespaced_pod_status(name, namespace, {"status": {
                    "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": self.registration.get(
                        "internalIP") or None, "startTime": stamp,
                    "conditions": [{"type": t, "status": "True", "lastTransitionTime": stamp}
                                   for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}})
        for key in list(self.pods):
            if key not in seen:
                self.stop_pod(key)

    def stop_pod(self, key: str) -> None:
        entry = self.pods.pop(key, None)
        if entry is not None:
            entry[1].stop()
            subprocess.run(["ip", "addr", "del", f"{entry[0]}/32", "dev", "lo"], check=False)
            self.free_ips.insert(0, entry[0])

    def run(self) -> None:
        register(self.api, self.registration)
        self.log("registered")
        last_lease = last_status = 0.0
        while not self.stopping.is_set():
            t = time.monotonic()
            try:
                if t - last_lease >= LEASE_SECONDS / 4:
                    self.renew_lease()
                    last_lease = t
                if t - last_status >= 10:
                    self.post_status()
                    last_status = t
                self.sync_pods()
            except Exception as exc:  # the tunnel may be briefly down (gateway restart): keep going
                self.log(f"sync failed: {type(exc).__name__}: {str(exc)[:200]}")
            self.stopping.wait(0.5)


def main() -> None:
    kubelet = Kubelet(Path(os.environ["KUBEON_NODE_DIR"]))
    signal.signal(signal.SIGTERM, lambda *_: kubelet.stopping.set())
    kubelet.run()
    sys.exit(0)


if __name__ == "__main__":
    main()
