"""HTTP plumbing: the body size limit, JSON body parsing after authentication, uniform error responses, and the
OpenAPI additions for bodies parsed that way."""

from __future__ import annotations

import email.message
import json
import logging
import re
from collections.abc import Awaitable
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from typing import TypeVar

from fastapi import FastAPI
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic import TypeAdapter
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hub.errors import Conflict
from hub.errors import ErrorResponse
from hub.errors import HubError
from hub.errors import InvalidJson
from hub.errors import ServiceUnavailable
from hub.errors import Unprocessable
from hub.errors import UnsupportedMediaType

log = logging.getLogger("hub")
M = TypeVar("M", bound=BaseModel)


# ----- body size -----


def refusal(status: int, code: str, message: str) -> JSONResponse:
    """The body limit's answer (common/asgi.py) in the hub's error shape; the connection closes after it."""
    body = ErrorResponse(error=code, message=message).model_dump()
    return JSONResponse(body, status_code=status, headers={"connection": "close"})


# ----- JSON bodies -----


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request) -> Any:
    """The decoded JSON body: 415 unless Content-Type is JSON, 400 when empty or not JSON."""
    content_type = request.headers.get("content-type")
    if not content_type:
        raise UnsupportedMediaType("Content-Type header missing: send the body as application/json")
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    if message.get_content_maintype() != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise UnsupportedMediaType(f"Content-Type {content_type[:80]!r} is not supported: send application/json")
    raw = await request.body()
    if not raw.strip():
        raise InvalidJson("request body is empty: send a JSON object", code="empty_body")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise InvalidJson(f"request body is not UTF-8 encoded JSON: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise InvalidJson(
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise InvalidJson("request body is JSON nested too deeply") from None
    except ValueError as exc:  # NaN, Infinity
        raise InvalidJson(f"request body is not valid JSON: {exc}") from None


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """Dependency parsing the body as ``model``. Declared after the auth dependency, so the caller is
    authenticated before its body is looked at (FastAPI resolves dependencies in parameter order)."""

    async def dependency(request: Request) -> M:
        return validate_body(model, await read_json(request))

    return dependency


def validate_body(model: type[M], data: Any) -> M:
    """``data`` as ``model``, or ``Unprocessable`` naming each field (the API's bodies and the web UI's forms)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        details = [(_field(err["loc"]), err["msg"].removeprefix("Value error, ")) for err in exc.errors()]
        raise Unprocessable(
            "invalid request body: " + "; ".join(f"{f}: {m}" for f, m in details), details=details
        ) from None


def body_doc(model: type[BaseModel] | str, description: str = "") -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is parsed by ``json_body``/``read_json``."""
    name = model if isinstance(model, str) else model.__name__
    return {"requestBody": {
        "required": True,
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }}


def _field(loc: tuple[int | str, ...]) -> str:
    parts = [p for p in loc if p not in ("body",)]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or part in ("function-after", "function-before"):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


# ----- errors -----


def _json_error(error: HubError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


async def _hub_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HubError)
    return _json_error(exc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details = [(_field(tuple(err["loc"])), str(err["msg"])) for err in exc.errors()]
    return _json_error(Unprocessable(
        "invalid request: " + "; ".join(f"{f}: {m}" for f, m in details), details=details
    ))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = HTTPStatus(exc.status_code)
    headers: dict[str, str] = {}
    if exc.status_code == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        allowed = _allowed_methods(request)
        message = f"method {request.method} not allowed on {request.url.path} (allowed: {', '.join(allowed)})"
        headers = {"Allow": ", ".join(allowed)}
    else:
        message = str(exc.detail)
    error = HubError(message, code=status.phrase.lower().replace(" ", "_").replace("-", "_"),
                     headers=headers if exc.status_code == 405 else exc.headers)
    error.status_code = exc.status_code
    return _json_error(error)


def _allowed_methods(request: Request) -> list[str]:
    """The methods the API documents for this path (from the OpenAPI document: every router included)."""
    paths: dict[str, dict[str, Any]] = request.app.openapi().get("paths", {})
    allowed: set[str] = set()
    for template, operations in paths.items():
        if re.fullmatch(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)), request.url.path):
            allowed.update(method.upper() for method in operations)
    return sorted(allowed)


async def _database_error(_: Request, exc: Exception) -> JSONResponse:
    log.error("database error: %s", exc)
    return _json_error(ServiceUnavailable("the hub's database is unavailable; retry later"))


async def _integrity_error(_: Request, exc: Exception) -> JSONResponse:
    log.warning("integrity error (a concurrent change?): %s", exc)
    return _json_error(Conflict("a concurrent request changed the same thing; retry", code="concurrent_change"))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error", exc_info=exc)
    error = HubError("internal error in the hub; see its log", code="internal_error")
    error.status_code = 500
    return _json_error(error)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(HubError, _hub_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _database_error)
    app.add_exception_handler(IntegrityError, _integrity_error)
    app.add_exception_handler(Exception, _internal_error)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in {
        400: "Bad request: body is not JSON, empty, or Content-Length is invalid",
        401: "Missing, malformed, unknown, revoked or expired token/key",
        403: "Authenticated, but not allowed (wrong kind of credential or role)",
        413: "Body larger than the limit (1 MiB by default)",
        415: "Content-Type is not application/json",
        422: "Invalid request: `details` names each field",
    }.items()
}


# ----- OpenAPI -----


def install_openapi(app: FastAPI, body_models: list[type[BaseModel]], extra: dict[str, TypeAdapter[Any]]) -> None:
    """Add the schemas of bodies parsed by hand (and the GpuPolicy document) to ``components.schemas``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        adapters: dict[str, TypeAdapter[Any]] = {m.__name__: TypeAdapter(m) for m in body_models}
        adapters.update(extra)
        for name, adapter in adapters.items():
            model_schema = adapter.json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
            for def_name, definition in model_schema.pop("$defs", {}).items():
                components.setdefault(def_name, definition)
            components[name] = model_schema
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
