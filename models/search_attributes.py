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
# The batch a node was planned in (on the node's workflow), or the open or latest batch (on the provisioning).
BATCH: Final = SearchAttributeKey.for_keyword("KubeonBatch")

ALL: Final = (CLUSTER, POLICY, LOCATION, PHASE, OPERATION_KIND, OPERATION, BATCH)
