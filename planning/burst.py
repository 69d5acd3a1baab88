"""Planning a batch: a policy's waiting pods packed onto the burst nodes already there (launching, joining or
serving, with room), then onto the cheapest set of new nodes by total USD per hour (transfer included), within
``maxGpuHour`` per GPU-hour and ``maxNodes`` at once, and no more new nodes than the gateway has free address
slots (every burst node needs one). Where ``maxNodes`` (or the gateway) binds, as many pods as possible are
served first, then at the least cost. Pods that fit nowhere are named with why.

Pure (no I/O): the ``plan_batch`` activity and the property tests run the same code. Up to ``EXACT_PODS`` pods
(and ``EXACT_ROOMS`` nodes with room) the plan is exact, by dynamic programming over subsets of pods; above that
identical pods (one GPU count and one set of fitting offerings) are planned exactly by a covering DP, and mixed
pods greedily (the node serving most pods per dollar, then each node shrunk to the cheapest offering that
holds its pods)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field

from models.labels import LABEL_GPU_PRODUCT
from models.labels import LABEL_INSTANCE_TYPE
from models.labels import LABEL_LOCATION
from models.labels import LABEL_POLICY
from models.policy import location_label_value
from models.provisioning import BatchPlan
from models.provisioning import NodeRequirement
from models.provisioning import Offering
from models.provisioning import PendingPod
from models.provisioning import PlannedNode
from models.provisioning import Unplaced

EXACT_PODS = 8
EXACT_ROOMS = 6
INF = float("inf")


@dataclass(frozen=True)
class AddressSlots:
    """The gateway's address slots: ``free`` is what new nodes may still take."""

    total: int
    held: int
    free: int

    def why(self) -> str:
        return (f"the gateway's address slots are taken ({self.held} of {self.total} held, {self.free} free for new "
                "nodes; KUBEON_GATEWAY_POD_CIDR / KUBEON_GATEWAY_NODE_CIDR_MASK size them): waits for a burst node "
                "to free one")


def node_labels(offering: Offering, policy: str) -> dict[str, str]:
    """The labels a burst node of this offering carries (those a pod's selector or affinity can name)."""
    return {LABEL_LOCATION: location_label_value(offering.location), LABEL_POLICY: policy,
            LABEL_GPU_PRODUCT: offering.gpu_product, LABEL_INSTANCE_TYPE: offering.instance_type}


def requirement_holds(req: NodeRequirement, labels: dict[str, str]) -> bool:
    value = labels.get(req.key)
    if req.operator == "In":
        return value is not None and value in req.values
    if req.operator == "NotIn":
        return value is None or value not in req.values
    if req.operator == "Exists":
        return value is not None
    if req.operator == "DoesNotExist":
        return value is None
    if req.operator in ("Gt", "Lt"):
        try:
            have, than = int(value or ""), int(req.values[0])
        except (ValueError, IndexError):
            return False
        return have > than if req.operator == "Gt" else have < than
    return False


def pod_matches(pod: PendingPod, labels: dict[str, str]) -> bool:
    """Whether a node with these labels satisfies the pod's nodeSelector and required node affinity (one term
    must hold in full; an empty term matches nothing, as in Kubernetes)."""
    if any(labels.get(k) != v for k, v in pod.node_selector.items()):
        return False
    if pod.affinity_terms:
        return any(term and all(requirement_holds(r, labels) for r in term) for term in pod.affinity_terms)
    return True


@dataclass
class Room:
    """A burst node already there (launching, joining or serving) and the GPUs it has free."""

    name: str
    labels: dict[str, str]
    free: int


@dataclass
class _Pods:
    pods: list[PendingPod]
    offer_mask: list[int]  # per pod: bitmask of fitting eligible offerings
    room_ok: list[list[int]]  # per pod: indices of rooms it matches (room size checked later)
    on_existing: dict[str, str] = field(default_factory=dict)
    nodes: list[tuple[int, list[int]]] = field(default_factory=list)  # (offering index, pod indices)


