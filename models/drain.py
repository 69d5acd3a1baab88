"""Draining a burst node and sending it home: cordon, evict, terminate, remove (``DrainWorkflow``)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from models.base import Model
from models.cost import TransferReading
from models.node import InstanceRef
from models.provisioning import OperationSettings


class DrainPhase(StrEnum):
    """A drain (``DrainWorkflow``): cordon, evict honouring PDBs, terminate, remove; then done."""

    DRAINING = "Draining"
    COMPLETED = "Completed"


class DrainInput(Model):
    cluster: str
    policy: str
    operation: str
    node_name: str
    instance: InstanceRef | None = None
    reason: str = ""
    settings: OperationSettings = Field(default_factory=OperationSettings)


class EvictionResult(Model):
    remaining: list[str]
    blocked: dict[str, str] = Field(default_factory=dict)  # pod -> "blocked by PDB <name>"


class NodeRef(Model):
    node_name: str
    # Only pods that request GPUs (a MIG reconfiguration evicts those; the node stays).
    gpu_only: bool = False


class DrainResult(Model):
    node_name: str
    evicted: int
    instance_terminated: bool
    node_removed: bool
    transfer: TransferReading | None = None  # read just before the Node's removal (None: not read)
    terminated_at: datetime | None = None  # when the instance's termination was done (workflow time)


class NodeRemoval(Model):
    node_name: str
    operation: str


class GoneCheck(Model):
    node_name: str
    instance: InstanceRef | None = None


class DrainStatus(Model):
    status: str
    blocked: dict[str, str] = Field(default_factory=dict)
    cordoned: bool = False
    evicted: list[str] = Field(default_factory=list)  # namespace/name, in eviction order
    pdb_waits: dict[str, int] = Field(default_factory=dict)  # pod -> eviction rounds a PDB refused it
    terminated: str | None = None  # the instance ID, once terminated
    node_removed: bool = False
    phase: DrainPhase = DrainPhase.DRAINING
    history: list[str] = Field(default_factory=list)  # what it did, a line per status
