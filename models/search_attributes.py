"""Custom search attributes: operators filter operations in the Temporal UI by cluster, policy, location,
phase and batch. Registered on the server by `kubeon-gpu` at start-up (and by the test fixtures)."""

from __future__ import annotations

from typing import Final

from temporalio.common import SearchAttributeKey

CLUSTER: Final = SearchAttributeKey.for_keyword("KubeonCluster")
POLICY: Final = SearchAttributeKey.for_keyword("KubeonPolicy")
LOCATION: Final = SearchAttributeKey.for_keyword("KubeonLocation")
PHASE: Final = SearchAttributeKey.for_keyword("KubeonPhase")
OPERATION_KIND: Final = SearchAttributeKey.for_keyword("KubeonOperationKind")
OPERATION: Final = SearchAttributeKey.for_keyword("KubeonOperation")
# What approving a plan spends: the plan's total USD per hour, compute and estimated transfer together, so a list
# of operations awaiting approval can show and sort by cost.
USD_PER_HOUR: Final = SearchAttributeKey.for_float("KubeonUsdPerHour")
# The batch a node was planned in (on the node's workflow), or the open or latest batch (on the provisioning).
BATCH: Final = SearchAttributeKey.for_keyword("KubeonBatch")

ALL: Final = (CLUSTER, POLICY, LOCATION, PHASE, OPERATION_KIND, OPERATION, USD_PER_HOUR, BATCH)


def cli_type(key: SearchAttributeKey[str] | SearchAttributeKey[float]) -> str:
    """The type name `temporal server start-dev --search-attribute NAME=TYPE` takes."""
    return "Double" if key is USD_PER_HOUR else "Keyword"
