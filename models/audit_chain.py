"""The audit hash chain: one canonical serialisation, the hash of a record, and the check of a chain.

Used alike by the writers (the worker's JSONL audit log, the hub's ``audit_events`` and ``action_reports``) and by
``kubeon-gpu audit verify``, so the verifier recomputes exactly the hash the writer stored.

**Canonical form.** A record is a JSON object of JSON values (strings, integers, floats, booleans, null, lists,
objects; times as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` strings in UTC). Its canonical bytes are
``json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)`` encoded as ASCII:
keys sorted, no whitespace, every non-ASCII character escaped, so the same value always gives the same bytes.

**A record's chain fields.** ``seq`` (1, 2, ... in its chain), ``prev`` (the ``hash`` of the record before it) and
``hash``: ``sha256`` (hex) of the canonical bytes of the record *without* its ``hash`` key, so ``seq`` and
``prev`` are covered. Editing a record changes its hash; deleting or moving one breaks the ``seq`` and ``prev`` of
the record after it; rewriting every later record too is caught only against a head recorded elsewhere (the hub's
copy of the cluster's head, the cluster's own file).

**Genesis.** The first chained record's ``prev`` is ``GENESIS`` (64 zeros) when nothing precedes it. Records
written before the chain existed (no ``hash``) are *sealed* by it instead: its ``prev`` is ``seal`` of them, so
from the upgrade on they cannot change unnoticed either (what happened to them before cannot be known).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from datetime import UTC
from datetime import datetime
from typing import Any
from typing import Final

GENESIS: Final = "0" * 64
HASH_PATTERN: Final = r"^[0-9a-f]{64}$"
CHAIN_ID_PATTERN: Final = r"^[0-9a-f]{32}$"
_HASH = re.compile(HASH_PATTERN)
CHAIN_FIELDS: Final = ("seq", "prev", "hash")


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The exact bytes a record is hashed over (see the module's docstring)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def record_hash(doc: Mapping[str, Any]) -> str:
    """The hash of a record: sha256 of its canonical bytes without its own ``hash`` key."""
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "hash"})).hexdigest()


def seal(parts: Iterable[bytes]) -> str:
    """The genesis ``prev`` of a chain that starts after unchained records: sha256 of their bytes, each followed by
    a newline (a file's lines exactly as stored; a table's rows in canonical form). ``GENESIS`` when none."""
    digest = hashlib.sha256()
    empty = True
    for part in parts:
        digest.update(part + b"\n")
        empty = False
    return GENESIS if empty else digest.hexdigest()


def is_hash(value: object) -> bool:
    return isinstance(value, str) and _HASH.match(value) is not None


def canonical_time(value: datetime | str) -> str:
    """A time as the chain stores it: UTC, microseconds, ``Z``. Accepts an aware datetime or an ISO string."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        raise ValueError(f"naive datetime {value!r}: chained times are aware")
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_record(line: bytes | str) -> tuple[dict[str, Any] | None, str]:
    """A stored line as a JSON object, strictly: a duplicate key or a NaN/Infinity (which the writer never writes,
    and other parsers read differently) makes it unreadable. Returns (object, "") or (None, why)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in items:
            if key in obj:
                raise ValueError(f"duplicate key {key!r}")
            obj[key] = value
        return obj

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        doc = json.loads(line, object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not a JSON record: {exc}"
    if not isinstance(doc, dict):
        return None, "not a JSON object"
    return doc, ""


def json_value(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, str enums as str): what a database's JSON column returns."""
    return json.loads(json.dumps(value, allow_nan=False))


# ----- the hub's rows (built from the row by the hub, from the API's JSON by the verifier) -----

HUB_AUDIT_LOG: Final = "audit"  # the hub's audit_events: one chain per cluster, "" for the hub's own (users, keys)
HUB_REPORTS_LOG: Final = "reports"  # the hub's action_reports: one chain per cluster


def hub_event_doc(*, chain: str, seq: int | None, prev: str | None, at: datetime | str, actor: str,
                  actor_key_id: str | None, action: str, cluster: str | None, target: str | None,
                  detail: Any) -> dict[str, Any]:
    return {"log": HUB_AUDIT_LOG, "chain": chain, "seq": seq, "prev": prev, "at": canonical_time(at),
            "actor": actor, "actor_key_id": actor_key_id, "action": action, "cluster": cluster, "target": target,
            "detail": json_value(detail)}


