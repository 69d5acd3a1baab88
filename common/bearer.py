"""An HTTP client whose bearer token is a mounted file, read at every call so a rotated token is used at once
(the optimizer's hub client and the on-prem agent's)."""

from __future__ import annotations

from pathlib import Path

import httpx


class TokenFileError(Exception):
    """The token file cannot be read or is empty: the message names the file."""


class BearerFileClient:
    """``credential`` names the token in errors; ``unauthorized`` is the error raised for a missing one (the
    caller's own 401 type, so one except clause handles both)."""

    def __init__(self, url: str, token_file: Path, *, user_agent: str, credential: str = "token",
                 unauthorized: type[Exception] = TokenFileError, timeout: float = 10.0, ca_file: str | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.token_file = token_file
        self._credential = credential
        self._unauthorized = unauthorized
        self._http = httpx.Client(base_url=self.url, timeout=timeout, verify=ca_file or True, transport=transport,
                                  headers={"User-Agent": user_agent})

    def close(self) -> None:
        self._http.close()

    def token(self) -> str:
        try:
            token = self.token_file.read_text().strip()
        except OSError as exc:
            raise self._unauthorized(f"no {self._credential}: cannot read {self.token_file} ({exc.strerror})") from None
        if not token:
            raise self._unauthorized(f"no {self._credential}: {self.token_file} is empty")
        return token

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token()}"}
