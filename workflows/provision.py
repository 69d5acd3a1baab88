"""ProvisionWorkflow: one long-lived workflow per policy (``provision/<cluster>/<policy>``) that turns waiting pods
into batches and batches into nodes.

Every watcher replica signals-with-start the same ID (``pods_waiting``), so pods are planned once however many
replicas see them. When pods arrive and no plan is being made, the policy's waiting pods are planned at once
(after the idle window, if one is set). Under load (pods arriving while a plan is made, or within a second of
others) the next plan gathers the trickle for a few seconds from when its first pod turned Unschedulable
(batch_load_*_seconds). A plan packs the pods onto the policy's burst nodes with room, then onto the cheapest new
nodes (``plan_batch``). One proposal per batch: Recommend
records and reports it; Approve waits for one approval of the whole batch (bound to its plan ID); Automatic
goes ahead at once. Each new node is its own ``BurstNode`` workflow, started with a derived ID; it tells this
workflow when it is done (``node_finished``). ``maxNodes`` is held here: nodes launching, joining, verifying
or serving count against it, and pods that find no node under it wait, shown with why, until one frees up.
The workflow continues as new before its history grows large, carrying its state."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable
from datetime import datetime
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError
from temporalio.workflow import ParentClosePolicy

from models import search_attributes as sa
from models.audit import AuditRecord
from models.eks import GroupScaling
from models.hub import proposal_detail
from models.ids import node_workflow_id
from models.ids import operation_id
from models.join import burst_node_name
from models.node import NodeFinished
from models.node import NodeInput
from models.node import NodePhase
from models.provisioning import AvoidedLocation
from models.provisioning import BatchPhase
from models.provisioning import BatchPlan
from models.provisioning import BatchPlanRequest
from models.provisioning import BatchRecord
from models.provisioning import HomeScaleRequest
from models.provisioning import LearnedEgress
from models.provisioning import LoadPolicyRequest
from models.provisioning import NodeRecord
from models.provisioning import PodsGone
from models.provisioning import PodsWaiting
from models.provisioning import PolicySnapshot
from models.provisioning import ProvisionInput
from models.provisioning import ProvisionPhase
from models.provisioning import ProvisionView
from models.ui_text import Details
from models.ui_text import code
from models.ui_text import md
from models.ui_text import md_usd
from workflows.audit import record_audit
from workflows.burst import BurstNodeWorkflow
from workflows.failures import RETRY
from workflows.failures import quick_step
from workflows.observe import batch_trace
from workflows.operation import Approvable
from workflows.operation import Proposal

KEEP_BATCHES = 20
# A provisioning waiting for capacity whose waiting pods all went settles at once (runs before it did not).
SETTLE_WHEN_WAITERS_GO = "kubeon-settle-when-capacity-waiters-go"
# A trickle is also pods arriving within its idle window after others (a quick plan has few arriving while it is
# made), and its gathering ends at the latest batch_load_max_seconds after its first pod turned Unschedulable (runs
# before it gathered only after pods arrived during a plan, and counted from the first arrival).
TRICKLE_BY_RATE = "kubeon-trickle-by-rate"


@workflow.defn(name="Provision")
class ProvisionWorkflow(Approvable[ProvisionPhase, ProvisionInput]):
    KIND = "Provision"
    NOUN = "batch"

    @workflow.init
    def __init__(self, inp: ProvisionInput) -> None:
        # State is read here, not in run(): signals can be handled before run() starts (signal-with-start and
        # continue-as-new alike).
        super().__init__(ProvisionPhase.IDLE)
        self.inp: ProvisionInput = inp
        self.waiting = {p.uid: p for p in inp.waiting}
        self.nodes = {n.workflow_id: n for n in inp.nodes}
        self.not_before = dict(inp.not_before)
        self.failures = dict(inp.failures)
        self.batches = list(inp.batches)
        self.learned_egress = dict(inp.learned_egress)
        self.home_scaled = dict(inp.home_scaled)  # home node group -> when this provisioning last grew it
        self.avoided = dict(inp.avoided_locations)  # location -> until when its plans leave it out, and why
        self.seq = inp.seq
        self.chain = inp.chain
        self.dirty = bool(self.waiting)
        self.first_arrival: datetime | None = None  # of the pods that arrived since the last plan
        self.last_arrival: datetime | None = None  # of any pod new to this run
        # The earliest Unschedulable time (the scheduler's condition) of the pods that arrived since the last plan.
        self.first_unschedulable: datetime | None = None
        self.planning = False  # a round is under way
        self.arrived_while_planning = False
        self.arrived_soon_after = False  # pods arrived within the trickle's idle window after others
        self.proposal: BatchRecord | None = None
        self.policy: PolicySnapshot | None = None
        self.unplaced: dict[str, str] = {}
        # pod -> why it waits for a node to free up (maxNodes, address slots), as the last plan found
        self.capacity_waits: dict[str, str] = {}
        self.rounds = 0  # of this run: each round that plans is a trace of its own

    # -- signals from the watchers and the node workflows ----------------------------------------------------
    @workflow.signal(name="pods_waiting", description="Internal: pods waiting for a burst node (sent by the watcher).")
    def pods_waiting(self, msg: PodsWaiting) -> None:
        arrived = False
        for pod in msg.pods:
            if not pod.uid or pod.gpus < 1:
                continue
            if pod.uid not in self.waiting:
                arrived = True
                since = pod.unschedulable_since
                if since is not None and (self.first_unschedulable is None or since < self.first_unschedulable):
                    self.first_unschedulable = since
            self.waiting[pod.uid] = pod
        if arrived:
            now = workflow.now()
            window = timedelta(seconds=self.inp.settings.batch_load_idle_seconds)
            self.arrived_soon_after = self.arrived_soon_after or (
                self.last_arrival is not None and now - self.last_arrival < window)
            self.dirty = True
            self.arrived_while_planning = self.arrived_while_planning or self.planning
            self.last_arrival = now
            self.first_arrival = self.first_arrival or now
        self._show()

    @workflow.signal(name="pods_gone", description="Internal: pods that no longer wait (sent by the watcher).")
    def pods_gone(self, msg: PodsGone) -> None:
        for uid in msg.uids:
            self._forget(uid)
        # Pods bound anywhere change the room on the policy's nodes: pods that no plan could place yet are
        # looked at again (their reason may have changed, or a node they were planned onto was taken).
        keys = {p.key for p in self.waiting.values()}
        if any(k in self.unplaced for k in keys):
            self.dirty = True
        if (self.phase == ProvisionPhase.WAITING_FOR_CAPACITY and not self._capacity_waits()
                and workflow.patched(SETTLE_WHEN_WAITERS_GO)):
            self._settle()  # no pod waits for a node to free up any more
        self._show()

    @workflow.signal(name="node_finished", description=(
        "Internal: a burst node's workflow ended (sent by that workflow); frees its place under maxNodes."))
    def node_finished(self, msg: NodeFinished) -> None:
        record = self.nodes.pop(msg.workflow_id, None)
        if record is None:
            return
        if msg.egress is not None:
            learned = self.learned_egress.get(msg.egress.location, LearnedEgress()).learn(msg.egress)
            self.learned_egress[msg.egress.location] = learned
            self._log(f"egress in {msg.egress.location}: {learned.gb_per_gpu_hour:.3f} GB/GPU-h measured over "
                      f"{learned.nodes} node(s); the next plans price transfer at it")
        self._log(f"node {msg.workflow_id} {msg.phase.value}" + (f": {msg.message}" if msg.message else ""))
        batch = next((b for b in reversed(self.batches) if b.batch == record.batch), None)
        if batch is not None and batch.node_ended(msg.workflow_id, msg.phase.value):
            self._log(f"batch {batch.batch} {batch.phase.value}: {batch.message}")
        if msg.phase in (NodePhase.FAILED, NodePhase.CANCELLED):
            self._back_off(set(record.pods))
        if msg.phase == NodePhase.FAILED:
            # Its pods are planned elsewhere for a while: the next node there may fail the same way.
            location = record.offering.location
            until = workflow.now() + timedelta(seconds=self.inp.settings.location_avoid_seconds)
            self.avoided[location] = AvoidedLocation(until=until, why=f"its node {msg.workflow_id} failed: "
                                                                      f"{msg.message}"[:300])
            self._log(f"{location} left out of the plans until {until:%H:%M:%S}: node {msg.workflow_id} failed")
        self.dirty = bool(self.waiting)  # a node freed up under maxNodes
        self._show()

    def _back_off(self, pods: set[str]) -> None:
        """The pods, if they still wait, are planned again after a back-off that doubles with each failure."""
        s = self.inp.settings
        for uid, pod in self.waiting.items():
            if pod.key in pods:
                count = self.failures[uid] = self.failures.get(uid, 0) + 1
                wait = min(s.recheck_seconds, s.retry_seconds * 2 ** (count - 1))
                self.not_before[uid] = (workflow.now() + timedelta(seconds=wait)).isoformat()

    def _forget(self, uid: str) -> None:
        self.waiting.pop(uid, None)
        self.not_before.pop(uid, None)
        self.failures.pop(uid, None)

    # -- approval (CLI, Temporal UI, hub): the handlers are Approvable's ---------------------------------------
    def _awaiting(self) -> Proposal | None:
        p = self.proposal
        return None if p is None else Proposal(operation=p.batch, plan_id=p.plan.plan_id, summary=p.plan.summary())

    # -- visibility -----------------------------------------------------------------------------------------
    @workflow.query(name="state", description=(
        "The policy's provisioning: phase, the proposal awaiting approval with its plan, waiting pods and why, "
        "nodes held under maxNodes, recent batches."))
    def state(self) -> ProvisionView:
        return ProvisionView(
            workflow_id=workflow.info().workflow_id, cluster=self.inp.cluster, policy=self.inp.policy,
            mode=self.policy.mode if self.policy else None, phase=self.phase, message=self._message(),
            proposal=self.proposal, waiting=self._waiting_lines(), nodes=list(self.nodes.values()),
            max_nodes=self.policy.max_nodes if self.policy else 0, batches=list(self.batches),
            learned_egress=dict(self.learned_egress), history=list(self.history))

    def _waiting_lines(self) -> list[str]:
        return sorted(f"{p.key}" + (f": {self.unplaced[p.key]}" if p.key in self.unplaced else "")
                      for p in self.waiting.values())

    def _message(self) -> str:
        """Between rounds the message is what the state is now (nodes finish, pods go at any time); in a round,
        what the round said (planning, the proposal awaiting approval)."""
        if self.phase == ProvisionPhase.IDLE:
            counts = f"{len(self.nodes)} node(s), {len(self.waiting)} pod(s) waiting"
            return f"{counts}; {self.message}" if self.message else counts
        if self.phase == ProvisionPhase.WAITING_FOR_CAPACITY:
            whys = self._capacity_waits()
            return f"{len(whys)} pod(s) wait" + (f": {whys[0]}" if whys else "")
        return self.message

    def _capacity_waits(self) -> list[str]:
        """Why the pods that still wait for a node to free up wait (maxNodes, address slots)."""
        waiting = {p.key for p in self.waiting.values()}
        return [why for pod, why in self.capacity_waits.items() if pod in waiting]

    def _details(self) -> str:
        p = self.policy
        d = Details()
        d.para(f"**Provisioning** of burst nodes for policy {code(self.inp.policy)} on cluster "
               f"{code(self.inp.cluster)}, mode {md(p.mode if p else '?')}")
        message = self._message()
        d.para(f"**Phase:** {md(self.phase.value)}" + (f" — {md(message)}" if message else ""))
        d.para(f"**Nodes:** {len(self.nodes)} of maxNodes {p.max_nodes if p else '?'} · "
               f"**waiting pods:** {len(self.waiting)}")
        if self.proposal is not None:
            plan_details(d, self.proposal.plan)
            grows = "".join(f", grows {md(h.describe())}" for h in self.proposal.plan.home_scale)
            d.para(f"**Approving** launches these {len(self.proposal.plan.new_nodes)} node(s) at "
                   f"{md_usd(self.proposal.plan.total_usd_per_hour, 'h')} in total{grows}: signal `approve` (empty "
                   f"input), or `kubeon-gpu ops approve {self.proposal.batch}`, or approve in the hub. Signal "
                   "`reject` launches nothing.")
        waiting = {p.key for p in self.waiting.values()}
        unplaced = sorted((pod, why) for pod, why in self.unplaced.items() if pod in waiting)
        if unplaced:
            d.para("**Waiting, and why:**")
            d.bullets((f"{code(pod)}: {md(why)}" for pod, why in unplaced), limit=10, more="more pods")
        if self.nodes:
            d.para("**Nodes held:**")
            d.bullets((f"{code(n.workflow_id)}: {md(n.offering.describe())} for {len(n.pods)} pod(s)"
                       for n in self.nodes.values()), limit=10, more="more nodes")
        return d.render()

    async def _audit(self, record: BatchRecord, action: str, detail: str = "", approver: str | None = None,
                     subject: str = "") -> None:
        """``subject``: what of the batch the record is about when it has several (a home node group)."""
        first = record.plan.new_nodes[0].offering.location if record.plan.new_nodes else None
        await record_audit(AuditRecord(
            key=f"{record.batch}/{action}" + (f"/{subject}" if subject else ""), at=workflow.now(),
            cluster=self.inp.cluster, policy=self.inp.policy,
            operation=record.batch, action=action, location=first, approver=approver,
            # A proposal carries its whole plan, as the hub shows it and binds a decision to its plan ID.
            detail=detail or (proposal_detail(record.plan, record.batch) if action == "proposed"
                              else record.plan.summary())))

    # -- the loop -------------------------------------------------------------------------------------------
    def _should_continue(self) -> bool:
        info = workflow.info()
        return (info.get_current_history_length() >= self.inp.continue_after_events
                or info.is_continue_as_new_suggested())

    def _due(self) -> list[str]:
        now = workflow.now().isoformat()
        return [uid for uid in self.waiting if self.not_before.get(uid, "") <= now]

    def _timeout(self) -> timedelta | None:
        if not self.waiting:
            return None
        wait = self.inp.settings.replan_seconds
        now = workflow.now()
        for uid in self.waiting:
            if uid in self.not_before:
                wait = min(wait, max(0.5, (datetime.fromisoformat(self.not_before[uid]) - now).total_seconds()))
        return timedelta(seconds=wait)

    @workflow.run
    async def run(self, inp: ProvisionInput) -> None:
        info = workflow.info()
        if not self.chain:
            self.chain = hashlib.sha256(info.run_id.encode()).hexdigest()[:6]
        self._start(sa.CLUSTER.value_set(inp.cluster), sa.POLICY.value_set(inp.policy),
                    sa.OPERATION_KIND.value_set(self.KIND), sa.PHASE.value_set(self.phase.value))
        self._show()
        while True:
            if self._should_continue():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(inp.model_copy(update={
                    "chain": self.chain, "seq": self.seq, "waiting": list(self.waiting.values()),
                    "nodes": list(self.nodes.values()), "not_before": self.not_before, "failures": self.failures,
                    "batches": self.batches[-KEEP_BATCHES:], "learned_egress": self.learned_egress,
                    "home_scaled": self.home_scaled, "avoided_locations": self.avoided}))
            try:
                await workflow.wait_condition(lambda: self.dirty or self._should_continue(),
                                              timeout=self._timeout())
            except TimeoutError:
                self.dirty = bool(self._due())
            if not self.dirty:
                continue
            self.planning = True
            self.rounds += 1
            try:
                with batch_trace(self._next_batch(), inp.policy, f"{info.workflow_id}/{info.run_id}/{self.rounds}"):
                    await self._round()
            finally:
                self.planning = False

    def _next_batch(self) -> str:
        """The ID of the batch the next plan with new nodes makes."""
        return "op-" + hashlib.sha256(
            f"{workflow.info().workflow_id}/{self.chain}/{self.seq + 1}".encode()).hexdigest()[:12]

    async def _gather(self, idle: float, longest: float, *, from_unschedulable: bool) -> None:
        """Wait until no pod arrived for ``idle`` seconds, at the latest ``longest`` seconds after the first arrived
        (``from_unschedulable``: or turned Unschedulable, if earlier: the watcher's own gathering counts)."""
        while idle > 0 and self.last_arrival is not None and self.first_arrival is not None:
            now = workflow.now()
            first = self.first_arrival
            if from_unschedulable and self.first_unschedulable is not None:
                # The cluster's clock, to the second: a pod that waited long already is planned at once.
                first = min(first, self.first_unschedulable)
            until = min(self.last_arrival + timedelta(seconds=idle), first + timedelta(seconds=longest))
            if now >= until:
                break
            await workflow.sleep(until - now, summary="gather pods arriving together into one plan")

    async def _round(self) -> None:
        inp, s = self.inp, self.inp.settings
        try:
            self.policy = await quick_step(
                "load_policy", LoadPolicyRequest(policy=inp.policy, default_mode=inp.default_mode),
                result_type=PolicySnapshot, summary="the policy, for this round's plan")
        except ActivityError as exc:  # the policy is gone or invalid: nothing to plan for its pods
            self.dirty = False
            self.waiting.clear()
            self._set_phase(ProvisionPhase.IDLE, str(exc.cause or exc))
            return
        policy = self.policy
        idle = s.batch_idle_seconds if policy.mode == "Automatic" else max(s.batch_idle_seconds,
                                                                           s.proposal_idle_seconds)
        if len(self.nodes) + len(self._due()) >= policy.max_nodes:
            idle = max(idle, s.limit_idle_seconds)
        longest = s.batch_max_seconds
        trickle = self.arrived_while_planning
        by_rate = workflow.patched(TRICKLE_BY_RATE)
        if by_rate:
            # Pods coming again within the window (a rollout), not now and then (each planned at once; a rollout's
            # first pods too).
            trickle = trickle or self.arrived_soon_after
        if trickle and idle < s.batch_load_idle_seconds:
            # A trickle of pods (a large rollout, the scheduler marking pods Unschedulable a few a second):
            # gathered for a few seconds rather than planned a few pods at a time onto small nodes.
            idle, longest = s.batch_load_idle_seconds, s.batch_load_max_seconds
        self.arrived_while_planning = self.arrived_soon_after = False
        await self._gather(idle, longest, from_unschedulable=by_rate and trickle)
        self.dirty = False
        self.first_arrival = self.first_unschedulable = None
        due = self._due()
        if not due:
            return
        batch = self._next_batch()
        self._set_phase(ProvisionPhase.PLANNING, f"{len(due)} pod(s) waiting")
        plan = await workflow.execute_activity(
            "plan_batch",
            BatchPlanRequest(policy=policy, batch=batch, pods=[self.waiting[u] for u in due],
                             nodes=list(self.nodes.values()),
                             max_new_nodes=max(0, policy.max_nodes - len(self.nodes)),
                             egress_gb_per_gpu_hour={loc: e.gb_per_gpu_hour for loc, e in self.learned_egress.items()},
                             home_scaled=self.home_scaled, avoid_locations=self._avoid_locations()),
            result_type=BatchPlan, start_to_close_timeout=timedelta(minutes=3), retry_policy=RETRY)
        for uid in plan.gone:
            self._forget(uid)
        self.unplaced = {u.pod: u.why for u in plan.unplaced}
        self.capacity_waits = {u.pod: u.why for u in plan.unplaced if u.waits_for_capacity}
        if not plan.acts:
            self._settle()
            return
        self.seq += 1
        record = BatchRecord(batch=batch, phase=BatchPhase.PLANNING, plan=plan)
        # The batch's attributes in one upsert, all four, as the histories of running provisionings hold it.
        self._upsert([sa.BATCH.value_set(batch), sa.OPERATION.value_set(batch),
                      sa.LOCATION.value_set(plan.new_nodes[0].offering.location if plan.new_nodes else "home"),
                      sa.USD_PER_HOUR.value_set(round(plan.total_usd_per_hour, 4))], every=True)
        if policy.mode == "Recommend":
            self._decided(record, BatchPhase.PROPOSED, plan.summary())
            await self._audit(record, "proposed")
            self._settle()
            return
        if policy.mode == "Approve" and not await self._approved(record):
            self._settle()
            return
        await self._start_nodes(record, policy)
        self._settle()

    def _avoid_locations(self) -> dict[str, str]:
        """The locations the next plan leaves out (their node failed a while ago), with why; the others forgotten."""
        now = workflow.now()
        self.avoided = {loc: a for loc, a in self.avoided.items() if a.until > now}
        return {loc: f"until {a.until:%H:%M:%S} UTC: {a.why}" for loc, a in self.avoided.items()}

    def _decided(self, record: BatchRecord, phase: BatchPhase, message: str) -> None:
        """A batch that launches nothing: its pods are planned again only after recheck_seconds."""
        record.phase, record.message = phase, message
        until = (workflow.now() + timedelta(seconds=self.inp.settings.recheck_seconds)).isoformat()
        planned = record.plan.planned_pods
        for uid, pod in self.waiting.items():
            if pod.key in planned:
                self.not_before[uid] = until
                self.unplaced[pod.key] = f"batch {record.batch} {phase.value.lower()}: {message}"
        self._keep(record)

    def _keep(self, record: BatchRecord) -> None:
        self.batches.append(record)
        del self.batches[:-KEEP_BATCHES]

    async def _approved(self, record: BatchRecord) -> bool:
        s = self.inp.settings
        self.proposal, self.approval, self.rejection = record, None, None
        record.phase = BatchPhase.AWAITING_APPROVAL
        self._set_phase(ProvisionPhase.AWAITING_APPROVAL, f"batch {record.batch}: {record.plan.summary()}")
        await self._audit(record, "proposed")
        planned = record.plan.planned_pods

        def wanted() -> bool:
            return any(p.key in planned for p in self.waiting.values())

        try:
            await workflow.wait_condition(
                lambda: self.approval is not None or self.rejection is not None or not wanted(),
                timeout=timedelta(seconds=s.approval_timeout_seconds),
                timeout_summary=f"approval deadline of batch {record.batch}")
        except TimeoutError:
            self.proposal = None
            self._decided(record, BatchPhase.EXPIRED, f"no approval within {s.approval_timeout_seconds}s")
            await self._audit(record, "expired")
            return False
        self.proposal = None
        if self.approval is None and self.rejection is None:  # every pod it was for is gone (bound, deleted)
            record.phase, record.message = BatchPhase.COMPLETED, "withdrawn: none of its pods waits any more"
            self._keep(record)
            await self._audit(record, "withdrawn", record.message)
            return False
        if self.rejection is not None:
            r = self.rejection
            self._decided(record, BatchPhase.REJECTED, f"rejected by {r.approver}: {r.reason}")
            record.approver = r.approver
            await self._audit(record, "rejected", r.reason or record.message, approver=r.approver)
            return False
        assert self.approval is not None
        record.approver = self.approval.approver
        await self._audit(record, "approved", f"plan {record.plan.plan_id}", approver=record.approver)
        return True

    async def _grow_home(self, record: BatchRecord) -> list[str]:
        """Grow the home node groups the plan grows (their pods still waiting), one after another: what each
        became. A group that cannot be grown (a cloud error, refused) backs its pods off; the next plan sees it."""
        waiting = {p.key for p in self.waiting.values()}
        done: list[str] = []
        for h in record.plan.home_scale:
            if not waiting.intersection(h.pods):
                continue
            try:
                scaling = await workflow.execute_activity(
                    "scale_home_group", HomeScaleRequest(group=h.group, to_size=h.to_size), result_type=GroupScaling,
                    start_to_close_timeout=timedelta(minutes=10), retry_policy=RETRY,
                    summary=f"grow home node group {h.group} to {h.to_size} nodes")
            except ActivityError as exc:
                why = f"home node group {h.group} not grown to {h.to_size}: {exc.cause or exc}"
                self._back_off(set(h.pods))
                await self._audit(record, "home-scale-failed", why, subject=h.group)
            else:
                self.home_scaled[h.group] = workflow.now()
                why = f"home node group {h.group} at {scaling.desired_size} node(s) (from {h.from_size}) for " \
                      f"{len(h.pods)} pod(s)"
                await self._audit(record, "home-scaled", why, subject=h.group)
            self._log(f"batch {record.batch}: {why}")
            done.append(why)
        return done

    async def _start_nodes(self, record: BatchRecord, policy: PolicySnapshot) -> None:
        inp = self.inp
        grown = await self._grow_home(record)
        waiting = {p.key for p in self.waiting.values()}
        room = max(0, policy.max_nodes - len(self.nodes))
        starts: list[Awaitable[workflow.ChildWorkflowHandle[Any, Any]]] = []
        for i, node in enumerate(record.plan.new_nodes):
            if not waiting.intersection(node.pods):  # its pods went (bound elsewhere, deleted) while approving
                continue
            if len(starts) >= room:
                break
            wf_id = node_workflow_id(inp.cluster, inp.policy, record.batch, i)
            self.nodes[wf_id] = NodeRecord(workflow_id=wf_id, node_name="", batch=record.batch,
                                           offering=node.offering, pods=node.pods)
            record.nodes.append(wf_id)
            starts.append(workflow.start_child_workflow(
                BurstNodeWorkflow.run,
                NodeInput(cluster=inp.cluster, policy=inp.policy, batch=record.batch,
                          provision_workflow_id=workflow.info().workflow_id, node=node,
                          default_mode=inp.default_mode, settings=inp.settings),
                id=wf_id, parent_close_policy=ParentClosePolicy.ABANDON,
                static_summary=(f"Burst node: {node.offering.instance_type} in {node.offering.location} for "
                                f"{len(node.pods)} pod(s) (batch {record.batch})")))
        record.launched()  # Launching until its nodes end (node_finished), then what became of them
        if grown and not record.nodes:
            record.message = "; ".join(grown)
        self._keep(record)
        handles = await asyncio.gather(*starts)
        for handle in handles:
            # The node's name comes from its own run (operation ID): known once started.
            rec = self.nodes.get(handle.id)
            if rec is not None:
                rec.node_name = burst_node_name(operation_id(handle.id, handle.first_execution_run_id or ''))
        self._log(f"batch {record.batch}: {len(handles)} node(s) started")

    def _settle(self) -> None:
        """The round is over: Idle, or waiting for capacity; the message says the state's (see _message)."""
        self._set_phase(ProvisionPhase.WAITING_FOR_CAPACITY if self._capacity_waits() else ProvisionPhase.IDLE)


def plan_details(d: Details, plan: BatchPlan) -> None:
    """A plan as the Temporal UI shows it: the total, then each new node with its price breakdown and pods."""
    d.para(f"**Plan** {code(plan.plan_id)} (batch {code(plan.batch)}): **total "
           f"{md_usd(plan.total_usd_per_hour, 'h')}** for {len(plan.new_nodes)} new node(s)")
    d.bullets((f"node {i}: {md(n.offering.describe())}; pods: {', '.join(code(p) for p in n.pods)}"
               for i, n in enumerate(plan.new_nodes)), limit=20, more="more nodes")
    if plan.home_scale:
        d.para("**Home node groups grown** (their pods are not burst):")
        d.bullets((f"{md(h.describe())}: {', '.join(code(p) for p in h.pods[:10])}" for h in plan.home_scale),
                  limit=10, more="more groups")
    if plan.on_existing:
        d.para("**On nodes already there:**")
        d.bullets((f"{code(pod)} on {code(node)}" for pod, node in sorted(plan.on_existing.items())), limit=10,
                  more="more pods")
    if plan.unplaced:
        d.para("**Not placed:**")
        d.bullets((f"{code(u.pod)}: {md(u.why)}" for u in plan.unplaced), limit=10, more="more pods")
