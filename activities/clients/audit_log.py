"""Append-only audit records of burst nodes (R4.7): location, instance, policy, approver and times.

Written as JSON lines with fsync; a record's key makes a retried activity write it once. The hub issue ships
these records to the hub."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from models.audit import AuditRecord


class AuditLog:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._keys = {r.key for r in self.read()}

    def append(self, record: AuditRecord) -> bool:
        """Write ``record`` unless one with its key exists. True if written."""
        with self._lock:
            if record.key in self._keys:
                return False
            line = record.model_dump_json() + "\n"
            # O_APPEND: records are only ever added at the end, never rewritten.
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            try:
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self._keys.add(record.key)
            return True

    def read(self) -> list[AuditRecord]:
        try:
            lines = self._path.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [AuditRecord.model_validate(json.loads(line)) for line in lines if line.strip()]
