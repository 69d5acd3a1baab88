"""``python -m tests.hub.clocked_server CLOCK_FILE [hub.server options]``: the real hub server with its clock read
from CLOCK_FILE (an ISO 8601 time), so a test can move a running hub 24 hours ahead without waiting."""

from __future__ import annotations

import os
import sys
from datetime import datetime
from pathlib import Path

from hub.server import serve


class FileClock:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> datetime:
        return datetime.fromisoformat(self.path.read_text().strip())

    @staticmethod
    def set(path: Path, when: datetime) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(when.isoformat())
        os.replace(tmp, path)  # atomic: the hub never reads half a time


if __name__ == "__main__":
    sys.exit(serve(sys.argv[2:], clock=FileClock(Path(sys.argv[1])), prog="tests.hub.clocked_server"))
