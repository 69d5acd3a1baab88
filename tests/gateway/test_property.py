"""A hostile corpus for the gateway (hypothesis): generated sequences of ticket issues, redemptions (the right
node, other keys, forged or tampered tickets, CSRs of every wrong shape, malformed bodies), registrations,
reconcile passes, removals, redemptions after removal and concurrent redemptions of one ticket, against a real
``KubeGateway`` on the real control plane, redemptions through its HTTP app. After every sequence: no Node
without a live slot, no slot without a Node or a live reservation, no certificate for a name outside the burst
scheme (nor for another node than its ticket's), a ticket never redeems after its node was removed, and no
answer is a 5xx."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import Final

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from fastapi.testclient import TestClient
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from kubernetes import client

from activities.providers.sim import KWOK_ANNOTATIONS
from gateway.app import TokenReviewer
from gateway.app import create_app
from gateway.service import KubeGateway
from models.errors import JoinRefused
from models.errors import TicketError
from models.join import JoinAnswer
from models.join import burst_node_name_problem
from node.join import NodeFiles
from tests.gateway.helpers import delete_nodes
from tests.gateway.helpers import gateway
from tests.gateway.helpers import ticket_request
from tests.harness.joining import csr
from tests.harness.joining import node_client
from tests.harness.joining import redeem_for
from tests.harness.joining import register_self
from tests.harness.joining import weak_rsa_csr
from tests.harness.kube import Cluster

pytestmark = pytest.mark.cluster

EXAMPLES: Final = 30  # sequences of up to 7 steps (each join a real CSR signed): ~35 s on a 2-core machine

CSR_SHAPES: Final = ("right", "other_node", "control_plane", "san", "weak_rsa", "no_org", "garbage")
TICKET_SHAPES: Final = ("right", "tampered", "truncated", "random", "empty")
BODY_SHAPES: Final = ("right", "missing_csr", "wrong_types", "extra_field", "huge_key")

STEP = st.one_of(
    st.just(("issue",)),
    st.tuples(st.just("redeem"), st.integers(0, 3), st.integers(0, 2), st.sampled_from(CSR_SHAPES),
              st.sampled_from(TICKET_SHAPES), st.sampled_from(BODY_SHAPES)),
    st.tuples(st.just("redeem"), st.integers(0, 3), st.integers(0, 2), st.just("right"), st.just("right"),
              st.just("right")),
    st.tuples(st.just("concurrent"), st.integers(0, 3), st.booleans()),
    st.just(("register",)),
    st.just(("reconcile",)),
    st.just(("remove",)),
)


@dataclass
class Run:
    """One sequence's state: the node and operation it is about, the tickets issued, the node key sets."""

    gw: KubeGateway
    http: TestClient
    files: list[NodeFiles]
    req: Any
    tickets: list[str] = field(default_factory=list)
    answers: dict[int, JoinAnswer] = field(default_factory=dict)  # per key set
    removed: bool = False
    redeemed_after_removal: list[str] = field(default_factory=list)
    five_hundreds: list[str] = field(default_factory=list)


def shaped_csr(shape: str, run: Run, keys: int) -> str:
    node = run.req.node_name
    if shape == "right":
        return redeem_for(run.files[keys], "x", node).csr
    return {"other_node": lambda: csr("burst-someone-else"), "control_plane": lambda: csr("kube-cp-1"),
            "san": lambda: csr(node, dns=("kubernetes.default.svc",)), "weak_rsa": lambda: weak_rsa_csr(node),
            "no_org": lambda: csr(node, org=""), "garbage": lambda: "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n"}[
        shape]()


