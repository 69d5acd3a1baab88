"""A DCGM-exporter-shaped fixture: ``/metrics`` in the Prometheus text format with dcgm-exporter's metric names,
labels and units (read from NVIDIA/dcgm-exporter ``etc/default-counters.csv`` and its Kubernetes mapping): one
series per GPU, the pod labels set when a pod holds the GPU (empty when free).

- ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``: ratio 0-1 (gauge); left out with ``profiling=False`` (GPUs or drivers without
  profiling metrics), so the client's fallback to ``DCGM_FI_DEV_GPU_UTIL`` is exercised
- ``DCGM_FI_DEV_GPU_UTIL``: percent 0-100 (gauge)
- ``DCGM_FI_DEV_FB_USED`` / ``DCGM_FI_DEV_FB_FREE``: MiB (gauge)

It also writes history: ``openmetrics_history`` renders the same series at past timestamps for ``promtool tsdb
create-blocks-from openmetrics``, so a test has "30 minutes of idle" without waiting for it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from http.server import ThreadingHTTPServer

from tests.harness.controlplane import free_port

HELP = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "Ratio of time the graphics engine is active.",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
}


@dataclass
class Gpu:
    index: int
    hostname: str
    model: str = "NVIDIA A100-SXM4-80GB"
    memory_mib: int = 81920
    namespace: str = ""
    pod: str = ""
    container: str = ""
    activity: float = 0.0  # 0-1
    fb_used_mib: float = 0.0

    @property
    def uuid(self) -> str:
        return f"GPU-{abs(hash((self.hostname, self.index))) % 10**8:08d}-0000-0000-0000-{self.index:012d}"

    def labels(self, *, exported: bool = False, extra: dict[str, str] | None = None) -> str:
        prefix = "exported_" if exported else ""
        pairs = [("gpu", str(self.index)), ("UUID", self.uuid), ("pci_bus_id", f"00000000:{self.index + 16:02X}:00.0"),
                 ("device", f"nvidia{self.index}"), ("modelName", self.model), ("Hostname", self.hostname),
                 ("DCGM_FI_DRIVER_VERSION", "570.124.06"), (f"{prefix}container", self.container),
                 (f"{prefix}namespace", self.namespace), (f"{prefix}pod", self.pod), *(extra or {}).items()]
        return ",".join(f'{k}="{v}"' for k, v in pairs)

    def values(self, *, profiling: bool) -> dict[str, float]:
        out = {"DCGM_FI_DEV_GPU_UTIL": round(self.activity * 100),
               "DCGM_FI_DEV_FB_USED": self.fb_used_mib,
               "DCGM_FI_DEV_FB_FREE": max(0.0, self.memory_mib - self.fb_used_mib)}
        if profiling:
            out["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] = self.activity
        return out


def render(gpus: Iterable[Gpu], *, profiling: bool = True, exported: bool = False) -> str:
    """The exposition text of these GPUs, as dcgm-exporter serves it."""
    gpus = list(gpus)
    lines: list[str] = []
    for name, help_text in HELP.items():
        if name == "DCGM_FI_PROF_GR_ENGINE_ACTIVE" and not profiling:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for gpu in gpus:
            lines.append(f"{name}{{{gpu.labels(exported=exported)}}} {gpu.values(profiling=profiling)[name]:g}")
    return "\n".join(lines) + "\n"


def openmetrics_history(samples: Iterable[tuple[float, list[Gpu]]], *, profiling: bool = True,
                        extra: dict[str, str] | None = None) -> str:
    """An OpenMetrics file of (timestamp, GPUs as they were then) for ``promtool tsdb create-blocks-from
    openmetrics``: each metric family once, samples in time order, ``# EOF`` at the end. ``extra`` labels (the
    scrape's ``job`` and ``instance``) make the history the same series the live scrape continues."""
    samples = sorted(samples, key=lambda s: s[0])
    lines: list[str] = []
    for name, help_text in HELP.items():
        if name == "DCGM_FI_PROF_GR_ENGINE_ACTIVE" and not profiling:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for at, gpus in samples:
            for gpu in gpus:
                lines.append(f"{name}{{{gpu.labels(extra=extra)}}} {gpu.values(profiling=profiling)[name]:g} "
                             f"{at:.3f}")
    return "\n".join(lines) + "\n# EOF\n"


@dataclass
class DcgmExporter:
    """Serves the GPUs' current values on 127.0.0.1; ``assign`` and ``set_pod`` change them between scrapes."""

    gpus: list[Gpu] = field(default_factory=list)
    profiling: bool = True
    port: int = 0
    _server: ThreadingHTTPServer | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> DcgmExporter:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                with exporter._lock:
                    body = render(exporter.gpus, profiling=exporter.profiling).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.port = self.port or free_port()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, name="dcgm-exporter", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def add_node(self, hostname: str, gpus: int = 1, **kwargs: object) -> list[Gpu]:
        with self._lock:
            start = len([g for g in self.gpus if g.hostname == hostname])
            added = [Gpu(index=start + i, hostname=hostname, **kwargs) for i in range(gpus)]  # type: ignore[arg-type]
            self.gpus += added
            return added

    def assign(self, namespace: str, pod: str, *, activity: float = 0.0, fb_used_mib: float = 0.0,
               container: str = "main") -> Gpu:
        """Give a free GPU to the pod (a pod holding one already keeps it) with these values."""
        with self._lock:
            for gpu in self.gpus:
                if (gpu.namespace, gpu.pod) == (namespace, pod):
                    break
            else:
                free = [g for g in self.gpus if not g.pod]
                if not free:
                    raise RuntimeError("every simulated GPU is taken: add_node first")
                gpu = free[0]
            gpu.namespace, gpu.pod, gpu.container = namespace, pod, container
            gpu.activity, gpu.fb_used_mib = activity, fb_used_mib
            return replace(gpu)

    def set_pod(self, namespace: str, pod: str, *, activity: float | None = None,
                fb_used_mib: float | None = None) -> None:
        with self._lock:
            found = [g for g in self.gpus if (g.namespace, g.pod) == (namespace, pod)]
            if not found:
                raise KeyError(f"no simulated GPU is held by {namespace}/{pod}")
            for gpu in found:
                if activity is not None:
                    gpu.activity = activity
                if fb_used_mib is not None:
                    gpu.fb_used_mib = fb_used_mib

    def release(self, namespace: str, pod: str) -> None:
        with self._lock:
            for gpu in self.gpus:
                if (gpu.namespace, gpu.pod) == (namespace, pod):
                    gpu.namespace = gpu.pod = gpu.container = ""
                    gpu.activity = gpu.fb_used_mib = 0.0

    def snapshot(self) -> list[Gpu]:
        with self._lock:
            return [replace(g) for g in self.gpus]
