"""`kubeon-gpu onprem-agent`: runs on an on-prem GPU server (a systemd service).

Its operator registers the server in the hub (name, GPU product and count). The agent enrols once with the
pool's enrolment token and keeps the server's own credential (``<state dir>/server-credential``, 0600); it
heartbeats with that credential, and the hub answers what the server should be part of. When a burst claims the
server, the agent joins the claiming cluster through *that cluster's gateway as this server's configuration pins
it* (``--gateways-file``: per cluster the gateway's URL and CA, and the routes it may install; a claim by a
cluster not there is declined, and a claim naming another gateway is refused before anything is sent), exactly as
a cloud burst node does, with the user data (gateway ticket) the claim carries, plus the claim the hub signed for
this server, which the gateway checks. When the claim is released it leaves (the kubelet and wireguard-go
stopped, the tunnel and its routes deleted, the kubelet's directory emptied, ticket and credentials wiped) and
reports the server idle.

Its state (idle / joining / serving, the claim's operation and user data) is in a state file written atomically:
a server that reboots mid-claim resumes where it was (a join is retried with the same ticket, which the gateway
answers with the same Node). While the hub is unreachable it keeps its state and reports once the hub is back:
a release is never lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import Literal

import httpx
from pydantic import BaseModel

from common.bearer import BearerFileClient
from models.errors import TicketError
from models.labels import GPU_RESOURCE
from models.pool_claim import POOL_CLAIM_HEADER
from node.join import DEFAULT_INTERFACE
from node.join import JoinRefusedByGateway
from node.join import JoinUnavailable
from node.join import NodeFiles
from node.pinned import GatewayPin
from node.pinned import PinRefused
from node.pinned import load_pins
from node.pinned import pinned_redeemer
from node.pinned import teardown

log = logging.getLogger("kubeon.onprem-agent")

# What a simulated server's node carries so that kwok runs it (dev and tests), as the sim provider's nodes do.
SIM_ANNOTATIONS = {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"}


class AgentState(BaseModel):
    phase: Literal["idle", "joining", "serving"] = "idle"
    operation: str | None = None
    cluster: str | None = None
    node_name: str | None = None
    user_data: str | None = None
    pool_claim: str | None = None  # the claim the hub signed for this server (renewed on every heartbeat)
    # The operation this server left (or declined) and has not yet reported idle for (the hub may be down).
    left: str | None = None


@dataclass
class AgentConfig:
    hub_url: str
    join_token_file: Path  # the pool's enrolment token: used once, to enrol
    pool: str
    server: str
    gpu_product: str
    gpus: int
    state_file: Path
    credentials_dir: Path
    gateways: dict[str, GatewayPin] = field(default_factory=dict)  # the clusters this server may serve
    labels: dict[str, str] = field(default_factory=dict)
    hub_ca_file: str | None = None
    simulated: bool = False  # dev/tests: the node is run by kwok, like the sim provider's instances
    heartbeat_seconds: float | None = None  # None: what the hub says
    credential_file: Path | None = None  # default: server-credential next to the state file
    interface: str = DEFAULT_INTERFACE
    kubelet_dir: Path | None = None  # emptied on leaving (the last tenant's volumes, images): /var/lib/kubelet
    kubelet_stop_command: str = "systemctl stop kubelet"  # on leaving (not simulated)

    @property
    def server_credential(self) -> Path:
        return self.credential_file or self.state_file.parent / "server-credential"


class HubError(Exception):
    """The hub could not be used; ``str()`` says why."""


class HubUnauthorized(HubError):
    """401, or no credential to send: nothing happens until a valid one arrives."""


class HubRefused(HubError):
    """Another 4xx: this request will never succeed as it is."""


class AgentHub(BearerFileClient):
    """The agent's client of the hub (the node side may not import the optimizer's clients): its heartbeat with
    the server's own credential, its enrolment with the pool's enrolment token, each read from its file at every
    call (a rotated one is used at once). No answer or a 5xx raises ``HubError``: try again later."""

    def __init__(self, url: str, token_file: Path, *, timeout: float = 10.0, ca_file: str | None = None) -> None:
        super().__init__(url, token_file, user_agent="kubeon-gpu-onprem-agent", credential="credential",
                         unauthorized=HubUnauthorized, timeout=timeout, ca_file=ca_file)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._http.post(path, json=body, headers=self.auth_headers())
        except httpx.TransportError as exc:
            raise HubError(f"hub {self.url} unreachable: {exc.__class__.__name__}: {exc}") from None
        if response.status_code == 401:
            raise HubUnauthorized(f"hub rejected the credential (401): {_message(response)}")
        if response.status_code >= 500:
            raise HubError(f"hub {self.url} answered {response.status_code}: {_message(response)}")
        if response.status_code >= 400:
            raise HubRefused(f"hub refused ({response.status_code}): {_message(response)}")
        answer: dict[str, Any] = response.json()
        return answer

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/v1/pool-agent/heartbeat", body)

    def enrol(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/v1/pool-agent/enrol", body)


def _message(response: httpx.Response) -> str:
    """The hub's error message (``{"error": ..., "message": ...}``), or the start of the body."""
    try:
        doc = response.json()
    except ValueError:
        return response.text[:300] or response.reason_phrase
    return str(doc["message"]) if isinstance(doc, dict) and isinstance(doc.get("message"), str) else str(doc)[:300]


