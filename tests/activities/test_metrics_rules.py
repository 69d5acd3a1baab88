"""The client's PromQL, unit-tested with `promtool test rules` on synthetic series and a virtual clock: the same
expressions activities/metrics.py sends, written as recording rules."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from activities.clients import prometheus as metrics
from activities.clients.prometheus import LabelForm
from tests.harness.prometheus import binary

pytestmark = pytest.mark.prometheus
FORM = LabelForm()
WINDOW = 1800


def _series(name: str, pod: str, gpu: int, values: str) -> dict[str, str]:
    return {"series": f'{name}{{namespace="ml",pod="{pod}",gpu="{gpu}",Hostname="n1"}}', "values": values}


def _samples(record: str, **value_by_pod: float) -> list[dict[str, object]]:
    """What promtool expects of ``record``: one sample per pod of namespace ml."""
    return [{"labels": f'{record}{{namespace="ml",pod="{pod}"}}', "value": value}
            for pod, value in value_by_pod.items()]


def test_idle_busy_young_and_fallback_queries(tmp_path: Path) -> None:
    rules = {"groups": [{"name": "kubeon", "rules": [
        {"record": "kubeon:peak_activity", "expr": metrics.peak_activity_query(FORM, ["ml"], WINDOW)},
        # 30 steps of a minute over 30 minutes (Prometheus 2 counts both ends of the range, 3 only one: clamped)
        {"record": "kubeon:covered_minutes",
         "expr": f"clamp_max({metrics.coverage_query(FORM, ['ml'], WINDOW)}, 30)"},
        {"record": "kubeon:peak_fb_mib", "expr": metrics.peak_memory_query(FORM, ["ml"], WINDOW)},
        {"record": "kubeon:fb_total_mib", "expr": metrics.memory_total_query(FORM, ["ml"])},
        {"record": "kubeon:p95_activity", "expr": metrics.p95_activity_query(FORM, ["ml"], WINDOW)},
    ]}]}
    gr, util = metrics.GR_ENGINE_ACTIVE, metrics.GPU_UTIL
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            _series(gr, "idle", 0, "0.01x40"),
            _series(util, "idle", 0, "1x40"),
            _series(metrics.FB_USED, "idle", 0, "9216x40"),
            _series(metrics.FB_FREE, "idle", 0, "72704x40"),
            _series(gr, "spiked", 1, "0.01x34 0.6 0.01x40"),  # 60% five minutes before the evaluation
            _series(gr, "young", 2, "_x35 0x4"),  # five minutes of data
            _series(util, "util", 3, "3x40"),  # no profiling metric on this GPU: utilisation / 100
            _series(gr, "both", 4, "0.02x40"),
            _series(util, "both", 4, "50x40"),  # the profiling ratio wins where it exists
            {"series": f'{gr}{{namespace="",pod="",gpu="5",Hostname="n1"}}', "values": "0x40"},  # a free GPU
        ],
        "promql_expr_test": [
            {"expr": "kubeon:peak_activity", "eval_time": "40m", "exp_samples": _samples(
                "kubeon:peak_activity", idle=0.01, spiked=0.6, young=0, util=0.03, both=0.02)},
            # 31 minutes after the spike it has left the 30-minute window: idle again.
            {"expr": 'kubeon:peak_activity{pod="spiked"}', "eval_time": "66m",
             "exp_samples": _samples("kubeon:peak_activity", spiked=0.01)},
            {"expr": "kubeon:covered_minutes", "eval_time": "40m", "exp_samples": _samples(
                "kubeon:covered_minutes", idle=30, spiked=30, young=6, util=30, both=30)},
            {"expr": "kubeon:peak_fb_mib", "eval_time": "40m",
             "exp_samples": _samples("kubeon:peak_fb_mib", idle=9216)},
            {"expr": "kubeon:fb_total_mib", "eval_time": "40m",
             "exp_samples": _samples("kubeon:fb_total_mib", idle=81920)},
            {"expr": 'kubeon:p95_activity{pod="spiked"}', "eval_time": "40m",
             "exp_samples": _samples("kubeon:p95_activity", spiked=0.01)},
        ],
    }]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([str(binary("promtool")), "test", "rules", "test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_fails_a_wrong_expectation(tmp_path: Path) -> None:
    """The harness really evaluates: a wrong expected value fails."""
    rules = {"groups": [{"name": "k", "rules": [
        {"record": "kubeon:peak_activity", "expr": metrics.peak_activity_query(FORM, ["ml"], WINDOW)}]}]}
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [_series(metrics.GR_ENGINE_ACTIVE, "idle", 0, "0.01x40")],
        "promql_expr_test": [{"expr": "kubeon:peak_activity", "eval_time": "40m",
                              "exp_samples": _samples("kubeon:peak_activity", idle=0.5)}]}]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(tests))
    done = subprocess.run([str(binary("promtool")), "test", "rules", "test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
