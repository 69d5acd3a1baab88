"""The sharing decision (planning/sharing.py) on hand-made nodes and DCGM usage: time-slicing replicas from the
busiest pod and the waiting pods, MIG geometries from the pods' peak framebuffer, busy and unmeasured nodes never
proposed, the saving and the risk of each proposal."""

from __future__ import annotations

import pytest

from planning.idle import PodMemory
from planning.sharing import GpuPod
from planning.sharing import NodeFacts
from planning.sharing import Rule
from planning.sharing import decide
from planning.sharing import mig_geometries
from planning.sharing import profile_memory_mib

RULE = Rule(threshold=0.4, min_coverage=0.9, window="168h", max_replicas=4,
            mig_allowed=("all-1g.10gb", "all-3g.40gb", "all-balanced"), usd_per_gpu_hour=4.1)


def pods(n: int, ns: str = "ml", prefix: str = "run") -> tuple[GpuPod, ...]:
    return tuple(GpuPod(ns, f"{prefix}-{i}", 1) for i in range(n))


def usage(ps: tuple[GpuPod, ...], *, p95: float, peak_mib: float = 2048, coverage: float = 1.0
          ) -> dict[tuple[str, str], PodMemory]:
    return {p.key: PodMemory(p.namespace, p.name, peak_used_mib=peak_mib, total_mib=81920, p95_activity=p95,
                             coverage=coverage) for p in ps}


def a100(running: tuple[GpuPod, ...], waiting: tuple[GpuPod, ...] = (), gpus: int = 4, **kw: object) -> NodeFacts:
    return NodeFacts(name="gpu-a", product="NVIDIA-A100-SXM4-80GB", gpus=gpus, pods=running, waiting=waiting,
                     **kw)  # type: ignore[arg-type]


def test_four_quiet_pods_and_four_waiting_get_two_replicas_with_the_saving_and_risk() -> None:
    running, waiting = pods(4), pods(4, prefix="wait")
    verdict = decide(a100(running, waiting), usage(running, p95=0.05), RULE)
    ts = [p for p in verdict.proposals if p.kind == "time-slicing"]
    assert len(ts) == 1
    p = ts[0]
    assert p.replicas == 2 and p.waiting_served == tuple(f"ml/wait-{i}" for i in range(4))
    assert p.gpus_saved == 4 and p.saving_usd_per_hour == pytest.approx(16.4)
    assert "noisy neighbours" in p.risk and "NVIDIA-A100-SXM4-80GB-SHARED" in p.risk
    assert p.summed_p95 == pytest.approx(0.2)
    assert p.plan_id == "gpu-a/time-slicing/r2"
    assert "$16.40/h" in p.summary()


def test_replicas_are_capped_by_the_busiest_pod_and_max_replicas() -> None:
    running, waiting = pods(1), pods(20, prefix="wait")
    # busiest 15%: 2 pods like it reach 30%, 3 reach 45% > 40%
    p = decide(a100(running, waiting, gpus=1), usage(running, p95=0.15), RULE).proposals[0]
    assert p.kind == "time-slicing" and p.replicas == 2 and len(p.waiting_served) == 1
    p = decide(a100(running, waiting, gpus=1), usage(running, p95=0.01), RULE).proposals[0]
    assert p.replicas == 4 and len(p.waiting_served) == 3  # maxReplicas


def test_busy_node_is_never_proposed() -> None:
    running = pods(1)
    verdict = decide(a100(running, pods(4, prefix="w"), gpus=1), usage(running, p95=0.6), RULE)
    assert verdict.proposals == ()
    assert verdict.reason.startswith("busy: its pods' summed p95 is 60%")
    many = pods(4)
    assert decide(a100(many, pods(4, prefix="w")), usage(many, p95=0.1), RULE).proposals == ()  # 40% summed


