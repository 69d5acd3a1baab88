"""Request and response bodies of the on-prem pool API (style and rules of ``hub.schemas``: unknown fields are
refused, strings are bounded and hold no control characters, integers and prices are bounded)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated
from typing import Final
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import StrictBool
from pydantic import StrictStr

from hub.schemas import NAME_PATTERN
from hub.schemas import OPERATION_PATTERN
from hub.schemas import CredentialOut
from hub.schemas import Name
from hub.schemas import OperationId
from hub.schemas import PolicyName

NO_CONTROL: Final = r"^[^\x00-\x1f\x7f]*$"
PRODUCT_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_DNS: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
LABEL_KEY_PATTERN: Final = rf"^({_DNS}(\.{_DNS})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN: Final = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
MAX_PRICE: Final = 10_000.0  # USD per GPU-hour: anything above is a typo
MAX_GPUS: Final = 64
MAX_USER_DATA: Final = 16_384  # the size limit of EC2 user data, which the ticket's user data also respects

Description = Annotated[StrictStr, Field(max_length=200, pattern=NO_CONTROL)]
GpuProduct = Annotated[StrictStr, Field(min_length=1, max_length=63, pattern=PRODUCT_PATTERN)]
Price = Annotated[float, Field(strict=True, ge=0, le=MAX_PRICE, allow_inf_nan=False)]
Gpus = Annotated[int, Field(strict=True, ge=1, le=MAX_GPUS)]
LabelKey = Annotated[StrictStr, Field(min_length=1, max_length=316, pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[StrictStr, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
NodeName = Annotated[StrictStr, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")]
UserData = Annotated[StrictStr, Field(min_length=1, max_length=MAX_USER_DATA, pattern=r"^[\x20-\x7e\n\r\t]*$")]
ServerState = Literal["idle", "claimed", "joining", "serving", "releasing"]
ShownState = Literal["idle", "claimed", "joining", "serving", "releasing", "offline", "retired"]
AgentPhase = Literal["idle", "joining", "serving"]

__all__ = ["NAME_PATTERN", "OPERATION_PATTERN"]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----- requests -----


class RateCard(_In):
    usd_per_gpu_hour: Annotated[dict[GpuProduct, Price], Field(max_length=100)] = Field(
        description="USD per GPU-hour per GPU product, e.g. `{\"NVIDIA-L4\": 0.35}`")
    transfer_usd_per_gpu_hour: Price = Field(
        default=0.0, description="data transfer back home per GPU-hour (0: the data center is on the home network)")


class PoolCreate(_In):
    name: Name = Field(description="the pool; its location is `onprem/<name>`")
    description: Description = ""
    rate_card: RateCard
    offline_after_seconds: Annotated[int, Field(strict=True, ge=5, le=86_400)] = Field(
        default=60, description="a server silent for longer is offline and never claimed")


class ServerRegister(_In):
    gpu_product: GpuProduct
    gpus: Gpus
    labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=64)] = Field(default_factory=dict)
    usd_per_gpu_hour: Price | None = Field(default=None, description="overrides the pool's rate card")


class Enrolment(_In):
    """A server's agent, with the pool's enrolment token, asking for its own credential (once)."""

    pool: Name
    server: Name
    gpu_product: GpuProduct
    gpus: Gpus


class Heartbeat(_In):
    """What an agent says every few seconds (with its server credential, which names the server): what it is
    doing. ``gpu_product`` and ``gpus`` must be what the operator registered; labels are the operator's."""

    pool: Name
    server: Name | None = Field(default=None, description="must be the credential's server, if given")
    gpu_product: GpuProduct
    gpus: Gpus
    labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=64)] = Field(
        default_factory=dict, description="ignored: a server's labels are what its operator registered")
    phase: AgentPhase = Field(description="idle, or joining/serving `operation`")
    operation: OperationId | None = Field(
        default=None, description="the claim the agent holds (joining or serving), has just left or declines "
        "(idle)")


