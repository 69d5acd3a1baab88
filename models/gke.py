"""``capacity.provider: gke-nodepools``: what the worker needs to reach the cluster's GKE node pools (the chart's
``capacity.gke``: project, location, clusterName), checked at start naming the field."""

from __future__ import annotations

import re
from typing import Final

# The node pool a GKE node's Node carries, and the accelerator label GKE adds to GPU nodes.
NODEPOOL_LABEL: Final = "cloud.google.com/gke-nodepool"
ACCELERATOR_LABEL: Final = "cloud.google.com/gke-accelerator"
# Set on a pool's Nodes while an operation of ours holds its disruption frozen (value: the operation).
FROZEN_BY_ANNOTATION: Final = "gpu.kubeon.io/disruption-frozen-by"

# GCP's documented shapes: project ids 6-30 lowercase letters, digits, hyphens (a letter first, no hyphen last);
# a location is a region (europe-west4) or a zone (europe-west4-a); cluster names 1-40, lowercase, as GKE asks.
_SHAPES: Final = {
    "project": (re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]"), "a Google Cloud project id (6-30 lowercase letters, "
                "digits or -, e.g. acme-ml)"),
    "location": (re.compile(r"[a-z]+-[a-z]+[0-9]+(-[a-z])?"), "a GKE location: a region (europe-west4) or a zone "
                 "(europe-west4-a)"),
    "clusterName": (re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?"), "the GKE cluster's name (1-40 lowercase "
                    "letters, digits or -)"),
}


def gke_setting_error(field: str, value: str) -> str | None:
    """Why ``value`` cannot be ``capacity.gke.<field>`` (None when it can)."""
    shape, what = _SHAPES[field]
    if shape.fullmatch(value):
        return None
    return f"capacity.gke.{field} is required with capacity.provider gke-nodepools: {what}, not {value!r}"


def region_of(location: str) -> str:
    """The region of a GKE location (a zone's region, or the region itself)."""
    return re.sub(r"-[a-z]$", "", location)