def eligible_offerings(offerings: Iterable[Offering], locations: list[str], max_gpu_hour: float
                       ) -> tuple[list[Offering], list[tuple[Offering, str]]]:
    """Offerings inside the policy's locations and under maxGpuHour, cheapest node first; the rest with why."""
    allowed = set(locations)
    eligible: list[Offering] = []
    refused: list[tuple[Offering, str]] = []
    for o in offerings:
        what = f"{o.instance_type} in {o.location}"
        if o.location not in allowed:
            refused.append((o, f"{what}: location not in policy"))
        elif o.gpus < 1:
            refused.append((o, f"{what}: no GPU"))
        elif o.usd_per_gpu_hour > max_gpu_hour:
            measured = " with measured transfer" if o.transfer_basis == "measured" else ""
            refused.append((o, f"{what}: ${o.usd_per_gpu_hour:.2f}/GPU-h{measured} over maxGpuHour "
                               f"${max_gpu_hour:.2f}"))
        else:
            eligible.append(o)
    eligible.sort(key=lambda o: (o.usd_per_hour, o.gpus, o.location, o.instance_type))
    return eligible, refused


def plan_pods(*, batch: str, policy: str, taint_key: str, pods: list[PendingPod], rooms: list[Room],
              offerings: list[Offering], locations: list[str], max_gpu_hour: float, max_new_nodes: int,
              max_nodes: int | None = None, preferred: dict[str, str] | None = None,
              address_slots: AddressSlots | None = None) -> BatchPlan:
    """The plan for ``pods``. ``rooms``: nodes already there with free GPUs; ``max_new_nodes``: what maxNodes
    leaves; ``preferred``: pod -> node it was planned onto before (kept when it still fits, so plans are
    stable); ``address_slots``: the gateway's, whose free ones cap the new nodes too."""
    eligible, refused = eligible_offerings(offerings, locations, max_gpu_hour)
    labels = [node_labels(o, policy) for o in eligible]
    order = sorted(pods, key=lambda p: (-p.gpus, p.key))
    unplaced: list[Unplaced] = []
    placeable: list[PendingPod] = []
    offer_mask: list[int] = []
    room_ok: list[list[int]] = []
    for pod in order:
        if not pod.tolerates(taint_key):
            unplaced.append(Unplaced(pod=pod.key, why=f"does not tolerate the policy's taint {taint_key}"))
            continue
        mask = 0
        for i, o in enumerate(eligible):
            if o.gpus >= pod.gpus and pod_matches(pod, labels[i]):
                mask |= 1 << i
        ok_rooms = [j for j, r in enumerate(rooms) if r.free >= pod.gpus and pod_matches(pod, r.labels)]
        if not mask and not ok_rooms:
            unplaced.append(Unplaced(pod=pod.key, why=_why_not(pod, eligible, labels, refused, policy)))
            continue
        placeable.append(pod)
        offer_mask.append(mask)
        room_ok.append(ok_rooms)
    state = _Pods(pods=placeable, offer_mask=offer_mask, room_ok=room_ok)
    budget = max(0, max_new_nodes)
    limit = f"maxNodes {max_nodes}" if max_nodes is not None else "maxNodes"
    why_waits = f"{limit} reached: waits for a burst node to free up"
    if address_slots is not None and address_slots.free < budget:
        budget, why_waits = address_slots.free, address_slots.why()
    if len(placeable) <= EXACT_PODS and len(rooms) <= EXACT_ROOMS:
        _exact(state, rooms, eligible, budget)
    else:
        _heuristic(state, rooms, eligible, budget, preferred or {})

    placed = set(state.on_existing)
    new_nodes: list[PlannedNode] = []
    for oi, members in state.nodes:
        member_pods = [placeable[m] for m in members]
        placed.update(p.key for p in member_pods)
        fits = _fitting(member_pods, eligible, labels)
        chosen = eligible[oi]
        new_nodes.append(PlannedNode(
            offering=chosen, alternatives=[o for o in fits if o is not chosen],
            pods=sorted(p.key for p in member_pods), gpus_used=sum(p.gpus for p in member_pods)))
    new_nodes.sort(key=lambda n: (n.offering.location, n.offering.instance_type, n.pods))
    for pod in placeable:
        if pod.key not in placed:
            unplaced.append(Unplaced(pod=pod.key, why=why_waits, waits_for_capacity=True))
    plan = BatchPlan(plan_id="", batch=batch, policy=policy, new_nodes=new_nodes, on_existing=state.on_existing,
                     unplaced=sorted(unplaced, key=lambda u: u.pod),
                     refused=_refusals_that_matter(refused, [p for p in pods if p.tolerates(taint_key)], policy))
    digest = hashlib.sha256("|".join(
        [batch]
        + [f"{n.offering.location}:{n.offering.instance_type}:{n.offering.usd_per_hour}:{','.join(n.pods)}"
           for n in new_nodes]
        + [f"{k}>{v}" for k, v in sorted(plan.on_existing.items())]
        + [u.pod for u in plan.unplaced]).encode()).hexdigest()[:10]
    plan.plan_id = f"plan-{digest}"
    return plan


