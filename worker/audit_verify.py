"""``kubeon-gpu audit verify``: check the audit hash chains (``models.audit_chain``) and name the first broken record.

- ``FILE``: a worker's audit log (``$KUBEON_STATE_DIR/audit.jsonl``): every line's hash, seq and prev, in order.
- ``--hub URL``: the hub's chains, read over its API with an admin key (``/v1/audit``, each cluster's
  ``/reports``, ``/v1/audit/chains``) and recomputed here: the audit log (one chain per cluster, one for the hub's
  own events), the action reports (one per cluster), each against the head the hub recorded; and each worker audit
  log as its cluster reported it (consecutive records linked, the reported head present, a break the hub saw).
- Both: also the file against the hub's copy, the anchor a rewrite of the whole file cannot pass: every record of
  this log the hub has must be in the file with the same hash, and the file must reach the head the hub recorded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx

from models.audit_chain import HUB_AUDIT_LOG
from models.audit_chain import HUB_REPORTS_LOG
from models.audit_chain import Break
from models.audit_chain import ChainCheck
from models.audit_chain import Stored
from models.audit_chain import canonical
from models.audit_chain import check_chain
from models.audit_chain import hub_event_doc
from models.audit_chain import hub_report_doc
from models.audit_chain import parse_record

PAGE = 1000


@dataclass
class Outcome:
    what: str  # "audit.jsonl", "hub audit log of cluster prod-eu", ...
    check: ChainCheck | None = None
    breaks: list[Break] = field(default_factory=list)  # beyond the chain check's own
    notes: list[str] = field(default_factory=list)

    @property
    def all_breaks(self) -> list[Break]:
        """Every break, the first broken record first: the chain's own in stored order, then those found against
        what the hub has (by seq), then those against the recorded head."""
        own = self.check.breaks if self.check else []
        return [*(b for b in own if not b.against_head),
                *sorted(self.breaks, key=lambda b: (b.seq is None, b.seq or 0)),
                *(b for b in own if b.against_head)]

    @property
    def ok(self) -> bool:
        return not self.all_breaks

    def render(self) -> str:
        breaks = self.all_breaks
        if self.check is not None and not self.breaks and (self.check.ok or breaks[0] == self.check.breaks[0]):
            head = self.check.summary()
        elif breaks:
            head = f"BROKEN, first broken record {breaks[0]}" + (
                f" ({len(breaks)} breaks in all)" if len(breaks) > 1 else "")
        else:
            head = "ok"
        return "\n".join([f"{self.what}: {head}", *(f"  {n}" for n in self.notes),
                          *(f"  break: {b}" for b in breaks[1:6]),
                          *([f"  ... and {len(breaks) - 6} more"] if len(breaks) > 6 else [])])

    def as_json(self) -> dict[str, Any]:
        breaks = self.all_breaks
        return {"what": self.what, "ok": self.ok,
                "chain": self.check.chain if self.check else None,
                "records": self.check.chained if self.check else None,
                "unchained_before": self.check.unchained if self.check else None,
                "head_seq": self.check.head_seq if self.check else None,
                "head_hash": self.check.head_hash if self.check else None,
                "first_break": {"record": breaks[0].label, "seq": breaks[0].seq, "reason": breaks[0].reason}
                if breaks else None,
                "breaks": len(breaks), "notes": self.notes}


# ----- the worker's file -----


def file_records(data: bytes) -> tuple[list[Stored], bytes]:
    """The complete lines of a JSONL audit log as stored records, and the bytes after its last newline."""
    lines = data.split(b"\n")
    tail = lines.pop()
    stored = []
    for number, line in enumerate(lines, 1):
        doc, problem = parse_record(line) if line.strip() else (None, "an empty line")
        stored.append(Stored(label=f"line {number}", doc=doc, problem=problem, canonical_bytes=line,
                             sealed_bytes=line))
    return stored, tail


def verify_file(path: Path, *, head: tuple[int, str] | None = None) -> Outcome:
    data = path.read_bytes()
    stored, tail = file_records(data)
    check = check_chain(stored, head=head, head_name="the head the hub recorded for this log")
    outcome = Outcome(what=str(path), check=check)
    if check.chain:
        outcome.notes.append(f"audit log chain {check.chain}")
    if tail:
        outcome.notes.append(f"the last {len(tail)} bytes are an incomplete line (a write cut short by a crash); "
                             "the worker's next append sets them aside in "
                             f"{path.name}.torn and goes on from the last complete record")
    return outcome


# ----- the hub -----


@dataclass
class HubData:
    chains: list[dict[str, Any]]
    reported: list[dict[str, Any]]
    events: list[dict[str, Any]]
    reports: dict[str, list[dict[str, Any]]]  # cluster -> its reports, by id


class HubAccessError(Exception):
    """The hub could not be read; the message says why."""


async def _pages(client: httpx.AsyncClient, path: str, key: str, headers: Mapping[str, str]
                 ) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    after = 0
    while True:
        body = await _get(client, path, headers, {"after": after, "limit": PAGE})
        items += body[key]
        if not body["more"]:
            return items
        after = body["cursor"]


async def _get(client: httpx.AsyncClient, path: str, headers: Mapping[str, str],
               params: Mapping[str, Any] | None = None) -> Any:
    try:
        response = await client.get(path, params=params, headers=headers)
    except httpx.HTTPError as exc:
        raise HubAccessError(f"hub {client.base_url} unreachable: {exc.__class__.__name__}: {exc}") from None
    if response.status_code != 200:
        try:
            message = response.json().get("message", response.text[:200])
        except ValueError:
            message = response.text[:200]
        raise HubAccessError(f"hub {client.base_url}{path} answered {response.status_code}: {message}")
    return response.json()


async def fetch_hub(client: httpx.AsyncClient, headers: Mapping[str, str] | None = None) -> HubData:
    """Everything the chains are made of, read with an admin key (in ``client``'s headers or ``headers``)."""
    h = headers or {}
    heads = await _get(client, "/v1/audit/chains", h)
    events = await _pages(client, "/v1/audit", "events", h)
    clusters = [c["name"] for c in await _get(client, "/v1/clusters", h)]
    reports = {name: await _pages(client, f"/v1/clusters/{name}/reports", "reports", h) for name in clusters}
    return HubData(chains=heads["chains"], reported=heads["reported"], events=events, reports=reports)


def _stored_row(label: str, doc: dict[str, Any], row: Mapping[str, Any]) -> Stored:
    return Stored(label=label, doc={**doc, "hash": row.get("chain_hash")}, sealed_bytes=canonical(doc))


def _event_stored(e: Mapping[str, Any]) -> Stored:
    chain = e.get("cluster") or ""
    doc = hub_event_doc(chain=chain, seq=e.get("chain_seq"), prev=e.get("chain_prev"), at=e["at"], actor=e["actor"],
                        actor_key_id=e.get("actor_key_id"), action=e["action"], cluster=e.get("cluster"),
                        target=e.get("target"), detail=e.get("detail"))
    return _stored_row(f"audit event id {e['id']}", doc, e)


def _report_stored(cluster: str, r: Mapping[str, Any]) -> Stored:
    doc = hub_report_doc(
        chain=cluster, seq=r.get("chain_seq"), prev=r.get("chain_prev"), idempotency_key=r["idempotency_key"],
        operation=r["operation"], policy=r["policy"], action=r["action"], location=r.get("location"),
        instance=r.get("instance"), node=r.get("node"), detail=r.get("detail") or "", occurred_at=r["occurred_at"],
        received_at=r["received_at"], audit_chain=r.get("audit_chain"), audit_seq=r.get("audit_seq"),
        audit_hash=r.get("audit_hash"), audit_prev=r.get("audit_prev"))
    return _stored_row(f"report id {r['id']} of cluster {cluster}", doc, r)


def _chain_name(log: str, chain: str) -> str:
    table = "hub audit log (audit_events)" if log == HUB_AUDIT_LOG else "hub action reports (action_reports)"
    return f"{table}, " + (f"cluster {chain}" if chain else "the hub's own events")


def verify_hub(data: HubData) -> list[Outcome]:
    heads = {(h["log"], h["chain"]): (int(h["seq"]), str(h["hash"])) for h in data.chains}
    groups: dict[tuple[str, str], list[Stored]] = defaultdict(list)
    for e in data.events:
        groups[(HUB_AUDIT_LOG, e.get("cluster") or "")].append(_event_stored(e))
    for cluster, rows in data.reports.items():
        for r in rows:
            groups[(HUB_REPORTS_LOG, cluster)].append(_report_stored(cluster, r))
    outcomes = []
    for key in sorted(set(groups) | set(heads)):
        check = check_chain(groups.get(key, []), head=heads.get(key), head_name="the head the hub recorded")
        outcome = Outcome(what=_chain_name(*key), check=check)
        if key not in heads and check.chained:
            outcome.breaks.append(Break(outcome.what, None, "the hub has no head recorded for this chain (its row in "
                                        "audit_chain_heads was deleted)"))
        outcomes.append(outcome)
    outcomes += verify_reported(data)
    return outcomes


def verify_reported(data: HubData, only: str | None = None) -> list[Outcome]:
    """Each worker audit log as its cluster reported it: what the hub has of it must link up."""
    by_chain: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for cluster, rows in data.reports.items():
        for r in rows:
            if r.get("audit_chain"):
                by_chain[(cluster, r["audit_chain"])].append(r)
    outcomes = []
    for head in data.reported:
        key = (head["cluster"], head["chain"])
        if only is not None and head["chain"] != only:
            continue
        rows = sorted(by_chain.get(key, []), key=lambda r: (r["audit_seq"], r["id"]))
        outcome = Outcome(what=f"worker audit log {head['chain']} of cluster {head['cluster']}, as reported to the "
                               "hub")
        at: dict[int, dict[str, Any]] = {}
        for r in rows:
            seq = r["audit_seq"]
            name = f"report id {r['id']} ({r['idempotency_key']}, audit record seq {seq})"
            other = at.get(seq)
            if other is not None and other["audit_hash"] != r["audit_hash"]:
                outcome.breaks.append(Break(name, seq, f"report id {other['id']} gave the same record another hash: "
                                            "the log forked or was rewritten"))
                continue
            at[seq] = r
            before = at.get(seq - 1)
            if before is not None and before["audit_hash"] != r["audit_prev"]:
                outcome.breaks.append(Break(name, seq, f"does not follow report id {before['id']} (seq {seq - 1}): "
                                            "its prev is not that record's hash"))
        top = at.get(int(head["seq"]))
        if top is not None and top["audit_hash"] != head["hash"]:
            outcome.breaks.append(Break(f"the reported head (seq {head['seq']})", int(head["seq"]),
                                        f"the hub's head hash {str(head['hash'])[:16]}... differs from report id "
                                        f"{top['id']}'s"))
        if head.get("problem"):
            outcome.breaks.append(Break("when it was reported", None, f"the hub found: {head['problem']} (at "
                                                                      f"{head.get('problem_at')})"))
        missing = int(head["seq"]) - int(head["first_seq"]) + 1 - len(at)
        outcome.notes.append(f"head seq {head['seq']} (hash {head['hash']}) reported {head['reported_at']}; "
                             f"{len(at)} record(s) of seq {head['first_seq']}-{head['seq']} on the hub"
                             + (f", {missing} not (still queued, dropped, or written without a hub)"
                                if missing > 0 else ""))
        outcomes.append(outcome)
    return outcomes


def verify_file_against_hub(path: Path, data: HubData) -> list[Outcome]:
    """The file, anchored by the hub: the head the hub recorded for its chain, and every record the hub has of it."""
    probe = verify_file(path)
    chain = probe.check.chain if probe.check else None
    head = next((h for h in data.reported if h["chain"] == chain), None)
    if head is None:
        probe.notes.append("the hub has no reports of this log (no hub configured when it was written, or none "
                           "delivered yet): checked on its own")
        return [probe]
    outcome = verify_file(path, head=(int(head["seq"]), str(head["hash"])))
    assert outcome.check is not None
    positions = outcome.check.positions
    for r in sorted((r for r in data.reports.get(head["cluster"], []) if r.get("audit_chain") == chain),
                    key=lambda r: r["audit_seq"]):
        seq = r["audit_seq"]
        found = positions.get(seq)
        if found is None:
            outcome.breaks.append(Break(f"seq {seq}", seq, f"the hub has report id {r['id']} "
                                        f"({r['idempotency_key']}) of this record, the file has no such record"))
        elif found[1] != r["audit_hash"]:
            outcome.breaks.append(Break(found[0] + f" (seq {seq})", seq,
                                        f"its hash differs from the one the hub was reported (report id {r['id']}, "
                                        f"{r['idempotency_key']}): the record was changed after it was reported"))
    outcome.notes.append(f"anchored by the hub: head seq {head['seq']} reported by cluster {head['cluster']} at "
                         f"{head['reported_at']}")
    return [outcome, *verify_reported(data, only=chain)]
