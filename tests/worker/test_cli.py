from __future__ import annotations

from pathlib import Path

import pytest

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
