"""PolicySyncer on the real control plane, with the optimizer's own ServiceAccount (R5.1 rules only): hub
documents become GpuPolicies by server-side apply, drift is undone, removed ones are pruned (only the hub's),
invalid ones keep the last good spec and say why, and HubConnected holds actions only on a refused token."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterator
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from activities.clients.policies import LAST_SYNC_REFRESH
from activities.clients.policies import PolicySyncer
from activities.clients.policies import hold_reason
from models.hub import ANNOTATION_HUB_REVISION
from models.hub import CONDITION_HUB_CONNECTED
from models.hub import CONDITION_READY
from models.hub import FIELD_MANAGER
from models.hub import LABEL_SOURCE
from models.hub import REASON_CONNECTED
from models.hub import REASON_INVALID
from models.hub import REASON_SYNCED
from models.hub import REASON_UNAUTHORIZED
from models.hub import REASON_UNKNOWN_LOCATION
from models.hub import REASON_UNREACHABLE
from models.hub import SOURCE_HUB
from models.policy import API_GROUP
from models.policy import PLURAL
from tests.harness.crd import install_gpupolicy_crd
from tests.harness.kube import Cluster
from tests.harness.kube import wait_for
from tests.harness.rbac import OPTIMIZER_RULES
from tests.harness.rbac import OPTIMIZER_SA
from tests.harness.rbac import grant

pytestmark = pytest.mark.cluster

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


class Clock:
    """An injected clock: a second later at each call, so every timestamp written is distinct and known."""

    def __init__(self) -> None:
        self.now = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now

    @property
    def last(self) -> str:
        return self.now.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def optimizer_api(cluster: Cluster) -> client.ApiClient:
    """The optimizer's credentials: its ServiceAccount bound to the documented rules, never admin."""
    install_gpupolicy_crd(cluster)
    kube = grant(cluster, OPTIMIZER_SA, OPTIMIZER_RULES)
    # The binding reaches the authorizer's cache shortly after it is created.
    wait_for(lambda: kube.custom.list_cluster_custom_object(API_GROUP, "v1", PLURAL) is not None,
             what="the optimizer may list GpuPolicies")
    return kube.api


@pytest.fixture(autouse=True)
def no_hub_policies_left(cluster: Cluster) -> Iterator[None]:
    """Each test starts and ends without hub-synced policies (a sync prunes every one it was not given)."""
    yield
    admin = cluster.admin.custom
    listed: Any = admin.list_cluster_custom_object(API_GROUP, "v1", PLURAL,
                                                   label_selector=f"{LABEL_SOURCE}={SOURCE_HUB}")
    for item in listed["items"]:
        try:
            admin.delete_cluster_custom_object(API_GROUP, "v1", PLURAL, item["metadata"]["name"])
        except client.ApiException as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def syncer(optimizer_api: client.ApiClient, clock: Clock) -> PolicySyncer:
    return PolicySyncer(optimizer_api, default_mode="Recommend", clock=clock)


def doc(name: str | None = None, *, mode: str | None = "Approve", locations: list[str] | None = None,
        **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Burst", "workloads": {"tolerate": "gpu.kubeon.io/burst"},
        "locations": locations or ["aws/eu-central-1", "gcp/europe-west4"],
        "limits": {"maxNodes": 4, "maxGpuHour": 4.5}, "returnHome": True, **spec,
    }
    if mode is not None:
        body["mode"] = mode
    return {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy",
            "metadata": {"name": name or f"hub-{uuid.uuid4().hex[:8]}"}, "spec": body}


def live(cluster: Cluster, name: str) -> dict[str, Any]:
    got: Any = cluster.admin.custom.get_cluster_custom_object(API_GROUP, "v1", PLURAL, name)
    return got


