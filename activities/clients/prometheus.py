"""GPU metrics from Prometheus (the HTTP API at the chart's ``prometheus.url``): DCGM exporter series per pod.

What the series look like (dcgm-exporter, see ../shared/notes): one series per GPU, labelled ``gpu``, ``UUID``,
``modelName``, ``Hostname`` and, for an allocated GPU, the pod's ``pod``/``namespace``/``container`` (empty for
a free GPU). Scraped with ``honor_labels: false`` by a ServiceMonitor those become ``exported_pod`` and
``exported_namespace`` (``pod`` is then the exporter's own pod): ``detect`` finds which form this Prometheus has.

Activity is ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (ratio 0-1, profiling metrics), per GPU falling back to
``DCGM_FI_DEV_GPU_UTIL / 100`` (percent) where the profiling metric is missing. Framebuffer is
``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE`` (MiB).

Nothing here ever answers "idle" by default: an unreachable Prometheus, an error answer or no DCGM series at
all raise a named ``MetricsError``; a pod without data, or with data over too little of the window, has a
``coverage`` below 1 that the caller must judge (``judge_idle``)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from typing import Final

import httpx

from planning.idle import PodActivity
from planning.idle import PodMemory

GR_ENGINE_ACTIVE: Final = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"

GPU_UTIL: Final = "DCGM_FI_DEV_GPU_UTIL"

FB_USED: Final = "DCGM_FI_DEV_FB_USED"

FB_FREE: Final = "DCGM_FI_DEV_FB_FREE"

DCGM_METRICS: Final = (GR_ENGINE_ACTIVE, GPU_UTIL, FB_USED, FB_FREE)

# Coverage is counted in at most this many steps over the window (a 7-day window is not 10,080 steps per pod).
MAX_COVERAGE_STEPS: Final = 120


class MetricsError(Exception):
    """GPU metrics could not be read: never treated as idle."""


class PrometheusUnavailable(MetricsError):
    """Prometheus did not answer, or answered with an error."""


class NoGpuMetrics(MetricsError):
    """Prometheus answers but holds no DCGM exporter series."""


@dataclass(frozen=True)
class LabelForm:
    """Which labels name a GPU's pod in this Prometheus: ``pod``/``namespace`` or ``exported_pod``/
    ``exported_namespace`` (the exporter scraped with ``honor_labels: false``)."""

    pod: str = "pod"
    namespace: str = "namespace"

    @property
    def exported(self) -> bool:
        return self.pod.startswith("exported_")


def selector(form: LabelForm, namespaces: Iterable[str]) -> str:
    """The GPU pods of these namespaces; of every namespace when none is named (sharing looks at nodes)."""
    names = sorted(set(namespaces))
    if not names:
        return f'{form.pod}!=""'
    return f'{form.namespace}=~"{"|".join(names)}",{form.pod}!=""'


def _by(form: LabelForm) -> str:
    return f"by ({form.namespace}, {form.pod})"


def activity_over(fn: str, window: str, sel: str, arg: str = "") -> str:
    """``fn`` over the window of each GPU's activity: the profiling ratio where it exists, else utilisation/100.
    ``or`` matches label sets without the metric name, so the fallback applies per GPU."""
    prefix = f"{arg}, " if arg else ""
    return (f"({fn}({prefix}{GR_ENGINE_ACTIVE}{{{sel}}}[{window}]) "
            f"or ({fn}({prefix}{GPU_UTIL}{{{sel}}}[{window}]) / 100))")


def peak_activity_query(form: LabelForm, namespaces: Iterable[str], window_s: int) -> str:
    return f"max {_by(form)} {activity_over('max_over_time', f'{window_s}s', selector(form, namespaces))}"


def coverage_step(window_s: int) -> int:
    return max(60, math.ceil(window_s / MAX_COVERAGE_STEPS))


def coverage_query(form: LabelForm, namespaces: Iterable[str], window_s: int) -> str:
    """How many steps of the window have a sample of the pod (any of its GPUs, any DCGM activity metric)."""
    sel = selector(form, namespaces)
    step = coverage_step(window_s)
    return (f"count_over_time((max {_by(form)} ({GR_ENGINE_ACTIVE}{{{sel}}} or {GPU_UTIL}{{{sel}}}))"
            f"[{window_s}s:{step}s])")


def p95_activity_query(form: LabelForm, namespaces: Iterable[str], window_s: int) -> str:
    return (f"max {_by(form)} "
            f"{activity_over('quantile_over_time', f'{window_s}s', selector(form, namespaces), arg='0.95')}")


def peak_memory_query(form: LabelForm, namespaces: Iterable[str], window_s: int) -> str:
    return f"max {_by(form)} (max_over_time({FB_USED}{{{selector(form, namespaces)}}}[{window_s}s]))"


def memory_total_query(form: LabelForm, namespaces: Iterable[str]) -> str:
    sel = selector(form, namespaces)
    return f"max {_by(form)} ({FB_USED}{{{sel}}} + {FB_FREE}{{{sel}}})"

EXPORTED_POD_SET: Final = ', exported_pod!=""'


def _any_dcgm(extra: str = "") -> str:
    return f'{{__name__=~"{"|".join(DCGM_METRICS)}"{extra}}}'


class PrometheusClient:
    """A small, synchronous client of the Prometheus HTTP API (``/api/v1/query``)."""

    def __init__(self, url: str, *, timeout: float = 10.0, form_ttl: float = 300.0) -> None:
        if not url:
            raise ValueError("prometheus.url is not set")
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout)
        self._form: tuple[float, LabelForm] | None = None
        self._form_ttl = form_ttl
        self.queries = 0  # for the bench: queries sent

    def close(self) -> None:
        self._http.close()

    def query(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query; each result's labels and value. Raises ``PrometheusUnavailable``."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        self.queries += 1
        try:
            response = self._http.post("/api/v1/query", data=params)
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(f"Prometheus at {self.url} is unreachable: {exc}") from None
        try:
            body = response.json()
        except ValueError:
            raise PrometheusUnavailable(
                f"Prometheus at {self.url} answered HTTP {response.status_code} without JSON "
                f"(is prometheus.url the Prometheus server?)") from None
        if response.status_code != 200 or body.get("status") != "success":
            raise PrometheusUnavailable(f"Prometheus at {self.url} refused the query ({response.status_code} "
                                        f"{body.get('errorType', '')}: {body.get('error', '')}): {expr}")
        data = body.get("data") or {}
        if data.get("resultType") == "scalar":
            return [({}, float(data["result"][1]))]
        out = []
        for item in data.get("result") or []:
            value = float(item["value"][1])
            if not math.isnan(value):
                out.append((dict(item.get("metric") or {}), value))
        return out

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The value of a query that yields one number (a demand query); None when it yields nothing. More than
        one series is summed (KEDA's Prometheus scaler takes the first; a sum is the safer reading of demand)."""
        results = self.query(expr, at)
        if not results:
            return None
        return sum(v for _, v in results)

    def detect(self, *, refresh: bool = False) -> LabelForm:
        """The label form of this Prometheus' DCGM series. Raises ``NoGpuMetrics`` when there are none."""
        now = time.monotonic()
        if self._form and not refresh and now - self._form[0] < self._form_ttl:
            return self._form[1]
        if self.query(f"count({_any_dcgm(EXPORTED_POD_SET)})"):
            form = LabelForm(pod="exported_pod", namespace="exported_namespace")
        elif self.query(f"count({_any_dcgm()})"):
            form = LabelForm()
        else:
            raise NoGpuMetrics(f"Prometheus at {self.url} has no DCGM exporter series ({', '.join(DCGM_METRICS)}):"
                               " is the NVIDIA DCGM exporter installed and scraped?")
        self._form = (now, form)
        return form

    def pod_activity(self, namespaces: Iterable[str], window_s: int, at: float | None = None
                     ) -> dict[tuple[str, str], PodActivity]:
        """Peak activity and sample coverage over the last ``window_s`` of every GPU pod in the namespaces: two
        queries, whatever the number of pods."""
        namespaces = sorted(set(namespaces))
        form = self.detect()
        peaks = self.query(peak_activity_query(form, namespaces, window_s), at)
        counts = self.query(coverage_query(form, namespaces, window_s), at)
        steps = window_s / coverage_step(window_s)
        covered = {(m.get(form.namespace, ""), m.get(form.pod, "")): min(1.0, v / steps) for m, v in counts}
        out = {}
        for m, v in peaks:
            key = (m.get(form.namespace, ""), m.get(form.pod, ""))
            out[key] = PodActivity(namespace=key[0], pod=key[1], peak=v, coverage=covered.get(key, 0.0))
        return out

    def pod_memory(self, namespaces: Iterable[str], window_s: int, at: float | None = None
                   ) -> dict[tuple[str, str], PodMemory]:
        """Peak framebuffer used, the GPU's reported memory and p95 activity over the window, per pod."""
        namespaces = sorted(set(namespaces))
        form = self.detect()

        def by_pod(expr: str) -> dict[tuple[str, str], float]:
            return {(m.get(form.namespace, ""), m.get(form.pod, "")): v for m, v in self.query(expr, at)}

        peak = by_pod(peak_memory_query(form, namespaces, window_s))
        total = by_pod(memory_total_query(form, namespaces))
        p95 = by_pod(p95_activity_query(form, namespaces, window_s))
        steps = window_s / coverage_step(window_s)
        coverage = {k: min(1.0, v / steps) for k, v in by_pod(coverage_query(form, namespaces, window_s)).items()}
        return {k: PodMemory(namespace=k[0], pod=k[1], peak_used_mib=v, total_mib=total.get(k, 0.0),
                             p95_activity=p95.get(k), coverage=coverage.get(k, 0.0)) for k, v in peak.items()}
