"""Hub policies into the cluster (R2.6): the hub's full desired set of GpuPolicy documents becomes cluster-scoped
``GpuPolicy`` objects, written by server-side apply under one field manager, and each hub-synced policy says in
its status whether it is in force (``Ready``) and whether the hub still answers (``HubConnected``).

- An invalid document never replaces the live policy: the last good spec stays enforced and ``Ready=False``
  names the field. A new invalid document creates nothing. Neither raises: one bad policy never stops the others.
- Only created or drifted objects are written (one LIST per sync): a ``kubectl edit`` of a hub policy is undone
  by the next sync, and a sync that changes nothing makes no write at all.
- Only objects labelled ``gpu.kubeon.io/source=hub`` are pruned; a policy a user created by hand is left alone.
- A policy naming a location this installation does not configure (``burst.locations``) is applied, but says
  ``Ready=False`` (reason ``UnknownLocation``) naming ``spec.locations[i]`` and the location: the hub cannot know
  every cluster's locations, the cluster can. Nothing is ever launched there (R4.7).

Server-side apply of ``status``: the status subresource has its own managed-fields entry per manager, and an
apply from the same manager removes every status field it owned and did not send. So every status write here
sends the whole status (read-modify-write from the live object), with the object's ``resourceVersion`` as a
precondition so a concurrent writer makes it re-read instead of losing an update.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from collections.abc import Collection
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from functools import partial
from typing import Any
from typing import Final

from kubernetes import client

from models.hub import ANNOTATION_HUB_REVISION
from models.hub import CONDITION_HUB_CONNECTED
from models.hub import CONDITION_READY
from models.hub import FIELD_MANAGER
from models.hub import LABEL_SOURCE
from models.hub import REASON_CONNECTED
from models.hub import REASON_INVALID
from models.hub import REASON_SYNCED
from models.hub import REASON_UNAUTHORIZED
from models.hub import REASON_UNKNOWN_LOCATION
from models.hub import SOURCE_HUB
from models.hub import PolicySyncOutcome
from models.policy import API_GROUP
from models.policy import API_VERSION
from models.policy import KIND
from models.policy import PLURAL
from models.policy import AnyPolicy
from models.policy import GpuPolicy
from models.policy import Mode
from models.policy import PolicyError
from models.policy import ScaleToZeroPolicy
from models.policy import parse_policy

log = logging.getLogger(__name__)

VERSION: Final = "v1"
APPLY_PATCH: Final = "application/apply-patch+yaml"
MERGE_PATCH: Final = "application/merge-patch+json"
# The apiserver refused the object itself (schema, label syntax): the document is bad, not the cluster.
REFUSED_STATUSES: Final = (400, 422)
LAST_SYNC_REFRESH: Final = timedelta(minutes=5)
STATUS_WRITE_ATTEMPTS: Final = 5
CONNECTED_MESSAGE: Final = "policies synced from the hub"


def _rfc3339(when: datetime) -> str:
    # metav1.Time has second precision; a naive datetime is taken as UTC.
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(status: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in (status or {}).get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == type_:
            return cond
    return None


def hold_reason(policy_status: dict[str, Any] | None) -> str | None:
    """Why no action may be taken for a policy, or None. Only a hub that refused this cluster's token holds
    actions; an unreachable hub does not (the last synced policies stay enforced)."""
    cond = _condition(policy_status, CONDITION_HUB_CONNECTED)
    if cond is None or cond.get("status") != "False" or cond.get("reason") != REASON_UNAUTHORIZED:
        return None
    reason = "hub rejected this cluster's token (revoked or unknown): no actions until a valid token is mounted"
    message = str(cond.get("message") or "").strip()
    return f"{reason}: {message}" if message else reason


def _without_nones(value: Any) -> Any:
    """YAML ``key: null`` means "unset": drop such keys so what is applied compares equal to what is read back."""
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value


def _merge_diff(live: Any, desired: Any) -> Any:
    """A JSON merge patch turning ``live`` into ``desired`` (dicts recursively, lists and scalars replaced)."""
    if not isinstance(live, dict) or not isinstance(desired, dict):
        return desired
    patch: dict[str, Any] = {k: None for k in live if k not in desired}
    for key, want in desired.items():
        if key not in live:
            patch[key] = want
        elif live[key] != want:
            patch[key] = _merge_diff(live[key], want)
    return patch


def _applied_keys(obj: dict[str, Any], field: str) -> set[str]:
    """Keys of ``metadata.<field>`` (labels, annotations) that our last apply to the object owns."""
    for entry in obj.get("metadata", {}).get("managedFields") or []:
        if (entry.get("manager") == FIELD_MANAGER and entry.get("operation") == "Apply"
                and not entry.get("subresource")):
            owned = (entry.get("fieldsV1") or {}).get("f:metadata", {}).get(f"f:{field}", {})
            return {key.removeprefix("f:") for key in owned if key.startswith("f:")}
    return set()


def _api_message(exc: client.ApiException) -> str:
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return f"the apiserver refused the policy: {exc.status} {exc.reason}: {exc.body}"
    return f"the apiserver refused the policy: {body.get('message') or exc.reason}"


def _mapping(answer: object) -> dict[str, Any]:
    """The custom objects API returns decoded JSON typed as ``object``."""
    if not isinstance(answer, dict):
        raise TypeError(f"expected a JSON object from the apiserver, got {type(answer).__name__}")
    return answer


def _raw_json(response: Any) -> dict[str, Any]:
    return _mapping(json.loads(response.data))


def _is_hub(obj: dict[str, Any]) -> bool:
    return (obj.get("metadata", {}).get("labels") or {}).get(LABEL_SOURCE) == SOURCE_HUB


def enforceable_policies(custom: client.CustomObjectsApi) -> list[AnyPolicy]:
    """Every GpuPolicy that parses; one that does not is never enforced (the hub sync reports it). No CRD: none."""
    try:
        listed: Any = custom.list_cluster_custom_object(API_GROUP, VERSION, PLURAL)
    except client.ApiException as exc:
        if exc.status == 404:
            return []
        raise
    out = []
    for doc in listed.get("items", []):
        try:
            out.append(parse_policy(doc))
        except PolicyError:
            continue
    return out


def patch_policy_status(custom: client.CustomObjectsApi, policy: str, key: str, value: dict[str, Any]) -> None:
    """Merge ``value`` into the policy's ``status.<key>`` (a JSON merge patch: other keys, other writers' entries
    and the hub sync's conditions stay); a policy deleted meanwhile has nothing to say."""
    try:
        custom.patch_cluster_custom_object_status(API_GROUP, VERSION, PLURAL, policy, {"status": {key: value}})
    except client.ApiException as exc:
        if exc.status != 404:
            raise


