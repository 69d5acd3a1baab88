"""A kubelet stand-in for tunnel nodes: only the node's own credentials (``system:node:<name>``, from the
kubeconfig ``kubeon-gpu node join`` wrote in ``$KUBEON_NODE_DIR``), and what a kubelet does at the API level.

What of the real kubelet it does, over raw HTTPS (httpx, no Kubernetes client: a light process, as the real
kubelet, a Go binary, starts in well under a second), with the kubeconfig's client certificate and key, the API
server verified against the kubeconfig's CA as its ``tls-server-name`` (the SNI the real kubelet sends):

- registers its Node as the kubelet's node registration does, ``POST /api/v1/nodes`` (labels and taints of its
  registration, as --node-labels/--register-with-taints; capacity, allocatable, addresses, Ready: the Node of
  ``node.register.node_manifest``); a 409 (already registered, a restart) is fine, a failure is tried again;
- node status: renews its Lease in kube-node-lease every leaseDuration/4 and, every 10 s, posts its Ready
  condition as the kubelet's status updates do, ``PATCH /api/v1/nodes/<name>/status`` with a strategic merge
  patch (``application/strategic-merge-patch+json``) of the Ready condition only: conditions are merged by type,
  so those others post (``gpu.kubeon.io/GpuHealthy`` from node/health.py, a node problem detector's) stay;
- lists its own pods (fieldSelector spec.nodeName=<self>, all the Node authorizer allows), "runs" each: an IP from
  its pod CIDR on the loopback of this network namespace and an HTTP server there on :8080 answering
  ``kubeon-pod <namespace>/<name>``; patches the pod's status Running/Ready with that IP;
- deletes its pods once they are being deleted (a kubelet's final delete), and stops their servers.

Not done: containers, volumes, probes, eviction, node status other than Ready.

Run it inside the node's network namespace: ``python -m tests.harness.kubelet`` (SIGTERM stops it). Its log
lines: ``<ISO time> kubelet <node>: registered`` (bench/tunnel_join.py reads it), ``runs <pod> at <ip>``,
``sync failed: ...``.
"""

from __future__ import annotations

import datetime as dt
import http.server
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from node.register import load_registration
from node.register import node_manifest

LEASE_SECONDS = 40
STATUS_SECONDS = 10
TIMEOUT_SECONDS = 10.0
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def stamp() -> str:
    return now().isoformat().replace("+00:00", "Z")


class ApiError(RuntimeError):
    def __init__(self, method: str, path: str, response: httpx.Response) -> None:
        super().__init__(f"{method} {path}: {response.status_code} {response.text[:200]}")
        self.status = response.status_code


class NodeApi:
    """HTTPS to the API server with a kubelet kubeconfig: its client certificate and key, its CA (file or data),
    its ``tls-server-name`` as SNI and the name the server's certificate is verified for."""

    def __init__(self, kubeconfig: Path) -> None:
        doc = yaml.safe_load(kubeconfig.read_text())
        context = next(c["context"] for c in doc["contexts"] if c["name"] == doc["current-context"])
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == context["cluster"])
        user = next(u["user"] for u in doc["users"] if u["name"] == context["user"])
        tls = ssl.create_default_context(cafile=cluster.get("certificate-authority"),
                                         cadata=_b64(cluster.get("certificate-authority-data")))
        tls.load_cert_chain(user["client-certificate"], user["client-key"])
        self.server_name: str | None = cluster.get("tls-server-name") or None
        self.http = httpx.Client(base_url=cluster["server"].rstrip("/"), verify=tls, timeout=TIMEOUT_SECONDS,
                                 headers={"User-Agent": "kubeon-kubelet-stand-in", "Accept": "application/json"})

    def call(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
             params: dict[str, str] | None = None, ok: tuple[int, ...] = ()) -> Any:
        request = self.http.build_request(
            method, path, params=params, content=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": content_type} if body is not None else None,
            extensions={"sni_hostname": self.server_name} if self.server_name else None)
        response = self.http.send(request)
        if response.status_code in ok:
            return None
        if response.status_code >= 400:
            raise ApiError(method, path, response)
        return response.json()

    def close(self) -> None:
        self.http.close()


