"""The worker's audit log as a hash chain: a generated day verifies; an edited, deleted or moved record is named;
appends from threads and processes never fork it; a restart (with a torn last line) goes on from the file."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC
from datetime import datetime
from pathlib import Path

import pytest

from activities.audit import report_of
from activities.clients.audit_log import AuditLog
from models.audit import AuditRecord
from models.audit_chain import GENESIS
from models.audit_chain import canonical
from models.audit_chain import record_hash
from models.audit_chain import seal
from tests.harness.audit_day import DayPlan
from tests.harness.audit_day import write_day
from tests.hub.helpers import wait_until
from worker import cli
from worker.audit_verify import verify_file

ROOT = Path(__file__).resolve().parent.parent.parent
AT = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _record(key: str, action: str = "launched", **kw: object) -> AuditRecord:
    return AuditRecord(key=key, at=AT, cluster="dev", policy="p", operation=key.split("/")[0], action=action,
                       **kw)


def _verify_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["audit", "verify", *args])
    return code, out.getvalue()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _rewrite(path: Path, lines: list[str]) -> None:
    path.write_text("".join(f"{line}\n" for line in lines))


def test_a_day_of_operations_verifies(tmp_path: Path) -> None:
    """A day of `make dev`-like records from eight threads of this process and two other worker processes at once,
    with retries: one chain, every record once, every link verified, by the CLI too."""
    path, go = tmp_path / "audit.jsonl", tmp_path / "go"
    seeds = (101, 102)
    others = [subprocess.Popen([sys.executable, "-m", "tests.harness.audit_day", str(path), str(seed), str(go)],
                               cwd=ROOT) for seed in seeds]
    # Every writer starts at once: the others are told to go only when they are ready (imported, log opened), as
    # this process starts writing; waiting instead for their first record let them finish first on a busy machine.
    wait_until(lambda: all(Path(f"{go}.ready-{seed}").exists() for seed in seeds), timeout=60,
               what="the other writers ready")
    log = AuditLog(path)
    go.touch()
    stored = write_day(log, threads=8)
    assert [p.wait(timeout=120) for p in others] == [0, 0]

    lines = _lines(path)
    docs = [json.loads(line) for line in lines]
    assert len(stored) > 2_000 and len(docs) > len(stored)  # the other processes' records are in the chain too
    ours = {r.key for r in stored}
    mine = [i for i, d in enumerate(docs) if d["key"] in ours]
    assert any(d["key"] not in ours for d in docs[mine[0]:mine[-1]]), "the processes did not write at once"
    assert [d["seq"] for d in docs] == list(range(1, len(docs) + 1))
    assert len({d["key"] for d in docs}) == len(docs)  # retries wrote nothing
    assert len({d["chain"] for d in docs}) == 1
    assert docs[0]["prev"] == GENESIS
    assert all(d["prev"] == p["hash"] for p, d in itertools.pairwise(docs))
    assert all(line.encode() == canonical(d) and record_hash(d) == d["hash"] for line, d in zip(lines, docs,
                                                                                               strict=True))
    by_key = {d["key"]: d for d in docs}
    assert all(by_key[r.key]["hash"] == r.hash and by_key[r.key]["seq"] == r.seq for r in stored)

    outcome = verify_file(path)
    assert outcome.ok, outcome.render()
    assert outcome.check is not None and outcome.check.head_seq == len(docs)
    code, out = _verify_cli(str(path))
    assert code == 0, out
    assert f"ok: {len(docs)} chained record(s), head seq {len(docs)} hash {docs[-1]['hash']}" in out


def _edit(lines: list[str], n: int) -> str:
    doc = json.loads(lines[n - 1])
    doc["location"] = "aws/us-east-1"  # the location of a burst node: what R4.7's audit promises
    lines[n - 1] = canonical(doc).decode()
    return "content changed after it was written"


def _edit_and_rehash(lines: list[str], n: int) -> str:
    doc = json.loads(lines[n - 1])
    doc["approver"] = "mallory"
    doc["hash"] = record_hash(doc)
    lines[n - 1] = canonical(doc).decode()
    return f"does not follow the record before it: its prev {json.loads(lines[n])['prev'][:16]}"


def _delete(lines: list[str], n: int) -> str:
    del lines[n - 1]
    return f"follows seq {n - 1}: record {n} missing"


def _reorder(lines: list[str], n: int) -> str:
    lines[n - 1], lines[n] = lines[n], lines[n - 1]
    return f"follows seq {n - 1}: record {n} missing (deleted, or moved later)"


def _respell(lines: list[str], n: int) -> str:
    lines[n - 1] = lines[n - 1].replace('"action":', '"action": ', 1)
    return "not the canonical form"


@pytest.fixture(scope="module")
def written_day(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shorter day's log, written once for the tamper tests (each edits its own copy)."""
    path = tmp_path_factory.mktemp("day") / "audit.jsonl"
    write_day(AuditLog(path), threads=4, plan=DayPlan(batches=60, idle_workloads=20))
    return path


