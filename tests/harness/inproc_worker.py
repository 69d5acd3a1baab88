"""The gateway in the worker's process, for tests and the bench: ``inproc_gateway`` builds it with the gateway's
own ServiceAccount and ticket key (never the optimizer's), as ``kubeon-gpu gateway`` would; run as
``python -m tests.harness.inproc_worker``, this is ``kubeon-gpu worker`` with that gateway in its runtime
(from ``KUBEON_GATEWAY_KUBECONFIG`` and ``KUBEON_GATEWAY_TICKET_KEY_FILE``), for tests that SIGKILL the worker.

The product's worker never builds a gateway: it talks to the gateway process over HTTPS. Here its runtime is
handed one (``build_runtime(settings, gateway=..., redeem=...)``), and simulated instances redeem their ticket
with its ``join``."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from common.kube import kube_api
from gateway.attestation import AttestationVerifier
from gateway.service import KubeGateway
from gateway.slots import AddressPlan
from worker.config import Settings


def inproc_gateway(kubeconfig: Path, ticket_key_file: Path, plan: AddressPlan | None = None,
                   attestation: AttestationVerifier | None = None) -> KubeGateway:
    """The gateway in namespace kubeon-gpu (``plan``: its address plan, default the gateway's; ``attestation``: the
    instance identities it verifies, default none), its reconciler running."""
    # Its callers are the worker's activity threads (simulated nodes redeem their tickets in them): a connection
    # for each, as the worker's own client has.
    threads = Settings.model_fields["max_concurrent_activities"].default
    gateway = KubeGateway(kube_api(kubeconfig, pool_size=threads + 8), ticket_key_file.read_bytes().strip(),
                          namespace="kubeon-gpu",
                          plan=plan, attestation=attestation)
    gateway.start_reconciler()
    return gateway


def main() -> None:
    from worker.cli import run_worker
    from worker.runtime import build_runtime

    mask = os.environ.get("KUBEON_GATEWAY_NODE_CIDR_MASK")
    gateway = inproc_gateway(Path(os.environ["KUBEON_GATEWAY_KUBECONFIG"]),
                             Path(os.environ["KUBEON_GATEWAY_TICKET_KEY_FILE"]),
                             AddressPlan(node_mask=int(mask)) if mask else None)
    sys.exit(run_worker(functools.partial(build_runtime, gateway=gateway, redeem=gateway.join)))


if __name__ == "__main__":
    main()
