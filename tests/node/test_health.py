"""The burn-in's GPU health check as the node runs it (node/health.py): DCGM's verdict read from its exit status
and its result table (the dcgmi stand-in, tests/harness/dcgmi.py), and a check that cannot run failing closed."""

from __future__ import annotations

import shlex
import sys

from node.health import GpuHealthRun
from node.health import verdict
from tests.harness.dcgmi import DEPLOYMENT_TESTS
from tests.harness.dcgmi import table

DCGMI = f"{shlex.quote(sys.executable)} -m tests.harness.dcgmi diag -r 1"


def test_a_passing_diagnostic_is_healthy_and_counts_its_tests() -> None:
    health = GpuHealthRun(DCGMI).result(timeout=60)
    assert (health.healthy, health.reason) == (True, "DcgmDiagPassed"), health
    assert health.message.endswith(f": {len(DEPLOYMENT_TESTS)} test(s) passed"), health.message


def test_a_failed_test_is_unhealthy_naming_the_test_and_the_exit_status() -> None:
    health = GpuHealthRun(f"{DCGMI} --fail 'Page Retirement/Row Remap'").result(timeout=60)
    assert (health.healthy, health.reason) == (False, "DcgmDiagFailed"), health
    assert "failed (exit 226): Page Retirement/Row Remap: Fail - GPU: 0" in health.message, health.message


def test_a_fail_row_is_unhealthy_even_when_the_exit_status_was_lost() -> None:
    # A wrapper script that ends in `|| true` or `| tee` exits 0 whatever dcgmi said.
    health = verdict("dcgmi diag -r 1", 0, "\n".join(table("Inforom")))
    assert not health.healthy and "Inforom: Fail - GPU: 0" in health.message, health


def test_a_non_zero_exit_without_a_table_is_unhealthy_with_what_it_printed() -> None:
    health = verdict("dcgmi diag -r 1", 255, "Error: unable to establish a connection to the host engine\n")
    assert not health.healthy and health.message.endswith("connection to the host engine"), health


def test_a_node_without_dcgm_fails_closed_saying_what_to_do() -> None:
    health = GpuHealthRun("kubeon-no-such-dcgmi diag -r 1").result()
    assert (health.healthy, health.reason) == (False, "DcgmDiagUnavailable"), health
    assert "could not start" in health.message and "spec.burnIn.checks" in health.message, health.message


def test_a_diagnostic_that_hangs_fails_at_the_timeout() -> None:
    health = GpuHealthRun("sleep 30").result(timeout=0.3)
    assert (health.healthy, health.reason) == (False, "DcgmDiagTimedOut"), health
