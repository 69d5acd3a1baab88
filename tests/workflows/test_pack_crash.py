"""Crash safety of a packing round (issue 23): on the real Karpenter (kwok provider) and the Temporal dev server,
an approved round runs in `kubeon-gpu worker` as its own process, and that process is SIGKILLed at each step of
the round: the pool frozen (our budget added), the node cordoned (its first eviction refused by the PDB), a pod
evicted (its replacement Pending), the node's NodeClaim deleted (not gone yet). A new worker resumes the round to
the same end: Done, exactly the planned node removed and the planned pods moved (each evicted once, no other),
no node left cordoned, the pool's budgets exactly the user's again, no node launched by Karpenter.

Each step is held by real state while the worker is killed, so that the kill lands there and not one step later:
the cordon refused to the optimizer by a ValidatingAdmissionPolicy, the eviction by the PDB, the replacement by a
taint on the kept nodes, the NodeClaim's removal by a finalizer of the test. The worker is killed only while no
activity or workflow task of the round runs in it (the workflow's pending activities, as the server describes
them): an activity killed mid-flight would be retried only at its start-to-close timeout (a minute)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import pytest
from kubernetes import client
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.api.enums.v1 import PendingWorkflowTaskState
from temporalio.client import Client
from temporalio.client import WorkflowFailureError
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.capacity.karpenter import KarpenterCapacity
from activities.clients.kube import KubeOps
from activities.packing import PackActivities
from models.capacity import FREEZE_BUDGET
from models.capacity import FROZEN_BY_ANNOTATION
from models.decisions import Approval
from models.packing import GroupRef
from models.packing import NodeRef2
from models.packing import PackPlanRequest
from models.packing import PackView
from models.packing import ReplacementCheck
from tests.harness import packing
from tests.harness.burst import BurstStack
from tests.harness.burst import WorkerProcesses
from tests.harness.burst import unique
from tests.harness.karpenter import KARPENTER_GROUP
from tests.harness.karpenter import KARPENTER_VERSION
from tests.harness.karpenter import Karpenter
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.packing import FAST
from tests.harness.packing import USER_BUDGETS
from tests.harness.packing import proposed_round
from tests.harness.packing import until_async
from tests.harness.rbac import OPTIMIZER_NAMESPACE
from tests.harness.rbac import OPTIMIZER_SA
from workflows.pack import PackWorkflow

pytestmark = [pytest.mark.cluster, pytest.mark.temporal]

# The round's waits long enough that the time a worker is down never stops it.
SETTINGS = FAST.model_copy(update={"replacement_timeout_seconds": 120, "removal_timeout_seconds": 120})
HOLD_KEY = "gpu.kubeon.io/pack-crash-hold"
OPTIMIZER_USER = f"system:serviceaccount:{OPTIMIZER_NAMESPACE}:{OPTIMIZER_SA}"


class Step(StrEnum):
    FROZEN = "frozen"  # the pool's disruption frozen, the node not cordoned yet
    CORDONED = "cordoned"  # the node cordoned, its first eviction refused (PDB), nothing evicted
    EVICTED = "evicted"  # one pod evicted, its replacement not Ready yet
    REMOVING = "removing"  # the node's NodeClaim deleted by the round, not gone yet


@pytest.fixture
def workers(stack: BurstStack, temporal_dev_server: WorkflowEnvironment) -> Iterator[WorkerProcesses]:
    queue = unique("pack-crash")
    settings = stack.settings(temporal_address=temporal_dev_server.client.service_client.config.target_host,
                              task_queue=queue, locations=[], cluster_name=queue, burst_enabled=False,
                              capacity_provider="karpenter")
    w = WorkerProcesses(settings, stack.workdir / f"{queue}.log")
    try:
        yield w
    finally:
        w.stop_all()


@pytest.fixture
def fragmented(cluster: Cluster, karpenter: Karpenter, namespace: str) -> Iterator[tuple[str, dict[str, int]]]:
    with packing.fragmented_pool(cluster, karpenter, namespace) as fragmented:
        yield fragmented


# -- what holds each step while the worker is killed (each release is idempotent and runs in `finally`) -----------

def _hold_cordon(cluster: Cluster, stack: BurstStack, node: str, *, uncordon: bool = False) -> Callable[[], None]:
    """A ValidatingAdmissionPolicy refusing the optimizer (only it) the cordon of ``node`` (``uncordon``: its
    uncordon): the round's cordon (uncordon) activity fails and is retried."""
    name = f"pack-crash-{uuid.uuid4().hex[:6]}"
    held = "has(object.spec.unschedulable) && object.spec.unschedulable"
    admission = client.AdmissionregistrationV1Api(cluster.admin.api)
    admission.create_validating_admission_policy(client.V1ValidatingAdmissionPolicy(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1ValidatingAdmissionPolicySpec(
            failure_policy="Fail",
            match_constraints=client.V1MatchResources(resource_rules=[client.V1NamedRuleWithOperations(
                api_groups=[""], api_versions=["v1"], operations=["UPDATE"], resources=["nodes"])]),
            match_conditions=[client.V1MatchCondition(
                name="the-optimizer", expression=f"request.userInfo.username == '{OPTIMIZER_USER}'")],
            validations=[client.V1Validation(
                expression=f"object.metadata.name != '{node}' || " + (f"({held})" if uncordon else f"!({held})"),
                message="the crash test holds this " + ("uncordon" if uncordon else "cordon"))])))
    admission.create_validating_admission_policy_binding(client.V1ValidatingAdmissionPolicyBinding(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1ValidatingAdmissionPolicyBindingSpec(policy_name=name, validation_actions=["Deny"])))
    refused = {"spec": {"unschedulable": not uncordon}}

    def change_refused() -> bool | None:
        try:
            stack.optimizer.core.patch_node(node, refused, dry_run="All")
        except client.ApiException as exc:
            if exc.status in (403, 422) and "ValidatingAdmissionPolicy" in str(exc.body):
                return True
            raise
        return None

    wait_for(change_refused, what=f"the optimizer's {'uncordon' if uncordon else 'cordon'} refused", retry_on=())

    def release() -> None:
        with contextlib.suppress(client.ApiException):
            admission.delete_validating_admission_policy_binding(name)
        with contextlib.suppress(client.ApiException):
            admission.delete_validating_admission_policy(name)
        wait_for(lambda: stack.optimizer.core.patch_node(node, refused, dry_run="All"),
                 what=f"the optimizer's {'uncordon' if uncordon else 'cordon'} allowed again")

    return release


