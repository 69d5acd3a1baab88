"""Workflow and operation IDs: derived from what they name, so every replica, retry and replay names the same one."""

from __future__ import annotations

import hashlib
from typing import Final

# Long-held activities (serving) poll their own task queue: <task queue> + this suffix.
SERVE_QUEUE_SUFFIX: Final = "-serve"


def provision_workflow_id(cluster: str, policy: str) -> str:
    """The one provisioning workflow of a policy: every watcher replica and every restart names the same one."""
    return f"provision/{cluster}/{policy}"


def node_workflow_id(cluster: str, policy: str, batch: str, index: int) -> str:
    """The workflow of the ``index``-th new node of a batch: derived, so a replayed or retried start names it."""
    return f"burst/{cluster}/{policy}/{batch}-{index}"


def operation_id(workflow_id: str, run_id: str) -> str:
    """Short, label-safe name of one run of an operation: tags, labels, tickets and audit records carry it."""
    return "op-" + hashlib.sha256(f"{workflow_id}/{run_id}".encode()).hexdigest()[:12]
