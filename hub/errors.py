"""Named errors. Every 4xx/5xx answer of the hub has the same JSON shape::

    {"error": "<code>", "message": "<what is wrong, naming the cause>", "details": [{"field": ..., "message": ...}]}
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic import Field


class ErrorDetail(BaseModel):
    field: str = Field(description="the offending field, e.g. `spec.limits.maxNodes`, `query.after`, `body`")
    message: str


class ErrorResponse(BaseModel):
    error: str = Field(description="a stable machine-readable code, e.g. `invalid_token`, `invalid_policy`")
    message: str = Field(description="a human-readable explanation naming the cause")
    details: list[ErrorDetail] = Field(default_factory=list)


class HubError(Exception):
    """An answer the hub gives instead of a result: its HTTP status, its stable code and a message naming the cause.

    Each subclass names one status and its default code in its class line; ``code=`` at raise time narrows it
    (``Conflict("...", code="stale_plan")``).
    """

    status_code = 400
    code = "bad_request"

    def __init_subclass__(cls, *, status_code: int | None = None, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if status_code is not None:
            cls.status_code = status_code
        if code is not None:
            cls.code = code

    def __init__(
        self,
        message: str,
        *,
        details: Sequence[tuple[str, str]] = (),
        headers: Mapping[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.details = list(details)
        self.headers = dict(headers or {})
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=self.code,
            message=self.message,
            details=[ErrorDetail(field=f, message=m) for f, m in self.details],
        ).model_dump()


class BadRequest(HubError, status_code=400, code="bad_request"): ...


class InvalidJson(HubError, status_code=400, code="invalid_json"): ...


class Unauthorized(HubError, status_code=401, code="invalid_token"):
    """401: no usable credentials. Carries ``WWW-Authenticate`` as RFC 6750 asks."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        description = message.replace('"', "'")
        super().__init__(
            message,
            code=code,
            headers={"WWW-Authenticate": f'Bearer realm="kubeon-hub", error="invalid_token", '
                     f'error_description="{description}"'},
        )


class Forbidden(HubError, status_code=403, code="forbidden"): ...


class NotFound(HubError, status_code=404, code="not_found"): ...


class Conflict(HubError, status_code=409, code="conflict"): ...


# The body limit's answer (hub/http.py's BodyLimit).
class PayloadTooLarge(HubError, status_code=413, code="body_too_large"): ...


class UnsupportedMediaType(HubError, status_code=415, code="unsupported_media_type"): ...


class Unprocessable(HubError, status_code=422, code="invalid_request"): ...


# The database did not answer: the client may retry.
class ServiceUnavailable(HubError, status_code=503, code="database_unavailable"): ...
