"""Text for the Temporal UI.

The UI renders a workflow's *details* as CommonMark (GFM tables, no raw HTML) and its *summary* as plain text.
Two traps: a pair of ``$`` reads as a math span ("$0.90 + $0.01" turned into ``\\(0.90 + \\)``), and a list only
starts after a blank line. Everything here is pure string work, so workflows may use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# CommonMark lets any ASCII punctuation be escaped with a backslash; these are the ones that change rendering.
_SPECIAL = re.compile(r"([\\`*_\[\]{}<>#|~$!])")
SUMMARY_LIMIT = 400  # bytes: Temporal refuses a longer static summary


def md(text: object) -> str:
    """Plain text as markdown that renders exactly as written (prices keep their ``$``)."""
    return _SPECIAL.sub(r"\\\1", str(text))


def code(text: object) -> str:
    """An identifier as an inline code span (literal inside; backticks in it fenced by a longer run)."""
    s = str(text)
    fence = "`" * (max((len(m) for m in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def usd(amount: float, per: str = "") -> str:
    """A price as plain text, e.g. ``$0.95/GPU-h``; pass it through :func:`md` (or use :func:`md_usd`) in details."""
    return f"${amount:,.2f}" + (f"/{per}" if per else "")


def md_usd(amount: float, per: str = "") -> str:
    return md(usd(amount, per))


class Details:
    """Builds a details document: paragraphs separated by blank lines, lists with the blank line they need."""

    def __init__(self) -> None:
        self._blocks: list[str] = []

    def para(self, *parts: str) -> Details:
        """A paragraph of already-markdown parts (use :func:`md` on plain text), joined by spaces."""
        text = " ".join(p for p in parts if p)
        if text:
            self._blocks.append(text)
        return self

    def heading(self, title: str) -> Details:
        self._blocks.append(f"**{md(title)}**")
        return self

    def bullets(self, items: Iterable[str], *, limit: int = 20, more: str = "more") -> Details:
        """A list of already-markdown items; beyond ``limit`` one last item says how many were left out."""
        listed = list(items)
        if not listed:
            return self
        shown = [f"- {item}" for item in listed[:limit]]
        if len(listed) > limit:
            shown.append(f"- … {len(listed) - limit} {md(more)}")
        self._blocks.append("\n".join(shown))
        return self

    def render(self) -> str:
        return "\n\n".join(self._blocks)


def summary(text: str) -> str:
    """A static summary within Temporal's size limit (cut on a character boundary)."""
    raw = text.encode()
    if len(raw) <= SUMMARY_LIMIT:
        return text
    return raw[: SUMMARY_LIMIT - 3].decode(errors="ignore") + "..."
