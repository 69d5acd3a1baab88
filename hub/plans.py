"""The plan a ``proposed`` report carries, so the hub can show it and bind a decision to it.

An optimizer that wants its proposals shown in full sends the report's ``detail`` as one JSON object::

    {"plan_id": "plan-1a2b", "batch": "op-...", "summary": "1 node(s) for 2 pod(s) ...",
     "total_usd_per_hour": 0.85, "console_url": "https://temporal.example/namespaces/default/workflows/...",
     "nodes": [{"location": "aws/eu-central-1", "instance_type": "g6.xlarge", "gpus": 1,
                "gpu_product": "NVIDIA-L4", "compute_usd_per_hour": 0.8, "transfer_usd_per_hour": 0.05,
                "pods": ["ml/infer-0", "ml/infer-1"]}]}

for a ScaleToZero proposal ``workload``, ``replicas`` and ``idle_evidence`` instead of ``nodes``, and for a Sharing
proposal ``node``, ``gpus``, ``change``, ``saving_usd_per_hour``, ``reason`` and ``risk``, and for a Packing round
``remove`` (the nodes it empties), ``moves`` and ``saving_usd_per_hour``. Anything
else in ``detail`` is plain text: shown as it is, with no plan id to bind a decision to.
"""

from __future__ import annotations

import json
from typing import Annotated
from typing import Final

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import StrictStr
from pydantic import ValidationError

MAX_NODES: Final = 64
Short = Annotated[StrictStr, Field(max_length=253)]
Dollars = Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)]


class _Lenient(BaseModel):
    # Fields a newer optimizer adds are ignored, not a reason to hide the plan.
    model_config = ConfigDict(extra="ignore")


class PlannedNode(_Lenient):
    location: Short
    instance_type: Short
    gpus: Annotated[int, Field(ge=0, le=1024)] = 0
    gpu_product: Short = ""
    compute_usd_per_hour: Dollars = 0.0
    transfer_usd_per_hour: Dollars = 0.0
    # "measured": priced at the egress the policy's earlier nodes measured there; else the configured estimate.
    transfer_basis: Short = "estimate"
    pods: Annotated[list[Short], Field(max_length=1000)] = Field(default_factory=list)

    @property
    def usd_per_hour(self) -> float:
        return round(self.compute_usd_per_hour + self.transfer_usd_per_hour, 6)


class ProposedPlan(_Lenient):
    plan_id: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    batch: Short = ""
    summary: Annotated[StrictStr, Field(max_length=2000)] = ""
    nodes: Annotated[list[PlannedNode], Field(max_length=MAX_NODES)] = Field(default_factory=list)
    total_usd_per_hour: Dollars | None = None
    # ScaleToZero: the workload (namespace/kind/name), its replicas before, and why it counts as idle.
    workload: Annotated[StrictStr, Field(max_length=600)] = ""
    replicas: Annotated[int, Field(ge=0, le=100_000)] | None = None
    idle_evidence: Annotated[StrictStr, Field(max_length=2000)] = ""
    # Packing: the nodes the round empties and removes, and the pods it moves ("ns/pod: from -> to").
    remove: Annotated[list[Short], Field(max_length=MAX_NODES)] = Field(default_factory=list)
    moves: Annotated[list[Annotated[StrictStr, Field(max_length=600)]], Field(max_length=1000)] = Field(
        default_factory=list)
    # Sharing: the node, the change (time-slicing replicas or a MIG geometry), what it saves and what it risks.
    node: Short = ""
    gpus: Annotated[int, Field(ge=0, le=1024)] | None = None
    change: Short = ""
    saving_usd_per_hour: Dollars | None = None
    reason: Annotated[StrictStr, Field(max_length=2000)] = ""
    risk: Annotated[StrictStr, Field(max_length=2000)] = ""
    console_url: Annotated[StrictStr, Field(max_length=2000, pattern=r"^https?://[^\s]+$")] | None = None

    @property
    def total(self) -> float:
        if self.total_usd_per_hour is not None:
            return self.total_usd_per_hour
        return round(sum(n.usd_per_hour for n in self.nodes), 6)


def parse_plan(detail: str) -> ProposedPlan | None:
    """The plan in a report's detail, or None when the detail is plain text (or JSON of another shape)."""
    text = detail.strip()
    if not text.startswith("{"):
        return None
    try:
        return ProposedPlan.model_validate(json.loads(text))
    except (ValueError, RecursionError, ValidationError):
        return None


def console_url(detail: str) -> str | None:
    """The operation's page in the cluster's Temporal UI, when the report names it."""
    text = detail.strip()
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    url = value.get("console_url") if isinstance(value, dict) else None
    if isinstance(url, str) and len(url) <= 2000 and url.startswith(("http://", "https://")) and " " not in url:
        return url
    return None
