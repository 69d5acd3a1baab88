"""Issue 21 (Low): the join document in a burst node's user data holds its ticket. The user data writes it for
root only (umask 077), and the node join deletes it once the ticket is redeemed; a rerun (a reboot) still works
from the saved answer."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from models.join import JoinAnswer, JoinRedeem, render_user_data
from models.labels import Taint
from node.join import main_join


def test_l5_the_user_data_writes_the_join_document_for_root_only(tmp_path: Path) -> None:
    user_data = render_user_data(gateway_url="https://gw.example:8443", ticket="the-ticket", node_name="burst-1",
                                 labels={}, taints=[Taint(key="gpu.kubeon.io/burst")])
    etc = tmp_path / "etc-kubeon"
    script = tmp_path / "user-data.sh"
    script.write_text(user_data.replace("/etc/kubeon", str(etc)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "kubeon-gpu"  # what the node join sees when it starts
    stub.write_text(f"#!/bin/sh\nstat -c '%a' {etc} {etc}/join.json > {tmp_path}/modes\n")
    stub.chmod(0o755)
    done = subprocess.run(["bash", "-c", f"umask 022; exec bash {script}"], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "modes").read_text().split() == ["700", "600"]


def _answer(node: str) -> JoinAnswer:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(hours=1))
            .sign(key, hashes.SHA256()))
    from cryptography.hazmat.primitives import serialization

    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    return JoinAnswer(node_name=node, certificate=pem, ca_bundle=pem, api_server="https://127.0.0.1:6443",
                      pod_cidr="10.245.0.0/24", labels={}, taints=[])


def test_l5_the_node_join_deletes_the_join_document_once_redeemed_and_a_rerun_still_works(tmp_path: Path) -> None:
    config = tmp_path / "join.json"
    user_data = render_user_data(gateway_url="https://gw.example:8443", ticket="the-ticket", node_name="burst-1",
                                 labels={}, taints=[])
    config.write_text(user_data.split("<<'KUBEON_JOIN'\n", 1)[1].split("\nKUBEON_JOIN", 1)[0])
    redeemed: list[JoinRedeem] = []

    def redeem(request: JoinRedeem) -> JoinAnswer:
        redeemed.append(request)
        return _answer("burst-1")

    state = tmp_path / "state"
    args = {"interface": "kubeon0", "kubelet_command": "true", "provider_id": "", "capacity": {}, "tunnel": False,
            "retry_seconds": 0.0, "redeem": redeem}
    assert main_join(config, state, **args) == 0  # type: ignore[arg-type]
    assert [r.ticket for r in redeemed] == ["the-ticket"]
    assert not config.exists()  # the ticket is nowhere on disk any more
    assert "the-ticket" not in "".join(p.read_text(errors="replace") for p in state.iterdir() if p.is_file())
    assert json.loads((state / "join-document.json").read_text())["nodeName"] == "burst-1"
    assert main_join(config, state, **args) == 0  # type: ignore[arg-type]  # the reboot: from the saved answer
    assert len(redeemed) == 1
