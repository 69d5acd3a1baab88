"""Every Kubernetes API call the code makes, as (API group, resource[/subresource], verb), found statically.

The kubernetes client's generated methods each serialize to one HTTP method and path; reading those pairs from
the installed client turns a method name (``patch_node``) into what RBAC checks (``patch`` on ``nodes``). The
code is scanned with ``ast``: calls of such methods, and methods handed to ``watch.Watch().stream`` (watch).
For ``CustomObjectsApi`` the group and plural come from the call's arguments, which must be string constants
or module-level constants (``models.policy.API_GROUP``); anything else is reported as unresolvable.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes.client.api as client_api

# Granted to every authenticated user by the default ClusterRoles (system:basic-user, system:discovery).
ALWAYS_ALLOWED = {
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
    ("authentication.k8s.io", "selfsubjectreviews", "create"),
}


@dataclass(frozen=True)
class Endpoint:
    http_method: str
    path: str


@dataclass(frozen=True)
class Call:
    file: str
    line: int
    scope: str  # enclosing class name, or "" at module level / in functions
    method: str
    group: str
    resource: str  # plural, with "/subresource" when there is one
    verb: str
    namespaced: bool

    def where(self) -> str:
        return f"{self.file}:{self.line} {self.method}"


class Unresolvable(Exception):
    pass


@cache
def endpoints() -> dict[str, frozenset[Endpoint]]:
    """method name -> its (HTTP method, path) in the installed kubernetes client."""
    table: dict[str, set[Endpoint]] = {}
    pattern = re.compile(
        r"def _(\w+)_serialize\(.*?param_serialize\(\s*method='(\w+)',\s*resource_path='([^']+)'", re.DOTALL
    )
    for path in Path(client_api.__file__).parent.glob("*_api.py"):
        for name, method, resource_path in pattern.findall(path.read_text()):
            table.setdefault(name, set()).add(Endpoint(method, resource_path))
    assert table, "no endpoints found in kubernetes.client.api: the client's generated layout changed"
    return {k: frozenset(v) for k, v in table.items()}


@cache
def _signature_params(method: str) -> list[str]:
    for module_name in dir(client_api):
        cls = getattr(client_api, module_name)
        if inspect.isclass(cls) and hasattr(cls, method):
            return [p for p in inspect.signature(getattr(cls, method)).parameters if p != "self"]
    return []


def _parse_path(path: str) -> tuple[str, list[str], bool] | None:
    """(group, segments after the version, namespaced), or None for discovery and non-resource paths."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[:1] == ["watch"]:
        rest = rest[1:]
    namespaced = len(rest) >= 3 and rest[0] == "namespaces"
    if namespaced:
        rest = rest[2:]
    return (group, rest, namespaced) if rest else None


def requirement(endpoint: Endpoint, *, watching: bool, args: dict[str, str]) -> tuple[str, str, str, bool] | None:
    parsed = _parse_path(endpoint.path)
    if parsed is None:
        return None
    group, rest, namespaced = parsed
    if group == "{group}":
        group = args.get("group", "{group}")
    rest = [args.get("plural", seg) if seg == "{plural}" else seg for seg in rest]
    named = len(rest) >= 2
    resource = rest[0] + (f"/{rest[2]}" if len(rest) >= 3 else "")
    verb = {
        "GET": ("get" if named else ("watch" if watching else "list")),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }[endpoint.http_method]
    if "/watch/" in endpoint.path:
        verb = "watch"
    return group, resource, verb, namespaced