def _hold_eviction(cluster: Cluster, namespace: str) -> Callable[[], None]:
    """The PDB ``serve`` allowing no disruption: the first eviction is refused (429), the node cordoned."""
    pdbs = cluster.admin.policy
    pdbs.patch_namespaced_pod_disruption_budget("serve", namespace, {"spec": {"maxUnavailable": 0}})
    wait_for(lambda: pdbs.read_namespaced_pod_disruption_budget("serve", namespace).status.disruptions_allowed == 0,
             what="the PDB allowing no disruption")

    def release() -> None:
        with contextlib.suppress(client.ApiException):
            pdbs.patch_namespaced_pod_disruption_budget("serve", namespace, {"spec": {"maxUnavailable": 1}})

    return release


def _hold_replacement(cluster: Cluster, kept: list[str]) -> Callable[[], None]:
    """A taint on the kept nodes that no pod tolerates: an evicted pod's replacement stays Pending (the pool is at
    its GPU limit, so Karpenter cannot launch a node for it either)."""
    core = cluster.admin.core

    def taints(node: client.V1Node) -> list[client.V1Taint]:
        return [t for t in node.spec.taints or [] if t.key != HOLD_KEY]

    for name in kept:
        node = core.read_node(name)
        core.patch_node(name, {"spec": {"taints": [*[core.api_client.sanitize_for_serialization(t)
                                                     for t in taints(node)],
                                                   {"key": HOLD_KEY, "value": "true", "effect": "NoSchedule"}]},
                               "metadata": {"resourceVersion": node.metadata.resource_version}})

    def release() -> None:
        for name in kept:
            with contextlib.suppress(client.ApiException):
                node = core.read_node(name)
                if any(t.key == HOLD_KEY for t in node.spec.taints or []):
                    core.patch_node(name, {"spec": {"taints": [core.api_client.sanitize_for_serialization(t)
                                                               for t in taints(node)]},
                                           "metadata": {"resourceVersion": node.metadata.resource_version}})

    return release


