"""A request-body limit for the ASGI apps (the hub and the gateway): 413 by Content-Length before anything is read,
and while reading a body sent without one (chunked)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp
from starlette.types import Message
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

# (status, code, message) -> the answer, in the app's own error shape.
Refusal = Callable[[int, str, str], ASGIApp]


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, *, refusal: Refusal) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        answer: ASGIApp | None = None
        if length is not None and not length.isdigit():
            answer = self.refusal(400, "invalid_content_length", f"invalid Content-Length header {length[:40]!r}")
        elif length is not None and int(length) > self.max_bytes:
            answer = self._too_large(f"Content-Length {int(length)}")
        if answer is not None:
            await answer(scope, receive, send)
            return
        received = 0
        refused = False

        async def limited_receive() -> Message:
            # Over the limit while reading: answer 413 here, then tell the application the client went away.
            # Raising instead would reach FastAPI's body parser, which turns any error into a 400.
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._too_large(f"more than {self.max_bytes} bytes")(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:  # the 413 is the answer; whatever the app says after the disconnect is dropped
                await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # The app failed reading the body we cut short (Starlette's ClientDisconnect): the 413 is sent.

    def _too_large(self, got: str) -> ASGIApp:
        message = f"request body too large: {got}, the limit is {self.max_bytes} bytes"
        return self.refusal(413, "body_too_large", message)
