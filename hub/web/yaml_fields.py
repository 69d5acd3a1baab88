"""Where each field of a YAML document is, so the policy editor can show an error next to the line it names."""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml
from yaml.nodes import MappingNode
from yaml.nodes import Node
from yaml.nodes import ScalarNode
from yaml.nodes import SequenceNode

_SEGMENT = re.compile(r"\.?([^.\[\]]+)|\[(\d+)\]")


def field_lines(text: str) -> dict[str, int]:
    """``{"spec.limits.maxNodes": 14, "spec.locations[1]": 11, ...}`` (1-based lines); empty if not YAML."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    out: dict[str, int] = {}
    seen: set[int] = set()

    def walk(node: Node, path: str) -> None:
        # An alias is the node it names, again: walked once, or a few nested aliases take forever.
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, ScalarNode) else "?"
                where = f"{path}.{name}" if path else str(name)
                out.setdefault(where, key.start_mark.line + 1)
                walk(value, where)
        elif isinstance(node, SequenceNode):
            for index, item in enumerate(node.value):
                where = f"{path}[{index}]"
                out.setdefault(where, item.start_mark.line + 1)
                walk(item, where)

    if root is not None:
        walk(root, "")
    return out


def line_of(field: str, lines: dict[str, int]) -> int | None:
    """The line of ``field``, or of its nearest parent present (a missing field is reported on its parent)."""
    parts = [m.group(0) for m in _SEGMENT.finditer(field)]
    while parts:
        path = "".join(parts).lstrip(".")
        if path in lines:
            return lines[path]
        parts.pop()
    return None


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str
    line: int | None


def syntax_error(text: str) -> FieldError | None:
    """The YAML syntax error of ``text`` with its line, or None when it parses. Aliases are refused: a policy
    needs none, and a few nested ones expand into billions of nodes once validated ("billion laughs")."""
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                line = event.start_mark.line + 1 if event.start_mark else None
                return FieldError(field="(yaml)", message="aliases (*name) are not allowed in a policy", line=line)
        yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        return FieldError(field="(yaml)", message=f"{exc.problem or exc}", line=mark.line + 1 if mark else None)
    except yaml.YAMLError as exc:
        return FieldError(field="(yaml)", message=str(exc), line=None)
    return None