def _hold_removal(karpenter: Karpenter, claim: str) -> Callable[[], None]:
    """A finalizer of the test on the node's NodeClaim: once the round deletes it, Karpenter drains and removes the
    node and the instance, and the NodeClaim stays (deleting) until the finalizer is lifted."""
    custom = karpenter.custom
    found = karpenter.nodeclaim(claim)
    custom.patch_cluster_custom_object(KARPENTER_GROUP, KARPENTER_VERSION, "nodeclaims", claim, {"metadata": {
        "finalizers": [*found["metadata"].get("finalizers", []), HOLD_KEY],
        "resourceVersion": found["metadata"]["resourceVersion"]}})

    def release() -> None:
        def lifted() -> bool:
            try:
                current = karpenter.nodeclaim(claim)
            except client.ApiException as exc:
                if exc.status == 404:
                    return True
                raise
            finalizers = current["metadata"].get("finalizers", [])
            if HOLD_KEY not in finalizers:
                return True
            custom.patch_cluster_custom_object(KARPENTER_GROUP, KARPENTER_VERSION, "nodeclaims", claim, {"metadata": {
                "finalizers": [f for f in finalizers if f != HOLD_KEY],
                "resourceVersion": current["metadata"]["resourceVersion"]}})
            return True

        wait_for(lifted, what=f"the test's finalizer lifted from NodeClaim {claim}")

    return release


# -- watching the round ----------------------------------------------------------------------------------------------

async def _idle(handle: WorkflowHandle[Any, Any], *, backing_off: str | None = None) -> bool:
    """No activity or workflow task of the round runs in a worker now (killing it loses nothing in flight); with
    ``backing_off``, that activity is between two failed attempts, its next one at least half a second away."""
    raw = (await handle.describe()).raw_description
    if raw.HasField("pending_workflow_task") and (
            raw.pending_workflow_task.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_STARTED):
        return False
    if any(a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED for a in raw.pending_activities):
        return False
    if backing_off is None:
        return True
    now = dt.datetime.now(dt.UTC)
    return any(a.activity_type.name == backing_off and a.attempt >= 2 and a.HasField("next_attempt_schedule_time")
               and (a.next_attempt_schedule_time.ToDatetime(dt.UTC) - now).total_seconds() > 0.5
               for a in raw.pending_activities)


def _frozen_by(karpenter: Karpenter, pool: str) -> tuple[list[dict[str, Any]], str | None]:
    found = karpenter.nodepool(pool)
    return (found["spec"]["disruption"]["budgets"],
            (found["metadata"].get("annotations") or {}).get(FROZEN_BY_ANNOTATION))


def _gone(cluster: Cluster, namespace: str, key: str) -> bool:
    return key not in _serve_pods(cluster, namespace)


def _cordoned(cluster: Cluster, node: str) -> bool:
    return bool(cluster.admin.core.read_node(node).spec.unschedulable)


def _serve_pods(cluster: Cluster, namespace: str) -> dict[str, client.V1Pod]:
    return {f"{namespace}/{p.metadata.name}": p
            for p in cluster.admin.core.list_namespaced_pod(namespace, label_selector="app=serve").items}


@dataclasses.dataclass
class Round:
    handle: WorkflowHandle[Any, Any]
    target: str  # the one node the round empties
    planned: set[str]  # the pods it moves
    claims_before: dict[str, dict[str, Any]]
    pods_before: set[str]


async def _proposed_round(cluster: Cluster, karpenter: Karpenter, namespace: str, workers: WorkerProcesses,
                          temporal: Client, pool: str) -> Round:
    """A worker started and its round proposed (one node at most), with what was there before it."""
    claims_before = {c["metadata"]["name"]: c for c in karpenter.nodeclaims(pool)}
    pods_before = set(_serve_pods(cluster, namespace))
    workers.start(wait=True)
    handle, proposal = await proposed_round(temporal, workers.settings.task_queue, [pool], max_nodes=1,
                                            settings=SETTINGS)
    assert proposal.plan is not None
    [target] = proposal.plan.empty
    return Round(handle, target, {m.pod for m in proposal.plan.moves}, claims_before, pods_before)


