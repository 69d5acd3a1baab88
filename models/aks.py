"""``capacity.provider: aks-nodepools``: what the worker needs to reach the cluster's AKS agent pools (the chart's
``capacity.aks``), checked at start naming the field."""

from __future__ import annotations

import re
from typing import Final

# The agent pool an AKS node's Node carries, and the mark of a GPU node (kubernetes.azure.com/accelerator=nvidia).
AGENTPOOL_LABEL: Final = "kubernetes.azure.com/agentpool"
ACCELERATOR_LABEL: Final = "kubernetes.azure.com/accelerator"
# Azure's naming rules: a subscription is a GUID; a resource group 1-90 letters, digits, _ - . ( ) not ending in
# "."; a managed cluster 1-63 letters, digits, _ or -, starting and ending with a letter or digit.
SUBSCRIPTION: Final = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
RESOURCE_GROUP: Final = re.compile(r"[\w\-.()]{0,89}[\w\-()]")
CLUSTER_NAME: Final = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?")


def aks_setting_error(field: str, value: str) -> str | None:
    """Why ``value`` is not a valid capacity.aks ``field`` (subscription, resourceGroup, clusterName), or None."""
    pattern, what = {"subscription": (SUBSCRIPTION, "the Azure subscription's id (a GUID)"),
                     "resourceGroup": (RESOURCE_GROUP, "the cluster's resource group (1-90 letters, digits, _ - . "
                                                       "( ), not ending in '.')"),
                     "clusterName": (CLUSTER_NAME, "the AKS cluster's name (1-63 letters, digits, _ or -)")}[field]
    if pattern.fullmatch(value):
        return None
    return f"is required with capacity.provider aks-nodepools: {what}, not {value!r}"
