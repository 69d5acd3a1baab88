"""The optimizer's configuration: the chart's values reach the worker as environment variables (R1.2)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.policy import Mode


class ConfigError(ValueError):
    pass


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    # Every policy without a mode of its own runs in this one; Recommend means installing changes nothing (R1.4).
    default_mode: Mode = "Recommend"
    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    task_queue: str = "kubeon-gpu"


ENV = {
    "cluster": "KUBEON_CLUSTER",
    "default_mode": "KUBEON_DEFAULT_MODE",
    "temporal_address": "KUBEON_TEMPORAL_ADDRESS",
    "temporal_namespace": "KUBEON_TEMPORAL_NAMESPACE",
    "task_queue": "KUBEON_TASK_QUEUE",
}


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from the environment; an invalid value fails naming the variable that holds it."""
    environ = os.environ if environ is None else environ
    values = {field: environ[var] for field, var in ENV.items() if var in environ}
    try:
        return Settings.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            field = str(err["loc"][0]) if err["loc"] else "?"
            problems.append(f"{ENV.get(field, field)}: {err['msg']}")
        raise ConfigError("; ".join(problems)) from None