@pytest.mark.parametrize("step", list(Step))
async def test_worker_killed_at_each_step_the_round_resumes_to_the_same_end(
        step: Step, cluster: Cluster, karpenter: Karpenter, stack: BurstStack, namespace: str,
        temporal_dev_server: WorkflowEnvironment, workers: WorkerProcesses,
        fragmented: tuple[str, dict[str, int]]) -> None:
    pool, spread = fragmented
    started = await _proposed_round(cluster, karpenter, namespace, workers, temporal_dev_server.client, pool)
    handle, target, planned = started.handle, started.target, started.planned
    claims_before, pods_before = started.claims_before, started.pods_before
    releases: list[Callable[[], None]] = []
    try:
        assert len(planned) == spread[target] and planned <= pods_before
        [claim] = [n for n, c in claims_before.items() if c["status"].get("nodeName") == target]
        kept = [n for n in spread if n != target]
        wid = handle.id
        frozen = [*USER_BUDGETS, FREEZE_BUDGET]
        if step == Step.FROZEN:
            releases.append(_hold_cordon(cluster, stack, target))
        elif step == Step.CORDONED:
            releases.append(_hold_eviction(cluster, namespace))
        elif step == Step.EVICTED:
            releases.append(_hold_replacement(cluster, kept))
        else:
            releases.append(_hold_removal(karpenter, claim))
        await handle.signal("approve", Approval(approver="test"))

        seen: list[str] = []

        async def at_step() -> bool:
            if _frozen_by(karpenter, pool) != (frozen, wid):
                return False
            state = await handle.query(PackWorkflow.state)
            seen.append(state.message)
            if step == Step.FROZEN:
                return not _cordoned(cluster, target) and await _idle(handle, backing_off="pack_cordon")
            if step == Step.CORDONED:
                return ("waits for PDB serve" in state.message and _cordoned(cluster, target)
                        and await _idle(handle))
            if step == Step.EVICTED:
                return "waiting for its replacement Ready" in state.message and await _idle(handle)
            deleting = karpenter.nodeclaim(claim)["metadata"].get("deletionTimestamp")
            return bool(deleting) and "removing it" in state.message and await _idle(handle)

        await until_async(at_step, what=f"the round at step {step}", timeout=90)
        workers.kill()
        # What the round left when its worker died, before a new one takes it up.
        assert _frozen_by(karpenter, pool) == (frozen, wid)
        pods = _serve_pods(cluster, namespace)
        gone = {k for k in pods_before if k not in pods or pods[k].metadata.deletion_timestamp is not None}
        if step in (Step.FROZEN, Step.CORDONED):
            assert _cordoned(cluster, target) == (step == Step.CORDONED)
            assert not gone
        elif step == Step.EVICTED:
            assert _cordoned(cluster, target) and len(gone) == 1 and gone <= planned, gone
            assert any(p.status.phase == "Pending" for p in pods.values())
        else:
            assert gone == planned
            assert karpenter.nodeclaim(claim)["metadata"].get("deletionTimestamp")
        # The server's view once the worker is dead: an activity still STARTED was in flight at the kill (a race
        # of milliseconds the test does not fail on: that activity is retried at its timeout, a minute later).
        in_flight = [a.activity_type.name for a in (await handle.describe()).raw_description.pending_activities
                     if a.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED]
        print(f"killed at {step}: {seen[-1]}; in flight: {in_flight or 'nothing'}")

        workers.start(wait=True)
        while releases:
            releases.pop()()
        view: PackView = await handle.result()
    finally:
        while releases:  # what a failed test still holds
            releases.pop()()
        with contextlib.suppress(Exception):
            await handle.terminate("the crash test ended")

    # The same end as without a crash.
    assert view.phase == "Done", view
    assert view.removed == [target]
    assert sorted(view.moved) == sorted(planned)
    assert len([line for line in view.history if ": evicted " in line]) == len(planned)
    # Exactly the planned pods were evicted, each once: every other pod is the one that was there; as many new pods
    # as moved ones (each its replacement), none on the removed node.
    after = {k: p for k, p in _serve_pods(cluster, namespace).items() if p.metadata.deletion_timestamp is None}
    assert pods_before - set(after) == planned
    assert len(set(after) - pods_before) == len(planned)
    assert target not in {p.spec.node_name for p in packing.wait_running(cluster, namespace, "serve", 6)}
    # Our NodeClaim is gone and Karpenter launched none; no node is cordoned; the budgets are the user's again.
    claims_after = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)}
    assert claims_after == set(claims_before) - {claim}
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))
    assert _frozen_by(karpenter, pool) == (USER_BUDGETS, None)


