"""What every page needs: who is signed in, the form's CSRF check, and HTML error pages for ``/ui``."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Annotated
from typing import Any
from typing import Final
from urllib.parse import quote

from fastapi import Depends
from fastapi import FastAPI
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.responses import Response
from pydantic import TypeAdapter
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hub.auth import HubState
from hub.auth import NowDep
from hub.auth import SessionDep
from hub.auth import hub_state
from hub.errors import HubError
from hub.errors import Unprocessable
from hub.schemas import Name
from hub.web import sessions
from hub.web.forms import Form
from hub.web.forms import read_form
from hub.web.render import page
from hub.web.sessions import SignedIn

StateDep = Annotated[HubState, Depends(hub_state)]
UI_PREFIX = "/ui"


class SignInRequired(Exception):
    """No valid session: a page redirects to the sign-in, a POST is refused (401)."""


def maybe_signed_in(request: Request, state: StateDep, session: SessionDep, now: NowDep) -> SignedIn | None:
    return sessions.current(request, session, now, state.settings)


def signed_in(who: Annotated[SignedIn | None, Depends(maybe_signed_in)]) -> SignedIn:
    if who is None:
        raise SignInRequired
    return who


MaybeSignedInDep = Annotated[SignedIn | None, Depends(maybe_signed_in)]
SignedInDep = Annotated[SignedIn, Depends(signed_in)]


async def checked_form(request: Request, who: SignedInDep) -> Form:
    """The POSTed form after its CSRF token matched the session's (and its Origin is the hub's)."""
    form = await read_form(request)
    sessions.check_csrf(request, form.get("csrf_token") or None, who.csrf_token)
    return form


FormDep = Annotated[Form, Depends(checked_form)]


_NAME: Final = TypeAdapter(Name)


def valid_name(value: str, field: str) -> str:
    """A cluster or pool name from a form, checked as the API checks it in a path."""
    try:
        return _NAME.validate_python(value)
    except ValidationError:
        raise Unprocessable(f"{field}: not a valid name", details=[(field, "lowercase DNS label, at most 63 "
                                                                            "characters")]) from None


def redirect(path: str) -> Response:
    return RedirectResponse(path, status_code=303)


def install_error_pages(app: FastAPI) -> None:
    """Errors under ``/ui`` as pages, every other path keeps the API's JSON errors (the handlers installed by
    ``hub.http.install_error_handlers``, which this wraps)."""
    classes: tuple[type[Exception], ...] = (HubError, RequestValidationError, StarletteHTTPException)

    def for_ui(api_handler: Callable[[Request, Exception], Any]) -> Callable[[Request, Exception], Awaitable[Any]]:
        async def handler(request: Request, exc: Exception) -> Any:
            if not request.url.path.startswith(UI_PREFIX + "/") and request.url.path != UI_PREFIX:
                answer = api_handler(request, exc)
                return await answer if inspect.isawaitable(answer) else answer
            return error_page(request, exc)

        return handler

    for cls in classes:
        app.add_exception_handler(cls, for_ui(app.exception_handlers[cls]))
    app.add_exception_handler(SignInRequired, _sign_in_required)


async def _sign_in_required(request: Request, _: Exception) -> Response:
    if request.method in ("GET", "HEAD"):
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return redirect(f"{UI_PREFIX}/sign-in?next={quote(target, safe='')}")
    return page(request, "error.html", title="Sign in first", signed_in=None, status_code=401,
                message="Your session is missing, expired or was signed out: sign in again. Nothing was changed.",
                details=[])


def error_page(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HubError):
        status, message, details = exc.status_code, exc.message, exc.details
    elif isinstance(exc, RequestValidationError):
        status, message = 422, "The address or its parameters are not valid."
        details = [(".".join(str(p) for p in err["loc"]), str(err["msg"])) for err in exc.errors()]
    elif isinstance(exc, StarletteHTTPException):
        status, message, details = exc.status_code, "No such page." if exc.status_code == 404 else str(
            exc.detail), []
    else:  # pragma: no cover - only the three classes above are routed here
        status, message, details = 500, "internal error", []
    return page(request, "error.html", title=f"Error {status}", signed_in=None, status_code=status,
                message=message, details=details)
