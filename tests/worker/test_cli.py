from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from worker.cli import main

HERE = Path(__file__).parent
VALID = HERE.parent / "models" / "valid_policy.yaml"


def test_validate_accepts_documented_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "validate", str(VALID)]) == 0
    assert "ok: inference-burst-eu (Burst, mode Approve)" in capsys.readouterr().out


def test_validate_names_the_field_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(VALID.read_text().replace("maxNodes: 4", "maxNodes: -1").replace("  mode: Approve\n", ""))
    assert main(["policy", "validate", str(bad)]) == 1
    assert "spec.limits.maxNodes: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_validate_applies_default_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "p.yaml"
    doc.write_text(VALID.read_text().replace("  mode: Approve\n", ""))
    assert main(["policy", "validate", "--default-mode", "Automatic", str(doc)]) == 0
    assert "mode Automatic" in capsys.readouterr().out


def test_validate_reports_unreadable_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "broken.yaml"
    doc.write_text("spec: [unclosed\n")
    assert main(["policy", "validate", str(doc)]) == 1
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.temporal
def test_the_command_prints_its_whole_answer_and_exits_with_its_code(temporal_dev_server: WorkflowEnvironment) -> None:
    """The installed ``kubeon-gpu`` (worker.cli:entry) leaves without the interpreter's teardown once the Temporal SDK
    ran (that teardown aborted one run in 20): what it printed to a pipe is all there, and its exit code is the
    command's. Several runs, since the abort it prevents came at random."""
    command = Path(sys.executable).parent / "kubeon-gpu"
    # Buffered, as a user's shell gives it a pipe (PYTHONUNBUFFERED would hide an unflushed answer).
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
           "KUBEON_TEMPORAL_ADDRESS": temporal_dev_server.client.service_client.config.target_host}
    for _ in range(5):
        listed = subprocess.run([str(command), "ops", "list", "--json", "--cluster", "no-such-cluster"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == []
        missing = subprocess.run([str(command), "ops", "show", "op-000000000000"], env=env, capture_output=True,
                                 text=True, timeout=60)
        assert missing.returncode == 1, missing.stderr
        assert missing.stderr.startswith("kubeon-gpu ops show: ") and "op-000000000000" in missing.stderr, (
            missing.stderr)
        assert "Fatal Python error" not in listed.stderr + missing.stderr


def test_a_reader_that_stops_early_ends_the_command_quietly_with_141() -> None:
    # `kubeon-gpu ... | grep -q ...`: the reader closes the pipe before the command has written. The command ends as a
    # shell tool does (128 + SIGPIPE), with no BrokenPipeError traceback on stderr.
    proc = subprocess.Popen([sys.executable, "-c", "from worker.cli import entry; entry()", "policy", "validate",
                             "examples/policies/sharing-a100.yaml"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
