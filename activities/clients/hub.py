"""The optimizer's HTTP client of the hub (R2.x). The hub never connects to the optimizer: this pulls policies and
approvals and pushes action reports, authenticated with the cluster token.

The token is read from its mounted Secret file on every request, so a rotated Secret (the kubelet swaps the
file) is used at once, without a restart (R2.2).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import Final

import httpx

from activities.clients.gateway import error_message
from activities.telemetry.tracing import http_call
from common.bearer import BearerFileClient
from models.hub import ActionReport

log = logging.getLogger(__name__)


def _version() -> str:
    """The installed optimizer's version, for the hub's clusters page (User-Agent kubeon-gpu-optimizer/<version>)."""
    from importlib import metadata

    try:
        return metadata.version("kubeon-gpu-optimizer")
    except metadata.PackageNotFoundError:
        return "0.0.0"

class HubError(Exception):
    """The hub could not be used; ``str()`` says why."""


class HubUnauthorized(HubError):
    """401: the token is revoked, expired, unknown, or there is none. No action until a valid token arrives."""


class HubUnreachable(HubError):
    """No answer, or a 5xx: try again later; nothing is lost."""


class HubRefused(HubError):
    """Another 4xx: this request will never succeed as it is (a malformed report, a key reused)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"hub refused ({status}): {message}")
        self.status = status


@dataclass(frozen=True)
class PolicySet:
    revision: int
    etag: str
    documents: list[dict[str, Any]]


@dataclass(frozen=True)
class HubApproval:
    id: int
    operation: str
    decision: str
    plan_id: str | None
    reason: str
    decided_by: str


@dataclass(frozen=True)
class ApprovalPage:
    approvals: list[HubApproval]
    cursor: int
    more: bool


class HubClient(BearerFileClient):
    def __init__(self, url: str, token_file: Path, *, timeout: float = 10.0, ca_file: str | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(url, token_file, user_agent=f"kubeon-gpu-optimizer/{_version()}", credential="hub token",
                         unauthorized=HubUnauthorized, timeout=timeout, ca_file=ca_file, transport=transport)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {**self.auth_headers(), **kwargs.pop("headers", {})}
        with http_call("hub", method, path) as call:
            try:
                response = self._http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                raise HubUnreachable(f"hub {self.url} unreachable: {exc.__class__.__name__}: {exc}") from None
            call.response(response.status_code)
        if response.status_code == 401:
            raise HubUnauthorized(f"hub rejected the cluster token (401): {error_message(response)}")
        if response.status_code >= 500:
            raise HubUnreachable(f"hub {self.url} answered {response.status_code}: {error_message(response)}")
        if response.status_code >= 400:
            raise HubRefused(response.status_code, error_message(response))
        return response

    def policies(self, etag: str | None = None) -> PolicySet | None:
        """The cluster's policy set, or None when it still has ``etag`` (304: nothing was sent)."""
        headers = {"If-None-Match": etag} if etag else {}
        response = self._request("GET", "/v1/cluster/policies", headers=headers)
        if response.status_code == 304:
            return None
        body = response.json()
        return PolicySet(revision=int(body["revision"]), etag=response.headers.get("ETag") or str(body["etag"]),
                         documents=list(body["policies"]))

    def approvals(self, after: int, limit: int = 100) -> ApprovalPage:
        response = self._request("GET", "/v1/cluster/approvals", params={"after": after, "limit": limit})
        body = response.json()
        return ApprovalPage(
            approvals=[HubApproval(id=int(a["id"]), operation=a["operation"], decision=a["decision"],
                                   plan_id=a.get("plan_id"), reason=a.get("reason") or "",
                                   decided_by=a["decided_by"]) for a in body["approvals"]],
            cursor=int(body["cursor"]), more=bool(body["more"]))

    def report(self, report: ActionReport) -> bool:
        """Deliver one report. True when the hub stored it now, False when it already had it (a retry).

        Its audit record's place in the audit log chain goes with it; a hub from before the chain refuses those
        fields (422), and then gets the report without them. When the hub finds that the record does not follow
        what it has of this log, it stores the report anyway and says why: logged as an error."""
        body = report.model_dump(mode="json", exclude={f for f in AUDIT_FIELDS if getattr(report, f) is None})
        try:
            response = self._request("POST", "/v1/cluster/reports", json=body)
        except HubRefused as exc:
            if exc.status != 422 or "Extra inputs" not in str(exc) or not any(f in str(exc) for f in AUDIT_FIELDS):
                raise
            log.warning("hub %s does not take audit chain fields (an earlier version): report %s sent without",
                        self.url, report.idempotency_key)
            response = self._request("POST", "/v1/cluster/reports",
                                     json={k: v for k, v in body.items() if k not in AUDIT_FIELDS})
        problem = _json_field(response, "audit_problem")
        if problem:
            log.error("hub: the audit chain of report %s is broken: %s", report.idempotency_key, problem)
        return response.status_code == 201


AUDIT_FIELDS: Final = ("audit_chain", "audit_seq", "audit_hash", "audit_prev")


def _json_field(response: httpx.Response, name: str) -> Any:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get(name) if isinstance(body, dict) else None
