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