def _refusals_that_matter(refused: list[tuple[Offering, str]], pods: list[PendingPod], policy: str) -> list[str]:
    """The refused offerings that could have served a waiting pod (its GPU product, instance type, GPU count),
    with why; the others only counted: an A100 over maxGpuHour says nothing about an L4 pod's plan."""
    def could_serve(o: Offering) -> bool:
        labels = node_labels(o, policy)
        return any(o.gpus >= p.gpus and pod_matches(p, labels) for p in pods)

    shown = [why for o, why in refused if could_serve(o)]
    others = len(refused) - len(shown)
    if others:
        shown.append(f"{others} other refused offering(s) fit none of the waiting pods")
    return shown


def _why_not(pod: PendingPod, eligible: list[Offering], labels: list[dict[str, str]],
             refused: list[tuple[Offering, str]], policy: str) -> str:
    if not eligible:
        # The refusals that could have served this pod, so its line says why without the plan beside it.
        reasons = _refusals_that_matter(refused, [pod], policy)
        return "no eligible offering in the policy's locations" + (f": {'; '.join(reasons[:3])}" if reasons else "")
    largest = max(o.gpus for o in eligible)
    matching = [o for o, lab in zip(eligible, labels, strict=True) if pod_matches(pod, lab)]
    if not matching:
        wanted = ", ".join(f"{k}={v}" for k, v in sorted(pod.node_selector.items())) or "its node affinity"
        return f"no eligible offering matches {wanted}"
    if pod.gpus > largest:
        return f"asks for {pod.gpus} GPU(s); the largest eligible offering has {largest}"
    return (f"asks for {pod.gpus} GPU(s); the largest eligible offering it matches has "
            f"{max(o.gpus for o in matching)}")


def _fitting(members: list[PendingPod], eligible: list[Offering], labels: list[dict[str, str]]) -> list[Offering]:
    need = sum(p.gpus for p in members)
    return [o for o, lab in zip(eligible, labels, strict=True)
            if o.gpus >= need and all(pod_matches(p, lab) for p in members)]


def _submasks(mask: int) -> Iterable[int]:
    sub = mask
    while sub:
        yield sub
        sub = (sub - 1) & mask