class PolicySyncer:
    """Writes the hub's policies into the cluster with the optimizer's own credentials (R5.1: gpupolicies and
    gpupolicies/status)."""

    def __init__(self, api: client.ApiClient, *, default_mode: Mode, locations: Collection[str] | None = None,
                 metrics: bool = True, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.default_mode: Mode = default_mode
        # Whether this installation has GPU metrics (prometheus.url): without them ScaleToZero only recommends.
        self.metrics = metrics
        # The locations this installation configures (burst.locations); None: not checked.
        self.locations = None if locations is None else frozenset(locations)
        self.clock = clock

    def unknown_locations(self, policy: AnyPolicy) -> str | None:
        """Why the policy cannot be fully in force here (each location it names that is not configured), or None.
        Only Burst policies name locations."""
        if self.locations is None or not isinstance(policy, GpuPolicy):
            return None
        unknown = [f"spec.locations[{i}]: location {loc!r} is not configured on this cluster"
                   for i, loc in enumerate(policy.spec.locations) if loc not in self.locations]
        if not unknown:
            return None
        configured = ", ".join(sorted(self.locations)) or "none"
        return (f"{'; '.join(unknown)} (burst.locations: {configured}); nothing is launched there until it is "
                "configured or removed from the policy")

    def enforced_mode(self, policy: AnyPolicy) -> Mode:
        """The mode in force (status.effectiveMode): the policy's own, else the installation's defaultMode (R1.2);
        Recommend for ScaleToZero without GPU metrics (R1.3), whatever the policy says."""
        if isinstance(policy, ScaleToZeroPolicy) and not self.metrics:
            return "Recommend"
        return policy.spec.effective_mode(self.default_mode)

    # -- the sync ----------------------------------------------------------------------------------------------
    def sync(self, documents: list[dict[str, Any]], revision: int) -> PolicySyncOutcome:
        outcome = PolicySyncOutcome(revision=revision)
        listed = _mapping(self.custom.list_cluster_custom_object(API_GROUP, VERSION, PLURAL))
        live: dict[str, dict[str, Any]] = {o["metadata"]["name"]: o for o in listed.get("items", [])}
        seen: set[str] = set()

        for index, document in enumerate(documents):
            name = self._document_name(document)
            key = name or f"(document {index})"
            if name is not None and name in seen:
                outcome.invalid[f"{name} (document {index})"] = f"another document is already named {name!r}"
                continue
            if name is not None:
                seen.add(name)
            try:
                policy = parse_policy(document)
            except PolicyError as exc:
                self._invalid(outcome, key, live.get(name) if name else None, str(exc), revision)
                continue
            name = policy.name
            current = live.get(name)
            try:
                obj, changed = self._apply(document, current, revision)
            except client.ApiException as exc:
                if exc.status not in REFUSED_STATUSES:
                    raise
                self._invalid(outcome, name, current, _api_message(exc), revision)
                continue
            if current is None:
                outcome.created.append(name)
            elif changed:
                outcome.updated.append(name)
            else:
                outcome.unchanged.append(name)
            mode = self.enforced_mode(policy)
            not_ready = self.unknown_locations(policy)
            if not_ready is not None:
                outcome.not_ready[name] = not_ready
                log.warning("hub policy %s is not ready: %s", name, not_ready)
            self._write_status(obj, partial(self._synced_status, mode=mode, revision=revision, invalid=not_ready,
                                            reason=REASON_UNKNOWN_LOCATION), stamp=True)

        for name, obj in live.items():
            if name in seen or not _is_hub(obj):
                continue
            try:
                self.custom.delete_cluster_custom_object(API_GROUP, VERSION, PLURAL, name)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
            outcome.pruned.append(name)
        log.debug("policy sync at hub revision %s: %s", revision, outcome.summary())  # the hub sync logs the outcome
        return outcome

    @staticmethod
    def _document_name(document: Any) -> str | None:
        if not isinstance(document, dict):
            return None
        metadata = document.get("metadata")
        name = metadata.get("name") if isinstance(metadata, dict) else None
        return name if isinstance(name, str) and name else None

    def _invalid(self, outcome: PolicySyncOutcome, key: str, current: dict[str, Any] | None, reason: str,
                 revision: int) -> None:
        """The live policy (if any) keeps its last good spec; a hub-synced one says why in its status."""
        outcome.invalid[key] = reason
        log.warning("hub policy %s not applied: %s", key, reason)
        if current is None or not _is_hub(current):
            return
        try:
            enforced: Mode = self.enforced_mode(parse_policy(current))
        except PolicyError:
            enforced = self.default_mode
        self._write_status(current, partial(self._synced_status, mode=enforced, revision=revision, invalid=reason),
                           stamp=True)

    def _desired(self, document: dict[str, Any], revision: int) -> dict[str, Any]:
        meta = document["metadata"]
        labels = {**(meta.get("labels") or {}), LABEL_SOURCE: SOURCE_HUB}
        annotations = {**(meta.get("annotations") or {}), ANNOTATION_HUB_REVISION: str(revision)}
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": meta["name"], "labels": labels, "annotations": annotations},
            "spec": _without_nones(copy.deepcopy(document["spec"])),
        }

    def _apply(self, document: dict[str, Any], current: dict[str, Any] | None, revision: int
               ) -> tuple[dict[str, Any], bool]:
        """Apply the policy if it is missing or has drifted. Returns the live object and whether its content
        (spec or labels) changed; a new hub revision alone only re-stamps the revision annotation."""
        desired = self._desired(document, revision)
        name = desired["metadata"]["name"]
        if current is not None:
            meta = current.get("metadata", {})
            labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
            want_labels, want_annotations = desired["metadata"]["labels"], desired["metadata"]["annotations"]
            content_drift = (
                current.get("spec") != desired["spec"]
                or any(labels.get(k) != v for k, v in want_labels.items())
                # A label the hub dropped from the document: our last apply still owns it.
                or _applied_keys(current, "labels") - set(want_labels)
            )
            annotation_drift = (any(annotations.get(k) != v for k, v in want_annotations.items())
                                or _applied_keys(current, "annotations") - set(want_annotations))
            if not content_drift and not annotation_drift:
                return current, False
        else:
            content_drift = True
        # Raw response: the client maps only 200 to a body, and an apply that creates answers 201.
        obj = _raw_json(self.custom.patch_cluster_custom_object(
            API_GROUP, VERSION, PLURAL, name, desired, field_manager=FIELD_MANAGER, force=True,
            field_validation="Strict", _content_type=APPLY_PATCH, _preload_content=False))
        if obj.get("spec") != desired["spec"]:
            # Apply only removes what this manager owns: a field or set element another manager added (kubectl
            # edit) survives it. Remove those with a merge patch.
            obj = _mapping(self.custom.patch_cluster_custom_object(
                API_GROUP, VERSION, PLURAL, name, {"spec": _merge_diff(obj.get("spec"), desired["spec"])},
                field_manager=FIELD_MANAGER, _content_type=MERGE_PATCH))
        return obj, bool(content_drift)

    # -- status ------------------------------------------------------------------------------------------------
    def _set_condition(self, conditions: list[dict[str, Any]], type_: str, status: bool, reason: str,
                       message: str, generation: Any) -> list[dict[str, Any]]:
        """``conditions`` with ``type_`` set; its lastTransitionTime changes only when its status flips."""
        status_text = "True" if status else "False"
        old = next((c for c in conditions if c.get("type") == type_), None)
        since = old.get("lastTransitionTime") if old and old.get("status") == status_text else None
        new = {"type": type_, "status": status_text, "reason": reason, "message": message,
               "lastTransitionTime": since or _rfc3339(self.clock())}
        if generation is not None:
            new["observedGeneration"] = generation
        out = [new if c.get("type") == type_ else c for c in conditions]
        return out if old is not None else [*out, new]

    def _synced_status(self, obj: dict[str, Any], mode: Mode, revision: int, invalid: str | None,
                       reason: str = REASON_INVALID) -> dict[str, Any]:
        generation = obj.get("metadata", {}).get("generation")
        old: dict[str, Any] = copy.deepcopy(obj.get("status") or {})
        conditions = [c for c in old.get("conditions") or [] if isinstance(c, dict)]
        if invalid is None:
            conditions = self._set_condition(conditions, CONDITION_READY, True, REASON_SYNCED,
                                             f"spec of hub revision {revision} is in force", generation)
        else:
            conditions = self._set_condition(conditions, CONDITION_READY, False, reason, invalid, generation)
        # The sync runs after the hub answered; keep an existing Connected condition (and its message) as is.
        connected = _condition(old, CONDITION_HUB_CONNECTED)
        if connected is None or connected.get("status") != "True" or connected.get("reason") != REASON_CONNECTED:
            conditions = self._set_condition(conditions, CONDITION_HUB_CONNECTED, True, REASON_CONNECTED,
                                             CONNECTED_MESSAGE, generation)
        else:
            conditions = self._set_condition(conditions, CONDITION_HUB_CONNECTED, True, REASON_CONNECTED,
                                             str(connected.get("message") or ""), generation)
        return {**old, "observedGeneration": generation, "effectiveMode": mode, "hubRevision": revision,
                "conditions": conditions}

    def _stale(self, status: dict[str, Any]) -> bool:
        """lastSyncTime is refreshed at least every LAST_SYNC_REFRESH even when nothing changed: operators read it
        as "the sync is alive", at the cost of one status write per policy per period, not per poll."""
        try:
            last = datetime.fromisoformat(str(status.get("lastSyncTime")).replace("Z", "+00:00"))
        except ValueError:
            return True
        return self.clock() - last >= LAST_SYNC_REFRESH

    def _write_status(self, obj: dict[str, Any], compute: Callable[[dict[str, Any]], dict[str, Any]], *,
                      stamp: bool) -> bool:
        """Apply the whole status ``compute`` derives from the live object, unless it equals the live one
        (lastSyncTime aside); ``stamp`` sets lastSyncTime to now when writing. Re-reads and recomputes when the
        object changed underneath (409). Returns whether it wrote."""
        name = obj["metadata"]["name"]
        for _ in range(STATUS_WRITE_ATTEMPTS):
            live = obj.get("status") or {}
            status = compute(obj)
            if {k: v for k, v in status.items() if k != "lastSyncTime"} == {
                    k: v for k, v in live.items() if k != "lastSyncTime"} and not (stamp and self._stale(live)):
                return False
            if stamp:
                status["lastSyncTime"] = _rfc3339(self.clock())
            body = {"apiVersion": API_VERSION, "kind": KIND,
                    "metadata": {"name": name, "resourceVersion": obj["metadata"]["resourceVersion"]},
                    "status": status}
            try:
                self.custom.patch_cluster_custom_object_status(
                    API_GROUP, VERSION, PLURAL, name, body, field_manager=FIELD_MANAGER, force=True,
                    _content_type=APPLY_PATCH)
                return True
            except client.ApiException as exc:
                if exc.status == 404:
                    return False  # deleted meanwhile: nothing to say
                if exc.status != 409:
                    raise
            obj = _mapping(self.custom.get_cluster_custom_object(API_GROUP, VERSION, PLURAL, name))
        raise RuntimeError(f"status of GpuPolicy {name} kept changing underneath; gave up after "
                           f"{STATUS_WRITE_ATTEMPTS} attempts")

    # -- the hub's answer --------------------------------------------------------------------------------------
    def mark_connection(self, connected: bool, reason: str, message: str) -> int:
        """Set ``HubConnected`` on every hub-synced policy, keeping the rest of its status; returns how many
        were written (a policy whose condition already says the same is not)."""
        listed = _mapping(self.custom.list_cluster_custom_object(
            API_GROUP, VERSION, PLURAL, label_selector=f"{LABEL_SOURCE}={SOURCE_HUB}"))
        marked = 0
        for obj in listed.get("items", []):
            if self._write_status(obj, partial(self._connection_status, connected=connected, reason=reason,
                                               message=message), stamp=False):
                marked += 1
        return marked

    def _connection_status(self, obj: dict[str, Any], connected: bool, reason: str, message: str
                           ) -> dict[str, Any]:
        old: dict[str, Any] = copy.deepcopy(obj.get("status") or {})
        cond = _condition(old, CONDITION_HUB_CONNECTED)
        want = "True" if connected else "False"
        if cond is not None and (cond.get("status"), cond.get("reason"), cond.get("message")) == (
                want, reason, message):
            return old
        conditions = [c for c in old.get("conditions") or [] if isinstance(c, dict)]
        conditions = self._set_condition(conditions, CONDITION_HUB_CONNECTED, connected, reason, message,
                                         obj.get("metadata", {}).get("generation"))
        return {**old, "conditions": conditions}