def join_node(user_data: str, *, gpus: int, provider_id: str, pin: GatewayPin, pool_claim: str | None,
              simulated: bool, state_dir: Path, node_name: str, interface: str = DEFAULT_INTERFACE) -> str:
    """Join the claiming cluster as a cloud burst node does (its own keys and kubelet CSR), the ticket redeemed at
    the gateway ``pin`` names (never the user data's: a different one is refused before anything is sent), with
    the hub's claim for this server, and the answer checked against the pin's routes. Simulated, the node
    registers itself over the API server's own address and kwok plays its kubelet; otherwise the tunnel comes up
    and the kubelet's registration file and flags are written for its systemd unit."""
    from models.join import parse_user_data
    from node.join import join
    from node.join import write_registration
    from node.register import join_simulated

    doc = parse_user_data(user_data)
    if doc.get("nodeName") != node_name:
        raise PinRefused(f"the user data is for node {doc.get('nodeName')!r}, the claim for {node_name!r}")
    capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", GPU_RESOURCE: str(gpus)}
    redeem = pinned_redeemer(pin, doc, header=(POOL_CLAIM_HEADER, pool_claim) if pool_claim else None)
    if simulated:
        node = join_simulated(doc, state_dir, redeem, provider_id=provider_id, capacity=capacity,
                              annotations=SIM_ANNOTATIONS)
        return answer_name(node)
    files = NodeFiles(state_dir)
    answer = join(doc, files, redeem=redeem, interface=interface, tunnel=True)
    write_registration(files, answer, provider_id=provider_id, capacity=capacity)
    return answer.node_name