def hub_report_doc(*, chain: str, seq: int | None, prev: str | None, idempotency_key: str, operation: str,
                   policy: str, action: str, location: str | None, instance: str | None, node: str | None,
                   detail: str, occurred_at: datetime | str, received_at: datetime | str,
                   audit_chain: str | None, audit_seq: int | None, audit_hash: str | None,
                   audit_prev: str | None) -> dict[str, Any]:
    return {"log": HUB_REPORTS_LOG, "chain": chain, "seq": seq, "prev": prev, "idempotency_key": idempotency_key,
            "operation": operation, "policy": policy, "action": action, "location": location,
            "instance": instance, "node": node, "detail": detail, "occurred_at": canonical_time(occurred_at),
            "received_at": canonical_time(received_at), "audit_chain": audit_chain, "audit_seq": audit_seq,
            "audit_hash": audit_hash, "audit_prev": audit_prev}


# ----- checking a chain -----


@dataclass(frozen=True)
class Stored:
    """One record as stored, in stored order. ``doc`` is None when it cannot be read (``problem`` says why)."""

    label: str  # how a person finds it: "line 12", "audit_events id 57"
    doc: Mapping[str, Any] | None
    problem: str = ""
    canonical_bytes: bytes | None = None  # a JSONL line as stored: must be the canonical form of ``doc``
    sealed_bytes: bytes = b""  # what an unchained record contributes to the seal


@dataclass(frozen=True)
class Break:
    label: str  # the first record that does not verify, named as ``Stored.label`` plus its seq and what it is
    seq: int | None
    reason: str
    against_head: bool = False  # found comparing with a head recorded elsewhere, not in the records themselves

    def __str__(self) -> str:
        return f"{self.label}: {self.reason}"


@dataclass
class ChainCheck:
    records: int = 0  # stored records looked at
    unchained: int = 0  # records before the chain started (written before it existed), sealed by its genesis
    chained: int = 0
    head_seq: int = 0
    head_hash: str = GENESIS
    chain: Any = None  # the chain's ID (a worker log's) or name (a hub chain's), from its records
    positions: dict[int, tuple[str, str]] = field(default_factory=dict, repr=False)  # seq -> (label, hash)
    breaks: list[Break] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.breaks

    @property
    def first(self) -> Break | None:
        return self.breaks[0] if self.breaks else None

    def summary(self) -> str:
        start = (f"; the chain starts after {self.unchained} earlier record(s) written before it existed, sealed by "
                 "its first record" if self.unchained else "")
        counts = f"{self.chained} chained record(s), head seq {self.head_seq} hash {self.head_hash}{start}"
        if self.ok:
            return f"ok: {counts}"
        more = f" ({len(self.breaks)} breaks in all)" if len(self.breaks) > 1 else ""
        return f"BROKEN, first broken record {self.first}{more}\n  {counts}"


def describe(doc: Mapping[str, Any]) -> str:
    """A few words of what a record is, for naming it: its key, or its action and target."""
    key = doc.get("key") or doc.get("idempotency_key")
    if key:
        return f"key {key}"[:160]
    return " ".join(str(doc[k]) for k in ("action", "target") if doc.get(k))[:160]


