from __future__ import annotations

import pytest

from worker.config import ConfigError, load_settings


def test_defaults_to_recommend_mode() -> None:
    settings = load_settings({"KUBEON_CLUSTER": "prod-use1-a"})
    assert settings.default_mode == "Recommend"
    assert settings.cluster == "prod-use1-a"


def test_default_mode_from_environment() -> None:
    assert load_settings({"KUBEON_CLUSTER": "c", "KUBEON_DEFAULT_MODE": "Approve"}).default_mode == "Approve"


def test_bad_mode_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KUBEON_DEFAULT_MODE"):
        load_settings({"KUBEON_CLUSTER": "c", "KUBEON_DEFAULT_MODE": "Sometimes"})


def test_missing_cluster_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KUBEON_CLUSTER"):
        load_settings({})


@pytest.mark.parametrize(("value", "seconds"), [("60s", 60.0), ("5m", 300.0), ("1m30s", 90.0), ("45", 45.0)])
def test_hub_poll_interval_takes_the_charts_durations(value: str, seconds: float) -> None:
    settings = load_settings({"KUBEON_CLUSTER": "c", "KUBEON_HUB_POLL_INTERVAL": value})
    assert settings.hub_poll_interval == seconds


@pytest.mark.parametrize(("variable", "value", "why"), [
    ("KUBEON_HUB_POLL_INTERVAL", "soon", "not a duration"),
    ("KUBEON_HUB_POLL_INTERVAL", "500ms", "at least 1s"),
    ("KUBEON_HUB_URL", "ftp://hub.example.com", "not an http"),
])
def test_bad_hub_setting_names_the_variable_and_why(variable: str, value: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"{variable}: .*{why}"):
        load_settings({"KUBEON_CLUSTER": "c", variable: value})