def _b64(data: str | None) -> str | None:
    import base64

    return base64.b64decode(data).decode() if data else None


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
        self.api = NodeApi(node_dir / "kubelet.kubeconfig")
        self.pods: dict[str, tuple[str, PodServer]] = {}
        network = ipaddress.ip_network(self.registration["podCIDR"])
        self.free_ips = [str(ip) for ip in list(network.hosts())[1:]]
        self.stopping = threading.Event()
        self.uid = ""

    def log(self, message: str) -> None:
        print(f"{now().isoformat()} kubelet {self.name}: {message}", flush=True)

    def register(self) -> None:
        """``POST /api/v1/nodes``, as the kubelet registers; an existing Node of this name (409) is kept."""
        created = self.api.call("POST", "/api/v1/nodes", node_manifest(self.registration), ok=(409,))
        if created is not None:
            self.uid = created["metadata"]["uid"]

    def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": stamp()}
        try:
            self.api.call("PATCH", path, {"spec": spec}, content_type=MERGE)
        except ApiError as exc:
            if exc.status != 404:
                raise
            uid = self.uid or self.api.call("GET", f"/api/v1/nodes/{self.name}")["metadata"]["uid"]
            self.api.call("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": uid}]},
                "spec": spec})

    def post_status(self) -> None:
        """The Ready condition only, as a strategic merge patch of the Node's status (merged by condition type)."""
        self.api.call("PATCH", f"/api/v1/nodes/{self.name}/status", {"status": {"conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet stand-in is ready",
            "lastHeartbeatTime": stamp()}]}}, content_type=STRATEGIC_MERGE)

    def sync_pods(self) -> None:
        pods = self.api.call("GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.name}"})["items"]
        seen = set()
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status") or {}
            name, namespace = str(meta["name"]), str(meta["namespace"])
            key = f"{namespace}/{name}"
            seen.add(key)
            if meta.get("deletionTimestamp") is not None:
                self.stop_pod(key)
                self.api.call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                              {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}, ok=(404,))
                continue
            if key not in self.pods and self.free_ips:
                ip = self.free_ips.pop(0)
                subprocess.run(["ip", "addr", "replace", f"{ip}/32", "dev", "lo"], check=True)
                self.pods[key] = (ip, PodServer(ip, f"kubeon-pod {key}"))
                self.log(f"runs {key} at {ip}")
            if key in self.pods and (status.get("phase") != "Running" or status.get("podIP") != self.pods[key][0]):
                ip, started = self.pods[key][0], stamp()
                self.api.call("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", {"status": {
                    "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                    "hostIP": self.registration.get("internalIP") or None, "startTime": started,
                    "conditions": [{"type": t, "status": "True", "lastTransitionTime": started}
                                   for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}},
                    content_type=STRATEGIC_MERGE)
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
        while not self.stopping.is_set():  # as the kubelet, it tries its registration again until it succeeds
            try:
                self.register()
                break
            except (httpx.HTTPError, ApiError) as exc:
                self.log(f"registration failed: {type(exc).__name__}: {str(exc)[:200]}")
                self.stopping.wait(0.5)
        else:
            return
        self.log("registered")
        last_lease = last_status = 0.0
        while not self.stopping.is_set():
            t = time.monotonic()
            try:
                if t - last_lease >= LEASE_SECONDS / 4:
                    self.renew_lease()
                    last_lease = t
                if t - last_status >= STATUS_SECONDS:
                    self.post_status()
                    last_status = t
                self.sync_pods()
            except Exception as exc:  # the tunnel may be briefly down (gateway restart): keep going
                self.log(f"sync failed: {type(exc).__name__}: {str(exc)[:200]}")
            self.stopping.wait(0.5)
        self.api.close()


def main() -> None:
    kubelet = Kubelet(Path(os.environ["KUBEON_NODE_DIR"]))
    signal.signal(signal.SIGTERM, lambda *_: kubelet.stopping.set())
    kubelet.run()
    sys.exit(0)


if __name__ == "__main__":
    main()