class ClaimCreate(_In):
    operation: OperationId
    policy: PolicyName = Field(description="the cluster's policy that names this pool's location")
    gpu_product: GpuProduct
    gpus: Gpus
    node_name: NodeName
    user_data: UserData = Field(description="the node's user data (gateway ticket), handed to the server's agent")
    exclude: Annotated[list[Name], Field(max_length=100)] = Field(
        default_factory=list, description="servers not to claim (this launch's withdrawn or declining ones)")


class ClaimRelease(_In):
    operation: OperationId
    policy: PolicyName
    withdraw: StrictBool = Field(
        default=False, description="the agent has not taken the claim up: the server is idle at once (a no-op once "
        "it has)")


# ----- responses -----


class JoinTokenOut(CredentialOut):
    """A pool's join token, which its servers' agents enrol with."""


class JoinTokenIssued(BaseModel):
    pool: str
    token_id: str
    token: str = Field(description="the pool's enrolment token; shown only here. Give it to the pool's servers' "
                       "agents (`--enrolment-token-file`) to enrol; never to a cluster")


class ServerCredentialIssued(BaseModel):
    pool: str
    server: str
    credential_id: str
    credential: str = Field(description="the server's own credential (kgs_...); shown only here. The agent keeps it "
                            "in its state directory and heartbeats with it")


class ClaimKey(BaseModel):
    kid: str
    pem: str


class ClaimKeys(BaseModel):
    keys: list[ClaimKey]
    pem: str = Field(description="all of them as one PEM bundle: the chart's `hub.claimPublicKeys`")


class ServerOut(BaseModel):
    name: str
    pool: str
    gpu_product: str
    gpus: int
    labels: dict[str, str]
    usd_per_gpu_hour: float = Field(description="the override, else the rate card's price for its GPU product")
    state: ShownState
    stored_state: ServerState = Field(description="the state without the offline/retired view")
    last_heartbeat_at: datetime | None
    registered_at: datetime
    registered_by: str
    claim_cluster: str | None
    claim_operation: str | None
    claim_policy: str | None
    claim_node_name: str | None
    claimed_at: datetime | None
    credential_id: str | None = Field(default=None, description="the server's active credential; none: not enrolled")


class PoolOut(BaseModel):
    name: str
    location: str
    description: str
    rate_card: RateCard
    offline_after_seconds: int
    created_at: datetime
    created_by: str
    join_tokens: list[JoinTokenOut]
    servers: list[ServerOut]


class PoolCreated(BaseModel):
    pool: PoolOut
    join_token: JoinTokenIssued


class PoolOffering(BaseModel):
    instance_type: str = Field(description="`onprem.<gpus>x<gpu product>`")
    gpu_product: str
    gpus: int
    usd_per_hour: float = Field(description="the whole server: GPUs x its price per GPU-hour")
    idle: int = Field(description="idle, online servers that fit")


class PoolOfferings(BaseModel):
    pool: str
    location: str
    transfer_usd_per_gpu_hour: float
    offerings: list[PoolOffering]


class Claim(BaseModel):
    """A server as a cluster sees it: what it claimed."""

    server: str
    pool: str
    location: str
    operation: str
    policy: str
    node_name: str
    gpu_product: str
    gpus: int
    state: ShownState
    claimed_at: datetime


class ClaimResult(BaseModel):
    created: bool
    claim: Claim


class ReleaseResult(BaseModel):
    server: str
    released: bool = Field(description="false when there was nothing to release (already released: safe retry)")
    state: ShownState


class AgentClaim(BaseModel):
    operation: str
    cluster: str
    policy: str
    node_name: str
    user_data: str | None = Field(description="the node's user data: only once the agent has taken the claim up "
                                  "(joining); null before and once the node serves (ticket redeemed)")
    pool_claim: str | None = Field(default=None, description="the claim the hub signed for this server (joining "
                                   "only), presented at the gateway (X-Kubeon-Pool-Claim)")


class HeartbeatAnswer(BaseModel):
    server: str
    pool: str
    state: ServerState
    claim: AgentClaim | None = Field(description="what the server should be part of; null: be idle (leave)")
    heartbeat_seconds: int = Field(description="send the next heartbeat within this many seconds")
