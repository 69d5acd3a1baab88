"""The metric names the chart's Grafana dashboard queries (tests check each against a real scrape)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = (Path(__file__).resolve().parent.parent.parent / "charts" / "kubeon-gpu-optimizer" / "dashboards"
             / "kubeon-gpu-optimizer.json")
METRIC = re.compile(r"\b((?:kubeon|temporal|process)_[a-z0-9_]+)\b")


def dashboard_metric_names(path: Path = DASHBOARD) -> set[str]:
    doc = json.loads(path.read_text())
    names = {m for panel in doc["panels"] for target in panel["targets"] for m in METRIC.findall(target["expr"])}
    assert names, f"{path}: no metric in any query"
    return names