@pytest.mark.parametrize(("tamper", "named_line", "named_seq"), [
    (_edit, 700, 700), (_edit_and_rehash, 701, 701), (_delete, 700, 701), (_reorder, 700, 701),
    (_respell, 700, 700),
], ids=["edited", "edited-and-rehashed", "deleted", "reordered", "respelled"])
def test_one_tampered_record_is_detected_naming_it(tmp_path: Path, written_day: Path,
                                                   tamper: Callable[[list[str], int], str], named_line: int,
                                                   named_seq: int) -> None:
    path = tmp_path / "audit.jsonl"
    shutil.copyfile(written_day, path)
    lines = _lines(path)
    assert len(lines) > 800
    reason = tamper(lines, 700)
    _rewrite(path, lines)

    outcome = verify_file(path)
    assert not outcome.ok and outcome.check is not None
    first = outcome.check.breaks[0]
    key = json.loads(lines[named_line - 1])["key"]
    assert first.label == f"line {named_line} (seq {named_seq}, key {key})" and first.seq == named_seq
    assert reason in first.reason, first.reason
    code, out = _verify_cli(str(path))
    assert code == 1
    assert f"BROKEN, first broken record line {named_line} (seq {named_seq}, key {key}): {first.reason}" in out


def test_a_restart_goes_on_from_the_file_and_sets_a_torn_line_aside(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for i in range(5):
        log.write(_record(f"op-{i}/launched"))
    head = log.head()
    assert head is not None and head.seq == 5

    # The worker is killed in the middle of a write: half a line at the end of the file.
    half = canonical({"key": "op-5/launched", "seq": 6})[:40]
    with path.open("ab") as f:
        f.write(half)
    assert verify_file(path).ok  # the complete records verify; the torn tail is said
    assert "incomplete line" in verify_file(path).render()

    restarted = AuditLog(path)  # the head is only ever the file's
    stored, written = restarted.write(_record("op-5/launched"))
    assert written and (stored.seq, stored.prev, stored.chain) == (6, head.hash, head.chain)
    assert (tmp_path / "audit.jsonl.torn").read_bytes().endswith(half + b"\n")
    assert path.read_bytes().count(half) == 0
    check = verify_file(path)
    assert check.ok and check.check is not None and check.check.head_seq == 6, check.render()

    # Killed after the whole record but before its newline: the record is kept, completed.
    doc = AuditRecord.model_validate(_record("op-6/launched").model_dump()).model_dump(mode="json", exclude={"hash"})
    doc |= {"chain": head.chain, "seq": 7, "prev": stored.hash}
    doc["hash"] = record_hash(doc)
    with path.open("ab") as f:
        f.write(canonical(doc))
    again = AuditLog(path)
    assert again.head() == type(head)(head.chain, 7, doc["hash"])
    assert again.write(_record("op-6/launched"))[1] is False  # its key is there: written once
    assert verify_file(path).ok


def test_records_from_before_the_chain_are_sealed_by_it(tmp_path: Path) -> None:
    """An audit log written before this change (no hashes): the chain starts at the first new record, whose prev is
    the seal of the lines before it; verify says so, and an edit of an old line is caught from then on."""
    path = tmp_path / "audit.jsonl"
    old = [_record(f"op-{i}/removed", "removed").model_dump_json(exclude={"chain", "seq", "prev", "hash"})
           for i in range(3)]
    _rewrite(path, old)
    log = AuditLog(path)
    first, _ = log.write(_record("op-9/launched"))
    log.write(_record("op-10/launched"))
    assert first.seq == 1 and first.prev == seal(line.encode() for line in old)
    outcome = verify_file(path)
    assert outcome.ok and outcome.check is not None and outcome.check.unchained == 3
    assert "the chain starts after 3 earlier record(s) written before it existed" in outcome.render()
    assert log.write(_record("op-1/removed", "removed"))[1] is False  # the old records' keys still count

    lines = _lines(path)
    lines[1] = lines[1].replace("op-1", "op-X")
    _rewrite(path, lines)
    broken = verify_file(path)
    assert broken.check is not None and broken.check.breaks[0].label == "line 4 (seq 1, key op-9/launched)"
    assert "does not start the chain" in broken.check.breaks[0].reason


def test_a_retried_record_is_reported_with_its_first_place(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl")
    first, written = log.write(_record("op-1/approved", "approved", approver="alice"))
    again, rewritten = log.write(_record("op-1/approved", "approved", approver="alice"))
    assert written and not rewritten and again == first
    report = report_of(again)
    assert (report.audit_chain, report.audit_seq, report.audit_hash, report.audit_prev) == (
        first.chain, 1, first.hash, GENESIS)
    assert report.detail == "(approver alice)"
