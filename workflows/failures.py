"""How the operations' activities are retried, and what a failure was: its application error type and its message,
the cause unwrapped."""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.exceptions import ApplicationError
from temporalio.exceptions import ChildWorkflowError

# Every operation's activities: retried without end (what they do is keyed, a retry does it once), backing off to
# 30 s; a short activity may take a minute.
RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30))
QUICK = timedelta(seconds=60)
# A local activity's attempt: short, so a stuck one is retried soon (in a later workflow task once its local retries
# have taken a minute).
LOCAL_TIMEOUT = timedelta(seconds=10)
# issue 26: an operation's quick reads (its policy; a node's attested identity) and one keyed write (a burn-in with
# no checks lifts the joining taint) run as local activities: one marker event each, in the workflow task that
# follows the step before, instead of a round trip through the task queue and two more workflow tasks. Histories
# recorded before hold them as activities, and replay so.
QUICK_STEPS_LOCAL = "quick-steps-local"

T = TypeVar("T")


async def quick_step(activity: str, arg: Any, *, result_type: type[T], summary: str) -> T:
    """A quick read or one keyed write, as a local activity (QUICK_STEPS_LOCAL), retried as every activity is; in a
    history from before it, an activity."""
    if workflow.patched(QUICK_STEPS_LOCAL):
        return await workflow.execute_local_activity(activity, arg, result_type=result_type,
                                                     start_to_close_timeout=LOCAL_TIMEOUT, retry_policy=RETRY,
                                                     summary=summary)
    return await workflow.execute_activity(activity, arg, result_type=result_type, start_to_close_timeout=QUICK,
                                           retry_policy=RETRY, summary=summary)


def error_type(exc: BaseException) -> str | None:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) else exc
    return cause.type if isinstance(cause, ApplicationError) else None


def message(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) and exc.cause else exc
    return str(cause) or type(cause).__name__
