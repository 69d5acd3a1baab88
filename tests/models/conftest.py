"""What the policy model tests share: the cluster with the GpuPolicy CRD, for the corpus against the apiserver."""

from __future__ import annotations

import pytest

from tests.harness.crd import install_gpupolicy_crd
from tests.harness.kube import Cluster


@pytest.fixture(scope="module")
def gpupolicy_crd(cluster: Cluster) -> Cluster:
    install_gpupolicy_crd(cluster)
    return cluster
