"""The local Compute Engine API, driven by google-cloud-compute's REST transport: a wrong shape fails here first."""

from __future__ import annotations

from typing import Any

import pytest
from google.api_core import exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from tests.harness.clouds.fake import FakeServer

PROJECT = "acme-ml"
ZONE = "europe-west4-a"


@pytest.fixture(scope="module")
def server(gcp_server: FakeServer) -> FakeServer:
    return gcp_server


@pytest.fixture
def gcp(server: FakeServer) -> dict[str, Any]:
    server.reset()
    options = {"api_endpoint": server.url}
    creds = AnonymousCredentials()
    return {"instances": compute_v1.InstancesClient(credentials=creds, transport="rest", client_options=options),
            "ops": compute_v1.ZoneOperationsClient(credentials=creds, transport="rest", client_options=options),
            "types": compute_v1.MachineTypesClient(credentials=creds, transport="rest", client_options=options)}


def _insert(gcp: dict[str, Any], name: str, *, zone: str = ZONE, request_id: str = "",
            labels: dict[str, str] | None = None) -> compute_v1.Operation:
    body = compute_v1.Instance(
        name=name, machine_type=f"zones/{zone}/machineTypes/g2-standard-4", labels=labels or {"kubeon-burst": "p"},
        scheduling=compute_v1.Scheduling(on_host_maintenance="TERMINATE"),
        metadata=compute_v1.Metadata(items=[compute_v1.Items(key="user-data", value="#cloud-config\n")]))
    return gcp["instances"].insert_unary(request=compute_v1.InsertInstanceRequest(
        project=PROJECT, zone=zone, instance_resource=body, request_id=request_id or None))


def _done(gcp: dict[str, Any], op: compute_v1.Operation, zone: str = ZONE) -> compute_v1.Operation:
    while op.status != compute_v1.Operation.Status.DONE:
        op = gcp["ops"].wait(project=PROJECT, zone=zone, operation=op.name)
    return op


def test_insert_runs_an_operation_then_the_instance_is_running(gcp: dict[str, Any], server: FakeServer) -> None:
    op = _insert(gcp, "vm-1")
    assert op.status in (compute_v1.Operation.Status.RUNNING, compute_v1.Operation.Status.DONE)
    assert gcp["instances"].get(project=PROJECT, zone=ZONE, instance="vm-1").status in ("PROVISIONING", "RUNNING")
    done = _done(gcp, op)
    assert not done.error.errors and done.operation_type == "insert"
    inst = gcp["instances"].get(project=PROJECT, zone=ZONE, instance="vm-1")
    assert inst.status == "RUNNING" and inst.labels == {"kubeon-burst": "p"}
    assert inst.metadata.items[0].key == "user-data"
    insert = next(r for r in server.requests() if r["method"] == "POST" and r["path"].endswith("/instances"))
    assert insert["path"] == f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instances"
    assert insert["body"]["scheduling"]["onHostMaintenance"] == "TERMINATE"


def test_gpu_machine_type_without_terminate_on_maintenance_is_refused(gcp: dict[str, Any]) -> None:
    body = compute_v1.Instance(name="vm-2", machine_type=f"zones/{ZONE}/machineTypes/g2-standard-4")
    with pytest.raises(exceptions.BadRequest, match="live migration"):
        gcp["instances"].insert_unary(project=PROJECT, zone=ZONE, instance_resource=body)


def test_same_request_id_is_the_same_operation_and_one_instance(gcp: dict[str, Any], server: FakeServer) -> None:
    first = _insert(gcp, "vm-3", request_id="8a1d7e0c-0000-4000-8000-000000000001")
    again = _insert(gcp, "vm-3", request_id="8a1d7e0c-0000-4000-8000-000000000001")
    assert again.name == first.name
    assert len(server.state()["instances"]) == 1
    with pytest.raises(exceptions.Conflict):
        _insert(gcp, "vm-3")


def test_label_filter_is_applied_by_the_server_with_pages(gcp: dict[str, Any]) -> None:
    for n in range(5):
        _insert(gcp, f"vm-{n}", labels={"kubeon-burst": "a" if n % 2 else "b", "kubeon-operation": f"op-{n}"})
    request = compute_v1.ListInstancesRequest(project=PROJECT, zone=ZONE, max_results=1,
                                              filter='(labels.kubeon-burst = "b")')
    pager = gcp["instances"].list(request=request)
    assert sorted(i.name for i in pager) == ["vm-0", "vm-2", "vm-4"]
    agg = gcp["instances"].aggregated_list(request=compute_v1.AggregatedListInstancesRequest(
        project=PROJECT, filter='(labels.kubeon-burst:*) AND (labels.kubeon-operation = "op-3")'))
    found = [(scope, i.name) for scope, scoped in agg for i in scoped.instances]
    assert found == [(f"zones/{ZONE}", "vm-3")]


