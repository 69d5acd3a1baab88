"""The base of every workflow and activity model: one model per argument, so fields can be added without breaking
histories (new fields need defaults)."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field


class Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)


class OperationViewBase(Model):
    """What every operation's ``state`` query (and `ops show`) returns, whatever its kind; each kind adds its own
    phase and what it is about."""

    operation: str
    workflow_id: str
    cluster: str
    policy: str
    approver: str | None = None
    message: str = ""
    history: list[str] = Field(default_factory=list)