def _exact(state: _Pods, rooms: list[Room], eligible: list[Offering], budget: int) -> None:
    """Serve the most pods, then at the least total $/h: DP over subsets of pods."""
    n = len(state.pods)
    full = (1 << n) - 1
    gpus = [0] * (1 << n)
    offers = [0] * (1 << n)
    offers[0] = (1 << len(eligible)) - 1
    for mask in range(1, 1 << n):
        low = (mask & -mask).bit_length() - 1
        gpus[mask] = gpus[mask & (mask - 1)] + state.pods[low].gpus
        offers[mask] = offers[mask & (mask - 1)] & state.offer_mask[low]
    # The cheapest offering holding exactly this set of pods on one new node (eligible is cheapest first).
    best_offer = [-1] * (1 << n)
    for mask in range(1, 1 << n):
        bits = offers[mask]
        for i in range(len(eligible)):
            if bits >> i & 1 and eligible[i].gpus >= gpus[mask]:
                best_offer[mask] = i
                break
    # Rooms: which sets of pods the nodes already there can take (at no cost).
    reach: dict[int, tuple[int, int, int] | None] = {0: None}  # placed set -> (previous set, room, subset)
    for r, room in enumerate(rooms):
        allowed = 0
        for p in range(n):
            if r in state.room_ok[p]:
                allowed |= 1 << p
        for placed in list(reach):
            for sub in _submasks(allowed & ~placed):
                if gpus[sub] <= room.free and placed | sub not in reach:
                    reach[placed | sub] = (placed, r, sub)
    # New nodes: the least cost to serve exactly a set with at most k nodes (one unbounded layer when maxNodes
    # cannot bind: no more nodes than pods are ever useful).
    k_max = min(budget, n)
    bounded = k_max < n
    layers = k_max if bounded else 1
    cost: list[list[float]] = [[INF] * (1 << n) for _ in range(layers + 1)]
    choice: list[list[int]] = [[0] * (1 << n) for _ in range(layers + 1)]
    for k in range(layers + 1):
        cost[k][0] = 0.0
    for k in range(1, layers + 1):
        prev = cost[k - 1] if bounded else cost[k]
        cur, pick = cost[k], choice[k]
        for mask in range(1, 1 << n):
            low = mask & -mask
            best, best_sub = (prev[mask], 0) if bounded else (INF, 0)
            rest = mask ^ low
            for sub in [*_submasks(rest), 0]:
                one = sub | low
                oi = best_offer[one]
                if oi < 0:
                    continue
                c = prev[mask ^ one] + eligible[oi].usd_per_hour
                if c < best - 1e-9:
                    best, best_sub = c, one
            cur[mask], pick[mask] = best, best_sub
    top = cost[layers]
    best_key: tuple[int, float, int] | None = None
    best_pair = (0, 0)
    for placed in reach:
        for new in [*_submasks(full & ~placed), 0]:
            c = top[new]
            if c == INF:
                continue
            key = (-(bin(placed | new).count("1")), round(c, 6), -bin(placed).count("1"))
            if best_key is None or key < best_key:
                best_key, best_pair = key, (placed, new)
    placed, new = best_pair
    while reach[placed] is not None:
        prev_set, r, sub = reach[placed]  # type: ignore[misc]
        for p in range(n):
            if sub >> p & 1:
                state.on_existing[state.pods[p].key] = rooms[r].name
        placed = prev_set
    k = layers
    while new:
        one = choice[k][new]
        if one == 0:  # as cheap with one node fewer
            k -= 1
            continue
        state.nodes.append((best_offer[one], [p for p in range(n) if one >> p & 1]))
        new ^= one
        if bounded:
            k -= 1


def _heuristic(state: _Pods, rooms: list[Room], eligible: list[Offering], budget: int,
               preferred: dict[str, str]) -> None:
    free = [r.free for r in rooms]
    by_name = {r.name: j for j, r in enumerate(rooms)}
    rest: list[int] = []
    for p, pod in enumerate(state.pods):  # largest first: best fit onto the nodes already there
        fits = [j for j in state.room_ok[p] if free[j] >= pod.gpus]
        want = by_name.get(preferred.get(pod.key, ""))
        if want in fits:
            chosen: int | None = want
        else:
            chosen = min(fits, key=lambda j: (free[j], rooms[j].name)) if fits else None
        if chosen is None:
            rest.append(p)
            continue
        free[chosen] -= pod.gpus
        state.on_existing[pod.key] = rooms[chosen].name
    rest = [p for p in rest if state.offer_mask[p]]
    classes = {(state.pods[p].gpus, state.offer_mask[p]) for p in rest}
    if len(classes) == 1:
        _identical(state, rest, eligible, budget)
    elif rest:
        _greedy(state, rest, eligible, budget)


