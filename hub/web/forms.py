"""HTML form bodies (``application/x-www-form-urlencoded``), parsed without a multipart library: the UI's forms
carry only short texts and one YAML document."""

from __future__ import annotations

from typing import Final
from urllib.parse import parse_qsl

from fastapi import Request

from hub.errors import BadRequest
from hub.errors import UnsupportedMediaType

MAX_FIELDS: Final = 50
FORM_TYPE: Final = "application/x-www-form-urlencoded"


class Form:
    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._values: dict[str, str] = {}
        for key, value in pairs:
            self._values.setdefault(key, value)  # the first of a repeated field counts

    def get(self, name: str, default: str = "") -> str:
        return self._values.get(name, default)

    def optional(self, name: str) -> str | None:
        value = self._values.get(name, "").strip()
        return value or None

    def __contains__(self, name: str) -> bool:
        return name in self._values


async def read_form(request: Request) -> Form:
    """The form, or 415 (another content type) / 400 (not UTF-8, too many fields). The body size limit of the
    whole hub (``BodySizeLimit``) applies first."""
    content_type = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if content_type != FORM_TYPE:
        raise UnsupportedMediaType(f"send the form as {FORM_TYPE}, not {content_type[:60]!r}")
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=MAX_FIELDS, encoding="utf-8",
                          errors="strict")
    except UnicodeDecodeError:
        raise BadRequest("the form is not UTF-8", code="invalid_form") from None
    except ValueError as exc:
        raise BadRequest(f"invalid form: {exc}", code="invalid_form") from None
    # Browsers send CR LF in textareas; the stored YAML and texts use LF.
    return Form([(k, v.replace("\r\n", "\n")) for k, v in pairs])
