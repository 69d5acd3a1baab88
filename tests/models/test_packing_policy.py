"""Packing policies: the model and the CRD schema accept the documented shape (and the example) and refuse
malformed ones, naming the field; `policy validate` says so too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from models import policy
from models.policy import PackingPolicy
from models.policy import parse_policy
from tests.harness.policy_corpus import PolicyCorpus

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
EXAMPLE = ROOT / "examples/policies/packing-l4.yaml"
CRD_FILE = ROOT / "charts/kubeon-gpu-optimizer/crds/gpupolicies.gpu.kubeon.io.yaml"
VALID: dict[str, Any] = yaml.safe_load((HERE / "valid_packing_policy.yaml").read_text())
CORPUS: list[dict[str, Any]] = yaml.safe_load((HERE / "invalid_packing_policies.yaml").read_text())


def test_documented_packing_policy_is_valid() -> None:
    spec = parse_policy(VALID).spec  # of the policy class: TestPackingPolicyCorpus checks
    assert spec.node_pools == ["gpu-l4"]
    assert spec.node_selector is not None and spec.node_selector.match_labels == {
        "nvidia.com/gpu.product": "NVIDIA-L4"}
    assert spec.pods.namespaces == ["inference"] and spec.pods.match_labels == {"tier": "serving"}
    assert spec.min_savings_usd_per_hour == 1.5 and spec.max_nodes_at_once == 2
    assert spec.protect.min_pod_age_minutes == 30 and spec.protect.annotations == ["example.com/pinned"]
    assert spec.interval_seconds == 1800 and spec.effective_mode("Recommend") == "Approve"


def test_defaults() -> None:
    doc = {"apiVersion": "gpu.kubeon.io/v1", "kind": "GpuPolicy", "metadata": {"name": "p"},
           "spec": {"kind": "Packing"}}
    spec = parse_policy(doc).spec
    assert isinstance(spec, policy.PackingSpec)
    assert spec.node_pools is None and spec.node_selector is None and spec.pods.namespaces == []
    assert spec.max_nodes_at_once == 1 and spec.min_savings_usd_per_hour == 0.0
    assert spec.protect.min_pod_age_minutes == 0 and spec.interval_seconds == 3600
    assert spec.effective_mode("Recommend") == "Recommend"


def test_crd_schema_uses_the_model_patterns() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["kind"]["enum"] == list(policy.SUPPORTED_KINDS)
    assert spec["nodePools"]["items"]["pattern"] == policy.RESOURCE_NAME_PATTERN
    assert spec["nodeSelector"]["properties"]["matchLabels"]["additionalProperties"]["pattern"] == \
        policy.LABEL_VALUE_PATTERN
    assert spec["pods"]["properties"]["namespaces"]["items"]["pattern"] == policy.NAMESPACE_PATTERN
    assert spec["protect"]["properties"]["annotations"]["items"]["pattern"] == policy.LABEL_KEY_PATTERN
    assert spec["interval"]["pattern"] == policy.DURATION_PATTERN
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Pack Saving"] == ".status.packing.proposal.usdPerHourSaved"


# --- the corpus, against the model and the real apiserver ------------------------------------------------------

class TestPackingPolicyCorpus(PolicyCorpus):
    policy_class = PackingPolicy
    valid = VALID
    example = EXAMPLE
    corpus = CORPUS
    at_least = 20
    prefix = "pk"
    example_ok = "ok: packing-l4 (Packing, mode Approve)"