class _Resolver:
    """String values of constants: literals, module-level assignments, imported names and module attributes."""

    def __init__(self, tree: ast.Module) -> None:
        self.local: dict[str, ast.expr] = {}
        self.imported: dict[str, tuple[str, str | None]] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.local[node.targets[0].id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                self.local[node.target.id] = node.value
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (alias.name, None)

    def value(self, expr: ast.expr) -> str:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return expr.value
        if isinstance(expr, ast.Name):
            if expr.id in self.local:
                return self.value(self.local[expr.id])
            if expr.id in self.imported:
                module, attr = self.imported[expr.id]
                if attr is not None:
                    return self._from_module(module, attr)
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in self.imported:
            module, attr = self.imported[expr.value.id]
            return self._from_module(module if attr is None else f"{module}.{attr}", expr.attr)
        raise Unresolvable(ast.unparse(expr))

    @staticmethod
    def _from_module(module: str, attr: str) -> str:
        try:
            got: Any = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise Unresolvable(f"{module}.{attr}: {exc}") from None
        if not isinstance(got, str):
            raise Unresolvable(f"{module}.{attr} is not a string")
        return got


def scan_source(source: str, file: str) -> Iterator[Call | tuple[str, int, str, str]]:
    """Calls found in ``source``; an unresolvable custom-object call yields (file, line, method, reason)."""
    tree = ast.parse(source, filename=file)
    resolver = _Resolver(tree)
    table = endpoints()
    parents: dict[ast.AST, ast.AST] = {}
    scopes: dict[ast.AST, str] = {}

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            parents[child] = node
            child_scope = child.name if isinstance(child, ast.ClassDef) else scope
            scopes[child] = child_scope
            visit(child, child_scope)

    visit(tree, "")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in table:
            continue
        parent = parents.get(node)
        call: ast.Call | None = parent if isinstance(parent, ast.Call) and parent.func is node else None
        # ``w.stream(core.list_node, ...)``: the method is handed over, not called: a watch
        watching = (isinstance(parent, ast.Call) and node in parent.args and isinstance(parent.func, ast.Attribute)
                    and parent.func.attr == "stream")
        if call is None and not watching:
            continue
        watch_call = parent if watching else call
        assert isinstance(watch_call, ast.Call)
        if call is not None and any(k.arg == "watch" and isinstance(k.value, ast.Constant) and k.value.value
                                    for k in call.keywords):
            watching = True
        args: dict[str, str] = {}
        if any("{group}" in e.path or "{plural}" in e.path for e in table[node.attr]):
            params = _signature_params(node.attr)
            bound: dict[str, ast.expr] = dict(zip(params, call.args if call else watch_call.args[1:], strict=False))
            bound.update({k.arg: k.value for k in (call or watch_call).keywords if k.arg})
            try:
                for key in ("group", "plural"):
                    if key in bound:
                        args[key] = resolver.value(bound[key])
            except Unresolvable as exc:
                yield (file, node.lineno, node.attr, f"cannot tell the {key} from {exc}")
                continue
        for endpoint in sorted(table[node.attr], key=lambda e: (e.http_method, e.path)):
            req = requirement(endpoint, watching=watching, args=args)
            if req is None:
                continue
            group, resource, verb, namespaced = req
            yield Call(file, node.lineno, scopes.get(node, ""), node.attr, group, resource, verb, namespaced)
            if watching and verb == "watch":
                # a watch starts with a list
                yield Call(file, node.lineno, scopes.get(node, ""), node.attr, group, resource, "list", namespaced)


def scan(root: Path, directories: Iterable[str]) -> tuple[list[Call], list[tuple[str, int, str, str]]]:
    calls: list[Call] = []
    problems: list[tuple[str, int, str, str]] = []
    for directory in directories:
        for path in sorted((root / directory).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for found in scan_source(path.read_text(), rel):
                if isinstance(found, Call):
                    calls.append(found)
                else:
                    problems.append(found)
    return calls, problems


def allowed(call: Call, rules: Iterable[tuple[str | None, dict[str, Any]]]) -> bool:
    """Whether one of the rules (with the namespace of its Role, None for a ClusterRole) grants the call."""
    if (call.group, call.resource, call.verb) in ALWAYS_ALLOWED:
        return True
    for namespace, rule in rules:
        if namespace is not None and not call.namespaced:
            continue  # a Role never grants a cluster-wide or cluster-scoped call
        if rule.get("resourceNames") and call.verb in ("list", "watch", "create", "deletecollection"):
            continue  # resourceNames cannot restrict these verbs
        if (call.group in rule["apiGroups"] or "*" in rule["apiGroups"]) \
                and (call.resource in rule["resources"] or "*" in rule["resources"]) \
                and (call.verb in rule["verbs"] or "*" in rule["verbs"]):
            return True
    return False
