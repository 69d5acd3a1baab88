"""Append-only audit records of burst nodes (R4.7): location, instance, policy, approver and times.

Written as JSON lines with fsync; a record's key makes a retried activity write it once. The hub sync ships these
records to the hub.

**A hash chain** (``models.audit_chain``): every record carries ``chain`` (the file's chain ID, random at its first
chained record), ``seq``, ``prev`` (the previous record's hash) and its own ``hash``; each line is the record's
canonical JSON, byte for byte what ``kubeon-gpu audit verify`` recomputes.

**One chain, however many writers.** Activities append from threads, and worker processes sharing the file (a
shared volume) from other processes: each append takes an exclusive ``flock`` on the file, reads what others
appended since its last look (their records move the head and join the keys), then writes and fsyncs its line, all
under the lock, so two records never get the same ``seq`` or ``prev``. The head is never kept anywhere but the
file: a restarted worker finds it in the file's last chained line.

**A torn last line** (a writer killed mid-write: bytes after the last newline) was never acknowledged, so no
activity counts on it: the next append finishes it if it is a whole record that chains on (only its newline was
lost), and otherwise moves the fragment to ``audit.jsonl.torn`` (with its offset and time) and cuts the file back
to its last complete line, so the chain goes on from the last whole record.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any

from models.audit import AuditRecord
from models.audit_chain import GENESIS
from models.audit_chain import canonical
from models.audit_chain import is_hash
from models.audit_chain import parse_record
from models.audit_chain import record_hash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Head:
    chain: str
    seq: int
    hash: str


class AuditLog:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._torn_path = path.with_name(path.name + ".torn")
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        # What the file held when last read (complete lines only), kept between appends and refreshed under the
        # file lock before each one: others may have appended.
        self._offset = 0
        self._head: Head | None = None
        self._seal = hashlib.sha256()  # the lines before the first chained record: its genesis prev seals them
        self._sealed = 0
        self._keys: dict[str, int] = {}  # key -> offset of its line
        with self._lock, self._locked() as fd:
            self._sync(fd)

    @property
    def path(self) -> Path:
        return self._path

    def append(self, record: AuditRecord) -> bool:
        """Write ``record`` unless one with its key exists. True if written."""
        return self.write(record)[1]

    def write(self, record: AuditRecord) -> tuple[AuditRecord, bool]:
        """Append ``record`` with its chain fields, unless one with its key exists. Returns the stored record (its
        ``chain``, ``seq``, ``prev`` and ``hash`` set; the earlier one when the key was there) and whether it was
        written now."""
        with self._lock, self._locked() as fd:
            self._sync(fd)
            if record.key in self._keys:
                stored = self._read_at(fd, self._keys[record.key])
                if stored is not None:
                    return stored, False
            next_chain, seq, prev = self._next()
            chain = next_chain or uuid.uuid4().hex
            doc = record.model_copy(update={"chain": chain, "seq": seq, "prev": prev}).model_dump(
                mode="json", exclude={"hash"})
            doc["hash"] = record_hash(doc)
            line = canonical(doc) + b"\n"
            _write_all(fd, line)
            os.fsync(fd)
            self._keys[record.key] = self._offset
            self._offset += len(line)
            self._head = Head(chain, seq, doc["hash"])
            return AuditRecord.model_validate(doc), True

    def head(self) -> Head | None:
        """The chain's last record as the file says now (None: nothing chained yet)."""
        with self._lock, self._locked() as fd:
            self._sync(fd)
            return self._head

    def read(self) -> list[AuditRecord]:
        """Every complete record in the file (an unreadable line is skipped here: ``audit verify`` names it)."""
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return []
        records = []
        for line in data.split(b"\n")[:-1]:
            try:
                records.append(AuditRecord.model_validate(json.loads(line)))
            except ValueError:
                continue
        return records

    # -- the file, under its lock --------------------------------------------------------------------------

    def _locked(self) -> _Locked:
        return _Locked(self._path)

    def _sync(self, fd: int) -> None:
        """Read what was appended since the last look: keys, head, seal; handle a torn last line."""
        size = os.fstat(fd).st_size
        if size < self._offset:  # cut or replaced behind our back: start over (verify says what happened)
            log.warning("audit log %s shrank from %d to %d bytes: reading it again", self._path, self._offset, size)
            self._offset, self._head, self._seal, self._sealed, self._keys = 0, None, hashlib.sha256(), 0, {}
        if size == self._offset:
            return
        data = os.pread(fd, size - self._offset, self._offset)
        end = data.rfind(b"\n") + 1
        at = self._offset
        for line in data[:end].split(b"\n")[:-1]:
            self._take(line, at)
            at += len(line) + 1
        self._offset += end
        if end < len(data):
            self._torn(fd, data[end:])

    def _take(self, line: bytes, at: int) -> None:
        doc = _parse(line)
        if doc is None or doc.get("hash") is None:
            if self._head is None:  # before the chain: sealed by its first record
                self._seal.update(line + b"\n")
                self._sealed += 1
            if doc is not None and isinstance(doc.get("key"), str):
                self._keys.setdefault(doc["key"], at)
            return
        if isinstance(doc.get("key"), str):
            self._keys.setdefault(doc["key"], at)
        seq, chain, hash_ = doc.get("seq"), doc.get("chain"), doc.get("hash")
        if isinstance(seq, int) and isinstance(chain, str) and is_hash(hash_):
            assert isinstance(hash_, str)
            self._head = Head(chain, seq, hash_)

    def _next(self) -> tuple[str | None, int, str]:
        """(chain, seq, prev) of the next record; chain None: a new chain begins (its ID is made then)."""
        head = self._head
        if head is None:
            return None, 1, self._seal.hexdigest() if self._sealed else GENESIS
        return head.chain, head.seq + 1, head.hash

    def _torn(self, fd: int, tail: bytes) -> None:
        doc = _parse(tail)
        chain, seq, prev = self._next()
        whole = (doc is not None and is_hash(doc.get("hash")) and record_hash(doc) == doc["hash"]
                 and tail == canonical(doc) and doc.get("seq") == seq and doc.get("prev") == prev
                 and (chain is None or doc.get("chain") == chain))
        if whole:
            log.warning("audit log %s: the last record was written without its newline (a crash): completed",
                        self._path)
            _write_all(fd, b"\n")
            os.fsync(fd)
            self._take(tail, self._offset)
            self._offset += len(tail) + 1
            return
        log.warning("audit log %s: %d bytes after the last complete line (a write cut short by a crash) moved to %s",
                    self._path, len(tail), self._torn_path)
        aside = os.open(self._torn_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            note = json.dumps({"at": datetime.now(UTC).isoformat(), "offset": self._offset, "bytes": len(tail)})
            _write_all(aside, f"# torn tail of {self._path.name} {note}\n".encode() + tail + b"\n")
            os.fsync(aside)
        finally:
            os.close(aside)
        os.ftruncate(fd, self._offset)
        os.fsync(fd)

    def _read_at(self, fd: int, offset: int) -> AuditRecord | None:
        line = os.pread(fd, 1 << 20, offset).split(b"\n", 1)[0]
        doc = _parse(line)
        try:
            return AuditRecord.model_validate(doc) if doc is not None else None
        except ValueError:
            return None


class _Locked:
    """The log file opened for appending, with an exclusive flock held until it is closed."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = -1

    def __enter__(self) -> int:
        self._fd = os.open(self._path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self._fd)
            raise
        return self._fd

    def __exit__(self, *_: object) -> None:
        os.close(self._fd)  # releases the lock


def _parse(line: bytes) -> dict[str, Any] | None:
    return parse_record(line)[0]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
