"""A cluster's policies: list, the YAML editor (validated with the optimizer's own model, each error shown at the
line of the field it names, a diff before saving), "all to Recommend", delete."""

from __future__ import annotations

import copy
import difflib
import hashlib
import hmac
from typing import Any
from typing import Final

import yaml
from fastapi import APIRouter
from fastapi import Request
from fastapi.responses import Response

from hub import ops
from hub import routes
from hub.audit import Role
from hub.auth import NowDep
from hub.auth import SessionDep
from hub.db import Policy
from hub.errors import HubError
from hub.errors import Unprocessable
from hub.routes import ClusterName
from hub.routes import PolicyName
from hub.web import sessions
from hub.web.common import FormDep
from hub.web.common import SignedInDep
from hub.web.common import redirect
from hub.web.render import confirm
from hub.web.render import page
from hub.web.yaml_fields import FieldError
from hub.web.yaml_fields import field_lines
from hub.web.yaml_fields import line_of
from hub.web.yaml_fields import syntax_error

router = APIRouter(prefix="/ui", include_in_schema=False)
MAX_YAML: Final = 256 * 1024
NEW_POLICY: Final = """\
apiVersion: gpu.kubeon.io/v1
kind: GpuPolicy
metadata:
  name: inference-burst-eu
spec:
  kind: Burst
  mode: Recommend
  workloads:
    tolerate: gpu.kubeon.io/burst
  locations:
    - aws/eu-central-1
  limits:
    maxNodes: 4
    maxGpuHour: 4.50
  returnHome: true
"""


def as_yaml(document: dict[str, Any]) -> str:
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True, default_flow_style=False)


def policy_rows(policies: list[Policy]) -> list[dict[str, Any]]:
    rows = []
    for p in policies:
        spec = p.document.get("spec") or {}
        limits = spec.get("limits") or {}
        rows.append({
            "name": p.name, "kind": spec.get("kind", "?"), "mode": spec.get("mode", "(default)"),
            "locations": ", ".join(spec.get("locations") or []) or "—",
            "limits": ", ".join(f"{k} {v}" for k, v in limits.items()) or "—",
            "updated_at": p.updated_at, "updated_by": p.updated_by, "revision": p.revision,
        })
    return rows


def _fingerprint(text: str) -> str:
    """Names the exact text a diff was shown for: Save writes only a reviewed document."""
    return hashlib.sha256(text.encode()).hexdigest()


def _editor(request: Request, who: sessions.SignedIn, cluster: str, *, original: str, text: str, base: int,
            errors: list[FieldError], diff: list[str] | None = None, message: str | None = None,
            reviewed: str = "", status_code: int = 200) -> Response:
    lines = text.split("\n")
    by_line: dict[int, list[FieldError]] = {}
    for error in errors:
        by_line.setdefault(error.line or 0, []).append(error)
    return page(request, "policy_edit.html", title=f"{'Edit policy ' + original if original else 'New policy'}"
                f" of {cluster}", signed_in=who, section="clusters", cluster=cluster, original=original,
                text=text, base=base, reviewed=reviewed, errors=errors, by_line=by_line, lines=lines, diff=diff,
                message=message, status_code=status_code)


@router.get("/clusters/{cluster}/new-policy")
def new_policy(request: Request, who: SignedInDep, session: SessionDep, cluster: ClusterName) -> Response:
    sessions.require(who, Role.OPERATOR, "writing a policy")
    ops.get_cluster(session, cluster)
    session.commit()
    return _editor(request, who, cluster, original="", text=NEW_POLICY, base=0, errors=[])


@router.get("/clusters/{cluster}/policies/{policy}")
def edit_policy(request: Request, who: SignedInDep, session: SessionDep, cluster: ClusterName,
                policy: PolicyName) -> Response:
    found = ops.get_policy(session, ops.get_cluster(session, cluster), policy)
    session.commit()
    if not who.can(Role.OPERATOR):
        return page(request, "policy_view.html", title=f"Policy {policy} of {cluster}", signed_in=who,
                    section="clusters", cluster=cluster, policy=found, text=as_yaml(found.document))
    return _editor(request, who, cluster, original=found.name, text=as_yaml(found.document), base=found.revision,
                   errors=[])


def _validate(text: str, original: str) -> tuple[str, Any, dict[str, Any]]:
    """(name, parsed document, stored form) of the editor's text, or ``Unprocessable`` with field details (the
    API's own validation: ``ops.normalize_policy``)."""
    if len(text) > MAX_YAML:
        raise Unprocessable(f"the document is larger than {MAX_YAML} characters",
                            details=[("(document)", "too large")], code="invalid_policy")
    problem = syntax_error(text)
    if problem is not None:
        raise Unprocessable(f"not YAML: {problem.message}", details=[("(yaml)", problem.message)],
                            code="invalid_yaml")
    document = yaml.safe_load(text)
    name = original
    if not name:
        metadata = document.get("metadata") if isinstance(document, dict) else None
        found = metadata.get("name") if isinstance(metadata, dict) else None
        name = found if isinstance(found, str) and found else ""
        if not name:
            raise Unprocessable("metadata.name is missing", details=[("metadata.name", "required: the policy's name")],
                                code="invalid_policy")
    return name, document, ops.normalize_policy(name, document)


