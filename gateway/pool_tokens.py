"""The gateway's check of an on-prem server's join token (R4.5: "joining with a join token").

A node of an ``onprem/<pool>`` location presents, besides its one-time ticket, the pool's join token in the
``X-Kubeon-Join-Token`` header. The gateway compares it (constant time) with the value behind the location's
``existingSecret``, mounted read-only at ``<tokens dir>/onprem.<pool>/token`` (the chart's layout). Nodes of other
locations are not asked for one. The optimizer itself never reads the Secret (R5.4).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Final

from models.join import JOIN_TOKEN_HEADER

DEFAULT_TOKENS_DIR: Final = Path("/var/run/kubeon/burst")


class JoinTokenRefused(Exception):
    """The join token is missing, wrong, or the gateway has none for the location; the message says which."""


def token_file(tokens_dir: Path, location: str) -> Path:
    return tokens_dir / location.replace("/", ".", 1) / "token"


def check_join_token(location: str, presented: str | None, tokens_dir: Path = DEFAULT_TOKENS_DIR) -> None:
    """Raise ``JoinTokenRefused`` unless ``presented`` is the join token of ``location``'s pool (onprem only)."""
    if not location.startswith("onprem/"):
        return
    path = token_file(tokens_dir, location)
    try:
        expected = path.read_text().strip()
    except OSError as exc:
        raise JoinTokenRefused(f"{location}: the gateway has no join token for this pool ({path}: "
                               f"{exc.strerror or exc}); set the location's credentials.existingSecret") from None
    if not expected:
        raise JoinTokenRefused(f"{location}: the pool's join token file {path} is empty")
    if not presented:
        raise JoinTokenRefused(f"{location}: a server of an on-prem pool must present the pool's join token "
                               f"({JOIN_TOKEN_HEADER})")
    if not hmac.compare_digest(presented.strip().encode(), expected.encode()):
        raise JoinTokenRefused(f"{location}: wrong join token ({JOIN_TOKEN_HEADER}) for this pool")