def shaped_ticket(shape: str, ticket: str) -> str:
    body, _, sig = ticket.partition(".")
    return {"right": ticket, "tampered": f"{body[:-2]}AA.{sig}", "truncated": ticket[: len(ticket) // 2],
            "random": uuid.uuid4().hex + "." + uuid.uuid4().hex, "empty": ""}[shape]


def body_of(run: Run, ticket: str, keys: int, csr_shape: str, ticket_shape: str, body_shape: str) -> Any:
    body: dict[str, Any] = redeem_for(run.files[keys], ticket, run.req.node_name).model_dump(mode="json",
                                                                                          by_alias=True)
    body["csr"] = shaped_csr(csr_shape, run, keys)
    body["ticket"] = shaped_ticket(ticket_shape, ticket)
    if body_shape == "missing_csr":
        del body["csr"]
    elif body_shape == "wrong_types":
        body["usages"] = {"a": 2**64}
    elif body_shape == "extra_field":
        body["nodeName"] = "kube-cp-1"
    elif body_shape == "huge_key":
        body["wireguardPublicKey"] = "A" * 5000
    return body


def check_answer(run: Run, status: int, payload: Any, what: str) -> None:
    if status >= 500:
        run.five_hundreds.append(f"{what}: {status} {payload}")
    if status == 200:
        if run.removed:
            run.redeemed_after_removal.append(what)
        cert = x509.load_pem_x509_certificate(payload["certificate"].encode())
        (value,) = [a.value for a in cert.subject if a.oid == NameOID.COMMON_NAME]
        cn = value.decode() if isinstance(value, bytes) else value
        name = cn.removeprefix("system:node:")
        assert not burst_node_name_problem(name), f"certificate for {cn} outside the burst scheme"
        assert name == run.req.node_name, f"certificate for {cn}, the ticket names {run.req.node_name}"
        assert payload["nodeName"] == run.req.node_name


def redeem_http(run: Run, body: Any, what: str) -> None:
    response = run.http.post("/v1/join", content=json.dumps(body))
    payload = response.json()
    check_answer(run, response.status_code, payload, what)
    if response.status_code == 200:
        run.answers[int(what.split("keys=")[1])] = JoinAnswer.model_validate(payload)


def redeem_direct(run: Run, ticket: str, keys: int) -> tuple[int, Any]:
    """In-process (threads), classified as the HTTP app answers."""
    try:
        answer = run.gw.join(redeem_for(run.files[keys], ticket, run.req.node_name))
    except TicketError as exc:
        return (409 if exc.code == "node_exists" else 403), exc.code
    except JoinRefused as exc:
        return exc.status, exc.code
    except client.ApiException as exc:
        return (502 if exc.status >= 500 else exc.status), str(exc.reason)
    run.answers[keys] = answer
    return 200, answer.model_dump(mode="json", by_alias=True)


def step(run: Run, cluster: Cluster, action: tuple[Any, ...]) -> None:
    kind = action[0]
    if kind == "issue":
        try:
            run.tickets.append(run.gw.issue_ticket(run.req).ticket)
        except JoinRefused as exc:  # e.g. the removed node re-created: no ticket names an existing node
            assert exc.status < 500 or exc.code == "addresses_exhausted", exc
        return
    if kind in ("redeem", "concurrent") and not run.tickets:
        return
    if kind == "redeem":
        _, index, keys, csr_shape, ticket_shape, body_shape = action
        ticket = run.tickets[index % len(run.tickets)]
        shapes = f"csr={csr_shape} ticket={ticket_shape} body={body_shape}"
        redeem_http(run, body_of(run, ticket, keys, csr_shape, ticket_shape, body_shape),
                    f"redeem #{index % len(run.tickets)} {shapes} keys={keys}")
    elif kind == "concurrent":
        _, index, same_keys = action
        ticket = run.tickets[index % len(run.tickets)]
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda k: redeem_direct(run, ticket, 0 if same_keys else k), range(3)))
        for status, payload in results:
            check_answer(run, status, payload, f"concurrent redeem same_keys={same_keys}")
        wins = {json.dumps(p, sort_keys=True) for s, p in results if s == 200}
        assert len(wins) <= 1 or same_keys, f"one ticket redeemed by {len(wins)} different nodes"
    elif kind == "register" and run.answers:
        keys, answer = next(iter(run.answers.items()))
        try:
            register_self(node_client(run.files[keys], answer), answer, annotations=KWOK_ANNOTATIONS)
        except client.ApiException as exc:  # already registered, or refused by the node admission policy
            assert exc.status in (403, 409, 422), exc
    elif kind == "reconcile":
        run.gw.reconcile()
    elif kind == "remove":
        try:
            run.gw.remove_node(run.req.node_name, operation=run.req.operation)
        except JoinRefused as exc:
            run.five_hundreds.append(f"remove: {exc.status} {exc}")
        run.removed = True


def invariants(run: Run, cluster: Cluster) -> None:
    assert not run.five_hundreds, run.five_hundreds
    assert not run.redeemed_after_removal, f"redeemed after its node was removed: {run.redeemed_after_removal}"
    name = run.req.node_name
    slots = [s for s in run.gw.records.slots() if s.node == name]
    assert len(slots) <= 1, f"{name} holds {len(slots)} slots"
    node = next(iter(cluster.admin.core.list_node(field_selector=f"metadata.name={name}").items), None)
    now = time.time()
    if node is not None:  # a Node only with a live slot (a revoked one is deleted by the next pass)
        run.gw.reconcile()
        node = next(iter(cluster.admin.core.list_node(field_selector=f"metadata.name={name}").items), None)
        assert node is None or (slots and not slots[0].reserved), f"Node {name} without a live slot"
    for slot in slots:  # a slot only with a Node, or a live reservation (or a redeemed ticket still joining)
        assert node is not None or slot.expires_at > now, f"slot {slot.name} of {name} outlived its ticket"


@pytest.fixture(scope="module")
def http_gateway(gateway_api: client.ApiClient) -> Iterator[tuple[KubeGateway, TestClient]]:
    gw = gateway(gateway_api)
    with TestClient(create_app(gw, TokenReviewer(gateway_api), frozenset()), raise_server_exceptions=False) as http:
        yield gw, http


@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=2, max_size=7))
def test_hostile_sequences_keep_the_gateways_invariants(
        cluster: Cluster, http_gateway: tuple[KubeGateway, TestClient], tmp_path_factory: pytest.TempPathFactory,
        steps: list[tuple[Any, ...]]) -> None:
    gw, http = http_gateway
    base: Path = tmp_path_factory.mktemp("corpus")
    names: list[str] = []
    run = Run(gw=gw, http=http, files=[NodeFiles(base / f"k{i}") for i in range(3)], req=ticket_request(names))
    for files in run.files:  # the node's keys, made before any thread reads them
        redeem_for(files, "x", run.req.node_name)
    try:
        for action in [("issue",), *steps]:
            step(run, cluster, action)
        invariants(run, cluster)
        if run.tickets:  # finally: remove, and every ticket of the node stays refused
            gw.remove_node(run.req.node_name, operation=run.req.operation)
            run.removed = True
            for i, ticket in enumerate(run.tickets):
                redeem_http(run, body_of(run, ticket, 1, "right", "right", "right"), f"after removal #{i} keys=1")
            invariants(run, cluster)
    finally:
        delete_nodes(cluster, names)
        for slot in gw.records.slots():
            if slot.node in names:
                gw.records.delete(slot.name)