def test_unmeasured_or_short_history_is_never_proposed() -> None:
    running = pods(2)
    assert "no DCGM data for pod ml/run-0" in decide(a100(running, pods(2, prefix="w")), {}, RULE).reason
    verdict = decide(a100(running, pods(2, prefix="w")), usage(running, p95=0.01, coverage=0.5), RULE)
    assert verdict.proposals == () and "too little history" in verdict.reason


def test_nothing_waiting_means_no_time_slicing_but_mig_may_still_fit() -> None:
    running = pods(2)
    verdict = decide(a100(running, gpus=2), usage(running, p95=0.05, peak_mib=9 * 1024), RULE)
    assert [p.kind for p in verdict.proposals] == ["mig"]
    assert "time-slicing" not in verdict.reason or "would free nothing" in verdict.reason


def test_two_pods_at_nine_gib_get_all_1g_10gb() -> None:
    running = pods(2)
    p = decide(a100(running, gpus=2), usage(running, p95=0.05, peak_mib=9 * 1024), RULE).proposals[0]
    assert p.kind == "mig" and p.geometry == "all-1g.10gb"
    assert p.gpus_saved == 1 and p.saving_usd_per_hour == pytest.approx(4.1)
    assert "evicts every GPU pod of gpu-a (2 now)" in p.risk and "nvidia.com/mig-1g.10gb" in p.risk
    assert p.plan_id == "gpu-a/mig/all-1g.10gb"


def test_a_peak_above_the_slice_never_gets_that_geometry() -> None:
    running = pods(2)
    verdict = decide(a100(running, gpus=2), usage(running, p95=0.05, peak_mib=12 * 1024), RULE)
    geometries = [p.geometry for p in verdict.proposals if p.kind == "mig"]
    assert geometries and "all-1g.10gb" not in geometries
    only_small = Rule(**{**RULE.__dict__, "mig_allowed": ("all-1g.10gb",), "max_replicas": None})
    verdict = decide(a100(running, gpus=2), usage(running, p95=0.05, peak_mib=12 * 1024), only_small)
    assert verdict.proposals == ()
    assert "all-1g.10gb: 2 pod(s) needing up to 13.2 GiB" in verdict.reason
    # what GFD reports for the slice wins over the profile's nominal size
    verdict = decide(a100(running, gpus=2, slice_memory_mib={"1g.10gb": 9728}),
                     usage(running, p95=0.05, peak_mib=9 * 1024), only_small)
    assert verdict.proposals == ()


def test_mig_compute_and_products() -> None:
    running = pods(2)
    # 7% p95 on a 1g slice (1/7 of the GPU) would be 49%: over the threshold
    only_small = Rule(**{**RULE.__dict__, "mig_allowed": ("all-1g.10gb",), "max_replicas": None})
    verdict = decide(a100(running, gpus=2), usage(running, p95=0.07, peak_mib=1024), only_small)
    assert verdict.proposals == () and "would run at 49% of a 1g slice" in verdict.reason
    l4 = NodeFacts(name="l4", product="NVIDIA-L4", gpus=1, pods=pods(1))
    assert "has no MIG geometries" in decide(l4, usage(pods(1), p95=0.01), only_small).reason
    assert mig_geometries("NVIDIA-A100-SXM4-40GB")["all-1g.5gb"] == {"1g.5gb": 7}
    assert mig_geometries("NVIDIA-H100-80GB-HBM3")["all-balanced"] == {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    assert profile_memory_mib("3g.40gb") == 40960


def test_pods_asking_for_two_gpus_block_time_slicing() -> None:
    running = (GpuPod("ml", "big", 2),)
    verdict = decide(a100(running, pods(2, prefix="w")), usage(running, p95=0.01), RULE)
    assert all(p.kind != "time-slicing" for p in verdict.proposals)
    assert "requests 2 GPUs" in verdict.reason


def test_already_shared_enough_is_not_proposed_again() -> None:
    running = pods(4)
    verdict = decide(a100(running, pods(4, prefix="w"), replicas=2), usage(running, p95=0.05), RULE)
    assert all(p.kind != "time-slicing" for p in verdict.proposals)
    assert "already time-sliced at 2 replicas" in verdict.reason
