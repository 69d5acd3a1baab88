"""Pure parts of the scale activities: the next scheduled wake, label selectors."""

from __future__ import annotations

from datetime import UTC
from datetime import datetime

from kubernetes import client

from activities.scale import next_wake
from activities.scale import scale_role_missing
from activities.scale import selector_string
from models.policy import ScheduleWake


def test_next_wake_same_day_later() -> None:
    after = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)  # a Tuesday
    assert next_wake(ScheduleWake(at="08:00"), after) == datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def test_next_wake_skips_to_the_next_weekday_in_its_time_zone() -> None:
    friday_night = datetime(2026, 12, 4, 20, 0, tzinfo=UTC)
    wake = next_wake(ScheduleWake(at="08:00", weekdays=["Mon", "Tue", "Wed", "Thu", "Fri"],
                                  time_zone="Europe/Berlin"), friday_night)
    assert wake == datetime(2026, 12, 7, 7, 0, tzinfo=UTC)  # Monday 08:00 CET


def test_next_wake_is_strictly_after() -> None:
    at_eight = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
    assert next_wake(ScheduleWake(at="08:00"), at_eight) == datetime(2026, 12, 2, 8, 0, tzinfo=UTC)


def test_selector_string() -> None:
    selector = client.V1LabelSelector(match_labels={"app": "llm"}, match_expressions=[
        client.V1LabelSelectorRequirement(key="tier", operator="In", values=["a", "b"]),
        client.V1LabelSelectorRequirement(key="canary", operator="DoesNotExist")])
    assert selector_string(selector) == "app=llm,tier in (a,b),!canary"


def test_role_missing_message_names_the_fix() -> None:
    message = scale_role_missing("ml")
    assert "namespace ml" in message and "scaleToZero.namespaces" in message
