"""Sign-in, the clusters (GPU > Optimizer), Add cluster, Rotate token and Revoke token."""

from __future__ import annotations

import hmac
from typing import Annotated
from typing import Any
from typing import Final
from typing import Literal
from urllib.parse import urlsplit

from fastapi import APIRouter
from fastapi import Depends
from fastapi import Query
from fastapi import Request
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.orm import Session

from hub import ops
from hub import optimizer_clients
from hub import routes
from hub.audit import Role
from hub.auth import HubState
from hub.auth import NowDep
from hub.auth import SessionDep
from hub.db import Cluster
from hub.errors import HubError
from hub.http import validate_body
from hub.optimizer_clients import OptimizerClient
from hub.routes import ClusterName
from hub.schemas import ClusterCreate
from hub.web import sessions
from hub.web.common import FormDep
from hub.web.common import MaybeSignedInDep
from hub.web.common import SignedInDep
from hub.web.common import StateDep
from hub.web.common import redirect
from hub.web.forms import Form
from hub.web.forms import read_form
from hub.web.policies import policy_rows
from hub.web.render import confirm
from hub.web.render import page
from hub.web.sessions import SignedIn

router = APIRouter(prefix="/ui", include_in_schema=False)
SECRET_NAME: Final = "kubeon-gpu-optimizer-token"
NAMESPACE: Final = "kubeon-gpu"


def _safe_next(target: str | None) -> str:
    """Only a path of this UI: never an open redirect to another site."""
    parts = urlsplit(target or "")
    if not target or not target.startswith("/ui/") or "\\" in target or parts.scheme or parts.netloc:
        return "/ui/clusters"
    return parts.path + (f"?{parts.query}" if parts.query else "")


@router.get("")
@router.get("/")
def home() -> Response:
    return redirect("/ui/clusters")


@router.get("/sign-in")
def sign_in_page(request: Request, who: MaybeSignedInDep,
                 next: Annotated[str | None, Query(max_length=500)] = None) -> Response:
    if who is not None:
        return redirect(_safe_next(next))
    response = Response()
    token = sessions.sign_in_csrf(request, response)
    out = page(request, "sign_in.html", title="Sign in", signed_in=None, sign_in_csrf=token,
               next=_safe_next(next), error=None)
    out.raw_headers.extend(h for h in response.raw_headers if h[0] == b"set-cookie")
    return out


@router.post("/sign-in")
def sign_in(request: Request, state: StateDep, session: SessionDep, now: NowDep,
            form: Annotated[Form, Depends(read_form)]) -> Response:
    """Sync, like every handler here (run in the thread pool): a database wait never blocks the event loop."""
    sessions.check_origin(request)
    expected = request.cookies.get(sessions.SIGN_IN_CSRF_COOKIE) or ""
    presented = form.get("csrf_token")
    target = _safe_next(form.get("next"))
    response = redirect(target)
    try:
        if not expected or not presented or not hmac.compare_digest(expected.encode(), presented.encode()):
            raise HubError("the sign-in form expired: load it again", code="csrf_failed")
        sessions.sign_in(session, now, state.settings, form.get("api_key").strip(), response, request)
    except HubError as exc:
        session.rollback()
        retry = Response()
        token = sessions.sign_in_csrf(request, retry)
        out = page(request, "sign_in.html", title="Sign in", signed_in=None, sign_in_csrf=token, next=target,
                   error=exc.message, status_code=exc.status_code if exc.status_code != 400 else 403)
        out.raw_headers.extend(h for h in retry.raw_headers if h[0] == b"set-cookie")
        return out
    session.commit()
    return response


@router.post("/sign-out")
def sign_out(request: Request, who: SignedInDep, session: SessionDep, _: FormDep) -> Response:
    response = redirect("/ui/sign-in")
    sessions.sign_out(session, who, request, response)
    session.commit()
    return response


# ----- clusters -----


def cluster_row(cluster: Cluster, now: Any, client: OptimizerClient | None) -> dict[str, Any]:
    out = routes._cluster_out(cluster, now)  # the API's own view: the same status rule
    valid = [t for t in out.tokens if t.state in ops.VALID_TOKEN_STATES]
    return {"out": out, "token_state": ", ".join(f"{t.id[:8]}… {t.state}" for t in valid) or "none valid",
            "version": client.version if client else None, "user_agent": client.user_agent if client else None}


@router.get("/clusters")
def clusters(request: Request, who: SignedInDep, session: SessionDep, now: NowDep) -> Response:
    clients = optimizer_clients.for_clusters(session)
    rows = [cluster_row(c, now, clients.get(c.id)) for c in session.scalars(select(Cluster).order_by(Cluster.name))]
    session.commit()
    return page(request, "clusters.html", title="GPU > Optimizer: clusters", signed_in=who, section="clusters",
                clusters=rows)


@router.get("/add-cluster")
def add_cluster_page(request: Request, who: SignedInDep) -> Response:
    sessions.require(who, Role.ADMIN, "Add cluster")
    return page(request, "cluster_new.html", title="Add cluster", signed_in=who, section="clusters",
                values={"name": "", "description": ""}, errors={}, message=None)


def _hub_url(request: Request, state: HubState) -> str:
    """What the optimizer's ``hub.url`` should be: ``--public-url``, else the address this page was loaded from."""
    return (state.settings.public_url or str(request.base_url)).rstrip("/")