def test_stockout_is_an_operation_done_with_error(gcp: dict[str, Any], server: FakeServer) -> None:
    server.fault(stockout_zones=[ZONE])
    done = _done(gcp, _insert(gcp, "vm-s"))
    assert done.http_error_status_code == 503
    assert done.error.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"
    with pytest.raises(exceptions.NotFound, match="was not found"):
        gcp["instances"].get(project=PROJECT, zone=ZONE, instance="vm-s")
    assert not _done(gcp, _insert(gcp, "vm-s", zone="europe-west4-b"), "europe-west4-b").error.errors


def test_quota_is_a_403_naming_the_quota(gcp: dict[str, Any], server: FakeServer) -> None:
    server.fault(quota={"metric": "NVIDIA_L4_GPUS"})
    with pytest.raises(exceptions.Forbidden, match="Quota 'NVIDIA_L4_GPUS' exceeded") as err:
        _insert(gcp, "vm-q")
    assert err.value.errors[0]["reason"] == "quotaExceeded"


def test_nth_call_fails_once_with_a_server_error(gcp: dict[str, Any], server: FakeServer) -> None:
    server.fault(fail_nth={"n": 2, "status": 500})
    _insert(gcp, "vm-n")
    with pytest.raises(exceptions.InternalServerError):
        gcp["instances"].get(project=PROJECT, zone=ZONE, instance="vm-n", retry=None)
    assert gcp["instances"].get(project=PROJECT, zone=ZONE, instance="vm-n").name == "vm-n"


def test_delete_then_not_found(gcp: dict[str, Any]) -> None:
    _done(gcp, _insert(gcp, "vm-d"))
    op = gcp["instances"].delete_unary(project=PROJECT, zone=ZONE, instance="vm-d")
    _done(gcp, op)
    with pytest.raises(exceptions.NotFound):
        gcp["instances"].get(project=PROJECT, zone=ZONE, instance="vm-d")


def test_machine_types_aggregated_with_regex_filter(gcp: dict[str, Any]) -> None:
    pager = gcp["types"].aggregated_list(request=compute_v1.AggregatedListMachineTypesRequest(
        project=PROJECT, filter="name eq 'g2-standard-4|a3-highgpu-8g'"))
    found = {(scope, mt.name) for scope, scoped in pager for mt in scoped.machine_types}
    assert (f"zones/{ZONE}", "g2-standard-4") in found and (f"zones/{ZONE}", "a3-highgpu-8g") in found
    assert {name for _, name in found} == {"g2-standard-4", "a3-highgpu-8g"}


def test_unparsable_filter_is_a_400(gcp: dict[str, Any]) -> None:
    with pytest.raises(exceptions.BadRequest, match="filter"):
        list(gcp["instances"].list(request=compute_v1.ListInstancesRequest(
            project=PROJECT, zone=ZONE, filter="labels.x = (")))


def test_an_instance_reads_its_signed_identity_from_the_metadata_server(gcp: dict[str, Any],
                                                                        server: FakeServer) -> None:
    """Issue 27: the node's identity token (the gateway as audience), verified by the gateway's own code against
    the server's CA; its zone's region is the ticket's or the join is refused."""
    from gateway.attestation import AttestationVerifier
    from gateway.attestation import load_roots
    from models.errors import JoinRefused
    from node.identity import fetch_attestation

    _done(gcp, _insert(gcp, "attested-1"))
    iid = gcp["instances"].get(project=PROJECT, zone=ZONE, instance="attested-1").id
    doc = {"attestation": {"method": "gcp", "audience": "https://gw.test"},
           "metadataUrl": f"{server.url}/_fake/metadata/{iid}"}
    attestation = fetch_attestation(doc)
    verifier = AttestationVerifier(roots={"gcp": load_roots(server.identity_ca()["signer"])},
                                   accounts={"gcp": PROJECT}, audience="https://gw.test")
    got = verifier.verify(attestation, "gcp/europe-west4")
    assert (got.zone, got.instance_id, got.account) == (ZONE, str(iid), PROJECT)
    with pytest.raises(JoinRefused) as err:
        verifier.verify(attestation, "gcp/us-central1")
    assert err.value.code == "location_mismatch"
