"""Activities of a policy's provisioning: its policy as it is now, and the plan of a batch of waiting pods."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.capacity import CapacityError
from activities.context import PhaseActivities
from activities.providers.errors import ProviderError
from models.eks import GroupScaling
from models.errors import POLICY_GONE
from models.locations import transfer_usd_per_gb
from models.provisioning import BatchPlan
from models.provisioning import BatchPlanRequest
from models.provisioning import HomeScaleRequest
from models.provisioning import LoadPolicyRequest
from models.provisioning import Offering
from models.provisioning import PendingPod
from models.provisioning import PolicySnapshot
from models.provisioning import Unplaced
from planning.burst import AddressSlots
from planning.burst import Room
from planning.burst import node_labels
from planning.burst import plan_pods
from planning.home import HomePlan
from planning.home import plan_home


class ProvisioningActivities(PhaseActivities):
    """load_policy, plan_batch, scale_home_group"""

    @activity.defn(name="load_policy", no_thread_cancel_exception=True)
    def load_policy(self, req: LoadPolicyRequest) -> PolicySnapshot:
        from kubernetes.client import ApiException

        try:
            policy = self.kube.read_policy(req.policy)
        except ApiException as exc:
            if exc.status == 404:
                raise ApplicationError(f"policy {req.policy} no longer exists", type=POLICY_GONE,
                                       non_retryable=True) from None
            raise
        except ValueError as exc:
            raise ApplicationError(f"policy {req.policy} is invalid: {exc}", type=POLICY_GONE,
                                   non_retryable=True) from None
        spec = policy.spec
        return PolicySnapshot(
            name=policy.name, generation=policy.metadata.generation or 0, mode=spec.effective_mode(req.default_mode),
            tolerate=spec.workloads.tolerate, locations=list(spec.locations), max_nodes=spec.limits.max_nodes,
            max_gpu_hour=float(spec.limits.max_gpu_hour), return_home=spec.return_home,
            on_over_budget=spec.limits.on_over_budget, burn_in_checks=list(spec.burn_in.checks),
            burn_in_timeout_seconds=spec.burn_in.timeout_seconds,
        )

    def _offerings(self, locations: list[str], egress_gb_per_gpu_hour: dict[str, float]
                   ) -> tuple[list[Offering], list[str]]:
        """Each location's offerings priced now; where the policy's earlier nodes measured their egress, transfer
        priced at that rate (the location's own USD/GB) instead of the configured estimate."""
        offerings: list[Offering] = []
        unavailable: list[str] = []
        for location in locations:
            try:
                config = self.config.location(location)
                priced = self.context.provider(location).price_offerings(location)
                if location in egress_gb_per_gpu_hour:
                    usd_per_gpu_hour = round(egress_gb_per_gpu_hour[location]
                                             * transfer_usd_per_gb(self.config.home, config), 4)
                    priced = [o.model_copy(update={"transfer_usd_per_gpu_hour": usd_per_gpu_hour,
                                                   "transfer_basis": "measured"}) for o in priced]
                offerings += priced
            except KeyError as exc:
                unavailable.append(f"{location}: {exc.args[0]}")
            except (ProviderError, ApplicationError) as exc:
                unavailable.append(f"{location}: {exc}")
        return offerings, unavailable

    @activity.defn(name="plan_batch", no_thread_cancel_exception=True)
    def plan_batch(self, req: BatchPlanRequest) -> BatchPlan:
        """Plan the batch: which of its pods still wait, the room on the policy's burst nodes, the offerings of
        its locations priced now; then the pure planner (planning.burst)."""
        still, used = self.kube.waiting_and_used({p.uid for p in req.pods}, {n.node_name for n in req.nodes})
        waiting = [p for p in req.pods if p.uid in still]
        home = self._home(waiting, req)
        waiting = [p for p in waiting if p.key not in home.at_home]
        rooms = [Room(name=n.node_name, labels=node_labels(n.offering, req.policy.name),
                      free=n.offering.gpus - used.get(n.node_name, 0)) for n in req.nodes]
        preferred = {pod: n.node_name for n in req.nodes for pod in n.pods}
        locations, avoided = self._locations(req)
        offerings, unavailable = (self._offerings(locations, req.egress_gb_per_gpu_hour) if waiting
                                  else ([], []))
        slots = self._free_slots(req) if waiting else None
        p = req.policy
        plan = plan_pods(batch=req.batch, policy=p.name, taint_key=p.tolerate, pods=waiting,
                         rooms=[r for r in rooms if r.free > 0], offerings=offerings, locations=locations,
                         max_gpu_hour=p.max_gpu_hour, max_new_nodes=req.max_new_nodes, max_nodes=p.max_nodes,
                         preferred=preferred, address_slots=slots)
        plan.gone = [pod.uid for pod in req.pods if pod.uid not in still]
        plan.unplaced = [Unplaced(pod=k, why=why) for k, why in sorted(home.at_home.items())] + plan.unplaced
        plan.home = home.burst
        plan.home_scale = home.scale
        plan.refused = avoided + unavailable + plan.refused
        plan.planned_at = self.clock()
        return plan

    @staticmethod
    def _locations(req: BatchPlanRequest) -> tuple[list[str], list[str]]:
        """The policy's locations the plan may use (those the provisioning avoids left out, unless none would be
        left), and a line for each avoided one."""
        usable = [loc for loc in req.policy.locations if loc not in req.avoid_locations]
        avoided = [loc for loc in req.policy.locations if loc in req.avoid_locations]
        if not usable:
            return list(req.policy.locations), [
                f"{loc}: planned again although {req.avoid_locations[loc]} (no other location of the policy)"
                for loc in avoided]
        return usable, [f"{loc}: left out, {req.avoid_locations[loc]}" for loc in avoided]

    def _home(self, pods: list[PendingPod], req: BatchPlanRequest) -> HomePlan:
        """capacity.provider: the pods home capacity is serving, those it cannot (each with why), and the home
        managed groups to grow for them (planning.home)."""
        capacity = self.context.capacity
        if capacity is None or not pods:
            return HomePlan()
        try:
            groups = capacity.list_groups()
        except CapacityError as exc:  # home unknown: burst as without a provider, and say so
            return HomePlan(burst={p.key: f"home capacity unknown ({exc})" for p in pods})
        s = self.context.home
        return plan_home(pods, groups, self.clock(), grace_seconds=s.launch_grace_seconds,
                         register_seconds=s.register_seconds, scaled=req.home_scaled)

    @activity.defn(name="scale_home_group", no_thread_cancel_exception=True)
    def scale_home_group(self, req: HomeScaleRequest) -> GroupScaling:
        """Grow a home managed node group to ``req.to_size`` nodes. Idempotent: the target is absolute (a retry
        sends nothing), and a group someone grew past it meanwhile, which the provider refuses to lower, is left as
        it is. The group is read only then: a scale up costs the provider's own calls (bench/README.md)."""
        capacity = self.context.capacity
        if capacity is None:
            raise ApplicationError("no capacity provider: capacity.provider is none", non_retryable=True)
        try:
            return capacity.scale_up(req.group, req.to_size)
        except CapacityError as exc:
            try:
                scaling = capacity.get_group(req.group).scaling
            except CapacityError:
                scaling = None
            if scaling is not None and scaling.desired_size >= req.to_size:
                return scaling
            raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=not exc.retryable) from exc

    def _free_slots(self, req: BatchPlanRequest) -> AddressSlots:
        """The gateway's address slots free for new nodes: every provider's node joins with a ticket, which
        reserves one. The provisioning's nodes still launching (no ticket yet) will take theirs."""
        room = self.gateway.capacity()
        holding = set(room.nodes)
        pending = sum(1 for n in req.nodes if n.node_name not in holding)
        return AddressSlots(total=room.total, held=room.held, free=max(0, room.free - pending))