def install_commands(cluster: str, token: str, hub_url: str) -> dict[str, str]:
    """The two commands of "Install the GPU optimizer", filled in."""
    secret = (f"kubectl create namespace {NAMESPACE}\n"
              f"kubectl -n {NAMESPACE} create secret generic {SECRET_NAME} \\\n"
              f"  --from-literal=token='{token}'")
    helm = ("helm upgrade --install kubeon-gpu-optimizer kubeon/kubeon-gpu-optimizer \\\n"
            f"  --namespace {NAMESPACE} --create-namespace \\\n"
            f"  --set cluster={cluster} \\\n"
            f"  --set hub.url={hub_url} \\\n"
            f"  --set hub.existingSecret={SECRET_NAME} \\\n"
            "  --set defaultMode=Recommend")
    update = (f"kubectl -n {NAMESPACE} create secret generic {SECRET_NAME} \\\n"
              f"  --from-literal=token='{token}' --dry-run=client -o yaml | kubectl apply -f -")
    return {"secret": secret, "helm": helm, "update_secret": update}


@router.post("/clusters")
def add_cluster(request: Request, who: SignedInDep, state: StateDep, session: SessionDep, now: NowDep,
                form: FormDep) -> Response:
    sessions.require(who, Role.ADMIN, "Add cluster")
    values = {"name": form.get("name").strip(), "description": form.get("description").strip()}
    try:
        body = validate_body(ClusterCreate, values)
        created = routes.create_cluster(who.actor, session, now, body)
    except HubError as exc:
        session.rollback()
        errors = {f.split(".")[0]: m for f, m in exc.details} or {"name": exc.message}
        return page(request, "cluster_new.html", title="Add cluster", signed_in=who, section="clusters",
                    values=values, errors=errors, message=exc.message, status_code=exc.status_code)
    return page(request, "token_issued.html", title=f"Cluster {created.cluster.name} added", signed_in=who,
                section="clusters", cluster=created.cluster.name, token=created.token.token,
                token_id=created.token.token_id, rotated=False, expires_at=None,
                commands=install_commands(created.cluster.name, created.token.token, _hub_url(request, state)),
                status_code=201)


@router.get("/clusters/{cluster}")
def cluster_page(request: Request, who: SignedInDep, session: SessionDep, now: NowDep, cluster: ClusterName
                 ) -> Response:
    found = ops.get_cluster(session, cluster)
    row = cluster_row(found, now, optimizer_clients.for_clusters(session).get(found.id))
    policies = policy_rows(ops.list_policies(session, found))
    session.commit()
    return page(request, "cluster.html", title=f"Cluster {found.name}", signed_in=who, section="clusters",
                cluster=row, policies=policies)


# What confirming each change of a cluster's tokens says: its button, whether it is destructive, and its text.
TOKEN_CHANGES: Final = {
    "rotate": ("Rotate token", False,
               "A new token is issued for cluster {name} and shown once. The current token keeps working until the "
               "new one is first used, or for 24 hours, whichever comes first."),
    "revoke": ("Revoke every token of {name}", True,
               "The optimizer of cluster {name} stops at once: it can no longer pull policies or approvals and "
               "takes no further action. The cluster shows as disconnected until you rotate to issue a new token."),
}


@router.get("/clusters/{cluster}/rotate")
def rotate_confirm(request: Request, who: SignedInDep, session: SessionDep, cluster: ClusterName) -> Response:
    return _token_change_confirm(request, who, session, cluster, "rotate")


@router.get("/clusters/{cluster}/revoke")
def revoke_confirm(request: Request, who: SignedInDep, session: SessionDep, cluster: ClusterName) -> Response:
    return _token_change_confirm(request, who, session, cluster, "revoke")


def _token_change_confirm(request: Request, who: SignedIn, session: Session, cluster: str,
                          change: Literal["rotate", "revoke"]) -> Response:
    button, danger, text = TOKEN_CHANGES[change]
    sessions.require(who, Role.ADMIN, f"{change.capitalize()} token")
    found = ops.get_cluster(session, cluster)
    session.commit()
    return confirm(request, who, section="clusters", title=f"{change.capitalize()} the token of {found.name}?",
                   button=button.format(name=found.name), danger=danger, back=f"/ui/clusters/{found.name}",
                   text=text.format(name=found.name))


@router.post("/clusters/{cluster}/rotate")
def rotate(request: Request, who: SignedInDep, state: StateDep, session: SessionDep, now: NowDep,
           cluster: ClusterName, _: FormDep) -> Response:
    sessions.require(who, Role.ADMIN, "Rotate token")
    issued = routes.rotate_token(who.actor, state, session, now, cluster)
    return page(request, "token_issued.html", title=f"New token for {issued.cluster}", signed_in=who,
                section="clusters", cluster=issued.cluster, token=issued.token, token_id=issued.token_id,
                rotated=True, expires_at=issued.previous_tokens_expire_at,
                commands=install_commands(issued.cluster, issued.token, _hub_url(request, state)), status_code=201)


@router.post("/clusters/{cluster}/revoke")
def revoke(who: SignedInDep, session: SessionDep, now: NowDep, cluster: ClusterName, _: FormDep) -> Response:
    sessions.require(who, Role.ADMIN, "Revoke token")
    routes.revoke_token(who.actor, session, now, cluster)
    return redirect(f"/ui/clusters/{cluster}")
