"""What each policy kind's model tests (tests/models/test_<kind>_policy.py) run alike on its documented policy, its
example and its corpus of malformed ones (tests/models/invalid_<kind>_policies.yaml): the model refuses each case
naming the field, and the apiserver with the chart's CRD accepts the good ones and refuses the bad ones its schema
can tell. A module's ``Test...(PolicyCorpus)`` names them; ``gpupolicy_crd`` is tests/models/conftest.py's fixture."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from typing import ClassVar

import pytest
import yaml

from models.policy import parse_policy
from tests.harness.crd import assert_accepted
from tests.harness.crd import assert_refused
from tests.harness.kube import Cluster
from tests.hub.helpers import apply_case
from tests.hub.helpers import assert_names_unique
from tests.hub.helpers import refused_naming


class PolicyCorpus:
    policy_class: ClassVar[type]  # what the documented policy and the example parse as
    valid: ClassVar[dict[str, Any]]  # the documented policy, which each case changes
    example: ClassVar[Path]
    corpus: ClassVar[list[dict[str, Any]]]
    at_least: ClassVar[int]  # cases in the corpus
    prefix: ClassVar[str]  # of the names of the policies created in the cluster
    example_ok: ClassVar[str]  # what `kubeon-gpu policy validate` prints for the example

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        # The cases are the subclass's, so they are parametrized here (a decorator on the base cannot see them). The
        # apiserver's are those its schema can refuse: a case marked ``refusedBy: worker`` only the model refuses.
        cases = {"case": self.corpus, "apiserver_case": [c for c in self.corpus if c.get("refusedBy") != "worker"]}
        for name, these in cases.items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, these, ids=[c["name"] for c in these])

    def test_documented_policy_parses_as_its_class(self) -> None:
        assert isinstance(parse_policy(self.valid), self.policy_class)

    def test_corpus_names_are_unique(self) -> None:
        assert_names_unique(self.corpus, at_least=self.at_least)

    def test_model_rejects_malformed_policy_naming_the_field(self, case: dict[str, Any]) -> None:
        refused_naming(apply_case(case, self.valid), case["field"])

    def test_cli_validate_accepts_the_example_and_names_each_cases_field(
            self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`kubeon-gpu policy validate` as a platform engineer runs it before applying: the example passes, and a
        file of every malformed case fails naming each one's field at its document."""
        from worker.cli import main

        assert main(["policy", "validate", str(self.example)]) == 0
        assert self.example_ok in capsys.readouterr().out
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump_all([apply_case(case, self.valid) for case in self.corpus]))
        assert main(["policy", "validate", str(bad)]) == 1
        err = capsys.readouterr().err
        for index, case in enumerate(self.corpus):
            assert f"{bad}[{index}]: {case['field']}: " in err, (case["name"], err)

    @pytest.mark.cluster
    def test_apiserver_accepts_the_documented_policy_and_the_example(self, gpupolicy_crd: Cluster) -> None:
        for doc in (self.valid, yaml.safe_load(self.example.read_text())):
            assert_accepted(gpupolicy_crd, doc, self.prefix, self.policy_class)

    @pytest.mark.cluster
    def test_apiserver_rejects_malformed_policy(self, gpupolicy_crd: Cluster, apiserver_case: dict[str, Any]) -> None:
        assert_refused(gpupolicy_crd, apply_case(apiserver_case, self.valid), self.prefix, apiserver_case)
