"""Sharing policies: the model and the CRD schema accept the documented shape (and the example) and refuse
malformed ones, naming the field; `policy validate` says so too."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from models import policy
from models.policy import PolicyError
from models.policy import SharingPolicy
from models.policy import parse_policy
from tests.harness.policy_corpus import PolicyCorpus

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
EXAMPLE = ROOT / "examples/policies/sharing-a100.yaml"
VALID: dict[str, Any] = yaml.safe_load((HERE / "valid_sharing_policy.yaml").read_text())
CORPUS: list[dict[str, Any]] = yaml.safe_load((HERE / "invalid_sharing_policies.yaml").read_text())


def test_documented_sharing_policy_is_valid() -> None:
    spec = parse_policy(VALID).spec  # of the policy class: TestSharingPolicyCorpus checks
    assert spec.nodes.match_labels == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert spec.time_slicing is not None and spec.time_slicing.max_replicas == 4
    assert spec.mig is not None and spec.mig.allowed == ["all-1g.10gb", "all-3g.40gb", "all-balanced"]
    assert spec.idle.threshold == 0.4 and spec.idle.window_seconds == 7 * 24 * 3600
    assert spec.usd_per_gpu_hour == 4.1 and spec.max_nodes_at_once == 2


def test_defaults_and_mig_never_automatic_by_default() -> None:
    doc = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "s"},
           "spec": {"kind": "Sharing", "nodes": {"matchLabels": {"pool": "a100"}}, "mig": {"allowed": ["all-1g.10gb"]}}}
    spec = parse_policy(doc).spec
    assert isinstance(spec, policy.SharingSpec)
    assert spec.time_slicing is None and spec.mig is not None and spec.mig.headroom == 0.1
    assert spec.idle.window == "168h" and spec.idle.min_coverage == 0.9
    assert spec.max_nodes_at_once == 1, "one node changing at a time unless the policy says more"
    assert spec.effective_mode("Automatic") == "Automatic"
    assert spec.mig_mode("Automatic") == "Approve"
    assert spec.mig_mode("Recommend") == "Recommend"
    doc["spec"]["mode"] = "Automatic"
    again = parse_policy(doc).spec
    assert isinstance(again, policy.SharingSpec) and again.mig_mode("Recommend") == "Automatic"


def test_days_get_a_message_that_says_what_to_write() -> None:
    doc = copy.deepcopy(VALID)
    doc["spec"]["idle"]["window"] = "7d"
    with pytest.raises(PolicyError, match="write 168h"):
        parse_policy(doc)


def test_crd_schema_uses_the_model_patterns() -> None:
    crd = yaml.safe_load((ROOT / "charts/kubeon-gpu-optimizer/crds/gpupolicies.gpu.kubeon.io.yaml").read_text())
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["mig"]["properties"]["allowed"]["items"]["pattern"] == policy.MIG_GEOMETRY_PATTERN
    assert spec["idle"]["properties"]["window"]["pattern"] == policy.DURATION_PATTERN
    assert spec["nodes"]["properties"]["matchLabels"]["additionalProperties"]["pattern"] == \
        policy.LABEL_VALUE_PATTERN
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Max Replicas"] == ".spec.timeSlicing.maxReplicas"
    assert columns["Sharing Proposals"] == ".status.sharing.proposals"


# --- the corpus, against the model and the real apiserver ------------------------------------------------------

class TestSharingPolicyCorpus(PolicyCorpus):
    policy_class = SharingPolicy
    valid = VALID
    example = EXAMPLE
    corpus = CORPUS
    at_least = 15
    prefix = "sh"
    example_ok = "ok: sharing-a100 (Sharing, mode Recommend)"
