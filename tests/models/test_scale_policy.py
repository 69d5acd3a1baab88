"""ScaleToZero policies: the model and the CRD schema accept the documented shape and refuse malformed ones,
naming the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from models import policy
from models.policy import PolicyError
from models.policy import ScaleToZeroPolicy
from models.policy import duration_seconds
from models.policy import parse_policy
from tests.harness.crd import assert_accepted
from tests.harness.crd import assert_refused
from tests.harness.crd import create_strictly
from tests.harness.kube import Cluster
from tests.hub.helpers import apply_case
from tests.hub.helpers import assert_names_unique
from tests.hub.helpers import refused_naming

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
VALID: dict[str, Any] = yaml.safe_load((HERE / "valid_scale_policy.yaml").read_text())
CORPUS: list[dict[str, Any]] = yaml.safe_load((HERE / "invalid_scale_policies.yaml").read_text())


def test_documented_scale_to_zero_policy_is_valid() -> None:
    p = parse_policy(VALID)
    assert isinstance(p, ScaleToZeroPolicy)
    spec = p.spec
    assert spec.namespaces == ["ml-inference", "ml-batch"]
    assert spec.selector.match_labels == {"gpu.kubeon.io/scale-to-zero": "true"}
    assert spec.idle.idle_for_seconds == 1800
    assert spec.excluded("ml-inference", "always-on") and spec.excluded("ml-batch", "trainer")
    assert not spec.excluded("ml-inference", "trainer")
    assert spec.wake.schedule is not None and spec.wake.schedule.time_zone == "Europe/Berlin"
    assert spec.wake.demand is not None and spec.wake.demand.poll_interval == "30s"
    assert spec.effective_mode("Recommend") == "Approve"


def test_defaults_idle_for_thirty_minutes_and_all_workload_kinds() -> None:
    doc = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "s"},
           "spec": {"kind": "ScaleToZero", "namespaces": ["ml"]}}
    spec = parse_policy(doc).spec
    assert isinstance(spec, policy.ScaleToZeroSpec)
    assert spec.idle.idle_for == "30m" and spec.idle.threshold == 0.05
    assert spec.selector.kinds == ["Deployment", "StatefulSet"]
    assert spec.wake.schedule is None and spec.wake.demand is None
    assert spec.effective_mode("Recommend") == "Recommend"


def test_durations() -> None:
    assert duration_seconds("1h30m") == 5400
    assert duration_seconds("45s") == 45
    with pytest.raises(ValueError, match="not a duration"):
        duration_seconds("")


def test_corpus_has_twenty_cases_with_unique_names() -> None:
    assert_names_unique(CORPUS, at_least=20)


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_model_rejects_malformed_scale_policy_naming_the_field(case: dict[str, Any]) -> None:
    refused_naming(apply_case(case, VALID), case["field"])


def test_crd_schema_uses_the_model_patterns() -> None:
    crd = yaml.safe_load((ROOT / "charts/kubeon-gpu-optimizer/crds/gpupolicies.gpu.kubeon.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["namespaces"]["items"]["pattern"] == policy.NAMESPACE_PATTERN
    assert spec["idle"]["properties"]["idleFor"]["pattern"] == policy.DURATION_PATTERN
    assert spec["selector"]["properties"]["matchLabels"]["additionalProperties"]["pattern"] == \
        policy.LABEL_VALUE_PATTERN
    assert spec["selector"]["properties"]["kinds"]["items"]["enum"] == list(policy.WORKLOAD_KINDS)
    assert spec["wake"]["properties"]["schedule"]["properties"]["at"]["pattern"] == policy.TIME_OF_DAY_PATTERN
    assert spec["wake"]["properties"]["schedule"]["properties"]["weekdays"]["items"]["enum"] == \
        list(policy.WEEKDAYS)


# --- the same corpus against the real apiserver --------------------------------------------------------------

def _create(cluster: Cluster, doc: dict[str, Any]) -> dict[str, Any]:
    return create_strictly(cluster, doc, "s")


@pytest.mark.cluster
def test_apiserver_accepts_the_documented_scale_policy_and_the_example(gpupolicy_crd: Cluster) -> None:
    example = yaml.safe_load((ROOT / "examples/policies/scale-to-zero-inference.yaml").read_text())
    for doc in (VALID, example):
        assert_accepted(gpupolicy_crd, doc, "s", ScaleToZeroPolicy)


@pytest.mark.cluster
@pytest.mark.parametrize("case", [c for c in CORPUS if c.get("refusedBy") != "worker"],
                         ids=[c["name"] for c in CORPUS if c.get("refusedBy") != "worker"])
def test_apiserver_rejects_malformed_scale_policy(gpupolicy_crd: Cluster, case: dict[str, Any]) -> None:
    assert_refused(gpupolicy_crd, apply_case(case, VALID), "s", case)


FIT = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "fit"},
       "spec": {"kind": "GpuTypeFit", "namespaces": ["ml"], "fit": {
           "current": {"name": "a100-80gb", "memoryMiB": 81920, "usdPerHour": 4.1},
           "candidates": [{"name": "l4", "memoryMiB": 23034, "usdPerHour": 0.8, "relativeCompute": 0.3}]}}}


def test_gpu_type_fit_policy_is_recommend_only() -> None:
    p = parse_policy(FIT)
    assert isinstance(p, policy.GpuTypeFitPolicy)
    assert p.spec.fit.window_seconds == 7 * 24 * 3600 and p.spec.fit.headroom == 0.2
    assert p.spec.effective_mode("Automatic") == "Recommend"
    doc = copy.deepcopy(FIT)
    doc["spec"]["mode"] = "Automatic"
    with pytest.raises(PolicyError) as err:
        parse_policy(doc)
    assert "spec.mode" in err.value.fields


@pytest.mark.parametrize(("path", "value", "field"), [
    ("candidates", [], "spec.fit.candidates"),
    ("headroom", 2, "spec.fit.headroom"),
    ("window", "10m", "spec.fit.window"),
])
def test_gpu_type_fit_malformed_fields_are_named(path: str, value: object, field: str) -> None:
    doc = copy.deepcopy(FIT)
    doc["spec"]["fit"][path] = value
    with pytest.raises(PolicyError) as err:
        parse_policy(doc)
    assert field in err.value.fields


def _fit_with_candidate(**fields: object) -> dict[str, Any]:
    doc = copy.deepcopy(FIT)
    doc["spec"]["fit"]["candidates"][0].update(fields)
    return doc


def test_gpu_type_fit_candidate_names_its_gpu_product_optionally() -> None:
    p = parse_policy(_fit_with_candidate(product="NVIDIA-L4"))
    assert isinstance(p, policy.GpuTypeFitPolicy)
    assert p.spec.fit.candidates[0].product == "NVIDIA-L4"
    assert p.spec.fit.current.product is None  # optional: policies without it stay valid


@pytest.mark.parametrize(("fields", "says"), [
    ({"product": "NVIDIA L4"}, "should match pattern"),  # not a label value: no spaces
    ({"product": "x" * 64}, "at most 63"),
    ({"product": "NVIDIA-A100-SXM4-80GB", "mig": True}, "product is not for a MIG candidate (mig: true)"),
])
def test_gpu_type_fit_bad_candidate_product_is_refused_naming_it(fields: dict[str, object], says: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(_fit_with_candidate(**fields))
    assert err.value.errors[0][0] == "spec.fit.candidates[0].product"
    assert says in err.value.errors[0][1]


def test_crd_schema_checks_the_offering_product_as_a_label_value() -> None:
    crd = yaml.safe_load((ROOT / "charts/kubeon-gpu-optimizer/crds/gpupolicies.gpu.kubeon.io.yaml").read_text())
    fit = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["fit"]
    for offering in (fit["properties"]["current"], fit["properties"]["candidates"]["items"]):
        assert offering["properties"]["product"]["pattern"] == policy.LABEL_VALUE_PATTERN
        assert offering["properties"]["product"]["maxLength"] == 63
        assert [v["fieldPath"] for v in offering["x-kubernetes-validations"]] == [".product"]


@pytest.mark.cluster
def test_apiserver_accepts_a_candidate_product_and_refuses_it_on_a_mig_slice(gpupolicy_crd: Cluster) -> None:
    assert_accepted(gpupolicy_crd, _fit_with_candidate(product="NVIDIA-L4"), "fit", policy.GpuTypeFitPolicy)
    for fields, says in (({"product": "NVIDIA L4"}, "should match"),
                         ({"product": "NVIDIA-A100-SXM4-80GB", "mig": True}, "product is not for a MIG candidate")):
        with pytest.raises(client.ApiException) as err:
            _create(gpupolicy_crd, _fit_with_candidate(**fields))
        assert err.value.status == 422, err.value.body
        assert "spec.fit.candidates[0].product" in err.value.body and says in err.value.body, err.value.body


@pytest.mark.cluster
def test_apiserver_accepts_gpu_type_fit_and_refuses_acting_modes(gpupolicy_crd: Cluster) -> None:
    created = _create(gpupolicy_crd, FIT)
    gpupolicy_crd.admin.custom.delete_cluster_custom_object(policy.API_GROUP, "v1", policy.PLURAL,
                                                            created["metadata"]["name"])
    doc = copy.deepcopy(FIT)
    doc["spec"]["mode"] = "Approve"
    with pytest.raises(client.ApiException) as err:
        _create(gpupolicy_crd, doc)
    assert "GpuTypeFit only recommends" in err.value.body
    doc = copy.deepcopy(FIT)
    doc["spec"]["fit"]["candidates"][0]["memoryMiB"] = "24GB"
    with pytest.raises(client.ApiException) as err:
        _create(gpupolicy_crd, doc)
    assert "memoryMiB" in err.value.body