def test_each_activity_retried_after_its_effect_is_a_no_op(
        cluster: Cluster, karpenter: Karpenter, stack: BurstStack, namespace: str,
        fragmented: tuple[str, dict[str, int]]) -> None:
    """What a worker killed inside an activity, after its effect and before it reported, leaves: the activity
    retried (by the next worker, at its timeout). Each retry, with the chart's identity on the real Karpenter, is a
    no-op that reports what the first call did: one budget of ours, one cordon, a pod evicted once whose replacement
    is still waited for (terminating or gone by then), a NodeClaim deleted once, the budgets the user's again."""
    pool, spread = fragmented
    acts = PackActivities(KubeOps(stack.optimizer.api), KarpenterCapacity(stack.optimizer.api))
    plan = acts.pack_plan(PackPlanRequest(groups=[pool]))
    [target] = plan.empty
    ref, op = NodeRef2(node=target, group=pool), GroupRef(group=pool, operation="pack-crash-retries")
    claims_before = {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)}
    try:
        for _ in range(2):
            acts.pack_freeze(op)
            assert _frozen_by(karpenter, pool) == ([*USER_BUDGETS, FREEZE_BUDGET], op.operation)
            assert acts.pack_cordon(ref) and _cordoned(cluster, target)
        pods = acts.pack_pods_on_node(ref)
        before = set(_serve_pods(cluster, namespace))
        assert len(pods) == spread[target] and all(p.owner_uid and p.ready_before == 6 for p in pods), pods
        for moved, pod in enumerate(pods, start=1):
            first = acts.pack_evict_pod(pod)
            assert first.outcome == "evicted" and first.ready_before == 6, first
            again = acts.pack_evict_pod(pod)  # terminating, or gone already
            wait_for(functools.partial(_gone, cluster, namespace, pod.key), what=f"{pod.key} gone")
            gone = acts.pack_evict_pod(pod)
            for retried in (again, gone):
                assert (retried.owner_uid, retried.ready_before) == (first.owner_uid, first.ready_before), retried
            check = ReplacementCheck(pod=pod, owner_uid=gone.owner_uid, node=target, ready_before=gone.ready_before)
            wait_for(functools.partial(lambda c: acts.pack_replacement_ready(c).ready, check),
                     what=f"{pod.key}'s replacement Ready")
            replacements = [p for k, p in _serve_pods(cluster, namespace).items() if k not in before
                            and p.status.phase == "Running" and p.spec.node_name != target]
            assert len(replacements) == moved, "a replacement was reported Ready before it was"
        acts.pack_remove_node(ref)
        acts.pack_remove_node(ref)  # the NodeClaim deleting
        wait_for(lambda: acts.pack_node_gone(ref), what=f"{target} gone", timeout=120)
        acts.pack_remove_node(ref)  # gone
        assert {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)} < claims_before
        assert not acts.pack_uncordon(ref)  # the node is gone
    finally:
        for _ in range(2):
            acts.pack_unfreeze(op)
            assert _frozen_by(karpenter, pool) == (USER_BUDGETS, None)


async def test_worker_killed_while_a_cancelled_round_compensates_it_still_uncordons_and_unfreezes(
        cluster: Cluster, karpenter: Karpenter, stack: BurstStack, namespace: str,
        temporal_dev_server: WorkflowEnvironment, workers: WorkerProcesses,
        fragmented: tuple[str, dict[str, int]]) -> None:
    """Cancelled while it waits on a PDB (its node cordoned, its pool frozen), the round compensates; its worker is
    SIGKILLed while the uncordon is refused (held by a ValidatingAdmissionPolicy). The next worker finishes the
    compensation: the round ends Cancelled, the node uncordoned, the budgets the user's, nothing evicted or
    removed."""
    pool, _ = fragmented
    started = await _proposed_round(cluster, karpenter, namespace, workers, temporal_dev_server.client, pool)
    handle, target = started.handle, started.target
    releases: list[Callable[[], None]] = []
    try:
        releases.append(_hold_eviction(cluster, namespace))
        await handle.signal("approve", Approval(approver="test"))

        async def waiting_on_the_pdb() -> bool:
            state = await handle.query(PackWorkflow.state)
            return "waits for PDB serve" in state.message and _cordoned(cluster, target)

        await until_async(waiting_on_the_pdb, what="the round waiting on the PDB", timeout=90)
        releases.append(_hold_cordon(cluster, stack, target, uncordon=True))
        await handle.cancel()
        await until_async(lambda: _idle(handle, backing_off="pack_uncordon"), what="the uncordon refused, retried",
                          timeout=90)
        workers.kill()
        # What the compensation left when its worker died: still cordoned, still frozen by the round.
        assert _cordoned(cluster, target)
        assert _frozen_by(karpenter, pool) == ([*USER_BUDGETS, FREEZE_BUDGET], handle.id)

        workers.start(wait=True)
        while releases:
            releases.pop()()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    finally:
        while releases:
            releases.pop()()
        with contextlib.suppress(Exception):
            await handle.terminate("the crash test ended")
    state = await handle.query(PackWorkflow.state)
    assert state.phase == "Cancelled", state
    assert not [line for line in state.history if ": evicted " in line] and not state.removed
    assert not any(n.spec.unschedulable for n in karpenter.nodes(pool))
    assert _frozen_by(karpenter, pool) == (USER_BUDGETS, None)
    assert {c["metadata"]["name"] for c in karpenter.nodeclaims(pool)} == set(started.claims_before)
    assert set(_serve_pods(cluster, namespace)) == started.pods_before
