"""Autoscaling policies: the model and the CRD schema accept the documented shape and refuse malformed ones,
naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from models.policy import AutoscalingPolicy, PolicyError, parse_policy
from tests.harness.crd import assert_accepted, assert_refused
from tests.harness.kube import Cluster
from tests.hub.helpers import apply_case

VALID: dict[str, Any] = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "cap-l4"},
                         "spec": {"kind": "Autoscaling", "mode": "Automatic", "nodePools": ["gpu-l4"],
                                  "maxGpus": 16}}
# (name, change, field the model names, word the apiserver's message holds)
CORPUS: list[dict[str, Any]] = [
    {"name": "node-pools-missing", "delete": ["spec.nodePools"], "field": "spec.nodePools",
     "leaf": "spec.nodePools and spec.maxGpus are required"},
    {"name": "max-gpus-missing", "delete": ["spec.maxGpus"], "field": "spec.maxGpus",
     "leaf": "spec.nodePools and spec.maxGpus are required"},
    {"name": "max-gpus-negative", "set": {"spec.maxGpus": -1}, "field": "spec.maxGpus"},
    {"name": "max-gpus-string", "set": {"spec.maxGpus": "16"}, "field": "spec.maxGpus"},
    {"name": "node-pools-empty", "set": {"spec.nodePools": []}, "field": "spec.nodePools"},
    {"name": "node-pool-invalid", "set": {"spec.nodePools": ["GPU_L4"]}, "field": "spec.nodePools[0]",
     "leaf": "nodePools"},
    {"name": "mode-approve", "set": {"spec.mode": "Approve"}, "field": "spec.mode", "leaf": "no Approve"},
    {"name": "packing-field", "set": {"spec.maxNodesAtOnce": 2}, "field": "spec.maxNodesAtOnce",
     "leaf": "only for kind Packing"},
    {"name": "namespaces-field", "set": {"spec.namespaces": ["ml"]}, "field": "spec.namespaces",
     "leaf": "not for kind Autoscaling"},
]


def test_documented_autoscaling_policy_is_valid_and_approve_is_never_the_default() -> None:
    p = parse_policy(VALID)
    assert isinstance(p, AutoscalingPolicy) and p.spec.node_pools == ["gpu-l4"] and p.spec.max_gpus == 16
    doc = apply_case({"delete": ["spec.mode"]}, VALID)
    spec = parse_policy(doc).spec
    assert spec.effective_mode("Approve") == "Recommend" and spec.effective_mode("Automatic") == "Automatic"


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_model_rejects_malformed_autoscaling_policy(case: dict[str, Any]) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(apply_case(case, VALID))
    assert case["field"] in err.value.fields, err.value


@pytest.mark.cluster
def test_apiserver_accepts_the_documented_autoscaling_policy(gpupolicy_crd: Cluster) -> None:
    assert_accepted(gpupolicy_crd, VALID, "as", AutoscalingPolicy)


@pytest.mark.cluster
@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_apiserver_rejects_malformed_autoscaling_policy(gpupolicy_crd: Cluster, case: dict[str, Any]) -> None:
    assert_refused(gpupolicy_crd, apply_case(case, VALID), "as", case)
