"""How the operations' activities are retried, and what a failure was: its application error type and its message,
the cause unwrapped."""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.exceptions import ApplicationError
from temporalio.exceptions import ChildWorkflowError

# Every operation's activities: retried without end (what they do is keyed, a retry does it once), backing off to
# 30 s; a short activity may take a minute.
RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))
QUICK = timedelta(seconds=60)


def error_type(exc: BaseException) -> str | None:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) else exc
    return cause.type if isinstance(cause, ApplicationError) else None


def message(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) and exc.cause else exc
    return str(cause) or type(cause).__name__