def answer_name(node: Any) -> str:
    name = node.metadata.name if node.metadata else None
    if not name:
        raise ValueError("the registered Node has no name")
    return str(name)


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.hub = AgentHub(cfg.hub_url, cfg.server_credential, ca_file=cfg.hub_ca_file)
        self.stop = threading.Event()
        self.state = self._load()
        self.interval = cfg.heartbeat_seconds or 5.0

    # -- state file --------------------------------------------------------------------------------------------
    def _load(self) -> AgentState:
        try:
            return AgentState.model_validate_json(self.cfg.state_file.read_text())
        except FileNotFoundError:
            return AgentState()

    def _save(self) -> None:
        self.cfg.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cfg.state_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.state.model_dump_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.cfg.state_file)

    # -- hub -----------------------------------------------------------------------------------------------------
    def _enrol(self) -> bool:
        """The server's own credential, once: the pool's enrolment token exchanged for it (0600)."""
        path = self.cfg.server_credential
        if path.exists():
            return True
        enrolment = AgentHub(self.cfg.hub_url, self.cfg.join_token_file, ca_file=self.cfg.hub_ca_file)
        try:
            issued = enrolment.enrol({"pool": self.cfg.pool, "server": self.cfg.server,
                                      "gpu_product": self.cfg.gpu_product, "gpus": self.cfg.gpus})
        except HubError as exc:
            log.error("cannot enrol server %s in pool %s: %s", self.cfg.server, self.cfg.pool, exc)
            return False
        finally:
            enrolment.close()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(str(issued["credential"]) + "\n")
        os.replace(tmp, path)
        log.info("enrolled server %s in pool %s: credential %s (the enrolment token %s is no longer needed here)",
                 self.cfg.server, self.cfg.pool, issued["credential_id"], self.cfg.join_token_file)
        return True

    def _beat(self) -> dict[str, Any] | None:
        s = self.state
        if not self._enrol():
            return None
        body = {"pool": self.cfg.pool, "server": self.cfg.server, "gpu_product": self.cfg.gpu_product,
                "gpus": self.cfg.gpus, "labels": self.cfg.labels, "phase": s.phase,
                "operation": s.operation if s.phase != "idle" else s.left}
        try:
            answer = self.hub.heartbeat(body)
        except HubUnauthorized as exc:
            log.error("the hub refused this server's credential %s (an operator revoked it? delete the file to "
                      "enrol again): %s", self.cfg.server_credential, exc)
            return None
        except HubRefused as exc:
            log.error("the hub refused this server's heartbeat: %s", exc)
            return None
        except HubError as exc:
            log.warning("hub unreachable, keeping state %s: %s", s.phase, exc)
            return None
        if self.cfg.heartbeat_seconds is None:
            self.interval = float(answer.get("heartbeat_seconds") or 5)
        if s.phase == "idle" and s.left is not None:
            log.info("reported idle after leaving operation %s", s.left)
            s.left = None
            self._save()
        return answer

    # -- join and leave ------------------------------------------------------------------------------------------
    def _join(self) -> bool:
        s = self.state
        assert s.user_data is not None and s.operation is not None
        pin = self.cfg.gateways.get(s.cluster or "")
        if pin is None:
            log.error("operation %s is cluster %s's, which this server is not configured for: leaving", s.operation,
                      s.cluster)
            self._leave()
            return False
        self.cfg.credentials_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            node = join_node(s.user_data, gpus=self.cfg.gpus,
                             provider_id=f"onprem://{self.cfg.pool}/{self.cfg.server}", pin=pin,
                             pool_claim=s.pool_claim, simulated=self.cfg.simulated,
                             state_dir=self.node_dir, node_name=s.node_name or "", interface=self.cfg.interface)
        except JoinUnavailable as exc:
            log.warning("gateway unavailable, will retry the join of %s: %s", s.operation, exc)
            return False
        except (TicketError, JoinRefusedByGateway, PinRefused, ValueError) as exc:
            log.error("the gateway refused the join of operation %s: %s; leaving", s.operation, exc)
            self._leave()
            return False
        (self.cfg.credentials_dir / "node").write_text(node)
        s.phase, s.node_name = "serving", node
        s.user_data = s.pool_claim = None  # redeemed
        self._save()
        log.info("joined cluster %s as node %s (operation %s)", s.cluster, node, s.operation)
        return True

    @property
    def node_dir(self) -> Path:
        return self.cfg.credentials_dir / "node-state"

    def _leave(self) -> None:
        """Stop the node side (kubelet, wireguard-go, the tunnel and its routes), empty the kubelet's directory
        and wipe the credentials; the server is idle (reported on the next heartbeat)."""
        s = self.state
        done = teardown(NodeFiles(self.node_dir), interface="" if self.cfg.simulated else self.cfg.interface,
                        kubelet_stop_command="" if self.cfg.simulated else self.cfg.kubelet_stop_command,
                        kubelet_dir=self.cfg.kubelet_dir) if self.cfg.credentials_dir.exists() else []
        shutil.rmtree(self.cfg.credentials_dir, ignore_errors=True)
        log.info("left operation %s (node %s): %s", s.operation, s.node_name, ", ".join([*done, "credentials wiped"]))
        self.state = AgentState(left=s.operation)
        self._save()

    def _decline(self, claim: dict[str, Any]) -> None:
        log.error("claimed by cluster %s (operation %s), which this server is not configured for (--gateways-file): "
                  "declined, nothing sent", claim.get("cluster"), claim.get("operation"))
        self.state = AgentState(left=str(claim["operation"]))
        self._save()
        self._beat()

    def step(self) -> None:
        """One heartbeat and whatever it asks for."""
        answer = self._beat()
        if answer is None:
            return
        claim = answer.get("claim")
        s = self.state
        if s.phase == "idle":
            if claim and claim.get("operation") != s.left:
                if claim.get("cluster") not in self.cfg.gateways:
                    self._decline(claim)
                    return
                self.state = AgentState(phase="joining", operation=claim["operation"], cluster=claim["cluster"],
                                        node_name=claim["node_name"])
                self._save()
                log.info("claimed by cluster %s for operation %s: joining", claim["cluster"], claim["operation"])
                taken = self._beat()  # taking it up: the hub answers with the ticket and its signed claim
                if taken is not None and self._take(taken.get("claim")):
                    self._join_and_report()
            return
        if claim is None or claim.get("operation") != s.operation:
            self._leave()
            self._beat()
            return
        if s.phase == "joining" and self._take(claim):  # e.g. after a reboot mid-join: the same ticket again
            self._join_and_report()

    def _take(self, claim: dict[str, Any] | None) -> bool:
        """The ticket and a fresh signed claim from the hub's answer (the ticket only comes once taken up)."""
        s = self.state
        if not claim or claim.get("operation") != s.operation:
            return False
        if claim.get("user_data"):
            s.user_data = claim["user_data"]
        if claim.get("pool_claim"):
            s.pool_claim = claim["pool_claim"]
        self._save()
        return s.user_data is not None

    def _join_and_report(self) -> None:
        if self._join() or self.state.phase == "idle":  # joined, or refused and left: the hub hears it at once
            self._beat()

    def run(self) -> None:
        log.info("on-prem agent for server %s of pool %s (%d x %s), hub %s, state %s", self.cfg.server,
                 self.cfg.pool, self.cfg.gpus, self.cfg.gpu_product, self.cfg.hub_url, self.state.phase)
        while not self.stop.is_set():
            try:
                self.step()
            except OSError as exc:
                log.error("step failed: %s", exc)
            self.stop.wait(self.interval)
        self.hub.close()


