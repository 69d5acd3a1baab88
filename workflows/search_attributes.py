"""Kept while other modules move to ``models.search_attributes`` (the keys are shared with activities)."""

from models.search_attributes import ALL, CLUSTER, LOCATION, OPERATION, OPERATION_KIND, PHASE, POLICY

__all__ = ["ALL", "CLUSTER", "LOCATION", "OPERATION", "OPERATION_KIND", "PHASE", "POLICY"]
