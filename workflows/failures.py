"""What an activity or child failure was: its application error type and its message, the cause unwrapped."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError


def error_type(exc: BaseException) -> str | None:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) else exc
    return cause.type if isinstance(cause, ApplicationError) else None


def message(exc: BaseException) -> str:
    cause = exc.cause if isinstance(exc, (ActivityError, ChildWorkflowError)) and exc.cause else exc
    return str(cause) or type(cause).__name__