def _identical(state: _Pods, rest: list[int], eligible: list[Offering], budget: int) -> None:
    """Pods alike (same GPU count, same fitting offerings): the cheapest cover, exact."""
    size, mask = state.pods[rest[0]].gpus, state.offer_mask[rest[0]]
    kinds = [(i, eligible[i].gpus // size, eligible[i].usd_per_hour)
             for i in range(len(eligible)) if mask >> i & 1 and eligible[i].gpus // size >= 1]
    per_node = max(k for _, k, _ in kinds)
    serve = min(len(rest), budget * per_node)
    if serve <= 0:
        return
    # cover[m][c]: least cost of at most m nodes holding at least c pods (m only bounded when maxNodes binds).
    nodes_cap = budget if budget < serve else serve
    layers = 1 if nodes_cap >= serve else nodes_cap
    counts: list[int] = []
    if layers == 1:
        cost = [0.0] + [INF] * serve
        pick = [-1] * (serve + 1)
        for c in range(1, serve + 1):
            for ki, (_, k, price) in enumerate(kinds):
                v = cost[max(0, c - k)] + price
                if v < cost[c] - 1e-9:
                    cost[c], pick[c] = v, ki
        c = serve
        while c > 0:
            counts.append(pick[c])
            c = max(0, c - kinds[pick[c]][1])
    else:
        grid = [[0.0] + [INF] * serve for _ in range(layers + 1)]
        picks = [[-1] * (serve + 1) for _ in range(layers + 1)]
        for m in range(1, layers + 1):
            for c in range(1, serve + 1):
                best, bp = grid[m - 1][c], -1
                for ki, (_, k, price) in enumerate(kinds):
                    v = grid[m - 1][max(0, c - k)] + price
                    if v < best - 1e-9:
                        best, bp = v, ki
                grid[m][c], picks[m][c] = best, bp
        m, c = layers, serve
        while c > 0 and m > 0:
            ki = picks[m][c]
            if ki >= 0:
                counts.append(ki)
                c = max(0, c - kinds[ki][1])
            m -= 1
    queue = list(rest[:serve])
    for ki in sorted(counts, key=lambda ki: -kinds[ki][1]):
        oi, k, _ = kinds[ki]
        members, queue = queue[:k], queue[k:]
        if members:
            state.nodes.append((oi, members))


def _greedy(state: _Pods, rest: list[int], eligible: list[Offering], budget: int) -> None:
    left = list(rest)  # largest first
    labels_fit = state.offer_mask
    while left and len(state.nodes) < budget:
        fills: list[tuple[int, list[int]]] = []
        for i, o in enumerate(eligible):
            room, members = o.gpus, []
            for p in left:
                if labels_fit[p] >> i & 1 and state.pods[p].gpus <= room:
                    members.append(p)
                    room -= state.pods[p].gpus
            if members:
                fills.append((i, members))
        if not fills:
            break
        most = max(len(m) for _, m in fills)
        binding = (budget - len(state.nodes)) * most < len(left)
        if binding:
            i, members = min(fills, key=lambda f: (-len(f[1]), eligible[f[0]].usd_per_hour))
        else:
            i, members = min(fills, key=lambda f: (eligible[f[0]].usd_per_hour / len(f[1]), -len(f[1])))
        # Shrink: the cheapest offering that holds the same pods.
        need = sum(state.pods[p].gpus for p in members)
        common = ~0
        for p in members:
            common &= labels_fit[p]
        for j, o in enumerate(eligible):
            if common >> j & 1 and o.gpus >= need:
                i = j if o.usd_per_hour < eligible[i].usd_per_hour else i
                break
        state.nodes.append((i, members))
        taken = set(members)
        left = [p for p in left if p not in taken]
