"""The base of every workflow and activity model: one model per argument, so fields can be added without breaking
histories (new fields need defaults)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)
