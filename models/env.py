"""Settings from ``KUBEON_*`` environment variables, for each of the product's processes (the worker, the gateway):
the chart's values reach them as environment variables, one per settings field (``KUBEON_`` + its name in upper
case), and an invalid value fails naming the variable that holds it."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TypeVar

from pydantic import BaseModel
from pydantic import ValidationError


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


def url_setting(value: str | None, *, https_only: bool = False) -> str | None:
    """A URL setting, checked: empty, or ``http(s)://host[:port][/path]`` with its trailing slash dropped. The
    scheme is required (google-cloud-compute turns a bare host:port into https); ``https_only`` where bearer
    tokens travel (azure-core refuses them over http, so does the setting)."""
    if not value:
        return value
    if not re.match(r"^https://[^/\s]+" if https_only else r"^https?://[^/\s]+", value):
        kind = "an https" if https_only else "an http(s)"
        raise ValueError(f"{value!r} is not {kind} URL (e.g. https://host.example.com:8443)")
    return value.rstrip("/")
