"""Documents and small helpers shared by the hub tests."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import TypeVar

import pytest
import yaml

from models.policy import PolicyError
from models.policy import parse_policy
from tests.harness.kube import wait_for

MODELS = Path(__file__).parent.parent / "models"
VALID_POLICY: dict[str, Any] = yaml.safe_load((MODELS / "valid_policy.yaml").read_text())
INVALID_POLICIES: list[dict[str, Any]] = yaml.safe_load((MODELS / "invalid_policies.yaml").read_text())
T = TypeVar("T")


def policy_document(name: str = "inference-burst-eu", *, max_nodes: int = 4, mode: str = "Approve") -> dict[str, Any]:
    doc = copy.deepcopy(VALID_POLICY)
    doc["metadata"]["name"] = name
    doc["spec"]["limits"]["maxNodes"] = max_nodes
    doc["spec"]["mode"] = mode
    return doc


def apply_case(case: dict[str, Any], valid: dict[str, Any] = VALID_POLICY) -> dict[str, Any]:
    """The ``valid`` policy changed as a corpus entry of tests/models/invalid_*policies.yaml says: each ``set``
    path (dotted; missing parents are created) given its value, each ``delete`` path removed."""
    doc = copy.deepcopy(valid)
    for path, value in (case.get("set") or {}).items():
        *parents, leaf = path.split(".")
        target = doc
        for p in parents:
            target = target.setdefault(p, {})
        target[leaf] = value
    for path in case.get("delete") or []:
        *parents, leaf = path.split(".")
        target = doc
        for p in parents:
            target = target[p]
        del target[leaf]
    return doc


def assert_names_unique(corpus: list[dict[str, Any]], at_least: int) -> None:
    """A corpus of at least ``at_least`` cases, each named (its test id) and no name twice."""
    names = [c["name"] for c in corpus]
    assert len(names) >= at_least
    assert len(set(names)) == len(names)


def refused_naming(doc: dict[str, Any], field: str) -> PolicyError:
    """The model's refusal of ``doc``, after checking it names ``field``."""
    with pytest.raises(PolicyError) as err:
        parse_policy(doc)
    assert field in err.value.fields, f"error {err.value} does not name {field}"
    return err.value


def report(key: str, *, operation: str = "op-0123456789ab", action: str = "launched", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "idempotency_key": key,
        "operation": operation,
        "policy": "inference-burst-eu",
        "action": action,
        "detail": "g5.xlarge launched",
        "occurred_at": "2025-03-01T12:00:00Z",
    }
    body.update(extra)
    return body


def wait_until(check: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.05) -> T:
    """``tests.harness.kube.wait_for`` retrying on any error (a hub that is still starting refuses connections)."""
    return wait_for(check, timeout=timeout, what=what, interval=interval, retry_on=(Exception,))
