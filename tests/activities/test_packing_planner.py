"""planning.packing: which GPU nodes a packing round empties, and which it must keep (and why)."""

from __future__ import annotations

from datetime import UTC
from datetime import datetime
from datetime import timedelta
from typing import Any

import planning.packing as planning_packing
from models.packing import PackNode
from models.packing import PackPod
from models.provisioning import PendingPod
from planning.packing import plan_packing

NOW = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)
L4, A100 = "NVIDIA-L4", "NVIDIA-A100-SXM4-40GB"


def _node(name: str, *, gpus: int = 4, price: float = 4.6016, product: str = L4, **kw: object) -> PackNode:
    return PackNode(name=name, group="gpu", gpus=gpus, gpu_product=product, usd_per_hour=price,
                    taints=["nvidia.com/gpu"], **kw)


def _pod(name: str, node: str, *, gpus: int = 1, owner: str = "ReplicaSet", selector: dict[str, str] | None = None,
         **kw: object) -> PackPod:
    return PackPod(pod=PendingPod(namespace="ml", name=name, gpus=gpus, node_selector=selector or {},
                                  tolerations=["nvidia.com/gpu"]), node=node, owner_kind=owner,
                   **kw)


def test_six_pods_spread_over_nodes_are_packed() -> None:
    # Six 1-GPU pods need two 4-GPU nodes: spread over three, one node is emptied (8 GPUs hold them all)...
    nodes = [_node("a"), _node("b"), _node("c")]
    pods = [_pod(f"p{i}", "abc"[i % 3]) for i in range(6)]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=2)
    assert len(plan.empty) == 1 and plan.exact and plan.usd_per_hour_saved == 4.6016
    assert sorted(m.pod for m in plan.moves) == sorted(p.pod.key for p in pods if p.node in plan.empty)
    assert all(m.target != plan.empty[0] for m in plan.moves)
    # ...spread over four (2, 2, 1, 1), two are.
    nodes.append(_node("d"))
    pods = [_pod(f"p{i}", n) for i, n in enumerate("aabbcd")]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=2)
    assert len(plan.empty) == 2 and plan.usd_per_hour_saved == 9.2032
    assert sorted(plan.empty) == ["c", "d"]  # the fewest pods moved for the same saving
    assert "saves $9.20/h" in plan.summary()
    # One node at a time if the policy says so.
    assert len(plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=1).empty) == 1


def test_exact_prefers_fewer_moves_and_checks_every_assignment() -> None:
    nodes = [_node("n1"), _node("n2"), _node("n3"), _node("n4")]
    pods = [_pod("x1", "n1", gpus=2), _pod("x2", "n2", gpus=2), _pod("y1", "n3"), _pod("y2", "n3"),
            _pod("y3", "n3"), _pod("z", "n4")]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=2)
    # n1+n2 cannot (2+2 onto 1 and 3 free); n3+n4 can with 4 moves; n1+n4 with 2.
    assert plan.empty in (["n1", "n4"], ["n2", "n4"])
    assert len(plan.moves) == 2


def test_nodes_held_by_bare_do_not_disrupt_and_multi_pdb_pods() -> None:
    nodes = [_node("bare"), _node("dnd"), _node("dur"), _node("pdbs"), _node("target", gpus=8)]
    pods = [_pod("b", "bare", owner=""),
            _pod("d", "dnd", do_not_disrupt="true"),
            _pod("t", "dur", do_not_disrupt="2h", started_at=NOW - timedelta(hours=1)),
            _pod("m", "pdbs", pdbs=["one", "two"])]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=5)
    assert plan.empty == ["target"]  # the empty 8-GPU node is the only one that may go
    assert plan.kept["bare"].startswith("bare pod ml/b")
    assert plan.kept["dnd"] == "pod ml/d has karpenter.sh/do-not-disrupt: true"
    assert plan.kept["dur"] == "pod ml/t has karpenter.sh/do-not-disrupt: 2h (not elapsed)"
    assert "2 PodDisruptionBudgets" in plan.kept["pdbs"]
    # The duration elapsed: that node may be emptied now; an invalid value is ignored, as Karpenter does.
    elapsed = [_pod("t", "dur", do_not_disrupt="2h", started_at=NOW - timedelta(hours=3)),
               _pod("i", "inv", do_not_disrupt="soon")]
    plan = plan_packing([_node("dur"), _node("inv")], elapsed, now=NOW, pdb_allowed={}, max_nodes=2)
    assert not plan.kept and len(plan.empty) == 1 and len(plan.moves) == 1


def test_daemonsets_do_not_hold_pdb_without_headroom_waits() -> None:
    nodes = [_node("a"), _node("b")]
    pods = [_pod("ds", "a", owner="DaemonSet", gpus=0), _pod("w", "a", pdbs=["web"]), _pod("k", "b")]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={"web": 0}, max_nodes=1)
    assert plan.empty == ["a"]
    [move] = plan.moves
    assert (move.pod, move.target, move.waits_for_pdb) == ("ml/w", "b", "web")