def _labels(values: list[str]) -> dict[str, str]:
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--label {item!r}: expected key=value")
        out[key] = value
    return out


def build_parser(prog: str = "kubeon-gpu onprem-agent") -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--hub-url", default=env("KUBEON_HUB_URL"), required=not env("KUBEON_HUB_URL"))
    p.add_argument("--enrolment-token-file", "--join-token-file", dest="join_token_file", type=Path,
                   default=Path(env("KUBEON_JOIN_TOKEN_FILE", "/etc/kubeon/join-token")),
                   help="the pool's enrolment token: exchanged once for the server's own credential (kept in the "
                   "state directory); not needed afterwards")
    p.add_argument("--gateways-file", type=Path, required=True,
                   help="the clusters this server may serve: clusters: {<cluster>: {gateway: <https URL>, caFile: "
                   "<PEM>, serverName: <name>, allowedRoutes: [<its tunnel, pod and service CIDRs>]}}")
    p.add_argument("--pool", required=True, help="the pool: the location onprem/<pool>")
    p.add_argument("--server", required=True, help="this server's name in the pool (a DNS label)")
    p.add_argument("--gpu-product", required=True, help="e.g. NVIDIA-L4")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--label", action="append", default=[], help="key=value, repeatable")
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/kubeon-agent"))
    p.add_argument("--hub-ca-file")
    p.add_argument("--interface", default=DEFAULT_INTERFACE, help="the tunnel's interface")
    p.add_argument("--kubelet-dir", type=Path,
                   help="emptied when the server leaves a cluster (the last tenant's volumes and images); default "
                   "/var/lib/kubelet, none when simulated")
    p.add_argument("--heartbeat-seconds", type=float)
    p.add_argument("--simulated", action="store_true", help="development: kwok runs the node (like sim locations)")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "kubeon-gpu onprem-agent") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        labels = _labels(args.label)
        gateways = load_pins(args.gateways_file)
    except (argparse.ArgumentTypeError, OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    cfg = AgentConfig(hub_url=args.hub_url, join_token_file=args.join_token_file, pool=args.pool,
                      server=args.server, gpu_product=args.gpu_product, gpus=args.gpus, labels=labels,
                      state_file=args.state_dir / "state.json", credentials_dir=args.state_dir / "credentials",
                      gateways=gateways, hub_ca_file=args.hub_ca_file, simulated=args.simulated,
                      heartbeat_seconds=args.heartbeat_seconds, interface=args.interface,
                      kubelet_dir=args.kubelet_dir or (None if args.simulated else Path("/var/lib/kubelet")))
    agent = Agent(cfg)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
