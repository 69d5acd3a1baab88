"""Launching a burst node: its join ticket (which reserves its address slot), its user data, its instance."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.context import PhaseActivities
from activities.providers.errors import InsufficientCapacityError
from activities.providers.errors import LocationNotAllowedError
from activities.providers.errors import ProviderError
from models.errors import ADDRESSES_EXHAUSTED_TYPE
from models.errors import HELD
from models.errors import INSUFFICIENT_CAPACITY
from models.errors import LOCATION_NOT_ALLOWED
from models.errors import PROVIDER_REJECTED
from models.errors import AddressesExhausted
from models.join import JoinTicketRequest
from models.join import UserDataTooLarge
from models.join import render_user_data
from models.node import Instance
from models.node import LaunchRequest


class LaunchActivities(PhaseActivities):
    """launch_instance"""

    @activity.defn(name="launch_instance", no_thread_cancel_exception=True)
    def launch_instance(self, req: LaunchRequest) -> Instance:
        provider = self.context.provider(req.offering.location)
        gate = self.context.gate(req.policy)  # checked again here, as the allow-list is: nothing launches while held
        if gate.held:
            raise ApplicationError(gate.reason, type=HELD, non_retryable=True)
        # Before the ticket (the gateway reads its records for it): a worker that takes long to get here under
        # load would otherwise miss the heartbeat timeout, and the retry finds the instance this attempt launches.
        activity.heartbeat("issuing the join ticket")
        try:  # the ticket reserves the node's address slot: none free, no instance (it could never join)
            grant = self.gateway.issue_ticket(JoinTicketRequest(
                operation=req.operation, policy=req.policy, location=req.offering.location,
                node_name=req.node_name, labels=req.labels, taints=req.taints, gpus=req.offering.gpus,
            ))
        except AddressesExhausted as exc:
            raise ApplicationError(str(exc), type=ADDRESSES_EXHAUSTED_TYPE, non_retryable=True) from None
        try:
            # Where the node joins: the endpoint the gateway names (its public URL or LoadBalancer address) and
            # the name to verify its certificate as; a gateway naming none: the configured URL.
            user_data = render_user_data(gateway_url=grant.endpoint or self.config.gateway_url,
                                         server_name=grant.server_name if grant.endpoint else "",
                                         ticket=grant.ticket, node_name=req.node_name, labels=req.labels,
                                         taints=req.taints, ca_bundle=self.config.gateway_ca_bundle,
                                         attestation=grant.attestation)
        except UserDataTooLarge as exc:  # configuration (labels, CA bundle): a retry would not shrink it
            raise ApplicationError(str(exc), type=PROVIDER_REJECTED, non_retryable=True) from None
        activity.heartbeat("launching")
        try:
            instance = provider.launch(req, user_data)
        except LocationNotAllowedError as exc:
            raise ApplicationError(str(exc), type=LOCATION_NOT_ALLOWED, non_retryable=True) from None
        except InsufficientCapacityError as exc:
            raise ApplicationError(str(exc), type=INSUFFICIENT_CAPACITY, non_retryable=True) from None
        except ProviderError as exc:
            if not exc.retryable:
                raise ApplicationError(str(exc), type=PROVIDER_REJECTED, non_retryable=True) from None
            raise
        return instance
