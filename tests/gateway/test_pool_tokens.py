"""The gateway's check of an on-prem server's join token against the pool's mounted Secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.pool_tokens import JoinTokenRefused, check_join_token, token_file

TOKEN = "kgp_0123456789abcdef_" + "a" * 43


@pytest.fixture
def tokens_dir(tmp_path: Path) -> Path:
    path = token_file(tmp_path, "onprem/dc1")
    assert path == tmp_path / "onprem.dc1" / "token"  # the chart's mount: /var/run/kubeon/burst/onprem.dc1/token
    path.parent.mkdir()
    path.write_text(TOKEN + "\n")
    return tmp_path


def test_the_pools_own_token_is_accepted(tokens_dir: Path) -> None:
    check_join_token("onprem/dc1", TOKEN, tokens_dir)


def test_nodes_of_cloud_locations_need_no_join_token(tokens_dir: Path) -> None:
    check_join_token("aws/eu-central-1", None, tokens_dir)
    check_join_token("sim/eu-west", None, tokens_dir)


@pytest.mark.parametrize(("location", "presented", "message"), [
    ("onprem/dc1", None, "must present the pool's join token"),
    ("onprem/dc1", "", "must present the pool's join token"),
    ("onprem/dc1", TOKEN[:-1] + "b", "wrong join token"),
    ("onprem/dc2", TOKEN, "has no join token for this pool"),  # another pool's server, or no existingSecret
])
def test_a_missing_wrong_or_unconfigured_join_token_is_refused(tokens_dir: Path, location: str,
                                                               presented: str | None, message: str) -> None:
    with pytest.raises(JoinTokenRefused, match=message):
        check_join_token(location, presented, tokens_dir)


def test_an_empty_token_file_refuses_every_server(tokens_dir: Path) -> None:
    token_file(tokens_dir, "onprem/dc1").write_text("\n")
    with pytest.raises(JoinTokenRefused, match="is empty"):
        check_join_token("onprem/dc1", "", tokens_dir)
