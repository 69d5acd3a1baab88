"""Whether a workload is idle, from the DCGM activity of its pods: pure, so workflows, activities and the bench
judge alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PodActivity:
    namespace: str
    pod: str
    peak: float  # highest activity (0-1) of any of its GPUs in the window
    coverage: float  # share of the window's steps with a sample (0-1)


@dataclass(frozen=True)
class PodMemory:
    namespace: str
    pod: str
    peak_used_mib: float
    total_mib: float  # used + free of the GPU at that peak's series (its reported memory)
    p95_activity: float | None
    coverage: float


@dataclass(frozen=True)
class IdleVerdict:
    idle: bool
    reason: str
    peak: float | None = None


def judge_idle(pods: list[tuple[str, str]], activity: dict[tuple[str, str], PodActivity], *, threshold: float,
               idle_for_s: int, min_coverage: float) -> IdleVerdict:
    """Idle only when every pod has DCGM data over enough of the window and every GPU stayed at or below the
    threshold. A workload without running pods is not judged here (nothing to measure)."""
    if not pods:
        return IdleVerdict(False, "no running pods to measure")
    peak = 0.0
    for key in pods:
        got = activity.get(key)
        if got is None:
            return IdleVerdict(False, f"no DCGM data for pod {key[1]} in the last {idle_for_s // 60}m")
        if got.coverage < min_coverage:
            return IdleVerdict(False, f"too little history for pod {key[1]}: data over {got.coverage:.0%} of the "
                                      f"last {idle_for_s // 60}m (needs {min_coverage:.0%})")
        if got.peak > threshold:
            return IdleVerdict(False, f"busy: pod {key[1]} peaked at {got.peak:.0%} GPU activity in the last "
                                      f"{idle_for_s // 60}m (idle threshold {threshold:.0%})", got.peak)
        peak = max(peak, got.peak)
    return IdleVerdict(True, f"idle: {len(pods)} pod(s) at most {peak:.0%} GPU activity for {idle_for_s // 60}m",
                       peak)