def _field_errors(exc: HubError, text: str) -> list[FieldError]:
    lines = field_lines(text)
    syntax = syntax_error(text)
    out = []
    for field, message in exc.details or [("(document)", exc.message)]:
        line = syntax.line if field == "(yaml)" and syntax else line_of(field, lines)
        out.append(FieldError(field=field, message=message, line=line))
    return out


@router.post("/clusters/{cluster}/policy-editor")
def save_policy(request: Request, who: SignedInDep, session: SessionDep, now: NowDep, cluster: ClusterName,
                form: FormDep) -> Response:
    """``step=preview``: validate and show the diff against the stored policy; ``step=save``: write it through the
    API's ``put_policy``, unless the policy changed since the editor was opened (``base``)."""
    sessions.require(who, Role.OPERATOR, "writing a policy")
    text = form.get("document")
    original = form.get("original").strip()
    base = int(form.get("base") or 0) if form.get("base").isdigit() else 0
    found = ops.get_cluster(session, cluster, lock=form.get("step") == "save")
    try:
        name, document, stored_form = _validate(text, original)
        current = session.query(Policy).filter_by(cluster_id=found.id, name=name).one_or_none()
        current_revision = current.revision if current is not None else 0
        reviewed = hmac.compare_digest(form.get("reviewed"), _fingerprint(text))
        if form.get("step") != "save" or current_revision != base or not reviewed:
            before = as_yaml(current.document).split("\n") if current is not None else []
            diff = list(difflib.unified_diff(before, as_yaml(stored_form).split("\n"), "stored", "edited",
                                             lineterm="", n=3))
            message = None
            if form.get("step") == "save" and not reviewed:
                message = "The document changed since you reviewed it: review these changes, then save."
            if current_revision != base:
                who_changed = current.updated_by if current is not None else "someone"
                message = (f"Policy {name} changed since you opened the editor (now revision {current_revision}, by "
                           f"{who_changed}): review the diff against the stored version and save again.")
            session.commit()
            return _editor(request, who, cluster, original=original or "", text=text, base=current_revision,
                           errors=[], diff=diff, message=message, reviewed=_fingerprint(text),
                           status_code=200 if current_revision == base else 409)
        routes.put_policy(who.actor, session, now, Response(), cluster, name, document)
    except HubError as exc:
        session.rollback()
        return _editor(request, who, cluster, original=original, text=text, base=base,
                       errors=_field_errors(exc, text), message=exc.message, status_code=exc.status_code)
    return redirect(f"/ui/clusters/{cluster}?saved={name}")


@router.get("/clusters/{cluster}/policies/{policy}/delete")
def delete_confirm(request: Request, who: SignedInDep, session: SessionDep, cluster: ClusterName,
                   policy: PolicyName) -> Response:
    sessions.require(who, Role.OPERATOR, "deleting a policy")
    ops.get_policy(session, ops.get_cluster(session, cluster), policy)
    session.commit()
    return confirm(request, who, section="clusters", title=f"Delete policy {policy}?", button=f"Delete {policy}",
                   back=f"/ui/clusters/{cluster}", text=f"Policy {policy} is removed from cluster {cluster}: its "
                   "optimizer prunes the GpuPolicy on its next poll.")


@router.post("/clusters/{cluster}/policies/{policy}/delete")
def delete_policy(who: SignedInDep, session: SessionDep, now: NowDep, cluster: ClusterName, policy: PolicyName,
                  _: FormDep) -> Response:
    sessions.require(who, Role.OPERATOR, "deleting a policy")
    routes.delete_policy(who.actor, session, now, cluster, policy)
    return redirect(f"/ui/clusters/{cluster}")


@router.get("/clusters/{cluster}/recommend")
def recommend_confirm(request: Request, who: SignedInDep, session: SessionDep, cluster: ClusterName) -> Response:
    sessions.require(who, Role.OPERATOR, "setting policies to Recommend")
    found = ops.get_cluster(session, cluster)
    acting = [p.name for p in ops.list_policies(session, found)
              if (p.document.get("spec") or {}).get("mode") != "Recommend"]
    session.commit()
    return confirm(request, who, section="clusters", title=f"Set every policy of {cluster} to Recommend?",
                   button=f"Set all {len(acting)} to Recommend", back=f"/ui/clusters/{cluster}",
                   text=f"The optimizer of {cluster} stops acting on its next poll and only proposes. Policies "
                   f"changed: {', '.join(acting) or 'none (all are in Recommend already)'}.")


@router.post("/clusters/{cluster}/recommend")
def recommend(who: SignedInDep, session: SessionDep, now: NowDep, cluster: ClusterName, _: FormDep,
              ) -> Response:
    """One transaction: every policy moves, or none (the API's ``put_policy`` rule for each)."""
    sessions.require(who, Role.OPERATOR, "setting policies to Recommend")
    found = ops.get_cluster(session, cluster, lock=True)
    for policy in ops.list_policies(session, found):
        if (policy.document.get("spec") or {}).get("mode") == "Recommend":
            continue
        document = copy.deepcopy(policy.document)
        document.setdefault("spec", {})["mode"] = "Recommend"
        ops.put_policy(session, now, who.actor, found, policy.name, document)
    session.commit()
    return redirect(f"/ui/clusters/{cluster}")

