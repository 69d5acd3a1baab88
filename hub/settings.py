"""Hub settings and the injectable clock."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from pathlib import Path
from typing import Final

Clock = Callable[[], datetime]
"""Returns the current time as a timezone-aware datetime. Injected so tests can move time (e.g. the 24 h
rotation grace) without waiting."""

BOOTSTRAP_KEY_ENV: Final = "KUBEON_HUB_BOOTSTRAP_ADMIN_KEY"
DATABASE_URL_ENV: Final = "KUBEON_HUB_DATABASE_URL"
DEFAULT_DATABASE_URL: Final = "sqlite:///kubeon-hub.db"
MIN_BOOTSTRAP_KEY_LENGTH: Final = 24
MAX_BODY_BYTES: Final = 1024 * 1024
ROTATION_GRACE: Final = timedelta(hours=24)


def system_clock() -> datetime:
    return datetime.now(UTC)


class SettingsError(ValueError):
    """The hub cannot start with these settings; the message says which one and why."""


@dataclass(frozen=True)
class HubSettings:
    database_url: str = DEFAULT_DATABASE_URL
    # People and automation start from this key: it creates users and their API keys. None: no bootstrap admin.
    bootstrap_admin_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    # After a rotation the previous cluster token keeps working until the new one is used, or this long.
    rotation_grace: timedelta = ROTATION_GRACE
    # The address optimizers reach this hub at, filled into the web UI's install commands. None: the address the
    # browser used (right unless the hub sits behind a proxy or a load balancer of another name).
    public_url: str | None = None

    def __post_init__(self) -> None:
        key = self.bootstrap_admin_key
        if key is not None and (len(key) < MIN_BOOTSTRAP_KEY_LENGTH or any(c.isspace() for c in key)):
            raise SettingsError(
                f"bootstrap admin key must be at least {MIN_BOOTSTRAP_KEY_LENGTH} characters without whitespace "
                f"(got {len(key)}); generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        if self.max_body_bytes < 1024:
            raise SettingsError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise SettingsError(f"public URL must start with http:// or https://, got {self.public_url[:80]!r}")
        if self.rotation_grace <= timedelta(0):
            raise SettingsError(f"rotation_grace must be positive, got {self.rotation_grace}")


def read_bootstrap_key(path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The bootstrap admin key from ``path`` (surrounding whitespace stripped), else from the environment."""
    env = os.environ if environ is None else environ
    if path:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise SettingsError(f"cannot read bootstrap admin key file {path}: {exc.strerror or exc}") from exc
        if not key:
            raise SettingsError(f"bootstrap admin key file {path} is empty")
        return key
    return env.get(BOOTSTRAP_KEY_ENV) or None