def check_chain(stored: Iterable[Stored], *, head: tuple[int, str] | None = None,
                head_name: str = "the recorded head") -> ChainCheck:
    """Check records in stored order: each chained record's hash, seq and prev; records before the first chained
    one are unchained (sealed by its ``prev``); an unchained record after it is a break. ``head`` (seq, hash), when
    known from elsewhere, must be the last record (or, if it is older, a record of the chain): this catches
    truncation and a rewrite of every later record. Every break is listed; the first is the one to look at."""
    result = ChainCheck()
    sealed: list[bytes] = []
    expected_seq, expected_prev = 1, GENESIS
    started = False
    hashes: dict[int, str] = {}
    chain_id: Any = None
    for item in stored:
        result.records += 1
        doc = item.doc

        def name(d: Mapping[str, Any] | None = doc, label: str = item.label) -> str:
            seq = d.get("seq") if d is not None else None
            what = describe(d) if d is not None else ""
            return label + (f" (seq {seq}" + (f", {what})" if what else ")") if seq is not None else
                            (f" ({what})" if what else ""))

        def broke(reason: str, seq: int | None = None, label: str | None = None) -> None:
            result.breaks.append(Break(label or name(), seq, reason))

        if doc is None:
            if not started:
                sealed.append(item.sealed_bytes)
                result.unchained += 1
                continue
            broke(f"cannot be read: {item.problem}")
            continue
        if doc.get("hash") is None:
            if not started:
                sealed.append(item.sealed_bytes)
                result.unchained += 1
                continue
            broke("has no hash after the chain started: its chain fields were removed, or it was added around the "
                  "chain")
            continue
        seq, prev, stored_hash = doc.get("seq"), doc.get("prev"), doc.get("hash")
        if not started:
            started = True
            expected_prev = seal(sealed)
        result.chained += 1
        if not (isinstance(seq, int) and not isinstance(seq, bool) and is_hash(prev) and is_hash(stored_hash)):
            broke(f"malformed chain fields (seq {seq!r}, prev {prev!r}, hash {stored_hash!r})")
            continue
        assert isinstance(prev, str) and isinstance(stored_hash, str)
        if chain_id is None:
            chain_id = doc.get("chain")
        elif doc.get("chain") != chain_id:
            broke(f"belongs to another chain ({doc.get('chain')!r}, not {chain_id!r}): copied in from elsewhere", seq)
        computed = record_hash(doc)
        if computed != stored_hash:
            broke(f"content changed after it was written: its hash is {stored_hash[:16]}... but its content hashes "
                  f"to {computed[:16]}...", seq)
        elif item.canonical_bytes is not None and item.canonical_bytes != canonical(doc):
            broke("changed after it was written: its bytes are not the canonical form the writer wrote (same "
                  "values, other spelling, duplicate keys or added whitespace)", seq)
        if seq != expected_seq:
            if seq > expected_seq:
                missing = f"record {expected_seq}" if seq == expected_seq + 1 else \
                    f"records {expected_seq}-{seq - 1}"
                broke(f"follows seq {expected_seq - 1}: {missing} missing (deleted, or moved later)", seq)
            else:
                broke(f"is out of order: seq {seq} where seq {expected_seq} was due (a record moved, or one "
                      "duplicated)", seq)
        elif prev != expected_prev:
            if expected_seq == 1:
                broke("does not start the chain: its prev is neither the genesis nor the seal of the records before "
                      "it (records before it were changed, added or removed)", seq)
            else:
                broke(f"does not follow the record before it: its prev {prev[:16]}... is not seq {expected_seq - 1}'s "
                      f"hash {expected_prev[:16]}... (seq {expected_seq - 1} was rewritten with a new hash, or "
                      "replaced)", seq)
        hashes[seq] = stored_hash
        result.positions.setdefault(seq, (item.label, stored_hash))
        # Carry on from this record as written, so one break is reported once and later ones still are.
        expected_seq, expected_prev = seq + 1, stored_hash
        result.head_seq, result.head_hash = seq, stored_hash
    result.chain = chain_id
    if head is not None:
        head_seq, head_hash = head
        if head_seq > result.head_seq:
            missing = f"seq {result.head_seq + 1}" + (f"-{head_seq}" if head_seq > result.head_seq + 1 else "")
            result.breaks.append(Break(
                f"the end of the chain (seq {result.head_seq})", result.head_seq,
                f"{head_name} is seq {head_seq} (hash {head_hash[:16]}...): {missing} missing (the last records were "
                "deleted, or the chain was rewritten from an earlier record)", against_head=True))
        elif head_seq > 0 and hashes.get(head_seq) != head_hash:
            got = hashes.get(head_seq)
            where = result.positions.get(head_seq)
            result.breaks.append(Break(
                f"{where[0]} (seq {head_seq})" if where else f"seq {head_seq}", head_seq,
                f"{head_name} is seq {head_seq} with hash {head_hash[:16]}... but the stored record has "
                + (f"hash {got[:16]}..." if got else "no such record")
                + ": the chain was rewritten from this record on (every later record rehashed)", against_head=True))
    return result
