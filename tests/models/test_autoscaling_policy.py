"""Autoscaling policies: the model and the CRD schema accept the documented shape and refuse malformed ones,
naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from models.policy import AutoscalingPolicy
from models.policy import AutoscalingSpec
from models.policy import PolicyError
from models.policy import parse_policy
from tests.harness.crd import assert_accepted
from tests.harness.crd import assert_cli_validates
from tests.harness.crd import assert_refused
from tests.harness.kube import Cluster
from tests.hub.helpers import apply_case

VALID: dict[str, Any] = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "cap-l4"},
                         "spec": {"kind": "Autoscaling", "mode": "Automatic", "nodePools": ["gpu-l4"],
                                  "maxGpus": 16}}
# (name, change, field the model names, word the apiserver's message holds)
CORPUS: list[dict[str, Any]] = [
    {"name": "node-pools-missing", "delete": ["spec.nodePools"], "field": "spec.nodePools",
     "leaf": "spec.nodePools is required"},
    # Neither budget: the message names both fields.
    {"name": "budget-missing", "delete": ["spec.maxGpus"], "field": "spec",
     "leaf": "spec.maxGpus or spec.maxUsdPerHour is required for kind Autoscaling"},
    {"name": "max-gpus-negative", "set": {"spec.maxGpus": -1}, "field": "spec.maxGpus"},
    {"name": "max-gpus-string", "set": {"spec.maxGpus": "16"}, "field": "spec.maxGpus"},
    {"name": "max-usd-negative", "set": {"spec.maxUsdPerHour": -1.5}, "field": "spec.maxUsdPerHour"},
    {"name": "max-usd-zero", "set": {"spec.maxUsdPerHour": 0}, "field": "spec.maxUsdPerHour"},
    {"name": "max-usd-string", "set": {"spec.maxUsdPerHour": "10"}, "field": "spec.maxUsdPerHour"},
    {"name": "max-usd-huge", "set": {"spec.maxUsdPerHour": 2e6}, "field": "spec.maxUsdPerHour"},
    {"name": "node-pools-empty", "set": {"spec.nodePools": []}, "field": "spec.nodePools"},
    {"name": "node-pool-invalid", "set": {"spec.nodePools": ["GPU_L4"]}, "field": "spec.nodePools[0]",
     "leaf": "nodePools"},
    {"name": "mode-approve", "set": {"spec.mode": "Approve"}, "field": "spec.mode", "leaf": "no Approve"},
    {"name": "packing-field", "set": {"spec.maxNodesAtOnce": 2}, "field": "spec.maxNodesAtOnce",
     "leaf": "only for kinds Packing and Sharing"},
    {"name": "namespaces-field", "set": {"spec.namespaces": ["ml"]}, "field": "spec.namespaces",
     "leaf": "not for kind Autoscaling"},
    {"name": "gpu-products-empty", "set": {"spec.gpuProducts": []}, "field": "spec.gpuProducts"},
    {"name": "gpu-product-invalid", "set": {"spec.gpuProducts": ["NVIDIA L4"]}, "field": "spec.gpuProducts[0]",
     "leaf": "gpuProducts"},
    {"name": "gpu-products-repeated", "set": {"spec.gpuProducts": ["NVIDIA-L4", "NVIDIA-L4"]},
     "field": "spec.gpuProducts", "leaf": "Duplicate value"},
]


def test_documented_autoscaling_policy_is_valid_and_approve_is_never_the_default() -> None:
    p = parse_policy(VALID)
    assert isinstance(p, AutoscalingPolicy) and p.spec.node_pools == ["gpu-l4"] and p.spec.max_gpus == 16
    doc = apply_case({"delete": ["spec.mode"]}, VALID)
    spec = parse_policy(doc).spec
    assert spec.effective_mode("Approve") == "Recommend" and spec.effective_mode("Automatic") == "Automatic"


# maxUsdPerHour alone, and both (the smaller limit wins, planning/autoscaling.py); GPU products with a budget.
BUDGETS: list[dict[str, Any]] = [{"delete": ["spec.maxGpus"], "set": {"spec.maxUsdPerHour": 25.5}},
                                 {"set": {"spec.maxUsdPerHour": 40}},
                                 {"delete": ["spec.maxGpus"], "set": {"spec.maxUsdPerHour": 40.0,
                                                                       "spec.gpuProducts": ["NVIDIA-L4"]}}]


@pytest.mark.parametrize("case", BUDGETS, ids=["max-usd-alone", "both", "gpu-products"])
def test_a_dollar_budget_alone_or_with_max_gpus_is_valid(case: dict[str, Any]) -> None:
    spec = parse_policy(apply_case(case, VALID)).spec
    assert isinstance(spec, AutoscalingSpec)
    assert spec.max_usd_per_hour == case["set"]["spec.maxUsdPerHour"]
    assert spec.max_gpus == (None if "delete" in case else 16)


def test_neither_budget_is_refused_naming_both_fields() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(apply_case({"delete": ["spec.maxGpus"]}, VALID))
    assert "spec.maxGpus" in str(err.value) and "spec.maxUsdPerHour" in str(err.value)


def test_policy_validate_names_a_bad_dollar_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = tmp_path / "cap-l4.yaml"
    example.write_text(yaml.safe_dump(apply_case(BUDGETS[0], VALID)))
    assert_cli_validates(tmp_path, capsys, example, "ok: cap-l4 (Autoscaling, mode Automatic)",
                         apply_case({"set": {"spec.maxUsdPerHour": -3}}, VALID),
                         "spec.maxUsdPerHour: Input should be greater than 0")


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_model_rejects_malformed_autoscaling_policy(case: dict[str, Any]) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(apply_case(case, VALID))
    assert case["field"] in err.value.fields, err.value


@pytest.mark.cluster
def test_apiserver_accepts_the_documented_autoscaling_policy(gpupolicy_crd: Cluster) -> None:
    assert_accepted(gpupolicy_crd, VALID, "as", AutoscalingPolicy)
    for case in BUDGETS:
        assert_accepted(gpupolicy_crd, apply_case(case, VALID), "as", AutoscalingPolicy)


@pytest.mark.cluster
@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_apiserver_rejects_malformed_autoscaling_policy(gpupolicy_crd: Cluster, case: dict[str, Any]) -> None:
    assert_refused(gpupolicy_crd, apply_case(case, VALID), "as", case)
