"""The onprem provider against the hub as a real process, with a server agent as its own process: offerings from
the rate card, launch = claim (idempotent by operation), two optimizers racing for one server, terminate =
release (idempotent, retried while the hub is down), locations the cluster's policies do not name."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from activities.providers.errors import InsufficientCapacityError
from activities.providers.errors import LocationNotAllowedError
from activities.providers.errors import ProviderError
from activities.providers.onprem import OnPremProvider
from activities.providers.onprem import PoolClient
from models.join import render_user_data
from models.labels import Taint
from models.locations import BurstConfig
from models.node import LaunchRequest
from models.provisioning import Offering
from tests.harness.controlplane import free_port
from tests.harness.onprem import AgentProcess
from tests.harness.onprem import register_server
from tests.harness.onprem import write_gateways
from tests.hub.conftest import BOOTSTRAP_KEY
from tests.hub.helpers import wait_until
from tests.hub.process import HubProcess

LOCATION = "onprem/dc1"
CONFIG = BurstConfig.model_validate({"locations": [{"name": LOCATION}]})
# A gateway that is not there: the agent picks the claim up and keeps retrying its join.
GATEWAY = f"http://127.0.0.1:{free_port()}"


@dataclass
class Env:
    hub: HubProcess
    admin: httpx.Client
    tmp: Path
    join_token_file: Path

    def cluster(self, name: str, locations: list[str]) -> OnPremProvider:
        created = self.admin.post("/v1/clusters", json={"name": name})
        assert created.status_code == 201, created.text
        token = self.tmp / f"{name}.token"
        token.write_text(created.json()["token"]["token"])
        doc = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "burst"},
               "spec": {"kind": "Burst", "mode": "Automatic", "workloads": {"tolerate": "gpu.kubeon.io/burst"},
                        "locations": locations, "limits": {"maxNodes": 2, "maxGpuHour": 4.5}}}
        assert self.admin.put(f"/v1/clusters/{name}/policies/burst", json=doc).status_code == 201
        return OnPremProvider(CONFIG, PoolClient(self.hub.url, token), claim_ack_seconds=20, poll_seconds=0.1,
                              beat=lambda _: None)

    def server(self, name: str) -> dict[str, Any]:
        servers = self.admin.get("/v1/pools/dc1").json()["servers"]
        found: dict[str, Any] = next((s for s in servers if s["name"] == name), {})
        return found


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    key_file = tmp_path / "bootstrap.key"
    key_file.write_text(BOOTSTRAP_KEY)
    hub = HubProcess(["--database-url", f"sqlite:///{tmp_path / 'hub.db'}", "--bootstrap-admin-key-file",
                      str(key_file)], logdir=tmp_path).start()
    admin = httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {BOOTSTRAP_KEY}"}, timeout=10)
    pool = admin.post("/v1/pools", json={"name": "dc1", "offline_after_seconds": 5, "rate_card": {
        "usd_per_gpu_hour": {"NVIDIA-L4": 0.4}, "transfer_usd_per_gpu_hour": 0.01}})
    assert pool.status_code == 201, pool.text
    join = tmp_path / "join.token"
    join.write_text(pool.json()["join_token"]["token"])
    try:
        yield Env(hub=hub, admin=admin, tmp=tmp_path, join_token_file=join)
    finally:
        admin.close()
        hub.stop()


@pytest.fixture
def agent(env: Env) -> Iterator[AgentProcess]:
    register_server(env.hub.url, BOOTSTRAP_KEY, "dc1", "gpu-a")
    gateways = write_gateways(env.tmp / "gateways.yaml", {"prod-a": GATEWAY, "prod-b": GATEWAY})
    proc = AgentProcess(hub_url=env.hub.url, join_token_file=env.join_token_file, pool="dc1", server="gpu-a",
                        state_dir=env.tmp / "agent", gateways_file=gateways, heartbeat_seconds=0.3).start()
    try:
        wait_until(lambda: env.server("gpu-a").get("state") == "idle" or None, timeout=20, what="gpu-a idle")
        yield proc
    finally:
        proc.stop()


def request(operation: str, offering: Offering) -> LaunchRequest:
    return LaunchRequest(operation=operation, cluster="c", policy="burst", allowed_locations=[LOCATION],
                         offering=offering, node_name=f"burst-{operation}", labels={},
                         taints=[Taint(key="gpu.kubeon.io/burst")])


def user_data(operation: str = "op-1") -> str:
    return render_user_data(gateway_url=GATEWAY, ticket="t.t", node_name=f"burst-{operation}", labels={}, taints=[])


def test_offerings_come_from_the_rate_card_with_the_pools_transfer_figure(env: Env, agent: AgentProcess) -> None:
    provider = env.cluster("prod-a", [LOCATION])
    [offering] = provider.price_offerings(LOCATION)
    assert (offering.instance_type, offering.gpus, offering.gpu_product) == ("onprem.1xNVIDIA-L4", 1, "NVIDIA-L4")
    assert offering.instance_usd_per_hour == 0.4 and offering.transfer_usd_per_gpu_hour == 0.01
    assert offering.usd_per_gpu_hour == 0.41


def test_launch_claims_once_per_operation_and_terminate_returns_the_server(env: Env, agent: AgentProcess) -> None:
    provider = env.cluster("prod-a", [LOCATION])
    [offering] = provider.price_offerings(LOCATION)
    first = provider.launch(request("op-1", offering), user_data())
    assert first.instance_id == "gpu-a" and first.state == "pending" and first.tags["kubeon.io/operation"] == "op-1"
    again = provider.launch(request("op-1", offering), user_data())  # a retried launch: the same server
    assert again.instance_id == "gpu-a"
    assert [i.instance_id for i in provider.list(LOCATION, operation="op-1")] == ["gpu-a"]
    assert provider.get(LOCATION, "gpu-a").node_name == "burst-op-1"
    assert json.loads((agent.state_dir / "state.json").read_text())["operation"] == "op-1"
    with pytest.raises(InsufficientCapacityError, match="no idle"):
        provider.launch(request("op-2", offering), user_data("op-2"))

    provider.terminate(LOCATION, "gpu-a", policy="burst")
    provider.terminate(LOCATION, "gpu-a", policy="burst")  # idempotent
    wait_until(lambda: env.server("gpu-a")["state"] == "idle" or None, timeout=20, what="gpu-a idle again")
    assert provider.list(LOCATION) == []
    assert not agent.credentials_dir.exists()


def test_two_optimizers_racing_for_one_server_exactly_one_wins(env: Env, agent: AgentProcess) -> None:
    providers = [env.cluster("prod-a", [LOCATION]), env.cluster("prod-b", [LOCATION])]
    [offering] = providers[0].price_offerings(LOCATION)
    outcomes: dict[int, Any] = {}
    start = threading.Barrier(2)

    def launch(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = providers[i].launch(request(f"op-{i}", offering), user_data(f"op-{i}"))
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    won = [o for o in outcomes.values() if not isinstance(o, Exception)]
    lost = [o for o in outcomes.values() if isinstance(o, Exception)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert isinstance(lost[0], InsufficientCapacityError)
    assert env.server("gpu-a")["claim_cluster"] in ("prod-a", "prod-b")


def test_a_location_the_clusters_policies_do_not_name_is_refused(env: Env, agent: AgentProcess) -> None:
    provider = env.cluster("prod-a", ["sim/eu-west"])
    with pytest.raises(LocationNotAllowedError, match="no policy naming location onprem/dc1"):
        provider.price_offerings(LOCATION)
    offering = Offering(location=LOCATION, instance_type="onprem.1xNVIDIA-L4", gpus=1, gpu_product="NVIDIA-L4",
                        instance_usd_per_hour=0.4, transfer_usd_per_gpu_hour=0)
    with pytest.raises(LocationNotAllowedError):
        provider.launch(request("op-1", offering), user_data())
    assert env.server("gpu-a")["state"] == "idle"


def test_a_release_while_the_hub_is_down_is_retried_and_delivered_when_it_is_back(
        env: Env, agent: AgentProcess) -> None:
    provider = env.cluster("prod-a", [LOCATION])
    [offering] = provider.price_offerings(LOCATION)
    provider.launch(request("op-1", offering), user_data())
    env.hub.stop()
    with pytest.raises(ProviderError) as raised:
        provider.terminate(LOCATION, "gpu-a", policy="burst")
    assert raised.value.retryable and "unreachable" in str(raised.value)
    assert json.loads((agent.state_dir / "state.json").read_text())["phase"] == "joining"  # nothing lost
    env.hub.start()
    provider.terminate(LOCATION, "gpu-a", policy="burst")  # the activity's retry
    wait_until(lambda: env.server("gpu-a")["state"] == "idle" or None, timeout=20, what="gpu-a idle again")


def test_a_claim_by_a_cluster_the_server_is_not_configured_for_is_declined(env: Env, agent: AgentProcess) -> None:
    provider = env.cluster("stranger", [LOCATION])  # not in the agent's --gateways-file
    [offering] = provider.price_offerings(LOCATION)
    with pytest.raises(InsufficientCapacityError, match="declined"):
        provider.launch(request("op-1", offering), user_data())
    assert env.server("gpu-a")["state"] == "idle"
    assert "declined, nothing sent" in agent.log
