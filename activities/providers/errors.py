"""The providers' typed errors (after Karpenter's cloudprovider errors): what the launch and drain phases decide
on. Every message names the location and the cause."""

from __future__ import annotations


class ProviderError(Exception):
    """A cloud call failed; the message names the location and the cause. ``retryable`` is False when the
    cloud refused the request itself (bad configuration, missing permission): retrying cannot help."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class InsufficientCapacityError(ProviderError):
    """The location has no capacity for the instance type now; the next eligible location should be tried."""


class InstanceNotFoundError(ProviderError):
    pass


class LocationNotAllowedError(ProviderError):
    """The launch names a location outside the policy's list (R4.7). Never retried."""


class NotOwnedError(ProviderError):
    """The instance does not carry this policy's burst tag: the optimizer never touches it."""
