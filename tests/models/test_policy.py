"""The GpuPolicy model and the CRD schema accept and reject the same documents (R3.1-R3.3)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from models import policy
from models.policy import PolicyError
from models.policy import parse_policy
from tests.harness.crd import CRD_FILE
from tests.harness.crd import assert_accepted
from tests.harness.crd import assert_refused
from tests.harness.kube import Cluster
from tests.hub.helpers import INVALID_POLICIES
from tests.hub.helpers import VALID_POLICY
from tests.hub.helpers import apply_case
from tests.hub.helpers import assert_names_unique
from tests.hub.helpers import refused_naming

ROOT = Path(__file__).parent.parent.parent
VALID = VALID_POLICY  # tests/models/valid_policy.yaml
CORPUS = INVALID_POLICIES  # tests/models/invalid_policies.yaml


def test_documented_burst_policy_is_valid() -> None:
    p = parse_policy(VALID)
    assert p.name == "inference-burst-eu"
    assert p.spec.kind == "Burst"
    assert p.spec.mode == "Approve"
    assert p.spec.workloads.tolerate == "gpu.kubeon.io/burst"
    assert [loc.provider for loc in p.spec.location_names] == ["aws", "gcp", "onprem"]
    assert p.spec.location_names[0].label_value == "aws.eu-central-1"
    assert p.spec.limits.max_nodes == 4
    assert p.spec.limits.max_gpu_hour == 4.5
    assert p.spec.return_home is True


def test_example_policies_parse_and_each_example_workload_opts_into_one_burst_policy() -> None:
    files = sorted((ROOT / "examples/policies").glob("*.yaml"))
    policies = [parse_policy(yaml.safe_load(f.read_text())) for f in files]
    bursts = {p.spec.workloads.tolerate: p.name for p in policies if isinstance(p, policy.GpuPolicy)}
    assert len(bursts) == len([p for p in policies if isinstance(p, policy.GpuPolicy)])  # one taint key each
    for workload in sorted(ROOT.joinpath("examples").glob("*burst-workload.yaml")):
        spec = yaml.safe_load(workload.read_text())["spec"]["template"]["spec"]
        tolerated = [bursts[t["key"]] for t in spec.get("tolerations", []) if t["key"] in bursts]
        assert len(tolerated) == 1, f"{workload.name} opts into {tolerated}"


def test_mode_defaults_from_configuration() -> None:
    doc = copy.deepcopy(VALID)
    del doc["spec"]["mode"]
    spec = parse_policy(doc).spec
    assert spec.mode is None
    assert spec.effective_mode("Recommend") == "Recommend"
    assert spec.effective_mode("Automatic") == "Automatic"
    assert parse_policy(VALID).spec.effective_mode("Recommend") == "Approve"


def test_burn_in_defaults_to_the_gpus_and_tunnel_checks_and_an_empty_list_skips_the_gate() -> None:
    # GpuHealth only where chosen: it needs DCGM on the node image.
    assert parse_policy(VALID).spec.burn_in.checks == ["Gpus", "Tunnel"]
    assert set(policy.BURN_IN_CHECKS) == {"Gpus", "Tunnel", "GpuHealth"}
    assert parse_policy(VALID).spec.burn_in.timeout_seconds == 900
    doc = copy.deepcopy(VALID)
    doc["spec"]["burnIn"] = {"checks": [], "timeoutSeconds": 30}
    burn_in = parse_policy(doc).spec.burn_in
    assert (burn_in.checks, burn_in.timeout_seconds) == ([], 30)


def test_corpus_is_large_enough_and_names_are_unique() -> None:
    assert_names_unique(CORPUS, at_least=25)


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_model_rejects_malformed_policy_naming_the_field(case: dict[str, Any]) -> None:
    assert case["field"] in str(refused_naming(apply_case(case), case["field"]))


def test_unknown_kind_is_named_with_the_supported_ones() -> None:
    doc = copy.deepcopy(VALID)
    doc["spec"]["kind"] = "Rebalancing"
    with pytest.raises(PolicyError, match=r"unknown kind 'Rebalancing' .*Packing, Autoscaling"):
        parse_policy(doc)


def test_crd_schema_uses_the_model_patterns() -> None:
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["locations"]["items"]["pattern"] == policy.LOCATION_PATTERN
    assert spec["workloads"]["properties"]["tolerate"]["pattern"] == policy.TAINT_KEY_PATTERN
    assert spec["kind"]["enum"] == list(policy.SUPPORTED_KINDS)
    assert spec["mode"]["enum"] == list(policy.MODES)


# --- the same corpus against the real apiserver --------------------------------------------------------------

@pytest.mark.cluster
def test_apiserver_accepts_the_documented_policy(gpupolicy_crd: Cluster) -> None:
    assert_accepted(gpupolicy_crd, VALID, "p", policy.GpuPolicy)


@pytest.mark.cluster
@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_apiserver_rejects_malformed_policy(gpupolicy_crd: Cluster, case: dict[str, Any]) -> None:
    assert_refused(gpupolicy_crd, apply_case(case), "p", case)


@pytest.mark.cluster
def test_printer_columns_show_kind_and_mode(gpupolicy_crd: Cluster) -> None:
    crd = gpupolicy_crd.admin.apiext.read_custom_resource_definition("gpupolicies.gpu.kubeon.io")
    columns = {c.name: c.json_path for c in crd.spec.versions[0].additional_printer_columns}
    assert columns["Kind"] == ".spec.kind"
    assert columns["Mode"] == ".spec.mode"
    assert "Age" in columns
