"""Settings from ``KUBEON_*`` environment variables, for each of the product's processes (the worker, the gateway):
the chart's values reach them as environment variables, one per settings field (``KUBEON_`` + its name in upper
case), and an invalid value fails naming the variable that holds it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    pass


SettingsT = TypeVar("SettingsT", bound=BaseModel)


def env_names(model: type[BaseModel]) -> dict[str, str]:
    """Each settings field's environment variable."""
    return {name: "KUBEON_" + name.upper() for name in model.model_fields}


def from_env(model: type[SettingsT], environ: Mapping[str, str] | None = None) -> SettingsT:
    """The settings the environment sets (an empty variable counts as unset); ``ConfigError`` naming every
    variable whose value is invalid."""
    environ = os.environ if environ is None else environ
    names = env_names(model)
    values = {field: environ[var] for field, var in names.items() if environ.get(var, "") != ""}
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            field = str(err["loc"][0]) if err["loc"] else "?"
            problems.append(f"{names.get(field, field)}: {err['msg']}")
        raise ConfigError("; ".join(problems)) from None