def test_gpu_product_selector_and_taints_of_the_targets() -> None:
    # The L4 pod cannot go to the A100 node, nor to an L4 node it does not match, nor one whose taint it lacks.
    nodes = [_node("l4"), _node("a100", product=A100, price=14.69),
             _node("l4-other", labels={"zone": "b"}), _node("l4-tainted")]
    nodes[3].taints.append("dedicated")
    pods = [_pod("p", "l4", selector={"zone": "a"}),
            _pod("q", "l4-other", gpus=4), _pod("r", "l4-tainted", gpus=4)]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=3)
    assert plan.empty == ["a100"]  # empty already; nothing else can move
    assert not plan.moves
    # With a matching L4 node with room, the pod moves there.
    nodes.append(_node("l4-a", labels={"zone": "a"}))
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=1)
    assert plan.empty == ["a100"]  # the dearest node first
    plan = plan_packing([n for n in nodes if n.name != "a100"], pods, now=NOW, pdb_allowed={}, max_nodes=1)
    assert [(m.pod, m.target) for m in plan.moves] in ([("ml/p", "l4-a")], [])
    assert plan.empty in (["l4"], ["l4-a"])


def test_min_savings_and_nothing_to_do() -> None:
    nodes = [_node("a", price=0.5), _node("b", price=0.5)]
    pods = [_pod("x", "a"), _pod("y", "b")]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=1, min_savings_usd_per_hour=1.0)
    assert not plan.empty and "under minSavingsUsdPerHour $1.00/h" in plan.message
    full = [_pod("x", "a", gpus=4), _pod("y", "b", gpus=4)]
    plan = plan_packing(nodes, full, now=NOW, pdb_allowed={}, max_nodes=2)
    assert not plan.empty and plan.summary() == "no GPU node's pods fit on the others' free GPUs"


def test_policy_scope_pods_outside_it_young_or_protected_hold_their_node() -> None:
    from models.packing import PackScope

    nodes = [_node("a"), _node("b"), _node("c")]
    old = NOW - timedelta(hours=2)

    def pods(**on_a: Any) -> list[PackPod]:
        fields: dict[str, Any] = {"started_at": old, "labels": {"tier": "serving"}, **on_a}
        return [_pod("a1", "a", **fields)] + [
            _pod(f"{n}1", n, started_at=old, labels={"tier": "serving"}) for n in "bc"]

    scope = PackScope(namespaces=["ml"], pod_labels={"tier": "serving"}, min_pod_age_seconds=1800,
                      protect_annotations=["example.com/pinned"])
    assert plan_packing(nodes, pods(), now=NOW, pdb_allowed={}, scope=scope).empty
    # Each rule, alone, keeps node a out of the round (b or c is emptied instead).
    cases: list[tuple[dict[str, Any], str]] = [
        ({"labels": {"tier": "batch"}}, "not among the policy's pods"),
        ({"annotation_keys": ["example.com/pinned"]}, "protected annotation example.com/pinned"),
        ({"started_at": NOW - timedelta(minutes=10)}, "younger than 30 min")]
    for on_a, why in cases:
        plan = plan_packing(nodes, pods(**on_a), now=NOW, pdb_allowed={}, scope=scope)
        assert why in plan.kept["a"] and "a" not in plan.empty and plan.empty, (why, plan)
    other_ns = PackScope(namespaces=["other"])
    plan = plan_packing(nodes, pods(), now=NOW, pdb_allowed={}, scope=other_ns)
    assert not plan.empty and len(plan.kept) == 3


def test_a_fifty_node_pool_of_alike_pods_is_packed_to_the_optimum() -> None:
    # 100 1-GPU pods of one Deployment spread 2 per node over 50 4-GPU nodes: 25 nodes hold them. Greedy (beyond
    # EXACT_CANDIDATES), each trial an assignment; once the kept nodes are full, every further trial is impossible,
    # which backtracking without pruning proved by trying every permutation of the alike pods (minutes of CPU).
    nodes = [_node(f"n{i:02d}") for i in range(50)]
    pods = [_pod(f"p{i:03d}", f"n{i // 2:02d}") for i in range(100)]
    plan = plan_packing(nodes, pods, now=NOW, pdb_allowed={}, max_nodes=50)
    assert not plan.exact and len(plan.empty) == 25
    assert plan.usd_per_hour_saved == round(25 * 4.6016, 4)
    load: dict[str, int] = {}
    for m in plan.moves:
        assert m.target not in plan.empty
        load[m.target] = load.get(m.target, 0) + m.gpus
    assert all(2 + extra <= 4 for extra in load.values())  # each kept node's 2 pods plus what it takes
    assert len(plan.moves) == 50


def test_an_assignment_gives_up_within_its_step_budget(monkeypatch: Any) -> None:
    # More GPUs asked than the usable targets have free: refused before any search. A feasible one is found; with a
    # budget smaller than the placements it needs, the assignment gives up (None: its node is kept, never a guess).
    targets = [_node(f"t{i}", gpus=1) for i in range(7)]
    free = {t.name: 1 for t in targets}
    pods = [_pod(f"p{i}", "src") for i in range(8)]
    assert planning_packing._assign(pods, targets, dict(free), {"src": L4}) is None
    assert planning_packing._assign(pods[:7], targets, dict(free), {"src": L4}) is not None
    monkeypatch.setattr(planning_packing, "ASSIGN_STEPS", 3)
    assert planning_packing._assign(pods[:7], targets, dict(free), {"src": L4}) is None  # 7 placements > 3
