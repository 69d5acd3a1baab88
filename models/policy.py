"""The ``GpuPolicy`` resource (``gpu.kubeon.io/v1``, cluster-scoped): R3.1-R3.3.

The CRD's OpenAPI schema in ``charts/kubeon-gpu-optimizer/crds/`` must accept and reject the same documents as
these models; ``tests/models/test_policy.py`` applies one corpus to both. Field types are strict (a string is
not a number) because the apiserver is strict too.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)
from pydantic.alias_generators import to_camel

API_GROUP: Final = "gpu.kubeon.io"
API_VERSION: Final = f"{API_GROUP}/v1"
KIND: Final = "GpuPolicy"
PLURAL: Final = "gpupolicies"

Mode = Literal["Recommend", "Approve", "Automatic"]
MODES: Final[tuple[str, ...]] = ("Recommend", "Approve", "Automatic")

# R3.2 names these kinds; only Burst has a spec so far. The others are listed so that an error can say
# "not supported yet" instead of "unknown", and so that adding one is a matter of adding its spec.
SUPPORTED_KINDS: Final[tuple[str, ...]] = ("Burst",)
PLANNED_KINDS: Final[tuple[str, ...]] = ("ScaleToZero", "Sharing", "Autoscaling", "Packing", "GpuTypeFit")

PROVIDERS: Final[tuple[str, ...]] = ("aws", "gcp", "azure", "onprem", "sim")

# These patterns are written into the CRD schema verbatim (the corpus test compares them).
DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
LOCATION_PATTERN: Final = rf"^({'|'.join(PROVIDERS)})/{DNS_LABEL}$"
# A taint key is a qualified name: an optional DNS-subdomain prefix and "/", then a name of up to 63 chars.
TAINT_KEY_PATTERN: Final = (
    rf"^({DNS_LABEL}(\.{DNS_LABEL})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
)
RESOURCE_NAME_PATTERN: Final = rf"^{DNS_LABEL}(\.{DNS_LABEL})*$"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class Workloads(_Spec):
    tolerate: Annotated[StrictStr, Field(pattern=TAINT_KEY_PATTERN, max_length=316)]


class Limits(_Spec):
    max_nodes: Annotated[StrictInt, Field(ge=1, le=1000)]
    # USD per GPU-hour, data transfer included (R4.8).
    max_gpu_hour: Annotated[StrictFloat, Field(gt=0, le=10000)]  # strict float takes ints, not strings


class Location(str):
    """``<provider>/<region or pool>``; the label form replaces ``/`` with ``.`` (label values cannot hold ``/``)."""

    @property
    def provider(self) -> str:
        return self.split("/", 1)[0]

    @property
    def region(self) -> str:
        return self.split("/", 1)[1]

    @property
    def label_value(self) -> str:
        return self.replace("/", ".")


def _check_location(value: str) -> str:
    provider, sep, region = value.partition("/")
    if not sep:
        raise ValueError(f"location {value!r} must be <provider>/<region or pool>, e.g. aws/eu-central-1")
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r} in location {value!r} (one of {', '.join(PROVIDERS)})")
    if not re.fullmatch(DNS_LABEL, region):
        raise ValueError(f"region or pool {region!r} in location {value!r} must be lowercase letters, digits, '-'")
    return value


LocationName = Annotated[StrictStr, Field(max_length=80), AfterValidator(_check_location)]


class GpuPolicySpec(_Spec):
    kind: StrictStr
    mode: Mode | None = None
    workloads: Workloads
    locations: Annotated[list[LocationName], Field(min_length=1, max_length=64)]
    limits: Limits
    return_home: StrictBool = False

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind in SUPPORTED_KINDS:
            return kind
        if kind in PLANNED_KINDS:
            raise ValueError(f"kind {kind!r} is not supported yet by this version (supported: Burst)")
        raise ValueError(f"unknown kind {kind!r} (supported: {', '.join(SUPPORTED_KINDS)})")

    @field_validator("locations")
    @classmethod
    def _unique_locations(cls, locations: list[str]) -> list[str]:
        seen: set[str] = set()
        for loc in locations:
            if loc in seen:
                raise ValueError(f"duplicate location {loc!r}")
            seen.add(loc)
        return locations

    def effective_mode(self, default_mode: Mode) -> Mode:
        """The mode in force: the policy's own, else the installation's ``defaultMode`` (R1.2)."""
        return self.mode or default_mode

    @property
    def location_names(self) -> list[Location]:
        return [Location(loc) for loc in self.locations]


class ObjectMeta(BaseModel):
    # Metadata read back from the apiserver carries uid, resourceVersion, managedFields...: keep them all.
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: Annotated[StrictStr, Field(pattern=RESOURCE_NAME_PATTERN, max_length=253)]
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class GpuPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["gpu.kubeon.io/v1"] = Field(alias="apiVersion")
    kind: Literal["GpuPolicy"]
    metadata: ObjectMeta
    spec: GpuPolicySpec
    status: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.metadata.name


class PolicyError(ValueError):
    """A policy document is invalid; ``errors`` lists (field path, message), the first named in ``str()``."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in errors))

    @property
    def fields(self) -> list[str]:
        return [path for path, _ in self.errors]


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue  # pydantic's internal validator and union-member steps
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_policy(document: Any) -> GpuPolicy:
    """Validate a GpuPolicy document (a dict as read from YAML or the apiserver). Raises ``PolicyError``."""
    if not isinstance(document, dict):
        raise PolicyError([("(document)", f"a GpuPolicy must be a mapping, got {type(document).__name__}")])
    try:
        return GpuPolicy.model_validate(document)
    except ValidationError as exc:
        errors: list[tuple[str, str]] = []
        for err in exc.errors(include_url=False):
            path = _path(tuple(err["loc"]))
            msg = err["msg"].removeprefix("Value error, ")
            if (path, msg) not in errors:
                errors.append((path, msg))
        raise PolicyError(errors) from None


def location_label_value(location: str) -> str:
    return location.replace("/", ".")
