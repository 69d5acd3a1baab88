"""The data converter every client and worker of the product uses: pydantic payloads, and refusals without a
stack trace.

An operator's request that is refused (a stale plan, the wrong phase) is an answer, not a crash: the Temporal
UI shows a failure's stack trace under its message, so a refusal carries none."""

from __future__ import annotations

import dataclasses

from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter
from temporalio.converter import DefaultFailureConverter
from temporalio.converter import PayloadConverter


class Refused(ValueError):
    """An operator's request the workflow will not act on, with the reason (raised by update validators)."""


class RefusalFailureConverter(DefaultFailureConverter):
    def to_failure(self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure) -> None:
        super().to_failure(exception, payload_converter, failure)
        if isinstance(exception, Refused):
            failure.stack_trace = ""


DATA_CONVERTER: DataConverter = dataclasses.replace(pydantic_data_converter,
                                                    failure_converter_class=RefusalFailureConverter)