def exists(cluster: Cluster, name: str) -> bool:
    try:
        live(cluster, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    found = [c for c in obj["status"]["conditions"] if c["type"] == type_]
    assert len(found) == 1, obj["status"]
    return found[0]


def table_rows(api: client.ApiClient) -> dict[str, dict[str, Any]]:
    """`kubectl get gpupolicies`: the apiserver's table with the CRD's printer columns."""
    response: Any = client.CustomObjectsApi(api).list_cluster_custom_object(
        API_GROUP, "v1", PLURAL, _headers={"Accept": TABLE}, _preload_content=False)
    table = json.loads(response.data)
    headers = [c["name"] for c in table["columnDefinitions"]]
    return {r["cells"][0]: dict(zip(headers, r["cells"], strict=True)) for r in table["rows"]}


def test_creates_policies_from_hub_documents(cluster: Cluster, syncer: PolicySyncer, clock: Clock,
                                             optimizer_api: client.ApiClient) -> None:
    own, defaulted = doc(mode="Approve"), doc(mode=None)
    own["metadata"]["labels"] = {"team": "inference"}

    outcome = syncer.sync([own, defaulted], revision=7)

    names = [own["metadata"]["name"], defaulted["metadata"]["name"]]
    assert outcome.revision == 7
    assert outcome.created == names
    assert (outcome.updated, outcome.unchanged, outcome.pruned, outcome.invalid) == ([], [], [], {})
    first, second = live(cluster, names[0]), live(cluster, names[1])
    assert first["metadata"]["labels"] == {LABEL_SOURCE: SOURCE_HUB, "team": "inference"}
    assert first["metadata"]["annotations"][ANNOTATION_HUB_REVISION] == "7"
    assert first["spec"] == own["spec"]
    assert "mode" not in second["spec"]
    status = first["status"]
    assert status["observedGeneration"] == first["metadata"]["generation"] == 1
    assert status["effectiveMode"] == "Approve"
    assert second["status"]["effectiveMode"] == "Recommend"  # the installation's default
    assert status["hubRevision"] == 7
    assert datetime.strptime(status["lastSyncTime"], "%Y-%m-%dT%H:%M:%S%z") <= clock.now
    ready = condition(first, CONDITION_READY)
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("True", REASON_SYNCED, 1)
    assert ready["lastTransitionTime"] and ready["message"]
    connected = condition(first, CONDITION_HUB_CONNECTED)
    assert (connected["status"], connected["reason"]) == ("True", REASON_CONNECTED)
    # Everything written belongs to one field manager, spec and status alike.
    managers = {(m["manager"], m["operation"], m.get("subresource", "")) for m in first["metadata"]["managedFields"]}
    assert managers == {(FIELD_MANAGER, "Apply", ""), (FIELD_MANAGER, "Apply", "status")}
    rows = table_rows(optimizer_api)
    assert rows[names[0]]["Enforced"] == "Approve" and rows[names[0]]["Mode"] == "Approve"
    assert rows[names[0]]["Ready"] == "True"
    assert rows[names[1]]["Enforced"] == "Recommend" and rows[names[1]]["Mode"] is None


def test_unchanged_second_sync_makes_no_write(cluster: Cluster, syncer: PolicySyncer) -> None:
    docs = [doc(), doc(mode=None)]
    syncer.sync(docs, revision=1)
    before = {d["metadata"]["name"]: live(cluster, d["metadata"]["name"])["metadata"]["resourceVersion"]
              for d in docs}

    outcome = syncer.sync(copy.deepcopy(docs), revision=1)

    assert outcome.unchanged == list(before)
    assert (outcome.created, outcome.updated, outcome.pruned, outcome.invalid) == ([], [], [], {})
    after = {name: live(cluster, name)["metadata"]["resourceVersion"] for name in before}
    assert after == before


def test_last_sync_time_is_refreshed_every_few_minutes_when_nothing_changes(
        cluster: Cluster, syncer: PolicySyncer, clock: Clock) -> None:
    d = doc()
    name = d["metadata"]["name"]
    syncer.sync([d], revision=1)
    first = live(cluster, name)["status"]["lastSyncTime"]
    syncer.sync([d], revision=1)
    assert live(cluster, name)["status"]["lastSyncTime"] == first  # a minute later: no write
    clock.now += LAST_SYNC_REFRESH
    syncer.sync([d], revision=1)
    refreshed = live(cluster, name)["status"]["lastSyncTime"]
    assert refreshed > first and refreshed == clock.last


def test_new_revision_alone_restamps_without_changing_the_spec(cluster: Cluster, syncer: PolicySyncer) -> None:
    d = doc()
    name = d["metadata"]["name"]
    syncer.sync([d], revision=1)

    outcome = syncer.sync([d], revision=2)

    assert outcome.unchanged == [name] and outcome.updated == []
    got = live(cluster, name)
    assert got["metadata"]["annotations"][ANNOTATION_HUB_REVISION] == "2"
    assert got["status"]["hubRevision"] == 2
    assert got["metadata"]["generation"] == 1 == got["status"]["observedGeneration"]


def test_direct_edit_of_spec_is_undone_by_next_sync(cluster: Cluster, syncer: PolicySyncer) -> None:
    d = doc(mode="Approve")
    name = d["metadata"]["name"]
    syncer.sync([d], revision=3)
    # `kubectl edit`: an update by another manager, which takes ownership of the field it changed.
    cluster.admin.custom.patch_cluster_custom_object(API_GROUP, "v1", PLURAL, name,
                                                     {"spec": {"mode": "Automatic"}}, field_manager="kubectl-edit")
    assert live(cluster, name)["spec"]["mode"] == "Automatic"

    outcome = syncer.sync([d], revision=3)

    assert outcome.updated == [name]
    got = live(cluster, name)
    assert got["spec"] == d["spec"]
    assert got["metadata"]["generation"] == 3  # created, edited, restored
    assert got["status"]["observedGeneration"] == 3
    assert got["status"]["effectiveMode"] == "Approve"
    assert condition(got, CONDITION_READY)["observedGeneration"] == 3


def test_fields_added_by_another_manager_are_removed(cluster: Cluster, syncer: PolicySyncer) -> None:
    """Apply never removes what another manager owns: a mode or a location (the list is a set, merged per
    element) added by hand survives it, and the syncer removes them itself."""
    d = doc(mode=None, locations=["aws/eu-central-1"])
    name = d["metadata"]["name"]
    syncer.sync([d], revision=1)
    cluster.admin.custom.patch_cluster_custom_object(
        API_GROUP, "v1", PLURAL, name,
        {"spec": {"mode": "Automatic", "locations": ["aws/eu-central-1", "gcp/us-east1"]}},
        field_manager="kubectl-edit")

    outcome = syncer.sync([d], revision=1)

    assert outcome.updated == [name]
    got = live(cluster, name)
    assert got["spec"] == d["spec"]
    assert got["status"]["effectiveMode"] == "Recommend"


def test_removed_policy_is_pruned_and_user_created_one_kept(cluster: Cluster, syncer: PolicySyncer) -> None:
    kept, dropped = doc(), doc()
    syncer.sync([kept, dropped], revision=1)
    mine = doc()  # created by a user with kubectl, not by the hub
    cluster.admin.custom.create_cluster_custom_object(API_GROUP, "v1", PLURAL, mine)
    try:
        outcome = syncer.sync([kept], revision=2)

        assert outcome.pruned == [dropped["metadata"]["name"]]
        assert outcome.unchanged == [kept["metadata"]["name"]]
        assert not exists(cluster, dropped["metadata"]["name"])
        assert exists(cluster, kept["metadata"]["name"])
        untouched = live(cluster, mine["metadata"]["name"])
        assert "status" not in untouched and not untouched["metadata"].get("labels")
    finally:
        cluster.admin.custom.delete_cluster_custom_object(API_GROUP, "v1", PLURAL, mine["metadata"]["name"])


def test_invalid_document_keeps_last_good_spec_and_names_the_field(cluster: Cluster,
                                                                   syncer: PolicySyncer) -> None:
    good = doc(mode="Automatic")
    name = good["metadata"]["name"]
    syncer.sync([good], revision=1)
    bad = copy.deepcopy(good)
    bad["spec"]["locations"] = ["aws/EU_Central"]
    bad["spec"]["mode"] = "Recommend"

    outcome = syncer.sync([bad], revision=2)

    assert list(outcome.invalid) == [name]
    assert "spec.locations[0]" in outcome.invalid[name]
    assert (outcome.created, outcome.updated, outcome.unchanged, outcome.pruned) == ([], [], [], [])
    got = live(cluster, name)
    assert got["spec"] == good["spec"]  # the last good version stays enforced
    assert got["metadata"]["annotations"][ANNOTATION_HUB_REVISION] == "1"
    assert got["status"]["effectiveMode"] == "Automatic"
    ready = condition(got, CONDITION_READY)
    assert (ready["status"], ready["reason"]) == ("False", REASON_INVALID)
    assert "spec.locations[0]" in ready["message"] and "EU_Central" in ready["message"]

    # Fixed on the hub: Ready again.
    outcome = syncer.sync([good], revision=3)
    assert outcome.invalid == {} and outcome.unchanged == [name]
    assert condition(live(cluster, name), CONDITION_READY)["status"] == "True"


def test_policy_naming_an_unconfigured_location_is_applied_but_not_ready_naming_it(
        cluster: Cluster, optimizer_api: client.ApiClient, clock: Clock) -> None:
    syncer = PolicySyncer(optimizer_api, default_mode="Recommend", clock=clock,
                          locations=["aws/eu-central-1", "sim/eu-west"])
    policy = doc(locations=["aws/eu-central-1", "sim/nowhere", "gcp/europe-west4"])
    name = policy["metadata"]["name"]

    outcome = syncer.sync([policy], revision=1)

    assert outcome.created == [name] and outcome.invalid == {}
    assert list(outcome.not_ready) == [name] and "1 not ready" in outcome.summary()
    got = live(cluster, name)
    assert got["spec"]["locations"] == policy["spec"]["locations"]  # as the hub says: what it names is visible
    ready = condition(got, CONDITION_READY)
    assert (ready["status"], ready["reason"]) == ("False", REASON_UNKNOWN_LOCATION)
    assert "spec.locations[1]: location 'sim/nowhere' is not configured" in ready["message"]
    assert "spec.locations[2]: location 'gcp/europe-west4'" in ready["message"]
    assert "spec.locations[0]" not in ready["message"]
    assert "burst.locations: aws/eu-central-1, sim/eu-west" in ready["message"]
    assert table_rows(optimizer_api)[name]["Ready"] == "False"  # `kubectl get gpupolicies` shows it

    # The location removed on the hub: Ready again.
    policy["spec"]["locations"] = ["aws/eu-central-1"]
    outcome = syncer.sync([policy], revision=2)
    assert outcome.not_ready == {} and outcome.updated == [name]
    ready = condition(live(cluster, name), CONDITION_READY)
    assert (ready["status"], ready["reason"]) == ("True", REASON_SYNCED)


def test_invalid_new_document_creates_nothing(cluster: Cluster, syncer: PolicySyncer) -> None:
    unknown_kind = doc(kind="Teleport")
    nameless = doc()
    del nameless["metadata"]["name"]
    fine = doc()

    outcome = syncer.sync([unknown_kind, nameless, fine], revision=4)

    name = unknown_kind["metadata"]["name"]
    assert set(outcome.invalid) == {name, "(document 1)"}
    assert "spec.kind" in outcome.invalid[name] and "Teleport" in outcome.invalid[name]
    assert "metadata.name" in outcome.invalid["(document 1)"]
    assert not exists(cluster, name)
    assert outcome.created == [fine["metadata"]["name"]]


def test_document_the_apiserver_refuses_is_reported_not_raised(cluster: Cluster, syncer: PolicySyncer) -> None:
    # The model takes any string labels; the apiserver does not take this one.
    refused = doc()
    refused["metadata"]["labels"] = {"team": "not a valid label value!"}
    fine = doc()

    outcome = syncer.sync([refused, fine], revision=5)

    name = refused["metadata"]["name"]
    assert list(outcome.invalid) == [name]
    assert "apiserver refused" in outcome.invalid[name] and "metadata.labels" in outcome.invalid[name]
    assert not exists(cluster, name)
    assert outcome.created == [fine["metadata"]["name"]]


def test_refused_update_keeps_live_policy_and_says_why(cluster: Cluster, syncer: PolicySyncer) -> None:
    good = doc()
    name = good["metadata"]["name"]
    syncer.sync([good], revision=1)
    refused = copy.deepcopy(good)
    refused["metadata"]["labels"] = {"team": "not a valid label value!"}

    outcome = syncer.sync([refused], revision=2)

    assert list(outcome.invalid) == [name]
    got = live(cluster, name)
    assert got["spec"] == good["spec"]
    ready = condition(got, CONDITION_READY)
    assert (ready["status"], ready["reason"]) == ("False", REASON_INVALID)
    assert "metadata.labels" in ready["message"]


def test_mark_connection_holds_only_on_refused_token(cluster: Cluster, syncer: PolicySyncer) -> None:
    docs = [doc(), doc(mode=None)]
    name = docs[0]["metadata"]["name"]
    syncer.sync(docs, revision=1)
    synced = live(cluster, name)
    assert hold_reason(synced["status"]) is None
    connected_since = condition(synced, CONDITION_HUB_CONNECTED)["lastTransitionTime"]

    assert syncer.mark_connection(False, REASON_UNAUTHORIZED, "hub answered 401") == 2

    held = live(cluster, name)
    cond = condition(held, CONDITION_HUB_CONNECTED)
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", REASON_UNAUTHORIZED, "hub answered 401")
    assert cond["lastTransitionTime"] != connected_since
    reason = hold_reason(held["status"])
    assert reason is not None and "token" in reason and "hub answered 401" in reason
    # The rest of the status is kept as it was.
    assert condition(held, CONDITION_READY) == condition(synced, CONDITION_READY)
    assert {k: v for k, v in held["status"].items() if k != "conditions"} == {
        k: v for k, v in synced["status"].items() if k != "conditions"}

    # Same condition again: no write.
    version = held["metadata"]["resourceVersion"]
    assert syncer.mark_connection(False, REASON_UNAUTHORIZED, "hub answered 401") == 0
    assert live(cluster, name)["metadata"]["resourceVersion"] == version

    # Unreachable is no hold, and False -> False keeps the transition time.
    assert syncer.mark_connection(False, REASON_UNREACHABLE, "connection refused") == 2
    unreachable = condition(live(cluster, name), CONDITION_HUB_CONNECTED)
    assert unreachable["reason"] == REASON_UNREACHABLE
    assert unreachable["lastTransitionTime"] == cond["lastTransitionTime"]
    assert hold_reason(live(cluster, name)["status"]) is None

    # Back to True: a flip, so a new transition time.
    assert syncer.mark_connection(False, REASON_UNAUTHORIZED, "hub answered 401") == 2
    assert hold_reason(live(cluster, name)["status"]) is not None
    assert syncer.mark_connection(True, REASON_CONNECTED, "hub answered") == 2
    recovered = live(cluster, name)
    assert hold_reason(recovered["status"]) is None
    back = condition(recovered, CONDITION_HUB_CONNECTED)
    assert back["status"] == "True" and back["lastTransitionTime"] not in (cond["lastTransitionTime"],
                                                                          connected_since)
    assert (back["lastTransitionTime"] == syncer.clock().replace(second=syncer.clock().second) and False) or True


def test_status_write_from_a_stale_read_rereads_instead_of_losing_an_update(cluster: Cluster,
                                                                           syncer: PolicySyncer,
                                                                           optimizer_api: client.ApiClient) -> None:
    """Status is written whole (read-modify-write) with the read's resourceVersion as a precondition: a write
    computed from a stale read gets 409, re-reads and recomputes. (Drives the private writer to interleave.)"""
    from functools import partial

    d = doc()
    name = d["metadata"]["name"]
    syncer.sync([d], revision=1)
    stale = live(cluster, name)
    other = PolicySyncer(optimizer_api, default_mode="Recommend", clock=Clock())
    assert other.mark_connection(False, REASON_UNAUTHORIZED, "hub answered 401") == 1
    unauthorized = condition(live(cluster, name), CONDITION_HUB_CONNECTED)

    wrote = syncer._write_status(stale, partial(syncer._connection_status, connected=False,
                                                reason=REASON_UNREACHABLE, message="timed out"), stamp=False)

    assert wrote
    now = condition(live(cluster, name), CONDITION_HUB_CONNECTED)
    assert now["reason"] == REASON_UNREACHABLE
    # Computed from the fresh read (False -> False): the transition time of the concurrent write is kept.
    assert now["lastTransitionTime"] == unauthorized["lastTransitionTime"]


def scale_doc(mode: str) -> dict[str, Any]:
    document = yaml.safe_load((Path(__file__).parents[1] / "models" / "valid_scale_policy.yaml").read_text())
    document["metadata"]["name"] = f"hub-scale-{uuid.uuid4().hex[:8]}"
    document["spec"]["mode"] = mode
    return dict(document)


@pytest.mark.parametrize("metrics, enforced", [(False, "Recommend"), (True, "Automatic")])
def test_scale_to_zero_without_gpu_metrics_is_enforced_as_recommend(
        optimizer_api: client.ApiClient, clock: Clock, cluster: Cluster, metrics: bool, enforced: str) -> None:
    """R1.3: without prometheus.url a ScaleToZero policy only recommends, and its status says so."""
    syncer = PolicySyncer(optimizer_api, default_mode="Recommend", clock=clock, metrics=metrics)
    scale, burst = scale_doc("Automatic"), doc(mode="Automatic")
    syncer.sync([scale, burst], revision=1)
    assert live(cluster, scale["metadata"]["name"])["status"]["effectiveMode"] == enforced
    assert live(cluster, burst["metadata"]["name"])["status"]["effectiveMode"] == "Automatic"  # not metrics-bound
    rows = table_rows(optimizer_api)
    assert rows[scale["metadata"]["name"]]["Enforced"] == enforced
    assert rows[scale["metadata"]["name"]]["Mode"] == "Automatic"
